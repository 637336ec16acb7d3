"""hispec-bench (hispec.bench + hispec.cli.bench): strategy comparison, identity check, plot, sweep.

Offline: a tiny random llama saved as a hispec checkpoint with a character-level tokenizer (and a chat template)
stands in for a real model; one `real_model` test runs a short bench on the SmolLM2 demo model.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

import hispec
from hispec import bench
from hispec.cli.bench import main
from hispec.model import EarlyExitModel
from tiny import char_tokenizer, save_tiny, tiny_model

PROMPTS = [
    {"prompt": "write a poem about the sea.", "category": "writing"},
    {"prompt": "what is 12 times 7?", "category": "math"},
    {"prompt": "name three colours.", "category": "writing"},
    {"prompt": "solve x + 3 = 5.", "category": "math"},
]
SUMMARY_KEYS = {"lossless", "lossless_up_to_ties", "speedup_vs_hf", "speedup_vs_self_spec", "reference",
                "strategies", "categories", "config", "model", "hardware"}
STRATEGY_KEYS = {"tokens_per_s", "speedup_vs_hf", "speedup_vs_self_spec", "tokens_per_target_pass",
                 "verify_acceptance", "target_acceptance", "layer_evals_per_token", "time_share", "identical",
                 "identical_up_to_ties"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = EarlyExitModel.from_base(tiny_model("llama"), draft_layer=2, verify_layer=4, head_type="linear",
                                     gamma=3, window=2, tokenizer=char_tokenizer())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking heads: drafts are sometimes right, sometimes wrong
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    folder = model.save(tmp_path_factory.mktemp("ckpt") / "tiny-hispec")
    from hispec import latency, packed  # a calibration of this machine, so that `auto` runs and predictions are
    # reported; with the kernels hispec-bench loads it with (prepacked where this torch can)
    packed.apply(model)
    latency.write_calibration(folder, latency.calibrate(model, [[5, 6, 7, 8, 9, 10]], max_new_tokens=8, repeats=1))
    return folder


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("base") / "tiny-llama")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return rc, out, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None


def common(model, prompts_file, tokens=12):
    return ["--model", model, "--prompts", prompts_file, "--dtype", "fp32", "--max-new-tokens", tokens,
            "--warmup", 0, "--threads", 1, "--no-progress"]


# ---------------------------------------------------------------------------------------------- bench
# every named strategy the tiny checkpoint can run (it has no EAGLE-3 drafter: `eagle` levels need one)
RUNNABLE = tuple(s for s in bench.STRATEGIES if not s.startswith("eagle"))


def test_bench_prints_table_then_one_json_line_and_every_strategy_reproduces_hf(checkpoint, prompts_file, capsys,
                                                                               tmp_path):
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", ",".join(RUNNABLE),
                               "--plot", tmp_path / "speedup.png", "--json-out", tmp_path / "full.json")
    assert rc == 0, out.err
    table = out.out.strip().splitlines()[:-1]
    assert any(line.startswith("strategy") and "tok/s" in line for line in table)
    for name in RUNNABLE:
        assert any(line.startswith(name + " ") for line in table), name
    assert any(line.startswith("math ") for line in table) and any(line.startswith("writing ") for line in table)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["lossless"] is True and summary["lossless_up_to_ties"] is True
    assert summary["reference"] == "hf"
    for name in RUNNABLE:
        s = summary["strategies"][name]
        assert STRATEGY_KEYS <= s.keys()
        assert s["identical"] == 1.0, name
        assert s["tokens_per_s"] > 0
        assert abs(sum(s["time_share"].values()) - 1.0) < 1e-6
    assert summary["strategies"]["hf"]["speedup_vs_hf"] == 1.0
    for name in RUNNABLE:  # the latency model's prediction next to the measurement, for hispec's own
        s = summary["strategies"][name]  # (the lookup-first level's too)
        if name.startswith("hf"):
            assert s["predicted_speedup_vs_ar"] is None
        else:
            assert s["predicted_speedup_vs_ar"] > 0 and s["speedup_vs_ar"] > 0
            assert s["prediction_error"] == pytest.approx(s["predicted_speedup_vs_ar"] / s["speedup_vs_ar"] - 1)
    assert summary["strategies"]["auto"]["hierarchy"].startswith("auto:")
    assert 0 <= summary["strategies"]["auto"]["plain_share"] <= 1
    assert any(line.startswith("latency model") for line in table)
    assert summary["categories"]["math"]["strategies"]["ngram"]["tokens_per_target_pass"] >= 1.0
    assert summary["headline"] == "auto"  # the default decoding, when it ran
    assert summary["speedup_vs_hf"] == summary["strategies"]["auto"]["speedup_vs_hf"]
    assert summary["speedup_vs_self_spec"] == summary["strategies"]["auto"]["speedup_vs_self_spec"]
    # per-stage counters: ar is one full pass per token; hispec's verifier saw drafts
    assert summary["strategies"]["ar"]["tokens_per_target_pass"] == 1.0
    assert summary["strategies"]["hf"]["layer_evals_per_token"] == pytest.approx(6.0)
    assert summary["strategies"]["hispec"]["verify_acceptance"] is not None
    assert summary["strategies"]["hf-early-exit"]["target_acceptance"] is not None
    assert set(summary["categories"]) == {"math", "writing"}
    assert summary["categories"]["math"]["prompts"] == 2
    assert summary["categories"]["math"]["strategies"]["hispec"]["identical"] == 1.0
    assert summary["hardware"]["threads"] == 1 and summary["hardware"]["torch"] == torch.__version__
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    full = json.loads((tmp_path / "full.json").read_text())
    assert len(full["per_prompt"]) == len(PROMPTS)
    assert full["per_prompt"][0]["strategies"]["hispec"]["identical"] is True


def test_tree_strategies_name_their_drafter_and_shape():
    from hispec.bench.runner import split_verification, tree_of, tree_strategy

    for name, strategy, widths in [("tree:4x2x1", "self-spec", (4, 2, 1)), ("lookup-tree:4", "self-spec-lookup", (4,)),
                                   ("eagle-tree:4x2", "eagle", (4, 2)),
                                   ("eagle-lookup-tree:3x1", "eagle-lookup", (3, 1))]:
        assert tree_of(name).widths == widths and tree_strategy(name) == strategy
        assert split_verification(name) == (name, None)
    assert tree_of("eagle") is None and tree_of("self-spec-lookup") is None
    with pytest.raises(ValueError, match="widths per depth"):
        tree_of("eagle-tree:4xz")


def test_static_trees_get_a_latency_prediction_and_dynamic_ones_none(checkpoint, prompts_file, capsys):
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file, tokens=8), "--num-prompts", 2,
                               "--strategies", "ar,self-spec,tree:2x1,tree:dyn-2-2-2-4")
    assert rc == 0, out.err
    st = summary["strategies"]
    assert all(st[s]["identical"] == 1.0 for s in st)
    assert st["tree:2x1"]["predicted_speedup_vs_ar"] > 0 and st["self-spec"]["predicted_speedup_vs_ar"] > 0
    assert st["tree:dyn-2-2-2-4"]["predicted_speedup_vs_ar"] is None  # dynamic trees are not modelled


def test_num_prompts_and_categories_select_prompts(checkpoint, prompts_file, capsys):
    rc, _, summary = run_cli(capsys, *common(checkpoint, prompts_file, 4), "--strategies", "hf,ar",
                             "--categories", "math", "--num-prompts", 1)
    assert rc == 0
    assert summary["config"]["prompts"] == 1 and set(summary["categories"]) == {"math"}


def test_sampling_runs_but_does_not_claim_identity(checkpoint, prompts_file, capsys):
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file, 6), "--strategies", "hf,hispec",
                               "--temperature", "0.8", "--num-prompts", 2)
    assert rc == 0, out.err
    assert summary["lossless"] is None and summary["strategies"]["hispec"]["identical"] is None
    assert summary["speedup_vs_self_spec"] is None  # self-spec was not run


def test_verification_both_runs_token_wise_and_hsd_side_by_side(checkpoint, prompts_file, capsys):
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file, 8), "--strategies", "hf,ar,self-spec,hispec",
                               "--temperature", "0.8", "--num-prompts", 2, "--verification", "both")
    assert rc == 0, out.err
    names = list(summary["strategies"])
    assert names == ["hf", "ar", "self-spec", "self-spec:hsd", "hispec", "hispec:hsd"]
    st = summary["strategies"]
    assert st["hispec"]["verification"] == "token" and st["hispec:hsd"]["verification"] == "hsd"
    assert st["ar"]["verification"] == "token" and st["hf"]["verification"] is None
    for name in ("self-spec:hsd", "hispec:hsd"):
        assert st[name]["speedup_vs_token"] > 0 and st[name]["tokens_per_target_pass_vs_token"] > 0
    assert any(line.startswith("sequence-level (hsd)") for line in out.out.splitlines())
    # a rule named per strategy; greedy runs are identical to hf under either
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file, 8), "--strategies",
                               "hf,hispec:token,hispec:hsd,ngram-hispec:hsd", "--num-prompts", 2)
    assert rc == 0, out.err
    assert summary["lossless"] is True
    assert summary["strategies"]["hispec:hsd"]["speedup_vs_token"] is not None


@pytest.mark.parametrize("argv,match", [
    (["--strategies", "hispec:foo"], "unknown verification 'foo'"),
    (["--strategies", "hf:hsd"], "applies to hispec's speculative strategies"),
    (["--verification", "foo"], "invalid choice"),
    (["--sweep", "--verification", "hsd"], "drop --verification"),
])
def test_bad_verification_is_refused_before_any_work(checkpoint, prompts_file, capsys, argv, match):
    try:
        rc = main([str(a) for a in common(checkpoint, prompts_file)] + argv)
    except SystemExit as e:  # argparse refuses choices / argument combinations with exit status 2
        rc = e.code
    assert rc == 2 and match in capsys.readouterr().err


def test_bad_inputs_exit_2_before_any_work(checkpoint, prompts_file, capsys):
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", "hf,medusa")
    assert rc == 2 and "medusa" in out.err
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file / "missing.jsonl"))
    assert rc == 2 and "does not exist" in out.err
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file, 400))
    assert rc == 2 and "context" in out.err
    with pytest.raises(SystemExit):
        main(["--model", str(checkpoint), "--prompts", str(prompts_file), "--write-defaults"])


def _record(index, category, seconds, tokens_by_strategy):
    rec = bench.PromptRecord(index, category, "p", 5)
    for (s, toks), secs in zip(tokens_by_strategy.items(), seconds):
        rec.samples[s] = [bench.Sample(secs, toks, bench.Counters(new_tokens=len(toks), target_passes=len(toks)))]
    return rec


def test_speedup_is_the_median_of_side_by_side_ratios_and_a_mismatch_breaks_identity():
    cfg = bench.BenchConfig(strategies=("hf", "self-spec", "hispec"), max_new_tokens=4)
    same = [1, 2, 3, 4]
    records = [  # seconds per strategy (hf, self-spec, hispec); 4 tokens each
        _record(0, "a", (4.0, 2.0, 1.0), {"hf": same, "self-spec": same, "hispec": same}),
        _record(1, "a", (2.0, 2.0, 1.0), {"hf": same, "self-spec": same, "hispec": same}),
        _record(2, "b", (8.0, 4.0, 2.0), {"hf": same, "self-spec": same, "hispec": [1, 2, 9, 4]}),
    ]
    records[2].margins["hispec"] = 3.0  # a clear error, not a rounding tie
    result = bench.BenchResult(cfg, records, {"name_or_path": "x", "num_layers": 6, "draft_layer": 2,
                                              "verify_layer": 4, "head_type": "linear", "dtype": "float32"},
                               bench.hardware_info(), tie_tolerance=0.5)
    summary = bench.summarize(result)
    hs = summary.strategies["hispec"]
    assert hs.speedup_vs_hf == pytest.approx(4.0)  # ratios 4, 2, 4 -> median 4
    assert hs.speedup_vs_self_spec == pytest.approx(2.0)
    assert hs.identical == pytest.approx(2 / 3) and hs.identical_up_to_ties == pytest.approx(2 / 3)
    assert summary.lossless is False and summary.lossless_up_to_ties is False
    assert summary.categories["b"]["strategies"]["hispec"]["identical"] == 0.0
    assert summary.per_prompt[2]["strategies"]["hispec"]["first_mismatch"] == 2
    records[2].own_margins["hispec"] = (0.5, 0.125)  # and 4 ulps apart in the model's own dtype: still an error
    assert bench.summarize(result).lossless_up_to_ties is False
    records[2].own_margins["hispec"] = (0.0625, 0.125)  # tied at the model's own resolution (bf16, logits ~11)
    summary = bench.summarize(result)
    assert summary.lossless is False and summary.lossless_up_to_ties is True
    assert "own-dtype margin +0.062" in bench.format_table(summary)
    del records[2].own_margins["hispec"]
    records[2].margins["hispec"] = 0.1  # a near-tie: lossless up to rounding, not bit-identical
    summary = bench.summarize(result)
    assert summary.lossless is False and summary.lossless_up_to_ties is True
    assert "lossless up to rounding ties" in bench.format_table(summary)


def test_the_tables_make_room_for_long_strategy_names():
    name = "eagle-lookup-tree:4x2x1"  # longer than the 17 columns shorter names get
    cfg = bench.BenchConfig(strategies=("hf", name), max_new_tokens=4)
    records = [_record(0, "a", (2.0, 1.0), {"hf": [1, 2, 3, 4], name: [1, 2, 3, 4]})]
    result = bench.BenchResult(cfg, records, {"name_or_path": "x", "num_layers": 6, "draft_layer": 2,
                                              "verify_layer": 4, "head_type": "linear", "dtype": "float32"},
                               bench.hardware_info(), tie_tolerance=0.5)
    lines = bench.format_table(bench.summarize(result)).splitlines()
    header = next(line for line in lines if line.startswith("strategy"))
    row = next(line for line in lines if line.startswith(name))
    end = header.index("tok/s") + len("tok/s")  # the columns stay under their headers
    assert row[:end].split() == [name, "4.0"] and row[end] == " ", (header, row)


def test_tie_checker_reports_the_fp32_margin_at_the_first_divergence(checkpoint):
    model = hispec.load(checkpoint)
    ids = torch.tensor([[5, 9, 14, 3]])
    logits = model.base(ids).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    margin = bench.TieChecker(model).margin(ids, torch.ones_like(ids), [top2[0]], [top2[1]])
    assert margin == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-5) and margin >= 0
    own, ulps = bench.TieChecker(model).own_margin(ids, torch.ones_like(ids), [top2[0]], [top2[1]])
    assert own == pytest.approx(margin, abs=1e-5) and 0 < ulps < 1e-5  # fp32: two ulps loosen nothing
    half = hispec.load(checkpoint, dtype="bf16")
    own, ulps = bench.TieChecker(half).own_margin(ids, torch.ones_like(ids), [top2[0]], [top2[1]])
    top = float(half.base(ids).logits[0, -1].float().abs().max())
    assert 2 * 2.0 ** -8 * top <= ulps <= 2 * 2.0 ** -7 * top  # 2 units in bf16's last place (7 mantissa bits)


# ---------------------------------------------------------------------------------------------- sweep
def test_sweep_picks_a_lossless_setting_and_writes_it_into_the_checkpoint(checkpoint, prompts_file, capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    rc, out, result = run_cli(capsys, *common(ckpt, prompts_file, 10), "--num-prompts", 2, "--sweep",
                              "--sweep-gammas", "1,2", "--sweep-windows", "1,3", "--write-defaults")
    assert rc == 0, out.err
    assert "fastest lossless setting" in out.out
    assert len(result["results"]) == 4 and all(r["identical"] == 1.0 for r in result["results"])
    best = result["best"]
    assert best["gamma"] in (1, 2) and best["window"] in (1, 3)
    assert (best["draft_layer"], best["verify_layer"]) == (2, 4)
    assert best["speedup_vs_hf"] == max(r["speedup_vs_hf"] for r in result["results"])
    assert result["written"]["gamma"] == best["gamma"]
    cfg = json.loads((ckpt / "config.json").read_text())["hispec"]
    assert cfg["decoding"] == {"gamma": best["gamma"], "window": best["window"]}
    assert [(e["name"], e["layer"]) for e in cfg["exits"]] == [("draft", 2), ("verify", 4)]  # trained heads stay
    reloaded = hispec.load(ckpt)
    assert (reloaded.hispec_config.gamma, reloaded.hispec_config.window) == (best["gamma"], best["window"])
    assert not list(ckpt.glob(".config.json.*"))  # no temporary file left behind


def test_layer_sweep_on_trained_heads_is_refused_before_any_work(checkpoint, prompts_file, capsys):
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file), "--sweep", "--sweep-draft-layers", "1,2")
    assert rc == 2 and "trained for draft layer 2" in out.err


def test_layer_sweep_on_a_base_model_with_shared_heads_tries_every_valid_pair(base_dir, prompts_file, capsys):
    rc, out, result = run_cli(capsys, *common(base_dir, prompts_file, 8), "--head-type", "shared", "--num-prompts", 1,
                              "--sweep", "--strategies", "self-spec,hispec", "--sweep-draft-layers", "1,3",
                              "--sweep-verify-layers", "3,4", "--sweep-gammas", "2")
    assert rc == 0, out.err
    labels = {r["label"] for r in result["results"]}
    # hispec (1,3) (1,4) (3,4) -- (3,3) is invalid; self-spec once per draft layer
    assert labels == {"hispec d1 v3 g2 w4", "hispec d1 v4 g2 w4", "hispec d3 v4 g2 w4",
                      "self-spec d1 g2", "self-spec d3 g2"}
    assert result["best"] is not None and set(result["best_per_strategy"]) == {"self-spec", "hispec"}
    rc, out, _ = run_cli(capsys, *common(base_dir, prompts_file, 8), "--head-type", "shared", "--sweep",
                         "--sweep-gammas", "2", "--write-defaults")
    assert rc == 2 and "checkpoint" in out.err


def test_write_defaults_replaces_config_atomically_and_keeps_other_keys(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    before = json.loads((ckpt / "config.json").read_text())
    bench.write_decoding_defaults(ckpt, bench.Setting("hispec", 1, 3, 5, 6), write_exits=True)
    after = json.loads((ckpt / "config.json").read_text())
    assert after["hispec"]["decoding"] == {"gamma": 5, "window": 6}
    assert hispec.model.HispecConfig.from_dict(after["hispec"]).exits == {"draft": 1, "verify": 3}
    assert {k: v for k, v in after.items() if k != "hispec"} == {k: v for k, v in before.items() if k != "hispec"}


# ---------------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_short_bench_on_the_demo_model_is_lossless(demo_model_dir, capsys):
    from pathlib import Path

    prompts = Path(__file__).resolve().parents[1] / "data" / "eval" / "spec_bench_question.jsonl"  # ships in the repo
    rc, out, summary = run_cli(capsys, "--model", demo_model_dir, "--head-type", "linear", "--prompts", prompts,
                               "--num-prompts", 2, "--max-new-tokens", 16, "--dtype", "fp32", "--warmup", 0,
                               "--no-progress", "--strategies", "hf,hf-early-exit,self-spec,hispec")
    assert rc == 0, out.err
    assert summary["lossless"] is True
    assert summary["model"]["num_layers"] == 30 and summary["strategies"]["hispec"]["tokens_per_s"] > 0


# ---------------------------------------------------------------------------------------------- make demo
def _demo_tool():
    from conftest import load_tool

    return load_tool("demo")


def test_demo_refuses_a_missing_prompt_file_before_any_work(tmp_path, capsys):
    demo = _demo_tool()
    assert demo.main(["--prompts", str(tmp_path / "none.jsonl"), "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "--prompts" in capsys.readouterr().err and not (tmp_path / "cache").exists()


def test_demo_short_training_run_launches_the_recipe_on_the_local_model(tmp_path):
    demo = _demo_tool()
    cmd = demo.train_command(tmp_path / "model", tmp_path / "out", 7, ["--seed", "1"])
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert str(demo.TRAIN_SCRIPT) in cmd and str(demo.RECIPE) in cmd
    i = cmd.index("--model_name_or_path")
    assert cmd[i + 1] == str(tmp_path / "model")
    assert cmd[cmd.index("--max_steps") + 1] == "7" and cmd[-2:] == ["--seed", "1"]  # extra arguments win


def test_demo_exports_the_shipped_artifact_with_its_own_settings_and_a_fresh_run_with_the_defaults():
    demo = _demo_tool()
    args = demo.build_parser().parse_args([])
    assert demo.export_options(args, shipped=True) == []
    assert demo.export_options(args, shipped=False) == ["--draft-vocab-size", "8192", "--verify-vocab-size", "8192",
                                                        "--gamma", "2", "--window", "4"]
    args = demo.build_parser().parse_args(["--gamma", "3", "--verify-vocab-size", "0"])
    assert demo.export_options(args, shipped=True) == ["--verify-vocab-size", "0", "--gamma", "3"]


@pytest.mark.parametrize("artifact, layers, vocab, decoding", [
    ("smollm2-135m", (4, 8), 8192, {"gamma": 2, "window": 4}),
    ("qwen2.5-coder-1.5b-instruct", (4, 7), 8192, {"gamma": 1, "window": 2}),
])
def test_shipped_artifacts_record_the_configuration_a_plain_export_reproduces(artifact, layers, vocab, decoding):
    """What `make demo` and the README measured must come out of `hispec-export ARTIFACT` with no flags: the
    vocabularies as integer ids in the heads, gamma and window in the record."""
    from safetensors import safe_open

    from hispec.model import HispecConfig

    folder = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "artifacts" / artifact
    hconf = HispecConfig.from_dict(json.loads((folder / "hispec_train.json").read_text())["hispec"])
    assert (hconf.draft_layer, hconf.verify_layer) == layers
    assert (hconf.draft_vocab_size, hconf.verify_vocab_size) == (vocab, vocab)
    assert {"gamma": hconf.gamma, "window": hconf.window} == decoding
    with safe_open(str(folder / "hispec_heads.safetensors"), framework="pt") as f:
        for name in ("draft", "verify"):
            ids = f.get_tensor(f"{name}.vocab")
            assert ids.dtype == torch.long and ids.numel() == vocab and bool((ids[1:] > ids[:-1]).all())
    assert sum(f.stat().st_size for f in folder.iterdir()) < 50 * 2**20


def test_calibrate_stores_a_calibration_and_auto_then_runs(checkpoint, prompts_file, capsys, tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(checkpoint, ckpt)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["hispec"]["calibration"]
    cfg_path.write_text(json.dumps(cfg))
    rc, out, summary = run_cli(capsys, *common(ckpt, prompts_file, 6), "--num-prompts", 2, "--calibrate",
                               "--calibration-num-prompts", 2, "--calibration-max-seconds", 600)
    assert rc == 0, out.err
    assert "latency model, calibrated on" in out.err
    stored = json.loads(cfg_path.read_text())["hispec"]["calibration"]
    assert stored["positions"] > 0 and set(stored["costs"]) >= {"layer", "final", "step_overhead"}
    assert stored["budget"]["max_seconds"] == 600 and stored["budget"]["skipped"] == {}
    assert "auto" in summary["strategies"] and summary["strategies"]["auto"]["identical"] == 1.0
    assert "hf-prompt-lookup" in summary["strategies"] and "ngram" in summary["strategies"]


def test_a_peer_strategy_that_raises_is_reported_and_the_others_run_on(checkpoint, prompts_file, capsys, monkeypatch):
    """As transformers 5.17's `assistant_early_exit` did on a GPU: it sets `config.num_hidden_layers` to the exit
    layer, then crashes (here on its second run, after one timed sample). The bench reports it as failed (table,
    JSON line, stderr), drops its samples, undoes the config change (else `hf` would run 2 layers and leave `ar`) and
    times the others on every prompt."""
    import transformers

    generate = transformers.GenerationMixin.generate
    calls = []

    def crashing(self, *args, generation_config=None, **kw):
        if generation_config is not None and getattr(generation_config, "assistant_early_exit", None):
            calls.append(1)
            if len(calls) == 2:
                self.config.num_hidden_layers = generation_config.assistant_early_exit
                raise RuntimeError("assistant_early_exit crashed")
        return generate(self, *args, generation_config=generation_config, **kw)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", crashing)
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies",
                               "hf-early-exit,hf,ar,self-spec")
    assert rc == 0, out.err
    assert summary["failed"] == {"hf-early-exit": "RuntimeError: assistant_early_exit crashed"} and len(calls) == 2
    assert set(summary["strategies"]) == {"hf", "ar", "self-spec"}
    assert summary["lossless"] is True  # hf ran the whole model again after the crash: identical to ar
    assert all(s["identical"] == 1.0 for s in summary["strategies"].values())
    assert "hf-early-exit    FAILED (not timed): RuntimeError: assistant_early_exit crashed" in out.out
    assert "hf-early-exit failed and was left out" in out.err
    assert summary["config"]["strategies"] == ["hf-early-exit", "hf", "ar", "self-spec"]


def test_restored_config_undoes_what_a_block_changed_in_the_configs():
    model = tiny_model("llama")
    before, gen_before = dict(vars(model.config)), dict(vars(model.generation_config))
    with pytest.raises(RuntimeError), bench.restored_config(model):
        model.config.num_hidden_layers = 1
        model.config.added_by_the_peer = True
        model.generation_config.max_new_tokens = 3
        raise RuntimeError
    assert vars(model.config) == before and vars(model.generation_config) == gen_before



def test_hispec_strategies_are_timed_on_their_own_path_and_transformers_passes_still_counted():
    # the pass counter's hooks would send every decoder layer through transformers' forward (hispec.fused steps
    # aside for hooked layers): they are attached only while one of transformers' strategies runs
    from tiny import tiny_model

    import hispec

    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 2, 4, "linear")
    runner = bench.Runner(model, bench.BenchConfig(strategies=("hf", "ar"), max_new_tokens=6))
    fast, calls = model.adapter.standard, []
    real = fast.run
    fast.run = lambda *a, **k: calls.append(1) or real(*a, **k)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ar = runner.run("ar", ids, mask, seed=0)
    assert len(calls) >= model.num_layers * ar.counters.new_tokens
    calls.clear()
    hf = runner.run("hf", ids, mask, seed=0)
    assert hf.counters.target_passes == hf.counters.new_tokens and not calls  # counted, and through its forward
    assert all(not (layer._forward_hooks or layer._forward_pre_hooks) for layer in model.adapter.parts.layers)
    assert hf.tokens == ar.tokens
    runner.close()
