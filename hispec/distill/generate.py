"""The one batched generator of the distillation core: self-written prompts, self-distillation answers and the
probe's answers all go through `generate_rows`; answers go through `answer_batches`, its one batching loop.

`generate_rows(model, rows, pad_id=, eos=, max_new_tokens=, sample=None, seed=None, keep_eos=True)` left-pads
token-id rows into one batch, runs the model's own `generate` once (greedy, or with `sample=(temperature, top_p)`
plain temperature + nucleus sampling, no top-k; `seed` seeds torch's global generator right before) and returns,
per row, the new tokens up to the first EOS (kept or not) and whether one came. Seeding schemes and where results
go stay with the callers.

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


@torch.no_grad()
def generate_rows(model, rows: list[list[int]], *, pad_id: int, eos, max_new_tokens: int,
                  sample: tuple[float, float] | None = None, seed: int | None = None,
                  keep_eos: bool = True) -> list[tuple[list[int], bool]]:
    ids, mask = left_pad(rows, pad_id)
    device = next(model.parameters()).device
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample is not None, pad_token_id=pad_id,
                  eos_token_id=list(eos) or None)
    if sample is None:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(temperature=sample[0], top_p=sample[1], top_k=0)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    return [cut_at_eos(row, eos, keep_eos=keep_eos) for row in out[:, ids.shape[1]:].cpu().tolist()]


def answer_batches(model, prompts: list[list[int]], *, batch_size: int, pad_id: int, eos, max_new_tokens: int,
                   sample: tuple[float, float] | None = None, seed=None, keep_eos: bool = True,
                   desc: str = "answering prompts", show_progress: bool = True):
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    bar = tqdm(total=len(order), desc=desc, unit="prompt", disable=not show_progress, dynamic_ncols=True)
    new_tokens, t0 = 0, time.time()
    for a in range(0, len(order), batch_size):
        idx = order[a : a + batch_size]
        rows = generate_rows(model, [prompts[i] for i in idx], pad_id=pad_id, eos=eos, max_new_tokens=max_new_tokens,
                             sample=sample, seed=None if seed is None else seed(idx[0]), keep_eos=keep_eos)
        yield idx, rows
        new_tokens += sum(len(toks) for toks, _ in rows)
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
