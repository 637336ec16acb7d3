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


def rank_among(cands: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """`[B]`: the position of `token` `[B]` in each row's best-first candidates `cands` `[B, k]` (k where absent), e.g.
    the model's token among a draft head's top-k."""
    at = cands == token[:, None]
    return torch.where(at.any(1), at.float().argmax(1), cands.shape[1])


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


# ---------------------------------------------------------------------------------------------- sequence-level
VERIFICATIONS = ("token", "hsd")


def check_verification(verification) -> str:
    """`verification` if it names a rule (`token`: `speculative_accept`, `hsd`: `hsd_accept`), else ValueError."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"unknown verification {verification!r}: choose one of {', '.join(VERIFICATIONS)} "
                         "(token: per-token speculative sampling; hsd: sequence-level, Zhou et al. 2026)")
    return verification


_TINY = 1e-30  # q(x) of a drafted token is > 0; the clamp only keeps impossible drafts finite


def _ratio_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # (mps has no float64)


def hsd_branches(cands: torch.Tensor, m: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor):
    """The branch quantities of sequence-level verification (HSD), in closed form.

    cands `[B, M]`, m `[B]`, q_rows `[B, M, V]`, p_rows `[B, M+1, V]` (as `speculative_accept`) ->
    (accept_all `[B]`, stop `[B, M]`, residual `[B, M, V]`):
    - `accept_all[b]`: probability that all m[b] candidates are accepted (the bonus token then comes from p_m);
    - `stop[b, t]`: probability that the backward scan, having come down to branch t, stops there (t < m[b]);
      branch 0 always stops (`stop[:, 0] == 1`);
    - `residual[b, t]`: the unnormalised positive part from which a scan stopping at branch t resamples position t.
    Prefix ratios are float64 logarithms (a zero p(x) is -inf, never NaN); the V-sized rows keep p_rows' dtype.
    See `hsd_accept` for the rule and its derivation.
    """
    B, M = cands.shape
    dt = _ratio_dtype(cands.device)
    real = torch.arange(M, device=cands.device) < m[:, None]
    p_x = p_rows[:, :M].gather(-1, cands[..., None]).squeeze(-1).to(dt)
    q_x = q_rows.gather(-1, cands[..., None]).squeeze(-1).to(dt)
    log_r = torch.where(real, p_x.log() - q_x.clamp(min=_TINY).log(), torch.zeros_like(p_x))  # log p_t/q_t
    log_R = torch.cat([torch.zeros_like(p_x[:, :1]), log_r.cumsum(-1)], -1)  # [B, M+1]: log R_t, R_0 = 1
    log_top = log_R.cummax(-1).values  # log of the running max M_t = max_{j <= t} R_j >= 1 (finite)
    keep = (log_R - log_top).exp()  # R_t / M_t in [0, 1]: the capped share of branch t's prefix
    accept_all = keep.gather(1, m[:, None]).squeeze(1)
    c = keep[:, :M]
    d = c[..., None].to(p_rows.dtype) * p_rows[:, :M] - q_rows  # [B, M, V]: capped target minus proposal
    residual = d.clamp(min=0)
    excess = residual.sum(-1).to(dt)
    deficit = (-d).clamp(min=0).sum(-1).to(dt)
    stop = torch.where(deficit > 0, excess / deficit.clamp(min=_TINY), torch.ones_like(excess)).clamp(max=1)
    # exactly 1 where the closed form says so (c_t = 1: excess == deficit; R_{t+1} a new maximum: nothing of branch
    # t's scan mass ever gets that far down), so rounding never lets the scan step back past such a branch
    sure = (c >= 1) | (log_R[:, 1:] >= log_top[:, :M])
    return accept_all, torch.where(sure, torch.ones_like(stop), stop), residual


def hsd_length_probs(accept_all: torch.Tensor, stop: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The law of the accepted length under HSD's backward scan: `[B, M+1]`, entry a = P(accepted == a).

    P(a = m) = accept_all; for t < m, P(a = t) = (1 - accept_all) * stop_t * prod_{t < j < m} (1 - stop_j).
    """
    B, M = stop.shape
    real = torch.arange(M, device=stop.device) < m[:, None]
    go_on = torch.where(real, 1 - stop, torch.ones_like(stop))  # padding never stops the scan
    # prod over j > t of go_on_j: reversed cumulative product, shifted by one
    after = torch.cat([go_on.flip(-1).cumprod(-1).flip(-1)[:, 1:], torch.ones_like(go_on[:, :1])], -1)
    probs = torch.zeros(B, M + 1, dtype=stop.dtype, device=stop.device)
    probs[:, :M] = torch.where(real, (1 - accept_all[:, None]) * stop * after, torch.zeros_like(stop))
    probs.scatter_(1, m[:, None], accept_all[:, None].to(stop.dtype))
    return probs


def hsd_accept(cands: torch.Tensor, m: torch.Tensor, q_rows: torch.Tensor, p_rows: torch.Tensor,
               generator: torch.Generator | None = None):
    """Sequence-level lossless verification (Hierarchical Speculative Decoding, Zhou et al., arXiv 2601.05724).

    Same contract as `speculative_accept`: candidates x_0..x_{m-1} drawn from the proposal rows q_t become exact
    samples of the target rows p_t; cands `[B, M]`, m `[B]` (m[b] <= M real candidates per row), q_rows `[B, M, V]`,
    p_rows `[B, M+1, V]` -> (accepted `[B]`, next_token `[B]`). Under greedy decoding neither rule runs (the
    decoder matches prefixes), so the choice changes nothing there.

    Rule. With P_t = prod_{s<t} p_s(x_s), Q_t = prod_{s<t} q_s(x_s), R_t = P_t / Q_t (R_0 = 1) and the running
    maximum M_t = max_{j<=t} R_j, branch t (prefix x_{<t}, any token at t) carries the capped target mass
    P~_t p_t with P~_t = P_t / M_t, against the proposal mass Q_t q_t. Let c_t = R_t / M_t (<= 1) and
    d_t = c_t p_t - q_t, with excess E_t = sum(d_t^+) and deficit D_t = sum(d_t^-) (D_t - E_t = 1 - c_t).
    1. Accept all m candidates with probability R_m / M_m (the bonus token then comes from p_m).
    2. Otherwise scan the branches backwards, t = m-1, ..., 0; stop at the first t with probability E_t / D_t
       (1 where R_{t+1} >= M_t, and branch 0 always stops since c_0 = 1), accept x_{<t} and resample position t
       from norm(d_t^+).

    Why it is exact. A verification emits an accepted prefix and one token, and the tokens after it follow p.
    The output follows p iff, at every node s of the draft tree, the mass of emissions that pass through s
    splits over the children v in proportion p(v | s):  alive(s v) + resampled(s, v) = alive(s) p(v | s),
    where alive(s) = P(draft passes s and is accepted through s). This forces alive(s v) <= alive(s) p(v | s) and
    alive(s) <= Q(s), hence alive(s) <= min_{j<=t} Q_j P(s) / P_j = P(s) / M_t; the rule reaches that bound,
    alive(s) = P~_t: resampled(s, v) = (P~_t p_t(v) - Q_t q_t(v))^+ = Q_t d_t(v)^+ is what the bound leaves at v
    (positive only where R_{t+1} > M_t), and by induction from the top (E[(1 - stop_t) (1 - R_{t+1}/M_{t+1})] over
    x_t ~ q_t is 1 - c_t exactly when stop_t = E_t / D_t) the scan stops at branch t on exactly Q_t E_t of mass.
    The same holds when m is decided by the drafting process from tokens already drawn (the hierarchy's windows).
    It accepts at least as much as the token-wise rule (R_t / M_t >= prod_{s<t} min(1, r_s), r_s =
    p_s(x_s)/q_s(x_s)); for one candidate the two coincide, and for a point-mass proposal (an n-gram level) both
    accept x_{<t} with probability P_t, so there HSD changes only which random numbers are drawn.

    Compared with the authors' reference code (algorithm_clean.py): the backward scan, the E_t / max(E_t, D_t)
    stop probability and the "never step back past a branch whose cumulative ratio is a new maximum" rule are the
    same, but it caps with min(P_t, Q_t) and accepts everything with min(1, R_m); both equal the running-max form
    only while no earlier prefix ratio exceeds max(1, R_t), and otherwise the output is not p (exact enumeration
    in tests/test_hsd.py shows errors of ~1e-2 in probability for two or more candidates).
    """
    if cands.shape[1] == 0:
        return torch.zeros_like(m), sample(p_rows[:, 0], generator)
    return hsd_draw(*hsd_branches(cands, m, q_rows, p_rows), m, p_rows, generator)


def hsd_draw(accept_all: torch.Tensor, stop: torch.Tensor, residual: torch.Tensor, m: torch.Tensor,
             p_rows: torch.Tensor, generator: torch.Generator | None = None):
    """HSD's random part, given `hsd_branches`: accept everything with probability accept_all, else scan the
    branches backwards from m-1 and stop at branch t with probability stop_t; resample the stopping branch from its
    residual (the bonus row p_m after a full acceptance) -> (accepted `[B]`, next_token `[B]`)."""
    B, M = stop.shape
    rows = torch.arange(B, device=stop.device)
    u = torch.rand(B, M + 1, device=stop.device, generator=generator, dtype=stop.dtype)
    full = u[:, 0] < accept_all
    pos = torch.arange(M, device=stop.device)
    stops = (u[:, 1:] < stop) & (pos < m[:, None])
    last = torch.where(stops, pos, torch.full_like(pos, -1)).max(-1).values  # the scan's first stop from the end
    a = torch.where(full, m, last.clamp(min=0))
    p_a = p_rows[rows, a]
    dist = torch.where((a < m)[:, None], residual[rows, a.clamp(max=M - 1)], p_a)
    total = dist.sum(-1, keepdim=True)
    dist = torch.where(total > 0, dist / total.clamp(min=1e-30), p_a)  # an empty residual has no mass to draw
    return a, sample(dist, generator)
