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


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None = None):
    """k draws without replacement from `probs` `[B, V]` (Gumbel top-k: the same law as drawing one at a time and
    renormalising the rest) -> (tokens `[B, k]` in draw order, valid `[B, k]`: False once the mass is used up)."""
    u = torch.rand(probs.shape, device=probs.device, generator=generator, dtype=torch.float64)
    keys = probs.double().log() - (-u.clamp(min=1e-300).log()).log()
    keys = keys.masked_fill(probs <= 0, float("-inf"))
    top = keys.topk(k, dim=-1)
    return top.indices, torch.isfinite(top.values)


def recursive_accept(p: torch.Tensor, q: torch.Tensor, cands: torch.Tensor, valid: torch.Tensor,
                     generator: torch.Generator | None = None):
    """Multi-candidate speculative sampling for candidates drawn from `q` *without replacement* (recursive
    rejection sampling; SpecInfer / EAGLE-2 / Jeon et al.). `p`, `q` `[B, V]`, `cands` `[B, k]` in draw order,
    `valid` `[B, k]` (False: no candidate; rows with none valid simply get `p` back).

    Candidate r (drawn from q_r = q without candidates < r, renormalised) is accepted with probability
    min(1, p_r(x)/q_r(x)); on rejection p_{r+1} = norm(max(p_r - q_r, 0)) and q_{r+1} = norm(q_r without x). Each
    step is ordinary speculative sampling toward p_r with a draft that really is distributed as q_r given what came
    before, so the accepted candidate, or a sample of the final residual, is an exact sample of p.
    -> (index of the accepted candidate `[B]` (-1: none), the residual to sample from when none `[B, V]`)."""
    B, k = cands.shape
    acc = torch.full((B,), -1, dtype=torch.long, device=p.device)
    p, q = p.clone(), q.clone()
    for r in range(k):
        x = cands[:, r : r + 1]
        qx, px = q.gather(-1, x)[:, 0], p.gather(-1, x)[:, 0]
        u = torch.rand(B, device=p.device, generator=generator)
        ok = valid[:, r] & (acc < 0) & (qx > 0)
        hit = ok & (u * qx <= px)
        acc = torch.where(hit, torch.full_like(acc, r), acc)
        rej = ok & ~hit
        res = (p - q).clamp(min=0)
        tot = res.sum(-1, keepdim=True)
        res = torch.where(tot > 0, res / tot.clamp(min=1e-30), p)
        q2 = q.scatter(-1, x, 0.0)
        qt = q2.sum(-1, keepdim=True)
        q2 = torch.where(qt > 0, q2 / qt.clamp(min=1e-30), q2)
        p = torch.where(rej[:, None], res, p)
        q = torch.where(rej[:, None], q2, q)
    return acc, p
