"""`train_vocab_size`: heads trained on a reduced vocabulary (the loss narrows the lm_head to K rows), the grouped
KL checked against a hand computation, and through the pipeline: a feature-cache run, a plain export that keeps the
vocabulary, lossless decoding, bad settings refused before work."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import _argv, _heads, _run, env, fresh_accelerate_state, pairs_file  # noqa: F401  (fixtures)

import hispec
from hispec.distill.losses import IGNORE_INDEX, teacher_topk, topk_distill_loss
from hispec.distill.training import narrow_to_vocab


def _hand_kl(s_full, t_logits, vocab, k):
    """KL(teacher grouped as {its top-k inside the vocabulary} + one bucket || student softmax over the vocabulary,
    grouped the same way), one row at a time."""
    out = []
    for s_row, t_row in zip(s_full, t_logits):
        p_all = torch.softmax(t_row.double(), -1)
        top = p_all.topk(k).indices
        inside = [int(i) for i in top if int(i) in set(vocab.tolist())]
        q = torch.softmax(s_row[vocab].double(), -1)
        pos = {int(v): j for j, v in enumerate(vocab.tolist())}
        p_in = torch.stack([p_all[i] for i in inside]) if inside else torch.zeros(0, dtype=torch.float64)
        q_in = torch.stack([q[pos[i]] for i in inside]) if inside else torch.zeros(0, dtype=torch.float64)
        r, q_rest = 1 - p_in.sum(), 1 - q_in.sum()
        out.append(float((p_in * (p_in / q_in).log()).sum() + (r * (r / q_rest).log() if r > 0 else 0.0)))
    return torch.tensor(out)


def test_the_narrowed_loss_is_the_grouped_kl_over_the_vocabulary_and_its_gradient_stays_inside():
    torch.manual_seed(0)
    V, H, n, k = 40, 6, 7, 8
    W = torch.randn(V, H)
    vocab = torch.tensor(sorted(torch.randperm(V)[:15].tolist()))
    t_logits = torch.randn(n, V) * 2
    ids, logp = teacher_topk(t_logits, k)
    x = torch.randn(n, H, requires_grad=True)
    labels = torch.full((n,), IGNORE_INDEX)
    proj, ids2, logp2, labels2 = narrow_to_vocab(lambda f, v: f @ W[v].T, vocab, V, ids, logp, labels)
    out = topk_distill_loss(proj, {"draft": x}, ids2, logp2, labels2, per_token=True)
    exp = _hand_kl(x.detach() @ W.T, t_logits, vocab, k)
    torch.testing.assert_close(out.kl_tokens["draft"].double(), exp.double(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    # the teacher's argmax outside the vocabulary never counts as agreement
    outside = ~torch.isin(ids[:, 0], vocab)
    assert outside.any() and (out.agree_tokens["draft"][outside] == 0).all()
    # the whole vocabulary as the "subset": the full top-k + bucket loss
    full = torch.arange(V)
    proj, ids3, logp3, _ = narrow_to_vocab(lambda f, v: f @ W[v].T, full, V, ids, logp, labels)
    a = topk_distill_loss(proj, {"draft": x.detach()}, ids3, logp3, per_token=True).kl_tokens["draft"]
    b = topk_distill_loss(lambda f: f @ W.T, {"draft": x.detach()}, ids, logp, per_token=True).kl_tokens["draft"]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # labels outside the vocabulary are ignored, inside ones remapped
    lab = torch.tensor([int(vocab[3]), int(next(i for i in range(V) if i not in set(vocab.tolist()))), IGNORE_INDEX])
    _, _, _, lab2 = narrow_to_vocab(lambda f, v: f, vocab, V, ids[:3], logp[:3], lab)
    assert lab2.tolist() == [3, IGNORE_INDEX, IGNORE_INDEX]


def test_a_feature_cache_run_trains_on_the_vocabulary_and_a_plain_export_keeps_it(env, pairs_file, tmp_path,  # noqa: F811
                                                                                  capsys):
    from hispec.cli.export import main as export_main

    out, cache = tmp_path / "run", tmp_path / "cache"
    assert _run(_argv(env, out, "--plain_text_file", str(pairs_file), "--plain_text_loss_on", "assistant",
                      "--feature_cache", str(cache), "--feature_cache_k", "8", "--train_vocab_size", "48",
                      "--self_distill", "true", "--gen_max_new_tokens", "12", "--gen_batch_size", "4",
                      "--max_steps", "8", "--learning_rate", "1e-2", "--eval_steps", "4")) == 0
    capsys.readouterr()
    state = _heads(out)
    assert state["draft.vocab"].numel() == 48 and torch.equal(state["draft.vocab"], state["verify.vocab"])
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["train_vocab"]["size"] == 48
    # counted on the model's own answers (what hispec-export counts by default), with the model's tokenizer
    answers = info["data"]["train_vocab"]["counted_on"]
    assert answers and all("self_distill" in f for f in answers)
    exits = {e["name"]: e["vocab_size"] for e in info["hispec"]["exits"]}
    assert exits == {"draft": 48, "verify": 48}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["final"]["draft"]["vocab_size"] == 48
    assert metrics["final"]["draft"]["kl"] < metrics["history"][0]["draft"]["kl"]
    ck = tmp_path / "ck"
    assert export_main([str(out), "--output-dir", str(ck)]) == 0  # no vocabulary flags: the trained one is kept
    model = hispec.load(ck)
    assert model.vocab_size_of("draft") == 48 and torch.equal(model.heads["draft"].vocab.cpu(), state["draft.vocab"])
    ids = torch.tensor([[5, 17, 33, 8, 41, 9, 12]])
    ref = model.base.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=1)
    for strategy in ("self-spec", "hispec"):
        got = model.generate(ids, max_new_tokens=16, strategy=strategy, eos_token_id=[], gamma=3, window=2)
        assert torch.equal(got.sequences, ref), strategy


@pytest.mark.parametrize("extra, message", [
    (("--train_vocab_size", "-1"), "train_vocab_size must be >= 0"),
    (("--train_vocab_size", "16"), "train_vocab_size needs a feature_cache"),
])
def test_bad_train_vocab_settings_fail_before_any_work(env, tmp_path, extra, message):  # noqa: F811
    from train.heads import ConfigError, main

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        main(_argv(env, out, "--max_steps", "2", *extra))
    assert not out.exists()


def test_vocabulary_ids_above_bf16_precision_survive_the_heads_file(tmp_path):
    """Ids > 256 are not exact in bf16: a bf16 model loading a heads file (integer ids, or the fp32 ids an older
    trainer wrote) must keep them exactly."""
    import transformers
    from safetensors.torch import load_file, save_file
    from tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.vocab_size = 600
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="linear")
    vocab = torch.tensor(sorted(set(range(0, 600, 2)) | {257, 259, 599}))
    for name in ("draft", "verify"):
        model.set_exit_vocab(name, vocab)
    path = tmp_path / "heads.safetensors"
    for as_float in (False, True):
        state = {k: (v.float() if as_float else v) for k, v in model.heads_state_dict().items()}
        save_file(state, str(path))
        assert (load_file(str(path))["draft.vocab"].dtype == torch.float32) == as_float
        other = hispec.EarlyExitModel.from_base(
            transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval(), draft_layer=2,
            verify_layer=4, head_type="linear")
        for name in ("draft", "verify"):
            other.set_exit_vocab(name, vocab)
        other.load_heads(path)
        for name in ("draft", "verify"):
            assert other.heads[name].vocab.dtype == torch.long and torch.equal(other.heads[name].vocab.cpu(), vocab)


def test_the_trainer_writes_vocabulary_ids_as_integers(env, pairs_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert _run(_argv(env, out, "--plain_text_file", str(pairs_file), "--feature_cache", str(tmp_path / "cache"),
                      "--feature_cache_k", "8", "--train_vocab_size", "40", "--max_steps", "2")) == 0
    state = _heads(out)
    assert state["draft.vocab"].dtype == torch.long and state["draft.adapter.weight"].dtype == torch.float32
