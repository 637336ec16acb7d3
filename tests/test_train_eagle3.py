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
    from hispec.drafters.eagle3 import load_drafter
    from hispec.export.speculators import export_speculators

    cache, out = tmp_path / "cache", tmp_path / "run"
    assert _run(_cache_argv(env, out, cache, pairs_file, *EAGLE, "--max_steps", "16", "--eval_steps", "8",
                            "--eagle3_intermediate_size", "24")) == 0
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
    assert drafter.config.intermediate_size == 24 and drafter.layers[0].mlp.up_proj.out_features == 24
    assert not (out / "hispec_heads.safetensors").exists()
    spec = export_speculators(out, tmp_path / "spec")
    spec_cfg = json.loads((spec / "config.json").read_text())
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert spec_cfg["transformer_layer_config"]["intermediate_size"] == 24

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
    plain = model.generate(ids, max_new_tokens=12, strategy="ar").new_tokens
    assert model.generate(ids, max_new_tokens=12, strategy="eagle").new_tokens == plain
    assert model.generate(ids, max_new_tokens=12, strategy="eagle", tree=[2, 1]).new_tokens == plain
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
    assert "acc/round" in printed and 0 < res["overall"]["in_vocab"] <= 1


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


def test_drafter_trains_on_from_an_earlier_drafter(env, pairs_file, tmp_path, capsys):
    """`--eagle3_init_from RUN`: a new run starts from that drafter (its weights and draft vocabulary, so its
    first evaluation is the earlier run's final one) and trains on; a drafter of another shape is refused before
    training, naming the difference."""
    from hispec.drafters.eagle3 import load_drafter

    cache, first, more = tmp_path / "cache", tmp_path / "first", tmp_path / "more"
    common = (*EAGLE, "--eval_steps", "4", "--eagle3_intermediate_size", "24")
    assert _run(_cache_argv(env, first, cache, pairs_file, *common, "--max_steps", "8")) == 0
    assert _run(_cache_argv(env, more, cache, pairs_file, *common, "--max_steps", "4",
                            "--eagle3_init_from", str(first))) == 0
    m1, m2 = (json.loads((p / "metrics.json").read_text()) for p in (first, more))
    assert m2["history"][0]["top1"] == pytest.approx(m1["final"]["top1"], abs=1e-6)
    assert m2["history"][0]["ce"] == pytest.approx(m1["final"]["ce"], rel=1e-5)
    (d1, _), (d2, meta) = load_drafter(first), load_drafter(more)
    assert torch.equal(d1.t2d, d2.t2d) and torch.equal(d1.d2t, d2.d2t)
    assert not torch.equal(d1.fc.weight, d2.fc.weight)  # trained on
    assert meta["data"]["init_from"]["folder"] == str(first) and len(meta["data"]["init_from"]["sha256"]) == 16

    # tools/drafter_eval.py scores both on the same answers, each exactly as it scores it alone
    from conftest import load_tool

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the cat {w}", "category": c}) + "\n"
                               for w, c in [("sat", "a"), ("is red", "b")]))
    common_eval = ["--model", str(env / "model"), "--prompts", str(prompts), "--max-new-tokens", "10"]
    capsys.readouterr()
    assert load_tool("drafter_eval").main(["--run", str(first), str(more), *common_eval]) == 0
    printed = capsys.readouterr().out
    both = json.loads(printed.strip().splitlines()[-1])
    assert [r["run"] for r in both["runs"]] == [str(first), str(more)] and "side by side" in printed
    assert load_tool("drafter_eval").main(["--run", str(more), *common_eval]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert alone["overall"] == both["runs"][1]["overall"] and alone["by_category"] == both["runs"][1]["by_category"]
    assert both["runs"][0]["overall"] != both["runs"][1]["overall"]

    # tools/research/draft_vocab_coverage.py ranks tokens as training does: its 40 are the first drafter's vocabulary
    from hispec.distill.features import CachedSequences

    train = CachedSequences(cache / "train", layers=[])
    V = d1.config.vocab_size
    by_items = sum(torch.bincount(train[i]["teacher_topk_ids"][:, 0], minlength=V) for i in range(len(train)))
    assert torch.equal(train.teacher_top1_counts(V), by_items)  # (read from the top-k column alone)
    assert load_tool("draft_vocab_coverage").main(["--model", str(env / "model"), "--feature-cache", str(cache),
                                                   "--sizes", "60", "20", "40", "--drafter", str(first),
                                                   "--prompts", str(prompts), "--max-new-tokens", "10"]) == 0
    cov = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["coverage"]
    assert cov["all"]["tokens"] == sum(r["tokens"] for c, r in cov.items() if c != "all") > 0
    for r in cov.values():
        assert r["20"] <= r["40"] <= r["60"] and r[str(first)] == r["40"]
    assert load_tool("draft_vocab_coverage").main(["--model", str(env / "model"), "--feature-cache", str(cache),
                                                   "--sizes", str(V)]) == 2

    # a larger eagle3_draft_vocab_size widens the earlier drafter's vocabulary, its tokens and rows kept
    wide = tmp_path / "wide"
    assert _run(_cache_argv(env, wide, cache, pairs_file, *common, "--max_steps", "2", "--eagle3_draft_vocab_size",
                            "50", "--eagle3_init_from", str(first))) == 0
    d3, _ = load_drafter(wide)
    assert d3.config.draft_vocab_size == 50 and set(d1.draft_token_ids().tolist()) < set(d3.draft_token_ids().tolist())
    with pytest.raises(ValueError, match="draft_vocab_size: 40 there, 30 here"):  # narrowing is refused
        _run(_cache_argv(env, tmp_path / "narrow", cache, pairs_file, *common, "--max_steps", "2",
                         "--eagle3_draft_vocab_size", "30", "--eagle3_init_from", str(first)))

    with pytest.raises(ValueError, match="intermediate_size: 24 there, 32 here"):
        _run(_cache_argv(env, tmp_path / "bad", cache, pairs_file, *EAGLE, "--eagle3_intermediate_size", "32",
                         "--max_steps", "2", "--eagle3_init_from", str(first)))
    assert not (tmp_path / "bad" / "hispec_drafter.safetensors").exists()


@pytest.mark.parametrize("extra, message", [
    (("--head_type", "eagle3"), "trains from a feature cache"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_ttt_steps", "0"),
     "eagle3_ttt_steps must be >= 1"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_aux_layers", "1", "9"),
     r"eagle3_aux_layers \[9\] are out of range for a 6-layer model"),
    (("--eagle3_aux_layers", "1", "2"), "apply to head_type eagle3 only"),
    (("--eagle3_intermediate_size", "32"), "apply to head_type eagle3 only"),
    (("--eagle3_init_from", "/tmp/nowhere-hispec"), "apply to head_type eagle3 only"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_init_from", "/tmp/nowhere-hispec"),
     "holds no EAGLE-3 drafter"),
    (("--head_type", "eagle3", "--feature_cache", "/tmp/nowhere-hispec", "--eagle3_intermediate_size", "-1"),
     "eagle3_intermediate_size must be >= 0"),
])
def test_bad_drafter_settings_fail_before_training(env, tmp_path, extra, message):
    from test_train import _argv

    with pytest.raises(ValueError, match=message):
        _run(_argv(env, tmp_path / "bad", *extra))
    assert not (tmp_path / "bad" / "hispec_drafter.safetensors").exists()


def test_the_data_job_killed_while_answering_resumes_to_identical_answers_and_shards(env, pairs_file, tmp_path,
                                                                                      monkeypatch):
    """The whole data job of an EAGLE-3 recipe (`--data_only`: self-written prompts, the model's answers, plain text,
    the feature cache of the aux layers), killed after two batches of answers (and the last line torn, as a kill
    mid-write leaves it), then run again: the same answers, nothing answered twice, and shard for shard the same
    cache as an uninterrupted job."""
    import hispec.distill.answers as answers
    from hispec.distill.features import open_feature_cache
    from test_train import char_tokenizer
    from tiny import tiny_model

    model = tiny_model("llama")  # the plain tiny llama: it samples varied prompts that stop
    model.config.eos_token_id = model.config.pad_token_id = 1
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 1
    model.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")

    def job(root):
        return ["--model_name_or_path", str(tmp_path / "model"), "--head_type", "eagle3", "--data_only", "true",
                "--self_prompts", "12", "--self_prompt_batch_size", "4", "--self_prompt_max_new_tokens", "24",
                "--self_distill", "true", "--gen_max_new_tokens", "10", "--gen_batch_size", "3",
                "--train_file", str(env / "train.jsonl"), "--text_column", "question", "--max_samples_per_file", "6",
                "--eval_fraction", "0.25", "--plain_text_file", str(pairs_file), "--plain_text_loss_on", "all",
                "--self_prompts_dir", str(root / "prompts"), "--self_distill_dir", str(root / "answers"),
                "--feature_cache", str(root / "cache"), "--feature_cache_k", "8", "--feature_cache_shard_tokens",
                "300", "--output_dir", str(root / "run"), "--max_seq_length", "96"]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(job(straight)) == 0
    calls = {"batches": 0}
    real = answers.answer_batches

    def dies_after_two(*a, **kw):
        for item in real(*a, **kw):
            if calls["batches"] == 2:
                raise KeyboardInterrupt("killed")
            calls["batches"] += 1
            yield item

    monkeypatch.setattr(answers, "answer_batches", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        _run(job(killed))
    monkeypatch.setattr(answers, "answer_batches", real)
    part = killed / "answers" / "part-rank0.jsonl"
    assert len(part.read_text().splitlines()) == 6  # two batches of 3 written and flushed
    with open(part, "a") as f:
        f.write('{"id": "torn')  # what a kill in the middle of a write leaves
    assert not (killed / "cache" / "train" / "manifest.json").exists()
    assert _run(job(killed)) == 0

    def rows(root):
        out = {}
        for line in (root / "answers" / "part-rank0.jsonl").read_text().splitlines():
            if line.startswith('{"id": "torn'):
                continue
            r = json.loads(line)
            assert r["id"] not in out  # nothing answered twice
            out[r["id"]] = r
        return out

    assert rows(killed) == rows(straight) and len(rows(straight)) > 6
    for split in ("train", "eval"):
        a, b = (open_feature_cache(root / "cache" / split) for root in (straight, killed))
        assert a["fingerprint"] == b["fingerprint"] and a["num_tokens"] == b["num_tokens"] > 0
        assert [s["fingerprint"] for s in a["shards"]] == [s["fingerprint"] for s in b["shards"]]
        for s in a["shards"]:
            x, y = (load_file(str(root / "cache" / split / s["file"])) for root in (straight, killed))
            assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), s["file"]
