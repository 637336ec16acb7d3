"""Logits -> probabilities and the acceptance rules, as small pure functions on tensors.

Shapes: `B` rows, `M` candidates per row (rows have `m[b] <= M` real ones, the rest is padding), `V` vocabulary.
Every level of the hierarchy warps its own logits with the same `temperature / top_k / top_p`, so each level's
distribution is a proper target for the level below and a proper proposal for the level above.
"""

from __future__ import annotations

import torch


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """fp32 logits after temperature, top-k, then top-p (the order and tie rules of transformers' warpers)."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    return warp_logits(logits, temperature, top_k, top_p).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs `[..., V]` -> token ids `[...]`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    # ok: [B, M] bool -> length of the all-True prefix per row [B]
    return ok.long().cumprod(-1).sum(-1)


def greedy_accept(cands: torch.Tensor, m: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification: accept the longest prefix equal to the target's argmax, then the target's own token.

    cands `[B, M]`, m `[B]`, target_logits `[B, M+1, V]` (row i predicts candidate i; row M is the bonus row)
    -> (accepted `[B]`, next_token `[B]`).
    """
    pred = target_logits.argmax(-1)  # [B, M+1]
    M = cands.shape[1]
    ok = (cands == pred[:, :M]) & (torch.arange(M, device=cands.device) < m[:, None])
    a = _accepted_prefix(ok)
    return a, pred.gather(1, a[:, None]).squeeze(1)


def speculative_accept(cands: torch.Tensor, m: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor,
                       generator: torch.Generator | None = None):
    """Speculative sampling (Leviathan et al.; Chen et al.): candidates drawn from `q` become exact samples of `p`.

    Accept candidate i with probability min(1, p_i(x)/q_i(x)); at the first rejection sample from
    norm(max(0, p_i - q_i)); if all m are accepted sample a bonus token from p_m.
    cands `[B, M]`, m `[B]`, q_rows `[B, M, V]`, p_rows `[B, M+1, V]` -> (accepted `[B]`, next_token `[B]`).
    """
    B, M = cands.shape
    rows = torch.arange(B, device=cands.device)
    if M > 0:
        p_x = p_rows[:, :M].gather(-1, cands[..., None]).squeeze(-1)
        q_x = q_rows.gather(-1, cands[..., None]).squeeze(-1)
        u = torch.rand(B, M, device=cands.device, generator=generator)
        ok = (u * q_x <= p_x) & (torch.arange(M, device=cands.device) < m[:, None])
        a = _accepted_prefix(ok)
        q_a = q_rows[rows, a.clamp(max=M - 1)]
    else:
        a = torch.zeros(B, dtype=torch.long, device=cands.device)
        q_a = torch.zeros_like(p_rows[:, 0])
    p_a = p_rows[rows, a]
    residual = torch.where((a < m)[:, None], (p_a - q_a).clamp(min=0), p_a)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_a)  # p == q: residual is empty
    return a, sample(residual, generator)
