"""hispec.distill.generate: a greedy batch that sheds its ended rows between `generate` calls gives every row the
tokens one uninterrupted `generate` gives it, on every family (tiny random models, fp32)."""

from __future__ import annotations

import pytest

from hispec.distill.generate import answer_batches, generate_rows
from tiny import FAMILIES, tiny_model

PROMPTS = [[5, 9, 12, 40, 7, 3, 22], [8, 8, 31], [17, 4, 4, 9, 60], [2, 70, 11, 11, 11, 5], [33, 6]]


def _eos_that_ends_rows_apart(model, pad):
    """The token whose first appearance (from the third new token on) is spread over the most distinct positions
    across the plain batch's rows ("never" counting as one): with it as EOS, rows end in different calls."""
    rows = generate_rows(model, PROMPTS, pad_id=pad, eos=[], max_new_tokens=12)
    tokens = {t for toks, _ in rows for t in toks[2:]} - {pad}

    def spread(t):
        return len({toks.index(t) if t in toks[2:] and t not in toks[:2] else -1 for toks, _ in rows})

    return max(sorted(tokens), key=spread)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_shrinking_greedy_batch_equals_one_generate_call(family):
    model = tiny_model(family).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    eos = _eos_that_ends_rows_apart(model, pad)
    plain = generate_rows(model, PROMPTS, pad_id=pad, eos=[eos], max_new_tokens=12)
    assert any(done for _, done in plain) and len({len(t) for t, _ in plain}) >= 2  # rows end at different times
    for every in (1, 3, 5):
        assert generate_rows(model, PROMPTS, pad_id=pad, eos=[eos], max_new_tokens=12, shrink_every=every) == plain
    assert generate_rows(model, PROMPTS, pad_id=pad, eos=[eos], max_new_tokens=12, shrink_every=3,
                         keep_eos=False) == [(t[:-1] if d else t, d) for t, d in plain]


def test_answer_batches_shrink_greedy_batches_and_keep_sampled_ones_whole(monkeypatch):
    import hispec.distill.generate as gen

    model = tiny_model("llama").eval()
    calls = []
    real = model.generate

    def counting(*a, **kw):
        calls.append(kw["max_new_tokens"])
        return real(*a, **kw)

    monkeypatch.setattr(model, "generate", counting)
    out = dict(i for idx, rows in answer_batches(model, PROMPTS, batch_size=5, pad_id=0, eos=[], max_new_tokens=9,
                                                   show_progress=False, shrink_every=4) for i in zip(idx, rows))
    assert calls == [4, 4, 1] and all(len(out[i][0]) == 9 for i in range(len(PROMPTS)))
    calls.clear()
    list(answer_batches(model, PROMPTS, batch_size=5, pad_id=0, eos=[], max_new_tokens=9, sample=(0.9, 0.95),
                        seed=lambda i: i, show_progress=False, shrink_every=4))
    assert calls == [9]
    assert gen.SHRINK_EVERY > 1
