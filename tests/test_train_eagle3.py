"""train/heads.py --head_type eagle3: an EAGLE-3 drafter trained by the distillation core from the feature cache,
with resume, then exported in the speculators format (tiny llama + character tokenizer of test_train.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_train import _cache_argv, _run, _run_killed_after, env, fresh_accelerate_state, pairs_file  # noqa: F401

EAGLE = ("--head_type", "eagle3", "--eagle3_draft_vocab_size", "40", "--eagle3_ttt_steps", "3",
         "--learning_rate", "3e-3", "--per_device_train_batch_size", "4")


def _drafter(path):
    return load_file(str(path / "hispec_drafter.safetensors"))


def test_drafter_trains_from_the_cache_of_its_aux_layers_and_exports(env, pairs_file, tmp_path, capsys):
    from hispec.distill.features import open_feature_cache
    from hispec.eagle3 import load_drafter
    from hispec.speculators_export import export_speculators

    cache, out = tmp_path / "cache", tmp_path / "run"
    assert _run(_cache_argv(env, out, cache, pairs_file, *EAGLE, "--max_steps", "16", "--eval_steps", "8")) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["head_type"] == "eagle3" and len(line["top1_by_step"]) == 3
    assert open_feature_cache(cache / "train")["layers"] == [1, 3, 5]  # the default aux layers of a 6-layer model
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["step"] for h in metrics["history"]] == [0, 8, 16]
    first, last = metrics["history"][0], metrics["final"]
    assert last["ce"][0] < 0.8 * first["ce"][0]
    assert last["accepted_per_round"] > first["accepted_per_round"]
    assert last["accepted_per_round"] == pytest.approx(sum(last["chain"]), abs=1e-3)
    drafter, meta = load_drafter(out)
    assert meta["ttt_steps"] == 3 and meta["config"]["aux_layers"] == [1, 3, 5]
    assert drafter.config.draft_vocab_size == 40 and int(drafter.t2d.sum()) == 40
    assert not (out / "hispec_heads.safetensors").exists()
    spec = export_speculators(out, tmp_path / "spec")
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]

    # into a hispec checkpoint beside exit heads: hispec.load finds it, `eagle` decodes exactly like `ar`
    import hispec
    from hispec.cli.export import main as export_main
    from test_train import _argv

    heads = tmp_path / "heads"
    assert _run(_argv(env, heads, "--max_steps", "2")) == 0
    assert export_main([str(heads), "--output-dir", str(tmp_path / "ck"), "--drafter", str(out)]) == 0
    model = hispec.load(tmp_path / "ck")
    assert model.drafter is not None and model.drafter.config.aux_layers == [1, 3, 5]
    ids = torch.tensor([[5, 9, 12, 40, 7]])
    assert model.generate(ids, max_new_tokens=12, strategy="eagle").new_tokens == \
        model.generate(ids, max_new_tokens=12, strategy="ar").new_tokens
    assert export_main([str(heads), "--output-dir", str(tmp_path / "ck2"), "--drafter", str(heads)]) == 1
    assert not (tmp_path / "ck2").exists()

    # tools/drafter_eval.py: the target answers held-out prompts, the drafter is scored per category
    from conftest import load_tool

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the cat {w}", "category": c}) + "\n"
                               for w, c in [("sat", "a"), ("ran", "a"), ("is red", "b")]))
    capsys.readouterr()
    assert load_tool("drafter_eval").main(["--run", str(out), "--model", str(env / "model"), "--prompts",
                                           str(prompts), "--max-new-tokens", "12", "--num-prompts", "3"]) == 0
    printed = capsys.readouterr().out
    res = json.loads(printed.strip().splitlines()[-1])
    assert set(res["by_category"]) == {"a", "b"} and res["steps"] == 3
    assert res["overall"]["tokens"] == sum(r["tokens"] for r in res["by_category"].values()) > 0
    assert "acc/round" in printed


def test_drafter_resume_after_kill_equals_uninterrupted_run(env, pairs_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    common = (*EAGLE, "--max_steps", "7", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
              "--eval_steps", "3", "--eagle3_aux_layers", "2", "4", "6")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(_cache_argv(env, straight, cache, pairs_file, *common)) == 0
    _run_killed_after(monkeypatch, 3, _cache_argv(env, killed, cache, pairs_file, *common))
    assert not (killed / "hispec_drafter.safetensors").exists()
    with pytest.raises(ValueError, match="already holds a run"):
        _run(_cache_argv(env, killed, cache, pairs_file, *common))
    assert _run(_cache_argv(env, killed, cache, pairs_file, *common, "--resume_from_checkpoint", "latest")) == 0
    a, b = _drafter(straight), _drafter(killed)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ma, mb = (json.loads((p / "metrics.json").read_text()) for p in (straight, killed))
    assert [h["step"] for h in mb["history"]] == [h["step"] for h in ma["history"]] == [0, 3, 6, 7]
    assert mb["final"] == ma["final"]
    with pytest.raises(ValueError, match="already holds a run"):  # a finished drafter run is not overwritten
        _run(_cache_argv(env, straight, cache, pairs_file, *common))


@pytest.mark.parametrize("extra, message", [
    (("--head_type", "eagle3"), "trains from a feature cache"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_ttt_steps", "0"),
     "eagle3_ttt_steps must be >= 1"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_aux_layers", "1", "9"),
     r"eagle3_aux_layers \[9\] are out of range for a 6-layer model"),
    (("--eagle3_aux_layers", "1", "2"), "applies to head_type eagle3 only"),
])
def test_bad_drafter_settings_fail_before_training(env, tmp_path, extra, message):
    from test_train import _argv

    with pytest.raises(ValueError, match=message):
        _run(_argv(env, tmp_path / "bad", *extra))
    assert not (tmp_path / "bad" / "hispec_drafter.safetensors").exists()
