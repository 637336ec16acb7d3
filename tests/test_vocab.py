"""Reduced head vocabularies: selection, checkpoint round trip, and decoding stays lossless (greedy and sampling)."""

from __future__ import annotations

import json

import pytest
import torch
from test_decoding import _chi2_pvalue, _draw, _exact_joint, _hf_greedy, _ragged, _tiny_vocab_model, _wrap
from tiny import tiny_model

import hispec
from hispec import vocab as hv
from hispec.model import CheckpointError


def test_select_vocab_orders_by_count_then_id_and_keeps_special_tokens():
    counts = torch.zeros(10, dtype=torch.long)
    counts[7], counts[3], counts[5] = 9, 4, 4
    ids = hv.select_vocab(4, 10, counts, always=[9])
    assert ids.tolist() == [3, 5, 7, 9]  # 9 forced; then 7 (9), 3 and 5 (4 each)
    assert hv.select_vocab(3, 10).tolist() == [0, 1, 2]  # no data: by id order
    assert hv.select_vocab(3, 10, counts, always=[8]).tolist() == [3, 7, 8]  # tie 3/5 broken by lower id
    with pytest.raises(ValueError, match="1..10"):
        hv.select_vocab(11, 10)
    with pytest.raises(ValueError, match="special"):
        hv.select_vocab(1, 10, always=[1, 2])
    assert hv.coverage(torch.tensor([1, 2]), torch.tensor([1, 1, 3, 2])) == 0.75


def test_texts_from_files_reads_every_string_field(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"q": "one", "turns": ["two", {"x": "three"}], "n": 4}) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "four"}]}]))
    (tmp_path / "c.txt").write_text("five\n\nsix\n")
    texts = hv.texts_from_files([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.txt"])
    assert texts == ["one", "two", "three", "human", "four", "five\n", "six\n"]
    with pytest.raises(FileNotFoundError):
        hv.texts_from_files([tmp_path / "missing.jsonl"])


def test_exit_logits_cover_only_the_head_vocabulary_and_round_trip(tmp_path):
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 2, 4, "linear", draft_vocab_size=40)
    ids = torch.tensor([5, 1, 77, 30])
    model.set_exit_vocab("verify", ids)
    assert model.heads["verify"].vocab.tolist() == [1, 5, 30, 77]
    assert model.hispec_config.verify_vocab_size == 4
    h = torch.randn(2, 3, model.adapter.hidden_size)
    logits = model.exit_logits("verify", h)
    full = model.adapter.project(model.heads["verify"](h))
    assert logits.shape == full.shape
    assert torch.allclose(logits[..., [1, 5, 30, 77]], full[..., [1, 5, 30, 77]], atol=1e-6)
    assert torch.isinf(logits).sum(-1).eq(model.adapter.vocab_size - 4).all()
    model.save(tmp_path / "ck")
    loaded = hispec.load(tmp_path / "ck")
    assert loaded.heads["verify"].vocab.tolist() == [1, 5, 30, 77]
    assert loaded.heads["draft"].vocab.equal(model.heads["draft"].vocab)
    assert loaded.hispec_config.draft_vocab_size == 40
    assert torch.equal(loaded.exit_logits("verify", h), logits)
    with pytest.raises(ValueError, match="must be <"):
        model.set_exit_vocab("draft", [model.adapter.vocab_size])


def test_a_corrupt_head_vocabulary_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 2, 4, "norm", draft_vocab_size=8)
    model.save(tmp_path / "ck")
    f = tmp_path / "ck" / "hispec_heads.safetensors"
    state = load_file(str(f))
    state["draft.vocab"] = torch.tensor([3, 2, 1, 0, 4, 5, 6, 7])
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match="sorted"):
        hispec.load(tmp_path / "ck")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_greedy_is_unchanged_with_reduced_vocabularies(family):
    base = tiny_model(family)
    model = _wrap(base, head_type="linear")
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    V = model.adapter.vocab_size
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 15)
    emitted = ref[:, 9:].flatten().unique()
    # the draft set misses half of what the model emits; the verifier's set is larger but still partial
    model.set_exit_vocab("draft", torch.cat([emitted[::2], torch.arange(0, V, 7)]))
    model.set_exit_vocab("verify", torch.cat([emitted[: len(emitted) * 3 // 4], torch.arange(0, V, 3)]))
    for strategy in ("self-spec", "hispec"):
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy


@pytest.mark.parametrize("strategy", ["self-spec", "hispec"])
def test_sampling_with_reduced_vocabularies_matches_the_exact_distribution(strategy):
    model = _tiny_vocab_model()
    model.set_exit_vocab("draft", [0, 2, 4])  # proposals with smaller support than the target
    model.set_exit_vocab("verify", [0, 1, 2])  # and a verifier whose support misses token 4 entirely
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=0.8, top_p=0.95)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=5)
    assert _chi2_pvalue(samples, outcomes, probs) > 1e-4
