"""`hispec.layers.DecoderAdapter` + `hispec.cache.KVCache` on every supported family (tests/tiny.py).

The reference is always the model's own Hugging Face forward over the whole sequence; the adapter runs the same
layers in three ranges over one shared cache, with left padding, per-row holes, rollback and rows that advance by
different numbers of tokens. Only the last test needs the real demo model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hispec.layers import DecoderAdapter, UnsupportedModelError, positions_from_mask
from tiny import FAMILIES, tiny_config, tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request):
    """(family, tiny fp32 model, adapter); one model per family, shared by the tests of this module."""
    model = tiny_model(request.param)
    return request.param, model, DecoderAdapter(model)


def _ranges(n: int) -> list[tuple[int, int]]:
    """Three contiguous ranges covering n layers, like [0, L_d), [L_d, L_i), [L_i, L)."""
    d, v = n // 3, 2 * n // 3
    return [(0, d), (d, v), (v, n)]


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, T], attention_mask [B, T]) padded on the left with token 0."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = 1
    return ids, mask


@torch.no_grad()
def _hf_logits(model, rows: list[list[int]]) -> list[torch.Tensor]:
    """The model's own logits for each (unpadded) sequence, `[len(row), V]` per row, from one padded forward."""
    ids, mask = _left_padded(rows)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    return [logits[b, ids.shape[1] - len(r):] for b, r in enumerate(rows)]


def _random_rows(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------- ranges == one full forward

@torch.no_grad()
def test_three_ranges_over_one_cache_equal_one_full_forward_with_left_padding(family_model):
    family, model, ad = family_model
    rows = _random_rows([12, 9, 4], ad.vocab_size, seed=1)  # longer than the sliding window (5)
    ids, mask = _left_padded(rows)
    pos = positions_from_mask(mask)
    cache = ad.new_cache(len(rows))

    hidden = ad.embed(ids, pos)
    for a, b in _ranges(ad.num_layers):
        hidden = ad.run_layers(hidden, a, b, position_ids=pos, cache=cache, valid=mask.bool())
        assert cache.seq_length(a, b) == ids.shape[1]
    logits = ad.final_logits(hidden)

    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref[real], atol=ATOL, rtol=0)
    assert torch.isfinite(logits).all()  # padded queries attend to themselves: junk, but never NaN
    assert cache.row_lengths(0).tolist() == [12, 9, 4]

    # forward_all (one call, exits saved) gives the same logits and the hidden states at the range boundaries.
    full, saved = ad.forward_all(ids, pos, ad.new_cache(len(rows)), valid=mask.bool(), exits=(2, 4))
    torch.testing.assert_close(full[real], ref[real], atol=ATOL, rtol=0)
    hs = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states
    for layer in (2, 4):
        torch.testing.assert_close(saved[layer][real], hs[layer][real], atol=ATOL, rtol=0)


def test_a_range_must_be_advanced_as_a_whole(family_model):
    _, _, ad = family_model
    cache = ad.new_cache(1)
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.arange(3)[None]
    with torch.no_grad():
        ad.run_layers(ad.embed(ids, pos), 0, 2, position_ids=pos, cache=cache)
        with pytest.raises(RuntimeError, match=r"layers 0\.\.3 are at different cache lengths \[0, 3\]"):
            ad.run_layers(ad.embed(ids, pos), 0, 4, position_ids=pos, cache=cache)
        with pytest.raises(ValueError, match=r"layer range \[4, 9\) is out of range for a 6-layer model"):
            ad.run_layers(ad.embed(ids, pos), 4, 9, position_ids=pos, cache=cache)


# ---------------------------------------------------------------- draft / verify / rollback / continue

@torch.no_grad()
def test_draft_verify_rollback_per_row_then_continue_matches_a_fresh_forward(family_model):
    """One HiSpec-shaped round on a batch of 2, by hand.

    Draft 3 tokens one at a time on range 0; verify them at once on range 1; roll ranges 0-1 back per row (row 0
    keeps 2, row 1 keeps 3: row 0's third slot becomes a hole); push row 0's correction token through ranges 0-1
    alone (row 1 idle: an invalid slot); full-verify 3 tokens per row on range 2; roll every range back per row
    (row 0 keeps 1, row 1 keeps 2); continue with 3 more tokens through all ranges. Every logit the staged run
    produced for a position of the final sequences equals a fresh full forward over those sequences.
    """
    family, model, ad = family_model
    (r0a, r0b), (r1a, r1b), (r2a, r2b) = _ranges(ad.num_layers)
    prompts = _random_rows([5, 8], ad.vocab_size, seed=2)
    ids, mask = _left_padded(prompts)
    B = len(prompts)
    pos = positions_from_mask(mask)
    nxt = mask.sum(1)  # [B] next absolute position per row
    cache = ad.new_cache(B)
    seqs = [list(p) for p in prompts]
    got: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]  # position -> final logits, per row

    def record(logits, positions, valid):
        for b in range(B):
            for t in range(logits.shape[1]):
                if valid[b, t]:
                    got[b][int(positions[b, t])] = logits[b, t]

    # prefill, all ranges
    h = ad.embed(ids, pos)
    for a, b in _ranges(ad.num_layers):
        h = ad.run_layers(h, a, b, position_ids=pos, cache=cache, valid=mask.bool())
    record(ad.final_logits(h), pos, mask.bool())

    # 1. draft 3 tokens token by token on range 0
    g = torch.Generator().manual_seed(3)
    drafts = torch.randint(2, ad.vocab_size, (B, 3), generator=g)
    h0 = []
    for i in range(3):
        p = (nxt + i)[:, None]
        h0.append(ad.run_layers(ad.embed(drafts[:, i : i + 1], p), r0a, r0b, position_ids=p, cache=cache))
    h0 = torch.cat(h0, 1)
    assert cache.seq_length(r0a, r0b) == ids.shape[1] + 3 and cache.seq_length(r2a, r2b) == ids.shape[1]

    # 2. intermediate verify: 3 tokens at once on range 1; row 0 keeps 2 drafts, row 1 keeps all 3
    dpos = nxt[:, None] + torch.arange(3)
    h1 = ad.run_layers(h0, r1a, r1b, position_ids=dpos, cache=cache)
    keep_i = nxt + torch.tensor([2, 3])
    for a, b in ((r0a, r0b), (r1a, r1b)):
        cache.truncate(a, b, keep_i)
    assert cache.seq_length(r0a, r0b) == ids.shape[1] + 3  # row 1 still uses the last slot: a hole for row 0
    assert cache.row_lengths(r0a).tolist() == (mask.sum(1) + torch.tensor([2, 3])).tolist()

    # row 0's correction token (at position nxt+2) passes ranges 0-1 alone; row 1 sits this call out
    corr = torch.randint(2, ad.vocab_size, (B, 1), generator=g)
    cpos = (nxt + 2)[:, None]
    only0 = torch.tensor([[True], [False]])
    hc = ad.run_layers(ad.embed(corr, cpos), r0a, r0b, position_ids=cpos, cache=cache, valid=only0)
    hc = ad.run_layers(hc, r1a, r1b, position_ids=cpos, cache=cache, valid=only0)

    # 3. full verify on range 2: row 0 = [d1, d2, correction], row 1 = [d1, d2, d3]
    toks = torch.stack([torch.cat([drafts[0, :2], corr[0]]), drafts[1]])
    h2_in = torch.stack([torch.cat([h1[0, :2], hc[0]]), h1[1]])
    h2 = ad.run_layers(h2_in, r2a, r2b, position_ids=dpos, cache=cache)
    final = ad.final_logits(h2)
    accept = [1, 2]  # row 0 commits d1; row 1 commits d1, d2
    for b in range(B):
        for t in range(accept[b]):
            got[b][int(dpos[b, t])] = final[b, t]
        seqs[b] += toks[b, : accept[b]].tolist()
    keep_f = nxt + torch.tensor(accept)
    for a, b in _ranges(ad.num_layers):
        cache.truncate(a, b, keep_f)
    for a, b in _ranges(ad.num_layers):
        assert cache.row_lengths(a).tolist() == keep_f.tolist()  # holes are invalid, not counted
    nxt = keep_f

    # 4. continue: one token, then two at once, through all ranges
    for width in (1, 2):
        new = torch.randint(2, ad.vocab_size, (B, width), generator=g)
        p = nxt[:, None] + torch.arange(width)
        h = ad.embed(new, p)
        for a, b in _ranges(ad.num_layers):
            h = ad.run_layers(h, a, b, position_ids=p, cache=cache)
        record(ad.final_logits(h), p, torch.ones(B, width, dtype=torch.bool))
        for b in range(B):
            seqs[b] += new[b].tolist()
        nxt = nxt + width

    assert [len(s) for s in seqs] == [9, 13]  # both longer than the sliding window (5)
    ref = _hf_logits(model, seqs)
    for b in range(B):
        assert sorted(got[b]) == list(range(len(seqs[b])))
        staged = torch.stack([got[b][i] for i in range(len(seqs[b]))])
        torch.testing.assert_close(staged, ref[b], atol=ATOL, rtol=0, msg=lambda m: f"{family} row {b}: {m}")


@torch.no_grad()
def test_rollback_past_the_window_then_regrowing_matches_a_fresh_forward():
    """Sliding window: roll back far (both rows, tail dropped physically), regrow longer than the window."""
    model = tiny_model("mistral-sliding")
    ad = DecoderAdapter(model)
    assert ad.sliding_window == 5
    prompts = _random_rows([11, 7], ad.vocab_size, seed=4)
    ids, mask = _left_padded(prompts)
    pos = positions_from_mask(mask)
    cache = ad.new_cache(2)
    ad.forward_all(ids, pos, cache, valid=mask.bool())
    keep = torch.tensor([3, 6])
    for a, b in _ranges(ad.num_layers):
        cache.truncate(a, b, keep)
    # row 1 (4 pads, then positions 0..6 in slots 4..10) keeps positions 0..5: only slot 10 is dropped
    assert cache.seq_length(0, ad.num_layers) == 10
    cache.truncate(0, ad.num_layers, torch.tensor([3, 2]))  # one call for all ranges: they share one layout here
    assert cache.seq_length(0, ad.num_layers) == 6  # row 1's position 1 sits in slot 5
    seqs = [prompts[0][:3], prompts[1][:2]]
    new = torch.tensor(_random_rows([9, 9], ad.vocab_size, seed=5))
    p = torch.tensor([[3], [2]]) + torch.arange(9)
    logits, _ = ad.forward_all(new, p, cache)
    ref = _hf_logits(model, [seqs[0] + new[0].tolist(), seqs[1] + new[1].tolist()])
    torch.testing.assert_close(logits[0], ref[0][3:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], ref[1][2:], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- ragged calls

@torch.no_grad()
def test_rows_with_different_numbers_of_new_tokens_match_each_row_run_alone(family_model):
    family, model, ad = family_model
    prompts = _random_rows([6, 9, 3], ad.vocab_size, seed=6)
    steps = [[3, 1, 0], [1, 4, 2], [2, 2, 2]]  # new tokens per row in each call (0: the row sits it out)
    g = torch.Generator().manual_seed(7)
    news = [[torch.randint(2, ad.vocab_size, (n,), generator=g) for n in step] for step in steps]

    def run(rows: list[int]) -> list[list[torch.Tensor]]:
        """Run rows `rows` together; return, per row, the final logits of each new token in order."""
        ids, mask = _left_padded([prompts[r] for r in rows])
        pos = positions_from_mask(mask)
        cache = ad.new_cache(len(rows))
        logits, _ = ad.forward_all(ids, pos, cache, valid=mask.bool())
        out = [[logits[i, -1]] for i in range(len(rows))]
        nxt = mask.sum(1)
        for step, new in zip(steps, news):
            width = max(step[r] for r in rows)
            if width == 0:
                continue
            tok = torch.zeros(len(rows), width, dtype=torch.long)
            valid = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, r in enumerate(rows):
                tok[i, : step[r]] = new[r]
                valid[i, : step[r]] = True
            p = nxt[:, None] + torch.arange(width)  # invalid slots get junk positions past the row's end
            h = ad.embed(tok, p)
            for a, b in _ranges(ad.num_layers):
                h = ad.run_layers(h, a, b, position_ids=p, cache=cache, valid=valid)
            lg = ad.final_logits(h)
            for i, r in enumerate(rows):
                out[i] += list(lg[i, : step[r]])
            nxt = nxt + valid.sum(1)
        return out

    together = run([0, 1, 2])
    for r in range(3):
        alone = run([r])[0]
        assert len(together[r]) == len(alone) == 1 + sum(s[r] for s in steps)
        torch.testing.assert_close(torch.stack(together[r]), torch.stack(alone), atol=ATOL, rtol=0,
                                   msg=lambda m: f"{family} row {r}: {m}")
    # and both equal the model's own forward over each row's final sequence
    full = [prompts[r] + [t for new in news for t in new[r].tolist()] for r in range(3)]
    ref = _hf_logits(model, full)
    for r in range(3):
        torch.testing.assert_close(torch.stack(together[r]), ref[r][len(prompts[r]) - 1 :], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- unsupported models

class _ToyConfig(SimpleNamespace):
    model_type = "toy"


class _ToyLM(nn.Module):
    """A causal-LM-shaped module with `n_blocks` blocks while its config claims `depth`."""

    def __init__(self, depth: int = 3, n_blocks: int = 3, final_norm: bool = True):
        super().__init__()
        self.config = _ToyConfig(num_hidden_layers=depth, hidden_size=8, vocab_size=11)
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_blocks))
        if final_norm:
            self.ln_f = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_model_without_a_layer_list_of_config_depth_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"model type 'toy': no list of 4 decoder layers"):
        DecoderAdapter(_ToyLM(depth=4, n_blocks=3))


def test_model_without_a_final_norm_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"model type 'toy': no final norm found .*ln_f.* on _ToyLM"):
        DecoderAdapter(_ToyLM(final_norm=False))
    model = tiny_model("qwen3")
    del model.model.norm
    with pytest.raises(UnsupportedModelError, match=r"model type 'qwen3': no final norm found .* on Qwen3Model"):
        DecoderAdapter(model)


def test_model_without_position_encoding_or_cache_argument_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"model type 'toy': no position encoding found"):
        DecoderAdapter(_ToyLM())
    model = tiny_model("llama")
    del model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match=r"model type 'llama': no position encoding found"):
        DecoderAdapter(model)


def test_base_model_without_lm_head_is_refused_by_name():
    from transformers import AutoModel

    with pytest.raises(UnsupportedModelError, match=r"model type 'mistral': get_output_embeddings\(\) returned"):
        DecoderAdapter(AutoModel.from_config(tiny_config("mistral")))


def test_config_without_depth_is_refused():
    toy = _ToyLM()
    toy.config.num_hidden_layers = None
    with pytest.raises(UnsupportedModelError, match=r"model type 'toy': config.num_hidden_layers is missing"):
        DecoderAdapter(toy)


def test_attention_implementation_other_than_sdpa_or_eager_is_refused_when_masks_are_built():
    model = tiny_model("llama")
    ad = DecoderAdapter(model)
    model.config._attn_implementation = "flash_attention_2"
    ids = torch.tensor([[3, 4]])
    pos = torch.arange(2)[None]
    with pytest.raises(UnsupportedModelError, match=r"sdpa or eager; this model uses 'flash_attention_2'.*sdpa"):
        ad.run_layers(ad.embed(ids, pos), 0, 2, position_ids=pos, cache=ad.new_cache(1))


# ---------------------------------------------------------------- output projection

@torch.no_grad()
def test_project_over_a_vocabulary_subset_equals_the_full_logits_at_those_ids(family_model):
    family, model, ad = family_model
    normed = ad.final_norm(torch.randn(2, 3, ad.hidden_size, generator=torch.Generator().manual_seed(8)))
    full = ad.project(normed)
    assert full.shape == (2, 3, ad.vocab_size)
    vocab = torch.tensor([0, 5, 96, 17, 5, 40])  # any order, repeats allowed
    sub = ad.project(normed, vocab=vocab)
    assert sub.shape == (2, 3, len(vocab))
    torch.testing.assert_close(sub, full[..., vocab], atol=1e-6, rtol=0)


@torch.no_grad()
def test_gemma2_final_logit_softcapping_matches_the_model_logits():
    config = tiny_config("gemma2")
    config.final_logit_softcapping = 0.5  # small enough to bend the tiny model's logits
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ad = DecoderAdapter(model)
    assert ad.logits_elementwise  # the cap runs on lm_head's rows for a vocabulary subset too
    ids = torch.tensor([[4, 9, 33, 2, 71, 8, 15]])
    pos = torch.arange(7)[None]
    logits, saved = ad.forward_all(ids, pos, ad.new_cache(1), exits=(3,))
    ref = model(input_ids=ids, position_ids=pos).logits
    assert ref.abs().max() <= 0.5
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    normed = ad.final_norm(saved[3])
    vocab = torch.tensor([1, 50, 3])
    torch.testing.assert_close(ad.project(normed, vocab=vocab), ad.project(normed)[..., vocab], atol=1e-6, rtol=0)
    assert not torch.allclose(ad.project(normed), model.lm_head(normed), atol=1e-3)  # the cap did something


# ---------------------------------------------------------------- the real demo model

@pytest.mark.real_model
@torch.no_grad()
def test_staged_forward_over_all_30_layers_equals_the_demo_model_logits(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ad = DecoderAdapter(model)
    assert ad.num_layers == 30
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    pos = torch.arange(ids.shape[1])[None]
    cache = ad.new_cache(1)
    h = ad.embed(ids, pos)
    for a, b in ((0, 4), (4, 8), (8, 30)):
        h = ad.run_layers(h, a, b, position_ids=pos, cache=cache)
    logits = ad.final_logits(h)
    ref = model(input_ids=ids).logits
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert tokenizer.decode(logits[0, -1].argmax()).strip()  # a real next token, not junk
