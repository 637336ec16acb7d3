"""`layer` exit heads: one decoder layer with its own KV inside the decoder's cache; decoding stays lossless and the
head's incremental KV bookkeeping equals running it over whole sequences."""

from __future__ import annotations

import pytest
import torch
from test_decoding import _chi2_pvalue, _draw, _exact_joint, _hf_greedy, _ragged, _tiny_vocab_model, _wrap
from tiny import FAMILIES, assert_same_decoding_after_a_round_trip, tiny_model

from hispec.layers import positions_from_mask


def _layer_model(family="llama", seed=0, scale=0.02, **kw):
    model = _wrap(tiny_model(family), head_type="layer", **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # heads that differ from the base and from each other
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def test_a_layer_head_starts_as_a_copy_of_the_next_base_layer_with_its_own_cache_slot():
    model = _wrap(tiny_model("llama"), head_type="layer")
    head = model.heads["draft"]
    assert head.stateful and model.stateful_heads
    base_layer = model.adapter.parts.layers[model.draft_layer]
    for (n, p), (_, q) in zip(head.layer.named_parameters(), base_layer.named_parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), n
    assert head.layer.self_attn.layer_idx == model.num_layers and base_layer.self_attn.layer_idx == model.draft_layer
    assert model.heads["verify"].layer.self_attn.layer_idx == model.num_layers + 1
    assert not torch.any(head.adapter.weight)  # zero-initialised residual adapter
    with pytest.raises(ValueError, match="run_layer"):
        model.exit_logits("draft", torch.zeros(1, 2, model.adapter.hidden_size))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_layer_heads_equals_hf_generate(family):
    model = _layer_model(family)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 15)
    for strategy in ("self-spec", "hispec"):
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy


def _teacher_forced_draft_argmax(model, seq):
    """The draft head's argmax at every position of `seq` [1, T], run over the whole sequence at once."""
    ad = model.adapter
    mask = torch.ones_like(seq)
    with torch.no_grad():
        _, saved = ad.forward_all(seq, positions_from_mask(mask), ad.new_cache(1), exits=(model.draft_layer,))
        head = model.heads["draft"]
        feats = head(saved[model.draft_layer], head.run_layer_fresh(ad, mask))
        return model.project_exit("draft", feats).argmax(-1)[0]


@pytest.mark.parametrize("family,scale", [("llama", 0.03), ("qwen2-sliding", 0.03), ("gemma2", 0.03), ("gemma3", 0.01),
                                          ("opt", 0.01)])
def test_draft_acceptance_equals_the_teacher_forced_heads_so_head_kv_is_exact(family, scale):
    """In greedy self-spec, a round accepts the longest run of drafts equal to the final tokens, and each draft is
    the head's argmax given the (final) prefix. Recomputing those argmaxes over whole sequences predicts the
    accepted count exactly — only if the head's KV inside the decoder (advanced with range 0, rolled back on
    rejection, holes per row) is what a fresh run computes."""
    model = _layer_model(family, scale=scale)
    ids, am = _ragged(3, 8, seed=4)
    gamma, N = 3, 24
    out = model.generate(ids, am, max_new_tokens=N, strategy="self-spec", gamma=gamma)
    expected = 0
    for b in range(len(ids)):
        prompt = ids[b, am[b].bool()]
        seq = torch.cat([prompt, torch.tensor(out.new_tokens[b])])[None]
        pred = _teacher_forced_draft_argmax(model, seq)  # pred[p] predicts token p + 1
        P, stop = len(prompt), len(prompt) + N
        c = P + 1  # the first new token comes from the full model
        while c < stop:
            d = min(gamma, stop - c)
            a = 0
            while a < d and int(pred[c + a - 1]) == int(seq[0, c + a]):
                a += 1
            expected += a
            c = c + a + (1 if c + a < stop else 0)
    assert out.stats.accepted_at_target == expected
    assert 0 < expected < out.stats.drafted  # the check has teeth: some drafts accepted, some rejected


@pytest.mark.parametrize("strategy", ["self-spec", "hispec"])
def test_sampling_with_layer_heads_matches_the_exact_distribution(strategy):
    model = _tiny_vocab_model(head_type="layer")
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=3)
    assert _chi2_pvalue(samples, outcomes, probs) > 1e-4


def test_layer_heads_round_trip_through_a_checkpoint(tmp_path):
    model = _layer_model("qwen3", draft=2, verify=3)
    assert assert_same_decoding_after_a_round_trip(model, tmp_path / "ck").hispec_config.head_type == "layer"
