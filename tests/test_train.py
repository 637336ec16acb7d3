"""The training entry point (train/heads.py) end to end on a tiny random model, offline.

In-process: outputs and their format, the loss going down, resume after a kill equal to an uninterrupted run,
bad configurations failing before training, recipes parsing; the feature-cache path (data_only build, training
from the cache, resume equal to a straight run), plain-text sources, self-written prompts (resumable and
deterministic) answered in bf16 (`gen_dtype`, weights restored bit for bit). Subprocesses through `accelerate launch`: a
DeepSpeed ZeRO-2 run on CPU (when deepspeed is installed) and a 2-process gloo run (both `slow`). One short
`real_model` run on SmolLM2 with self-distillation.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hispec.model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()


def char_tokenizer():
    """A 97-token character tokenizer (fits tests/tiny.py's vocabulary) with a chat template; built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 126)]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    t.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return t


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny llama (6 layers, 97 tokens) + tokenizer saved as an HF folder, and two training files."""
    from tiny import tiny_model

    root = tmp_path_factory.mktemp("train_env")
    model = tiny_model("llama")
    model.config.eos_token_id = model.config.pad_token_id = 1
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked distributions: exits and final layer clearly disagree at first
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 1
    model.save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"question": " ".join(rng.choices(WORDS, k=rng.randint(4, 12)))}) + "\n")
    chats = [{"conversations": [{"from": "human", "value": " ".join(rng.choices(WORDS, k=5))},
                                {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=6))}]} for _ in range(6)]
    (root / "chat.json").write_text(json.dumps(chats))
    (root / "blank.jsonl").write_text(json.dumps({"question": "  "}) + "\n")
    return root


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """main() runs several times in this process; accelerate keeps process-wide singletons."""
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _argv(env, out, *extra):
    return ["--model_name_or_path", str(env / "model"),
            "--train_file", str(env / "train.jsonl"), str(env / "chat.json"),
            "--text_column", "question", "--messages_column", "conversations",
            "--output_dir", str(out), "--max_seq_length", "48", "--per_device_train_batch_size", "2",
            "--eval_fraction", "0.1", "--logging_steps", "1", *extra]


def _run(argv):
    """main(argv) with accelerate's process-wide state reset afterwards (several runs share this process)."""
    from train.heads import main

    try:
        return main(argv)
    finally:
        fresh_accelerate_state_reset()


def _heads(path):
    return load_file(str(Path(path) / "hispec_heads.safetensors"))


def test_end_to_end_writes_heads_config_and_metrics(env, tmp_path):
    from hispec.model import EarlyExitModel
    from train.heads import main

    out = tmp_path / "run"
    assert main(_argv(env, out, "--max_steps", "12", "--learning_rate", "3e-2", "--head_type", "lowrank",
                      "--head_rank", "4", "--draft_layer", "2", "--verify_layer", "4", "--eval_steps", "6",
                      "--temperature", "2.0")) == 0
    heads = _heads(out)
    base = EarlyExitModel.from_base(str(env / "model"), 2, 4, "lowrank", head_rank=4)
    assert sorted(heads) == sorted(base.heads_state_dict())
    base.load_heads(out / "hispec_heads.safetensors")  # loads strictly

    info = json.loads((out / "hispec_train.json").read_text())
    assert hispec.model.HispecConfig.from_dict(info["hispec"]).exits == {"draft": 2, "verify": 4}
    assert info["hispec"]["head"]["type"] == "lowrank" and info["hispec"]["head"]["rank"] == 4
    assert info["base"]["num_hidden_layers"] == 6 and info["base"]["vocab_size"] == 97
    assert info["args"]["learning_rate"] == 3e-2 and info["steps"] == 12
    assert info["data"]["train_examples"] == 27 and info["data"]["eval_examples"] == 3

    metrics = json.loads((out / "metrics.json").read_text())
    steps = [h["step"] for h in metrics["history"]]
    assert steps == [0, 6, 12]
    first, last = metrics["history"][0], metrics["final"]
    for k in ("draft", "verify"):
        assert last[k]["kl"] < 0.8 * first[k]["kl"]  # the loss went down on held-out text
        a = last[k]["top1_agreement"]
        assert 0 <= a <= 1 and last[k]["expected_tokens_per_round"] == pytest.approx(
            (1 - a ** (last["gamma"] + 1)) / (1 - a) if a < 1 else last["gamma"] + 1)
    assert not list(out.glob(".*tmp*"))


class _Killed(Exception):
    pass


def _run_killed_after(monkeypatch, step, argv):
    """main(argv), killed (an exception from the trainer's step hook) right after optimizer step `step`."""
    from hispec.distill import trainer

    def kill(s):
        if s == step:
            raise _Killed

    monkeypatch.setattr(trainer, "_step_hook", kill)
    with pytest.raises(_Killed):
        _run(argv)
    monkeypatch.undo()


def _leaves(d, prefix=""):
    """A nested metrics dict -> {"a.b": leaf}."""
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _assert_same_run(straight, resumed, steps=(0, 3, 6, 9), tol=None):
    """The resumed run ended with the straight run's heads (bit for bit), evaluation steps and final metrics."""
    a, b = _heads(straight), _heads(resumed)
    assert sorted(a) == sorted(b)
    for k in a:
        if tol is None:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)
    ma = json.loads((straight / "metrics.json").read_text())
    mb = json.loads((resumed / "metrics.json").read_text())
    assert [h["step"] for h in mb["history"]] == [h["step"] for h in ma["history"]] == list(steps)
    if tol is None:
        assert mb["final"] == ma["final"]
    else:
        fa, fb = _leaves(ma["final"]), _leaves(mb["final"])
        assert fa.keys() == fb.keys()
        for k, v in fa.items():
            assert fb[k] == (pytest.approx(v, rel=tol, abs=tol) if isinstance(v, float) else v), k


def test_resume_after_kill_equals_uninterrupted_run(env, tmp_path, monkeypatch):
    """9 steps straight vs. killed after step 5 + `--resume_from_checkpoint latest` (from step 4, mid-epoch,
    with gradient accumulation and an epoch boundary after it): identical heads, bit for bit."""
    common = ("--max_steps", "9", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
              "--eval_steps", "3", "--learning_rate", "1e-2")
    straight = tmp_path / "straight"
    assert _run(_argv(env, straight, *common)) == 0
    info = json.loads((straight / "hispec_train.json").read_text())
    assert info["data"]["steps_per_epoch"] < 9  # the run crosses an epoch boundary

    killed = tmp_path / "killed"

    _run_killed_after(monkeypatch, 5, _argv(env, killed, *common))
    ckpts = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"] and not (killed / "hispec_heads.safetensors").exists()
    (killed / "checkpoints" / ".tmp_step_6").mkdir()  # a half-written checkpoint is never picked up

    with pytest.raises(ValueError, match="already holds a run"):
        _run(_argv(env, killed, *common))  # refuses to silently start over
    assert _run(_argv(env, killed, *common, "--resume_from_checkpoint", "latest")) == 0
    _assert_same_run(straight, killed)
    # save_total_limit (3) keeps the newest checkpoints only
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step_4", "step_6", "step_8"]


def fresh_accelerate_state_reset():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--draft_layer", "9"), "draft_layer 9 is out of range for a 6-layer model; choose 1..5"),
        (("--draft_layer", "3", "--verify_layer", "2"), "must be below verify_layer"),
        (("--head_type", "mlp"), "unknown head type 'mlp'"),
        (("--head_type", "shared"), "no trainable weights"),
        (("--text_column", "nope"), "neither messages_column 'conversations' nor text_column 'nope'"),
        (("--temperature", "0"), "temperature must be > 0"),
        (("--self_prompts", "4"), "set self_distill: true"),
        (("--feature_cache", "/tmp/nowhere-hispec", "--temperature", "2"), "teacher at temperature 1"),
        (("--plain_text_loss_on", "user"), "unknown plain_text_loss_on 'user'"),
        (("--gen_dtype", "int8"), "gen_dtype: unknown dtype 'int8'"),
        (("--loss_dtype", "int4"), "loss_dtype: unknown dtype 'int4'"),
        (("--self_prompts", "3", "--self_distill", "true", "--self_prompt_top_p", "0"), "self_prompt_top_p"),
    ],
)
def test_bad_config_fails_before_training(env, tmp_path, extra, message):
    from train.heads import ConfigError, main

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(_argv(env, out, "--max_steps", "2", *extra))
    assert not (out / "hispec_heads.safetensors").exists() and not (out / "checkpoints").exists()


def test_lora_adapter_is_merged_before_training(env, tmp_path):
    """--adapter_name_or_path: a peft LoRA adapter is merged into the frozen base; its name is recorded."""
    peft = pytest.importorskip("peft")
    from tiny import tiny_model

    model = tiny_model("llama")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    lora.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "run"
    assert _run(_argv(env, out, "--max_steps", "1", "--adapter_name_or_path", str(tmp_path / "adapter"))) == 0
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["base"]["merged_adapter"] == str(tmp_path / "adapter")


def test_empty_dataset_fails_before_training(env, tmp_path):
    from train.heads import ConfigError, main

    argv = ["--model_name_or_path", str(env / "model"), "--train_file", str(env / "blank.jsonl"),
            "--text_column", "question", "--output_dir", str(tmp_path / "run"), "--max_steps", "2"]
    with pytest.raises(ConfigError, match="training data is empty"):
        main(argv)


def test_yaml_gives_defaults_and_cli_wins(env, tmp_path):
    from train.heads import ConfigError, parse_args

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {env / 'model'}\ntrain_file: {env / 'train.jsonl'}\n"
                      "learning_rate: 0.5\nmax_steps: 7\nself_distill: true\noutput_dir: ~/x\n")
    m, d, g, t = parse_args(["--config", str(recipe), "--max_steps", "3"])
    assert t.learning_rate == 0.5 and t.max_steps == 3 and d.self_distill is True
    assert d.train_file == [str(env / "train.jsonl")] and m.model_name_or_path == str(env / "model")
    recipe.write_text("learning_rat: 0.5\n")
    with pytest.raises(ConfigError, match="unknown field"):
        parse_args(["--config", str(recipe)])


def test_recipes_parse_and_state_their_launch_command():
    from train.heads import parse_args

    names = ("smollm2-135m", "smollm2-135m-scale", "llama3-8b", "llama2-7b", "codellama-7b", "qwen3-8b", "qwen2.5-7b",
             "mistral-7b")
    recipes = [REPO / "recipes" / f"{n}.yaml" for n in names]
    for r in recipes:
        first = r.read_text().splitlines()[0]
        assert first.startswith("#") and "accelerate launch" in first and "train/heads.py" in first, r
        m, d, g, t = parse_args(["--config", str(r)])
        assert m.model_name_or_path and (d.train_file or d.dataset_name), r
    for cfg in (REPO / "recipes" / "accelerate").glob("*.yaml"):
        assert "accelerate launch" in cfg.read_text().splitlines()[0] or "accelerate launch" in cfg.read_text()


def test_benchmarks_are_never_training_data(env, tmp_path):
    from train.heads import ConfigError, main

    bench = tmp_path / "spec_bench_question.jsonl"
    bench.write_text(json.dumps({"question": "q"}) + "\n")
    for opt in ("--train_file", "--plain_text_file"):
        with pytest.raises(ConfigError, match="evaluation benchmark"):
            main(["--model_name_or_path", str(env / "model"), opt, str(bench), "--text_column", "question",
                  "--output_dir", str(tmp_path / "run")])


# ---------------------------------------------------------------------------------------------------- scale data
@pytest.fixture(scope="module")
def pairs_file(env):
    """GSM8K-like {question, answer} rows for teacher-forced plain-text distillation."""
    rng = random.Random(1)
    path = env / "pairs.jsonl"
    with open(path, "w") as f:
        for _ in range(10):
            f.write(json.dumps({"question": " ".join(rng.choices(WORDS, k=5)),
                                "answer": " ".join(rng.choices(WORDS, k=8))}) + "\n")
    return path


def _cache_argv(env, out, cache, pairs, *extra):
    return _argv(env, out, "--plain_text_file", str(pairs), "--plain_text_loss_on", "assistant",
                 "--feature_cache", str(cache), "--feature_cache_k", "8", "--feature_cache_shard_tokens", "200",
                 "--draft_layer", "2", "--verify_layer", "4", *extra)


def test_feature_cache_data_only_then_training(env, pairs_file, tmp_path, capsys):
    from hispec.distill.features import open_feature_cache

    cache, out = tmp_path / "cache", tmp_path / "run"
    assert _run(_cache_argv(env, out, cache, pairs_file, "--data_only", "true")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["data_only"] and summary["sources"]["plain_text_rows"] == 10
    assert not (out / "hispec_heads.safetensors").exists()
    train_m, eval_m = open_feature_cache(cache / "train"), open_feature_cache(cache / "eval")
    assert train_m["layers"] == [2, 4] and train_m["k"] == 8 and len(train_m["shards"]) > 1
    assert train_m["num_sequences"] == summary["train_sequences"] == 27 + 10
    assert train_m["num_loss_tokens"] < train_m["num_tokens"]  # plain-text chats: assistant replies only
    assert eval_m["num_sequences"] == 3 and eval_m["num_loss_tokens"] == eval_m["num_tokens"]

    assert _run(_cache_argv(env, out, cache, pairs_file, "--max_steps", "12", "--learning_rate", "1e-2",
                            "--eval_steps", "6")) == 0
    assert open_feature_cache(cache / "train")["build_seconds"] == train_m["build_seconds"]  # reused, not rebuilt
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["step"] for h in metrics["history"]] == [0, 6, 12]
    first, last = metrics["history"][0], metrics["final"]
    assert last["teacher"] == "feature cache: top-k + bucket" and last["eval_tokens"] == eval_m["num_tokens"]
    for k in ("draft", "verify"):
        assert last[k]["kl"] < 0.8 * first[k]["kl"]
        assert 0 <= last[k]["top1_agreement"] <= 1
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["feature_cache"]["train_tokens"] == train_m["num_tokens"]
    assert info["data"]["sources"]["plain_text_sequences"] == 10


@pytest.mark.parametrize("head_type", ["linear", "layer"])
def test_training_from_a_full_vocabulary_fp32_cache_equals_training_on_the_fly(env, pairs_file, tmp_path,
                                                                                head_type):
    """k = V and fp32 hidden states: the cached path must reproduce the backbone-on-the-fly path (same loss
    tokens, same KL, same heads up to float rounding), which checks features, masks, labels and the loss -- for
    `layer` heads also the whole sequences rebuilt from the cache's offsets (padding, positions, causal order)."""
    common = ("--plain_text_file", str(pairs_file), "--plain_text_loss_on", "assistant", "--max_steps", "6",
              "--eval_steps", "3", "--learning_rate", "1e-2", "--ce_weight", "0.3", "--draft_layer", "2",
              "--verify_layer", "4", "--head_type", head_type)
    assert _run(_argv(env, tmp_path / "fly", *common)) == 0
    assert _run(_argv(env, tmp_path / "cached", *common, "--feature_cache", str(tmp_path / "cache"),
                      "--feature_cache_k", "97", "--feature_cache_dtype", "fp32")) == 0
    fly = json.loads((tmp_path / "fly" / "metrics.json").read_text())
    cached = json.loads((tmp_path / "cached" / "metrics.json").read_text())
    for a, b in zip(fly["history"], cached["history"]):
        assert a["eval_tokens"] == b["eval_tokens"]
        for k in ("draft", "verify", "draft_verify"):
            assert a[k]["top1_agreement"] == b[k]["top1_agreement"]
        for k in ("draft", "verify"):
            assert a[k]["kl"] == pytest.approx(b[k]["kl"], rel=1e-4)
    ha, hb = _heads(tmp_path / "fly"), _heads(tmp_path / "cached")
    # a layer head's attention sums over differently padded batches (the on-the-fly collator pads otherwise)
    atol = 1e-4 if head_type == "layer" else 1e-5
    for k in ha:
        torch.testing.assert_close(ha[k], hb[k], rtol=1e-3, atol=atol)


def test_resume_from_a_checkpoint_written_before_the_distill_core(env, tmp_path):
    """tests/fixtures/resume-53f8a82/step_4 was written by the trainer as of commit 53f8a82 (before the
    distillation core moved to hispec/distill/) in the run of the test above, killed after step 5; resuming it
    with today's trainer ends with the same heads and metrics as an uninterrupted run. Up to float rounding only:
    its first 4 steps ran on the CPU that wrote the fixture, and another CPU's kernels round differently (an
    Intel Xeon with AMX against the AMD EPYC that wrote the fixture), so bit-identity holds only for resumes on one
    machine (the test above). A broken resume (wrong step, optimizer or data position) is off by far more."""
    import shutil

    common = ("--max_steps", "9", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
              "--eval_steps", "3", "--learning_rate", "1e-2")
    straight = tmp_path / "straight"
    assert _run(_argv(env, straight, *common)) == 0
    old = tmp_path / "old"
    shutil.copytree(REPO / "tests" / "fixtures" / "resume-53f8a82", old / "checkpoints")
    assert _run(_argv(env, old, *common, "--resume_from_checkpoint", "latest")) == 0
    _assert_same_run(straight, old, tol=1e-4)


def test_feature_cache_resume_after_kill_equals_uninterrupted_run(env, pairs_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"  # built by the first run, reused by the others
    common = ("--max_steps", "7", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
              "--eval_steps", "3", "--learning_rate", "1e-2", "--ce_weight", "0.2", "--loss_dtype", "bf16")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(_cache_argv(env, straight, cache, pairs_file, *common)) == 0

    _run_killed_after(monkeypatch, 3, _cache_argv(env, killed, cache, pairs_file, *common))
    assert _run(_cache_argv(env, killed, cache, pairs_file, *common, "--resume_from_checkpoint", "latest")) == 0
    _assert_same_run(straight, killed, steps=(0, 3, 6, 7))


def test_feature_cache_of_other_data_is_refused(env, pairs_file, tmp_path):
    from train.heads import ConfigError

    cache = tmp_path / "cache"
    assert _run(_cache_argv(env, tmp_path / "a", cache, pairs_file, "--data_only", "true")) == 0
    with pytest.raises(ConfigError, match="does not fit this run"):
        _run(_cache_argv(env, tmp_path / "b", cache, pairs_file, "--data_only", "true", "--max_seq_length", "40"))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """The tiny llama without the sharpened lm_head: it samples varied text that often stops (self prompts)."""
    from tiny import tiny_model

    root = tmp_path_factory.mktemp("plain_model")
    model = tiny_model("llama")
    model.config.eos_token_id = model.config.pad_token_id = 1
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 1
    model.save_pretrained(root)
    char_tokenizer().save_pretrained(root)
    return root


def test_generation_dtype_restores_the_weights_bit_for_bit():
    from tiny import tiny_model
    from hispec.distill.answers import generation_dtype

    model = tiny_model("llama")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.named_parameters()}
    with generation_dtype(model, "bf16"):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, pad_token_id=1)
    for k, v in model.named_parameters():
        assert v.dtype == torch.float32 and v.data_ptr() == before[k][0] and torch.equal(v, before[k][1])
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied here; tied models share one


def test_generating_packs_the_linears_for_the_block_and_puts_the_same_modules_back(monkeypatch):
    from tiny import tiny_model
    from hispec import packed
    from hispec.distill.answers import generating

    if not packed.available():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    model = tiny_model("llama")
    before = dict(model.named_modules())
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = model(ids).logits
    with generating(model, None):
        kinds = [type(m) for m in model.modules()]
        assert kinds.count(packed.PackedLinear) == sum(isinstance(m, torch.nn.Linear) for m in before.values())
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)  # the same product, another order
    assert dict(model.named_modules()) == before  # the very same module objects, nothing packed left behind
    assert not any(isinstance(m, packed.PackedLinear) for m in model.modules())
    with pytest.raises(KeyboardInterrupt):  # a block that dies puts the modules back too
        with packed.for_generation(model):
            raise KeyboardInterrupt
    assert dict(model.named_modules()) == before
    monkeypatch.setattr(packed, "available_memory", lambda: 1)  # the copies would not fit: stock kernels
    with packed.for_generation(model) as n:
        assert n == 0 and not any(isinstance(m, packed.PackedLinear) for m in model.modules())


def _sp_args(**kw):
    from hispec.distill.self_prompts import SelfPromptArguments

    return SelfPromptArguments(**{"self_prompt_batch_size": 4, "self_prompt_max_new_tokens": 32, **kw})


def test_self_prompts_are_deterministic_and_resume_after_a_torn_batch(plain_model, tmp_path):
    from hispec.model import load_base_model
    from hispec.distill.self_prompts import SelfPromptError, generate_self_prompts, read_self_prompts

    model, tok = load_base_model(str(plain_model)), char_tokenizer()
    a, b = tmp_path / "a", tmp_path / "b"
    generate_self_prompts(model, tok, 6, a, _sp_args(), seed=3, show_progress=False)
    got = read_self_prompts(a, 6)
    assert len(got) == 6 and len({p["id"] for p in got}) == 6
    assert all(p["messages"][0]["role"] == "user" and p["messages"][0]["content"] for p in got)
    lines = (a / "candidates.jsonl").read_text().splitlines()
    assert len(lines) >= 8  # at least two batches, so a torn one can be cut off below
    b.mkdir()
    (b / "settings.json").write_text((a / "settings.json").read_text())
    (b / "candidates.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])  # batch 1 torn in row 0
    assert len(read_self_prompts(b)) < 6
    generate_self_prompts(model, tok, 6, b, _sp_args(), seed=3, show_progress=False)
    assert read_self_prompts(b, 6) == got
    redone = (b / "candidates.jsonl").read_text().splitlines()
    assert redone[4] == lines[4][:20] and redone[5:] == lines[4 : 4 + len(redone) - 5]  # the redo starts afresh
    assert generate_self_prompts(model, tok, 6, b, _sp_args(), seed=3, show_progress=False) == 0  # nothing to do
    with pytest.raises(SelfPromptError, match="other settings"):
        generate_self_prompts(model, tok, 6, b, _sp_args(self_prompt_temperature=0.5), seed=3, show_progress=False)


def test_self_prompt_cue_file_is_used_recorded_and_checked(plain_model, tmp_path):
    from hispec.model import load_base_model
    from hispec.distill.self_prompts import SelfPromptError, generate_self_prompts, load_cues, validate_args

    cues = tmp_path / "cues.txt"
    cues.write_text("# comment\n\nTranslate from German to English:\\n\\n\nSummarize:\n")
    assert load_cues(str(cues)) == ("Translate from German to English:\n\n", "Summarize:")
    (tmp_path / "cues.json").write_text(json.dumps(["Who was", "When did"]))
    assert load_cues(str(tmp_path / "cues.json")) == ("Who was", "When did")
    for bad, why in (("missing.txt", "does not exist"), ("empty.txt", "holds no cues"), ("bad.json", "list of str")):
        if bad != "missing.txt":
            (tmp_path / bad).write_text("# nothing\n" if bad == "empty.txt" else json.dumps({"a": 1}))
        with pytest.raises(SelfPromptError, match=why):
            validate_args(_sp_args(self_prompts=2, self_prompt_cues=str(tmp_path / bad)))

    model, tok = load_base_model(str(plain_model)), char_tokenizer()
    out = tmp_path / "sp"
    generate_self_prompts(model, tok, 4, out, _sp_args(self_prompt_cues=str(cues), self_prompt_cue_fraction=1.0),
                          seed=3, show_progress=False)
    drawn = {json.loads(x)["cue"] for x in (out / "candidates.jsonl").read_text().splitlines()}
    assert drawn <= set(load_cues(str(cues))) and drawn
    cues.write_text("Summarize:\n")  # other cues: resuming into the same folder would mix two schemes
    with pytest.raises(SelfPromptError, match="other settings"):
        generate_self_prompts(model, tok, 8, out, _sp_args(self_prompt_cues=str(cues), self_prompt_cue_fraction=1.0),
                              seed=3, show_progress=False)


def test_self_written_prompts_answered_in_bf16_and_trained_on(plain_model, tmp_path):
    from hispec.distill.data import prompt_id

    out = tmp_path / "run"
    assert _run(["--model_name_or_path", str(plain_model), "--self_prompts", "8", "--self_distill", "true",
                 "--self_prompt_batch_size", "4", "--self_prompt_max_new_tokens", "32", "--gen_dtype", "bf16",
                 "--gen_max_new_tokens", "6", "--gen_batch_size", "4", "--eval_fraction", "0.25",
                 "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--max_seq_length", "64"]) == 0
    prompts = [json.loads(x) for x in (out / "self_prompts" / "candidates.jsonl").read_text().splitlines()]
    answers = [json.loads(x) for x in (out / "self_distill" / "part-rank0.jsonl").read_text().splitlines()]
    kept = {prompt_id([{"role": "user", "content": p["text"]}]) for p in prompts if not p["reject"]}
    assert len(answers) == 8 and {r["id"] for r in answers} <= kept
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["sources"]["self_prompts"] == 8
    assert info["data"]["train_examples"] == 6 and info["data"]["eval_examples"] == 2


# ---------------------------------------------------------------------------------------------------- launched
def _launch(args, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    accelerate = Path(sys.executable).parent / "accelerate"
    return subprocess.run([str(accelerate), "launch", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu(env, tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "z2"
    res = _launch(["--config_file", "recipes/accelerate/zero2.yaml", "--num_processes", "1", "train/heads.py",
                   *_argv(env, out, "--max_steps", "3", "--gradient_accumulation_steps", "2",
                          "--checkpointing_steps", "2")])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "checkpoints" / "step_2").is_dir()
    heads = _heads(out)
    assert any(v.abs().sum() > 0 for k, v in heads.items() if "adapter" in k)  # the zero-initialised adapters moved


@pytest.mark.slow
def test_two_process_gloo_run(env, tmp_path):
    out = tmp_path / "mp"
    res = _launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "train/heads.py", *_argv(env, out, "--max_steps", "3",
                                                                      "--self_distill", "true",
                                                                      "--gen_max_new_tokens", "8")],
                  env_extra={"ACCELERATE_USE_CPU": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["world_size"] == 2
    assert len(list((out / "self_distill").glob("part-rank*.jsonl"))) == 2  # answers were generated by both ranks
    assert (out / "hispec_heads.safetensors").exists()


@pytest.mark.slow
def test_two_process_gloo_feature_cache(env, pairs_file, tmp_path):
    """Two processes build the cache's shards between them (rank = shard % 2), one writes the manifest, both
    train from it."""
    out, cache = tmp_path / "mp", tmp_path / "cache"
    res = _launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "train/heads.py",
                   *_cache_argv(env, out, cache, pairs_file, "--max_steps", "3")],
                  env_extra={"ACCELERATE_USE_CPU": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((cache / "train" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["num_sequences"] == 37
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["world_size"] == 2 and (out / "hispec_heads.safetensors").exists()
    eval_manifest = json.loads((cache / "eval" / "manifest.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["final"]["eval_tokens"] == eval_manifest["num_loss_tokens"]  # gathered over both ranks


# ---------------------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_smollm2_self_distill_smoke(demo_model_dir, tmp_path):
    from train.heads import main

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": q}) + "\n" for q in
                            ["What is 2 + 3?", "Name a colour.", "Say hello.", "What is the capital of France?"]))
    out = tmp_path / "run"
    assert main(["--model_name_or_path", str(demo_model_dir), "--train_file", str(data), "--text_column",
                 "question", "--self_distill", "true", "--gen_max_new_tokens", "12", "--gen_batch_size", "4",
                 "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--max_seq_length", "64", "--eval_fraction", "0.25"]) == 0
    rows = [json.loads(x) for x in (out / "self_distill" / "part-rank0.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    info = json.loads((out / "hispec_train.json").read_text())
    assert hispec.model.HispecConfig.from_dict(info["hispec"]).exits == {"draft": 4, "verify": 8}  # round(30/8), round(30/4)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["final"]["draft"]["top1_agreement"] >= 0


@pytest.mark.real_model
def test_smollm2_writes_its_own_prompts(demo_model_dir, tmp_path):
    """SmolLM2 in bf16 writes instructions that end at <|im_end|>; the prefix stops where the user content starts."""
    from hispec.model import load_base_model, load_tokenizer
    from hispec.distill.self_prompts import chat_prefix, generate_self_prompts, read_self_prompts, stop_token_ids

    model, tok = load_base_model(str(demo_model_dir)), load_tokenizer(str(demo_model_dir))
    assert chat_prefix(tok).endswith("<|im_end|>\n<|im_start|>user\n")
    assert chat_prefix(tok).startswith("<|im_start|>system\n")
    assert stop_token_ids(tok, model) == [tok.convert_tokens_to_ids("<|im_end|>")]
    generate_self_prompts(model, tok, 6, tmp_path, _sp_args(self_prompt_batch_size=8, self_prompt_max_new_tokens=64),
                          seed=0, gen_dtype="bf16", show_progress=False)
    prompts = read_self_prompts(tmp_path, 6)
    assert len(prompts) == 6 and all(len(p["messages"][0]["content"].split()) >= 4 for p in prompts)
    assert next(model.parameters()).dtype == torch.float32


def test_low_precision_on_a_cpu_without_native_support_is_warned_about(monkeypatch):
    from types import SimpleNamespace

    import hispec.io
    from hispec.io import matmul_speed_ratio
    from hispec.distill.precision import warn_if_slow_low_precision

    assert 0 < matmul_speed_ratio(size=32) < float("inf")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    m = SimpleNamespace()
    d = SimpleNamespace(feature_cache="x", feature_cache_backbone_dtype="bf16")
    g, t = SimpleNamespace(gen_dtype="bf16"), SimpleNamespace(loss_dtype="fp32")
    monkeypatch.setattr(hispec.io, "matmul_speed_ratio", lambda dtype, **kw: 60.0)
    got = warn_if_slow_low_precision(m, d, g, t)
    assert len(got) == 2 and "gen_dtype=bf16" in got[0] and "60x slower than fp32" in got[0]
    assert "feature_cache_backbone_dtype: fp32" in got[1]
    monkeypatch.setattr(hispec.io, "matmul_speed_ratio", lambda dtype, **kw: 0.6)
    assert warn_if_slow_low_precision(m, d, g, t) == []
    # accelerate's mixed precision comes from the launcher's environment
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert warn_if_slow_low_precision(m, d, g, t) == []
    monkeypatch.setattr(hispec.io, "matmul_speed_ratio", lambda dtype, **kw: 60.0)
    got = warn_if_slow_low_precision(m, SimpleNamespace(feature_cache=""), SimpleNamespace(gen_dtype="fp32"), t)
    assert len(got) == 1 and got[0].startswith("mixed_precision=bf16") and "--mixed_precision no" in got[0]


def test_fp32_training_on_a_cpu_with_fast_bf16_names_the_bf16_config(monkeypatch, caplog):
    from types import SimpleNamespace

    import hispec.io
    from hispec.distill.precision import warn_if_slow_low_precision

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = (SimpleNamespace(), SimpleNamespace(feature_cache=""), SimpleNamespace(gen_dtype="fp32"),
            SimpleNamespace(loss_dtype="fp32"))
    monkeypatch.setattr(hispec.io, "matmul_speed_ratio", lambda dtype, **kw: 0.4)
    with caplog.at_level(logging.INFO, logger="hispec.train"):
        assert warn_if_slow_low_precision(*args) == []
    assert "2.5x faster" in caplog.text and "recipes/accelerate/cpu-bf16.yaml" in caplog.text
    caplog.clear()
    monkeypatch.setattr(hispec.io, "matmul_speed_ratio", lambda dtype, **kw: 0.9)
    with caplog.at_level(logging.INFO, logger="hispec.train"):
        warn_if_slow_low_precision(*args)
    assert "cpu-bf16" not in caplog.text
    assert (Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "cpu-bf16.yaml").is_file()


def test_the_training_loop_hands_free_heap_back(env, tmp_path, monkeypatch):
    """Trainer.loop calls a HeapTrimmer after every optimizer step (it trims at most once per interval)."""
    from hispec.distill import trainer

    seen = []

    class Counting(trainer.HeapTrimmer):
        def __call__(self, force=False):
            seen.append(self.interval_s)
            return super().__call__(force)

    monkeypatch.setattr(trainer, "HeapTrimmer", Counting)
    assert _run(_argv(env, tmp_path / "run", "--max_steps", "3", "--head_type", "linear", "--draft_layer", "2",
                      "--verify_layer", "4")) == 0
    assert seen == [60.0] * 3
