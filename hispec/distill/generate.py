"""The one batched generator of the distillation core: self-written prompts, self-distillation answers and the
probe's answers all go through `generate_rows`.

`generate_rows(model, rows, pad_id=, eos=, max_new_tokens=, sample=None, seed=None, keep_eos=True)` left-pads
token-id rows into one batch, runs the model's own `generate` once (greedy, or with `sample=(temperature, top_p)`
plain temperature + nucleus sampling, no top-k; `seed` seeds torch's global generator right before) and returns,
per row, the new tokens up to the first EOS (kept or not) and whether one came. Ordering rows into batches,
seeding schemes and where results go stay with the callers.
"""

from __future__ import annotations

import torch

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
