"""The one batched generator of the distillation core: self-written prompts, self-distillation answers and the
probe's answers all go through `generate_rows`; answers go through `answer_batches`, its one batching loop.

`generate_rows(model, rows, pad_id=, eos=, max_new_tokens=, sample=None, seed=None, keep_eos=True)` left-pads
token-id rows into one batch, runs the model's own `generate` once (greedy, or with `sample=(temperature, top_p)`
plain temperature + nucleus sampling, no top-k; `seed` seeds torch's global generator right before) and returns,
per row, the new tokens up to the first EOS (kept or not) and whether one came. Seeding schemes and where results
go stay with the callers.

Greedy batches shrink (`shrink_every=N`, what `answer_batches` asks for): `generate` runs N new tokens at a time
and between those runs the rows that ended leave the batch, their keys/values dropped from the cache
(`Cache.batch_select_indices`); the survivors go on from the same cache, so every row's tokens are what one
uninterrupted `generate` gives it (tested on every family in fp32; in bf16 a smaller batch may round a near-tie
the other way: 59-60 of 64 SmolLM2 answers identical). Answers end anywhere from 10 to `max_new_tokens` tokens; a
batch that keeps its ended rows pays for them until its longest row ends (SmolLM2's answers: 45% of the batch's
row-steps; Qwen2.5-Coder's: 39%); shedding them made 64 real SmolLM2 answers 1.25x faster (bf16, one Xeon core:
186 -> 232 tokens/s; every 16 tokens: 219). Why not refill the freed rows (continuous batching): transformers'
`generate_batch` is paged attention, 4 tokens/s against 14 for these padded batches on a 2-core Xeon, and
hispec's own engine serves decoding, not this. Sampled batches keep one `generate` call, so a seed gives what it
always gave.

`answer_batches(model, prompts, batch_size=, ...)` answers token-id prompts longest first (similar lengths share a
batch: little padding), `batch_size` at a time, with a progress bar; it yields `(indices, rows)` per batch, rows as
`generate_rows` returns them, so callers write each batch as it comes (resumable). `seed(i)` (optional) seeds a
batch from the index of its first prompt.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from hispec.prompts import cut_at_eos, left_pad


SHRINK_EVERY = 32  # new tokens per generate() call of a shrinking greedy batch


@torch.no_grad()
def generate_rows(model, rows: list[list[int]], *, pad_id: int, eos, max_new_tokens: int,
                  sample: tuple[float, float] | None = None, seed: int | None = None,
                  keep_eos: bool = True, shrink_every: int | None = None) -> list[tuple[list[int], bool]]:
    ids, mask = left_pad(rows, pad_id)
    device = next(model.parameters()).device
    kwargs = dict(do_sample=sample is not None, pad_token_id=pad_id, eos_token_id=list(eos) or None)
    if sample is None:
        kwargs.update(temperature=None, top_p=None, top_k=None)
        if shrink_every and shrink_every < max_new_tokens and len(rows) > 1:
            return _shrinking(model, ids.to(device), mask.to(device), eos, max_new_tokens, shrink_every, keep_eos,
                              kwargs)
    else:
        kwargs.update(temperature=sample[0], top_p=sample[1], top_k=0)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         **kwargs)
    return [cut_at_eos(row, eos, keep_eos=keep_eos) for row in out[:, ids.shape[1]:].cpu().tolist()]


def _shrinking(model, ids, mask, eos, max_new_tokens: int, every: int, keep_eos: bool, kwargs: dict):
    """Greedy `generate` `every` new tokens at a time; rows that ended leave the batch and the cache between calls
    (see the module docstring). ids, mask: [B, P] left-padded."""
    P, eos_set = ids.shape[1], set(eos)
    out: list = [None] * ids.shape[0]
    live = list(range(ids.shape[0]))  # batch row j is prompt live[j]
    seqs, past = ids, None
    while True:
        todo = max_new_tokens - (seqs.shape[1] - P)
        res = model.generate(input_ids=seqs, attention_mask=mask, cache=past, max_new_tokens=min(every, todo),
                             return_dict_in_generate=True, **kwargs)
        seqs, past = res.sequences, res.cache  # seqs [b, P + n]; the cache holds P + n - 1 positions
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], seqs.shape[1] - mask.shape[1])], dim=1)
        new = seqs[:, P:].cpu().tolist()
        last = seqs.shape[1] - P >= max_new_tokens
        keep = []
        for j, toks in enumerate(new):
            if last or eos_set.intersection(toks):
                out[live[j]] = cut_at_eos(toks, eos, keep_eos=keep_eos)
            else:
                keep.append(j)
        if not keep:
            return out
        if len(keep) < len(live) and hasattr(past, "batch_select_indices"):  # else ended rows ride along
            idx = torch.tensor(keep, device=seqs.device)
            past.batch_select_indices(idx)
            seqs, mask, live = seqs[idx], mask[idx], [live[j] for j in keep]


def answer_batches(model, prompts: list[list[int]], *, batch_size: int, pad_id: int, eos, max_new_tokens: int,
                   sample: tuple[float, float] | None = None, seed=None, keep_eos: bool = True,
                   desc: str = "answering prompts", show_progress: bool = True, shrink_every: int | None = SHRINK_EVERY):
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    bar = tqdm(total=len(order), desc=desc, unit="prompt", disable=not show_progress, dynamic_ncols=True)
    new_tokens, t0 = 0, time.time()
    for a in range(0, len(order), batch_size):
        idx = order[a : a + batch_size]
        rows = generate_rows(model, [prompts[i] for i in idx], pad_id=pad_id, eos=eos, max_new_tokens=max_new_tokens,
                             sample=sample, seed=None if seed is None else seed(idx[0]), keep_eos=keep_eos,
                             shrink_every=shrink_every)
        yield idx, rows
        new_tokens += sum(len(toks) for toks, _ in rows)
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
