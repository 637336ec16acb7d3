"""`context` heads through the training pipeline on a tiny model: frontier distances drawn like decoding produces
them, training on the fly and from a feature cache (which then holds the final layer's states), per-distance
evaluation, resume, a cache without the final states refused before any work, export -> lossless decoding."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import (  # noqa: F401  (fixtures)
    _argv, _assert_same_run, _heads, _run, _run_killed_after, env, fresh_accelerate_state, pairs_file,
)

import hispec

CTX = ("--head_type", "context", "--draft_layer", "2", "--verify_layer", "4", "--context_window", "6",
       "--context_heads", "2", "--context_head_dim", "8")


def _cache_argv(env, out, cache, pairs, *extra):  # noqa: F811
    return _argv(env, out, "--plain_text_file", str(pairs), "--plain_text_loss_on", "assistant",
                 "--feature_cache", str(cache), "--feature_cache_k", "8", "--feature_cache_shard_tokens", "200",
                 *extra)


def test_distance_draws_respect_the_ranges_and_are_reproducible():
    from hispec.distill.training import distance_sampler, draw_distances, fixed_distances

    ranges = {"draft": (2, 7), "verify": (1, 8), "mid": (1, 4)}
    f = distance_sampler(ranges, torch.Generator().manual_seed(0))
    d, mid = f("draft", 20000)
    assert d.dtype == torch.long and int(d.min()) == 2 and int(d.max()) == 7
    assert sorted(d.unique().tolist()) == list(range(2, 8))  # every value of the range is drawn
    assert (mid >= 1).all() and (mid <= torch.clamp(d, max=4)).all()  # never behind the final frontier
    for v in range(2, 8):  # uniform in 1..min(4, d) given d
        sel = mid[d == v]
        assert sorted(sel.unique().tolist()) == list(range(1, min(4, v) + 1))
    v, none = f("verify", 5000)
    assert none is None and int(v.min()) == 1 and int(v.max()) == 8
    counts = torch.bincount(v, minlength=9)[1:].float()
    assert (counts / counts.mean() - 1).abs().max() < 0.15  # uniform
    g = distance_sampler(ranges, torch.Generator().manual_seed(0))
    assert torch.equal(g("draft", 20000)[0], d)  # same seed, same draws
    fd, fm = fixed_distances(3, mid=1)("draft", 4)
    assert fd.tolist() == [3] * 4 and fm.tolist() == [1] * 4 and fixed_distances(3, 1)("verify", 2)[1] is None
    capped = draw_distances(1000, (1, 4), torch.Generator().manual_seed(1), cap=torch.full((1000,), 2))
    assert set(capped.tolist()) == {1, 2}


@pytest.mark.parametrize("extra, ranges", [
    ((), {"draft": [1, 4], "verify": [1, 8], "mid": None}),
    (("--gamma", "3", "--window", "2"), {"draft": [1, 4], "verify": [1, 5], "mid": None}),
    (("--gamma", "3", "--context_mid", "true"), {"draft": [1, 6], "verify": [1, 7], "mid": [1, 3]}),
    (("--context_draft_distance", "2", "5", "--context_verify_distance", "1", "3"),
     {"draft": [2, 5], "verify": [1, 3], "mid": None}),
])
def test_distance_ranges_follow_the_decoding_settings(env, tmp_path, extra, ranges):  # noqa: F811
    from hispec.distill.args import parse_args
    from hispec.distill.training import context_ranges

    m, d, g, t = parse_args(_argv(env, tmp_path / "r", *CTX, *extra))
    got = context_ranges(m, t)
    assert {k: list(v) if v else None for k, v in got.items()} == ranges


@pytest.mark.parametrize("extra, message", [
    (("--context_draft_distance", "0", "3"), "context_draft_distance must be two integers LO HI with 1 <= LO"),
    (("--context_verify_distance", "5", "2"), "context_verify_distance must be two integers"),
    (("--context_draft_distance", "3"), "context_draft_distance must be two integers"),
    (("--context_mid_distance", "1", "2"), "set context_mid: true"),
    (("--context_mid", "true", "--context_mid_distance", "2", "3"), "above the draft's smallest final distance"),
    (("--context_window", "0"), "context_window must be an integer >= 1"),
    (("--context_head_dim", "0"), "context_head_dim must be >= 1"),
])
def test_bad_context_settings_fail_before_any_work(env, tmp_path, extra, message):  # noqa: F811
    from train.heads import ConfigError, main

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        main(_argv(env, out, "--max_steps", "2", *CTX, *extra))
    assert not out.exists()


def test_context_settings_on_another_head_type_are_refused(env, tmp_path):  # noqa: F811
    from train.heads import ConfigError, main

    for extra in (("--context_mid", "true"), ("--context_draft_distance", "1", "2")):
        with pytest.raises(ConfigError, match="apply to head_type: context"):
            main(_argv(env, tmp_path / "run", "--head_type", "linear", *extra))


def test_context_heads_train_evaluate_by_distance_export_and_decode_losslessly(env, tmp_path, capsys):  # noqa: F811
    from hispec.cli.export import main as export_main

    out = tmp_path / "run"
    assert _run(_argv(env, out, *CTX, "--context_mid", "true", "--max_steps", "12", "--learning_rate", "1e-2",
                      "--eval_steps", "6", "--gamma", "3", "--window", "2")) == 0
    printed = capsys.readouterr().out
    assert "top-1/top-5 d=1" in printed and "mid 1 d=1" in printed
    line = json.loads(printed.strip().splitlines()[-1])
    assert set(line["draft_agreement_by_distance"]) == {"1", "2", "3", "4"}

    state = _heads(out)
    assert any(k.startswith("draft.ctx_") for k in state)
    assert torch.count_nonzero(state["draft.ctx_o.weight"]) > 0  # zero-initialised outputs were trained
    assert torch.count_nonzero(state["verify.ctx_down.weight"]) > 0
    metrics = json.loads((out / "metrics.json").read_text())
    first, last = metrics["history"][0], metrics["final"]
    assert [h["step"] for h in metrics["history"]] == [0, 6, 12]
    assert last["context"]["ranges"] == {"draft": [1, 4], "verify": [1, 5], "mid": [1, 3]}
    for k in ("draft", "verify"):
        assert last[k]["kl"] < 0.8 * first[k]["kl"]  # the loss went down on held-out text
        assert last[k]["head_type"] == "context" and "by_distance" not in first[k]  # per distance: final only
        by_d = last[k]["by_distance"]
        assert list(by_d) == ["1", "2", "3", "4"]
        for v in by_d.values():
            assert 0 <= v["top1_agreement"] <= v["top5_agreement"] <= 1 and v["kl"] > 0
    assert list(last["draft"]["by_distance_mid1"]) == ["1", "2", "3", "4"]
    assert "by_distance_mid1" not in last["verify"]
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["hispec"]["head"]["context"] == {"window": 6, "heads": 2, "head_dim": 8, "mlp_mult": 2, "frontier": 1}
    assert info["hispec"]["head"]["context_layers"] == {"draft": [2, 4, 6], "verify": [4, 6]}
    assert info["data"]["context"]["ranges"]["mid"] == [1, 3]

    ck = tmp_path / "ck"
    assert export_main([str(out), "--output-dir", str(ck)]) == 0
    model = hispec.load(ck)
    cfg = model.hispec_config
    assert cfg.head_type == "context" and cfg.context == {"window": 6, "heads": 2, "head_dim": 8, "mlp_mult": 2,
                                                    "frontier": 1}
    assert cfg.context_layers == {"draft": [2, 4, 6], "verify": [4, 6]}
    for k, v in model.heads_state_dict().items():
        torch.testing.assert_close(v.float(), state[k], rtol=0, atol=0)
    ids = torch.tensor([[5, 17, 33, 8, 41, 9, 12]])
    ref = model.base.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=1)
    for strategy in ("self-spec", "hispec"):
        got = model.generate(ids, max_new_tokens=16, strategy=strategy, eos_token_id=[], gamma=3, window=2)
        assert torch.equal(got.sequences, ref), strategy


def test_context_training_from_a_full_vocabulary_fp32_cache_equals_training_on_the_fly(env, pairs_file,  # noqa: F811
                                                                                        tmp_path):
    """k = V, fp32 states: the cached path rebuilds every layer's whole sequences (left padded) and draws the same
    distances as the on-the-fly path (right padded): same held-out numbers, same heads up to float rounding."""
    common = ("--plain_text_file", str(pairs_file), "--plain_text_loss_on", "assistant", "--max_steps", "5",
              "--learning_rate", "1e-2", *CTX, "--context_mid", "true")
    assert _run(_argv(env, tmp_path / "fly", *common)) == 0
    assert _run(_argv(env, tmp_path / "cached", *common, "--feature_cache", str(tmp_path / "cache"),
                      "--feature_cache_k", "97", "--feature_cache_dtype", "fp32")) == 0
    fly = json.loads((tmp_path / "fly" / "metrics.json").read_text())["final"]
    cached = json.loads((tmp_path / "cached" / "metrics.json").read_text())["final"]
    assert fly["eval_tokens"] == cached["eval_tokens"]
    for k in ("draft", "verify"):
        assert fly[k]["kl"] == pytest.approx(cached[k]["kl"], rel=1e-4)
        for d, v in fly[k]["by_distance"].items():
            assert v["kl"] == pytest.approx(cached[k]["by_distance"][d]["kl"], rel=1e-4)
    ha, hb = _heads(tmp_path / "fly"), _heads(tmp_path / "cached")
    for k in ha:
        torch.testing.assert_close(ha[k], hb[k], rtol=1e-3, atol=1e-4)


def test_a_cache_without_the_final_states_is_refused_before_any_work(env, pairs_file, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    import train.heads as th
    from hispec.distill.features import open_feature_cache

    cache = tmp_path / "cache"
    assert _run(_cache_argv(env, tmp_path / "lin", cache, pairs_file, "--draft_layer", "2", "--verify_layer", "4",
                            "--data_only", "true")) == 0
    assert open_feature_cache(cache / "train")["layers"] == [2, 4]

    def no_work(*a, **k):
        raise AssertionError("loaded the model before refusing the cache")

    monkeypatch.setattr(th.trainer, "load_base", no_work)
    with pytest.raises(th.ConfigError, match=r"not hidden\.6 \(context heads read the final layer's raw residual.*"
                                             r"rebuild it: delete .*cache"):
        _run(_cache_argv(env, tmp_path / "ctx", cache, pairs_file, *CTX, "--max_steps", "2"))
    assert not (tmp_path / "ctx").exists()


def test_one_cache_with_final_states_trains_linear_and_context_heads_and_context_resume(env, pairs_file, tmp_path,
                                                                                       monkeypatch):  # noqa: F811
    import train.heads as th
    from hispec.distill.features import open_feature_cache

    cache = tmp_path / "cache"
    common = ("--max_steps", "7", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
              "--eval_steps", "3", "--learning_rate", "1e-2", *CTX)
    # a linear run builds the cache with the final states for later context runs ...
    assert _run(_cache_argv(env, tmp_path / "lin", cache, pairs_file, "--draft_layer", "2", "--verify_layer", "4",
                            "--feature_cache_final_states", "true", "--max_steps", "2")) == 0
    built = open_feature_cache(cache / "train")
    assert built["layers"] == [2, 4, 6]
    # ... which a context run reuses as it is, straight and killed + resumed: bit for bit the same heads
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(_cache_argv(env, straight, cache, pairs_file, *common)) == 0
    assert open_feature_cache(cache / "train")["build_seconds"] == built["build_seconds"]

    _run_killed_after(monkeypatch, 3, _cache_argv(env, killed, cache, pairs_file, *common))
    with pytest.raises(th.ConfigError, match="trained with context="):  # other distances: refused
        _run(_cache_argv(env, killed, cache, pairs_file, *common, "--resume_from_checkpoint", "latest",
                         "--context_draft_distance", "1", "2"))
    assert _run(_cache_argv(env, killed, cache, pairs_file, *common, "--resume_from_checkpoint", "latest")) == 0
    _assert_same_run(straight, killed, steps=(0, 3, 6, 7))


def test_head_report_puts_context_heads_next_to_linear_ones_from_metrics_json(env, tmp_path, capsys):  # noqa: F811
    """tools/research/head_report.py reads training runs' metrics.json: one table (context heads per frontier distance,
    linear heads with their one distance-independent number), one plot, the JSON line."""
    from conftest import load_tool

    common = ("--max_steps", "3", "--learning_rate", "1e-2", "--draft_layer", "2", "--verify_layer", "4")
    assert _run(_argv(env, tmp_path / "lin", *common)) == 0
    assert _run(_argv(env, tmp_path / "ctx", *common, *CTX, "--context_mid", "true")) == 0
    capsys.readouterr()
    hr = load_tool("head_report")
    assert hr.main(["--run", "linear", str(tmp_path / "lin" / "metrics.json"), "--run", "context",
                    str(tmp_path / "ctx"), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    lin = json.loads((tmp_path / "lin" / "metrics.json").read_text())["final"]
    ctx = json.loads((tmp_path / "ctx" / "metrics.json").read_text())["final"]
    head = next(line for line in out if line.startswith("| run |"))
    assert "draft top-1 (d=1/2/3/4)" in head and "draft top-1, mid 1 (d=1/2/3/4)" in head
    row = {line.split(" | ")[0][2:]: line.split(" | ") for line in out if line.startswith("| linear |")
           or line.startswith("| context |")}
    assert row["linear"][1] == "linear" and row["linear"][6] == f"{lin['draft']['top1_agreement']:.3f}"
    assert row["context"][1] == "context" and row["context"][5] == "full / full"
    assert row["context"][6] == " / ".join(f"{ctx['draft']['by_distance'][d]['top1_agreement']:.3f}"
                                           for d in "1234")
    assert row["context"][10] == " / ".join(f"{ctx['draft']['by_distance_mid1'][d]['top1_agreement']:.3f}"
                                            for d in "1234")
    assert row["context"][3] == "3" and row["linear"][10] == "-"  # steps from hispec_train.json; no mid numbers
    assert (tmp_path / "p.png").stat().st_size > 10_000
    summary = json.loads(out[-1])
    assert summary["runs"][1]["draft_top1_by_distance"]["1"] == round(ctx["draft"]["by_distance"]["1"]
                                                                      ["top1_agreement"], 4)
    assert "draft_top1_by_distance" not in summary["runs"][0]
