"""Distillation of exit heads from the frozen model's own final layer.

Contract:
- `exit_states(adapter, input_ids, position_ids, valid, exits)` runs the frozen backbone once (no grad) through
  `hispec.layers.DecoderAdapter`, the same code path the decoder uses, and returns the residual stream after
  each exit layer and the final normed features (`[B, T, H]` each). It never builds `[B, T, V]` logits.
- `distill_loss(project, teacher, students, ...)` takes, for the N valid tokens of a batch, the teacher's final
  normed features `[N, H]` and each head's features `[N, H]`; `project` is the frozen lm_head
  (`DecoderAdapter.project`). Per exit: forward KL(p_final || p_exit) at temperature T (scaled by T^2, Hinton),
  optionally mixed with next-token cross-entropy: `(1 - ce_weight) * T^2 * KL + ce_weight * CE`; the loss is the
  sum over exits of the per-token means. Softmax is fp32.
- Memory: logits exist for one chunk of `chunk_size` tokens at a time, teacher and all heads together. With
  grad enabled each chunk runs under activation checkpointing, so the backward pass recomputes a chunk's logits
  instead of keeping every chunk's `[chunk, V]` tensors alive: peak memory is ~ a few x chunk x V floats
  whatever N is. `chunk_size=None` picks the largest chunk with at most `CHUNK_ELEMENTS` logits per tensor.
  Measured (one step, 2,048 tokens, 128,256-token vocabulary, both heads): +0.8 GiB peak RSS with the automatic
  261-token chunks, +6.9 GiB unchunked. On CPU prefer the automatic size: glibc keeps freed blocks of <= 32 MiB
  in its heap, so very small chunks can show a larger RSS than they use (MALLOC_MMAP_THRESHOLD_ avoids that).
- `topk_distill_loss(project, students, topk_ids, topk_logprobs, ...)` is the same loss against a teacher stored
  as its k most likely tokens (hispec/distill/features.py): the teacher distribution is the k top probabilities plus one
  bucket holding the remaining mass `r = 1 - sum(p_topk)`; the student is the full-vocabulary log-softmax of
  `project(head features)`, read at the k ids, with its bucket = logsumexp over every other token. Per token
  `KL = sum_i p_i (log p_i - log q_i) + r (log r - log q_rest)` (the bucket term is 0 when r = 0 or k = V), which
  is exactly the full KL when k = V and a lower bound of it otherwise (grouping outcomes never increases KL).
  The teacher is at temperature 1 (no temperature argument); agreement is with `topk_ids[:, 0]` (the final
  layer's argmax). Same chunking, checkpointing, CE mix and outputs as `distill_loss`.
- Both losses take `topk_agree=k` (with `per_token=True`): `DistillOutput.topk_tokens[exit]` is then 1.0 where the
  final layer's argmax is among the head's k most likely tokens (top-5 agreement for evaluation), else 0.0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # 32M logits (128 MiB in fp32) per [chunk, V] tensor


@dataclass
class DistillOutput:
    """Loss and per-exit statistics of one batch. `kl`, `ce`, `agree` are per-token means (detached);
    with `per_token=True` the `*_tokens` dicts hold the per-token values `[N]` instead."""

    loss: torch.Tensor  # scalar, differentiable when any student requires grad
    kl: dict[str, torch.Tensor]
    ce: dict[str, torch.Tensor]
    agree: dict[str, torch.Tensor]  # top-1 agreement with the teacher; also "draft_verify"-style pairs
    n_tokens: int
    kl_tokens: dict[str, torch.Tensor] | None = None
    agree_tokens: dict[str, torch.Tensor] | None = None
    topk_tokens: dict[str, torch.Tensor] | None = None  # final argmax within the head's top-k (`topk_agree`)


@torch.no_grad()
def exit_states(adapter, input_ids, position_ids, valid, exits: tuple[int, ...]):
    """Frozen backbone, one pass: `({layer: hidden after `layer` layers [B, T, H]}, final normed [B, T, H])`."""
    cache = adapter.new_cache(input_ids.shape[0])
    hidden = adapter.embed(input_ids, position_ids)
    saved = {}
    bounds = sorted({0, adapter.num_layers, *exits})
    for a, b in zip(bounds[:-1], bounds[1:]):
        hidden = adapter.run_layers(hidden, a, b, position_ids=position_ids, cache=cache, valid=valid)
        if b in exits:
            saved[b] = hidden
    del cache
    return saved, adapter.final_norm(hidden)


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits `[n, V]` -> (its top-k ids `[n, k]` long, their log-probabilities `[n, k]` fp32), k capped at
    V: the targets of the top-k + bucket KL (the feature cache and the probe store these)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids, vals


def next_token_labels(input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[B, T]` -> `[B, T]` label of each position = the next token, IGNORE_INDEX where there is none."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    nxt_ok = valid[:, 1:] & valid[:, :-1]
    labels[:, :-1] = torch.where(nxt_ok, input_ids[:, 1:], torch.full_like(input_ids[:, 1:], IGNORE_INDEX))
    return labels


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0):
    """Reference forward KL(softmax(t/T) || softmax(s/T)) per row, fp32: `[N, V], [N, V] -> [N]`."""
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def auto_chunk_size(vocab_size: int, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(1, vocab_size))


def _topk_hits(s_logits: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """`[c, V]` logits, `[c]` token ids -> `[c]` 1.0 where the id is among the k largest logits."""
    k = min(k, s_logits.shape[-1])
    return (s_logits.detach().topk(k, dim=-1).indices == target[:, None]).any(-1).float()


def _chunk_stats(project, names, temperature, teacher, labels, *students, topk_agree=0):
    """One chunk: per exit [kl_sum, ce_sum] (differentiable) and per-token kl / agreement (detached).

    teacher, students: [c, H]; labels: [c] (IGNORE_INDEX = no label). Returns (sums [E, 2], kl_tok [E, c],
    argmax [E + 1, c], top-k hits [E, c] (empty unless `topk_agree`)) with the teacher's argmax last.
    """
    with torch.no_grad():
        t_logits = project(teacher).float()  # [c, V]
        log_p = F.log_softmax(t_logits / temperature, dim=-1)
        p = log_p.exp()
        t_top = t_logits.argmax(-1)
        del t_logits
    has_label = labels != IGNORE_INDEX
    sums, kl_tok, tops, hits = [], [], [], []
    for s in students:
        s_logits = project(s).float()  # [c, V]
        if topk_agree:
            hits.append(_topk_hits(s_logits, t_top, topk_agree))
        log_q = F.log_softmax(s_logits / temperature, dim=-1)
        kl = (p * (log_p - log_q)).sum(-1)  # [c]
        if has_label.any():
            ce = F.cross_entropy(s_logits, labels.clamp(min=0), reduction="none")
            ce = (ce * has_label).sum()
        else:
            ce = s_logits.sum() * 0.0
        sums.append(torch.stack([kl.sum(), ce]))
        kl_tok.append(kl.detach())
        tops.append(s_logits.detach().argmax(-1))
    tops.append(t_top)
    return torch.stack(sums), torch.stack(kl_tok), torch.stack(tops), _stack_hits(hits, t_top)


def _stack_hits(hits, like):
    return torch.stack(hits) if hits else like.new_zeros(0, like.shape[0], dtype=torch.float32)


def distill_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    teacher: torch.Tensor,
    students: dict[str, torch.Tensor],
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    pairs: tuple[tuple[str, str], ...] = (),
    per_token: bool = False,
    topk_agree: int = 0,
) -> DistillOutput:
    """Chunked distillation loss over N valid tokens (see module docstring).

    teacher: `[N, H]` final normed features (no grad); students: `{exit: [N, H]}` head features; labels: `[N]`
    next-token ids or IGNORE_INDEX (only used when `ce_weight > 0`). `pairs` adds top-1 agreement between two
    students (e.g. ("draft", "verify")), reported as "draft_verify".
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    names = list(students)
    n = teacher.shape[0]
    if labels is None:
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.long, device=teacher.device)
    if chunk_size is None or chunk_size <= 0:
        chunk_size = auto_chunk_size(vocab_size or project(teacher[:1]).shape[-1])
    need_grad = torch.is_grad_enabled() and any(s.requires_grad for s in students.values())
    use_ckpt = need_grad and n > chunk_size

    sums, kl_tok, tops, hits = _over_chunks(_chunk_stats, (project, names, temperature),
                                            (teacher, labels, *(students[k] for k in names)), n, chunk_size, use_ckpt,
                                            topk_agree)
    return _assemble(names, sums, kl_tok, tops, labels, n, temperature, ce_weight, pairs, per_token, teacher.device,
                     hits if topk_agree else None)


def _over_chunks(stats, lead: tuple, tensors: tuple, n: int, chunk_size: int, use_ckpt: bool, topk_agree: int):
    """`stats(*lead, *chunk of each of tensors)` over chunks of `chunk_size` rows (under activation checkpointing
    when `use_ckpt`) -> (summed [E, 2] sums, and per chunk the kl / argmax / top-k hit tensors), for both losses."""
    sums = torch.zeros(len(lead[1]), 2, dtype=torch.float32, device=tensors[0].device)
    kl_tok, tops, hits = [], [], []
    kw = {"topk_agree": topk_agree} if topk_agree else {}
    for a in range(0, n, chunk_size):
        args = (*lead, *(x[a : min(n, a + chunk_size)] for x in tensors))
        s, k, t, h = checkpoint(stats, *args, use_reentrant=False, **kw) if use_ckpt else stats(*args, **kw)
        sums = sums + s
        kl_tok.append(k)
        tops.append(t)
        hits.append(h)
    return sums, kl_tok, tops, hits


def bucket_log_mass(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """`[N, k]` log-probabilities of the k top tokens -> `[N]` log of the remaining mass, `log(1 - sum p)`.

    Computed as `log1p(-sum p)` in float64 with the sum clamped to [0, 1]: a remainder that rounding made zero or
    negative gives `-inf` (the caller drops the bucket term there), never NaN.
    """
    total = topk_logprobs.double().exp().sum(-1).clamp(0.0, 1.0)
    return torch.log1p(-total).float()


class TopkBucketKL(torch.autograd.Function):
    """Per-row "top-k + bucket" KL of student logits against a top-k teacher, fused (one [c, V] temporary).

    forward(s [c, V], ids [c, k] long, logp [c, k], log_r [c]) -> (kl [c], log_z [c], argmax [c]); gradients flow to
    `s` through kl and log_z. The bucket's log-mass is computed stably: with m = max of the logits outside the top k
    and e = exp(s - m) there (0 at the top k), log sum_rest exp(s) = m + log(sum e) (sum e >= 1), and
    log Z = logaddexp(that, logsumexp(s at the top k)): no cancellation, no underflow. The gradient is analytic:
    d kl / d s_i = q_i (sum p + r) - p_i [i in top k] - r q_i / q_rest [i outside], plus q_i per unit of log_z.
    About 4 passes over [c, V] forward and 1 backward, against ~15 for the same loss through autograd.
    """

    @staticmethod
    def forward(ctx, s, ids, logp, log_r):
        V, k = s.shape[-1], ids.shape[-1]
        has_rest = k < V
        p = logp.exp()
        bucket = torch.isfinite(log_r) & has_rest
        r = torch.where(bucket, log_r.exp(), torch.zeros_like(log_r))
        s_k = s.gather(-1, ids)  # [c, k]
        lse_k = torch.logsumexp(s_k, -1)
        top_max, top_arg = s_k.max(-1)
        top_idx = ids.gather(-1, top_arg[:, None])[:, 0]
        if has_rest:
            e = s.scatter(-1, ids, float("-inf"))  # the rest only
            m_rest, i_rest = e.max(-1)
            e.sub_(m_rest[:, None]).exp_()
            rest_sum = e.sum(-1)  # >= 1
            lse_rest = m_rest + rest_sum.log()
            log_z = torch.logaddexp(lse_rest, lse_k)
            log_q_rest = lse_rest - log_z
            bucket_term = r * (torch.where(bucket, log_r, torch.zeros_like(log_r)) - log_q_rest)
            argmax = torch.where(m_rest > top_max, i_rest,
                                 torch.where(m_rest < top_max, top_idx, torch.minimum(i_rest, top_idx)))
        else:
            e = m_rest = rest_sum = None
            log_z = lse_k
            bucket_term = torch.zeros_like(lse_k)
            argmax = top_idx
        kl = (p * (logp - (s_k - log_z[:, None]))).sum(-1) + bucket_term
        ctx.has_rest, ctx.shape = has_rest, s.shape
        ctx.save_for_backward(*(t for t in (e, m_rest, rest_sum) if t is not None), ids, p, r, s_k, log_z)
        ctx.mark_non_differentiable(argmax)
        return kl, log_z, argmax

    @staticmethod
    def backward(ctx, g_kl, g_lz, _g_arg):
        if ctx.has_rest:
            e, m_rest, rest_sum, ids, p, r, s_k, log_z = ctx.saved_tensors
        else:
            ids, p, r, s_k, log_z = ctx.saved_tensors
        g_kl = torch.zeros_like(log_z) if g_kl is None else g_kl
        g_lz = torch.zeros_like(log_z) if g_lz is None else g_lz
        coef_q = g_kl * (p.sum(-1) + r) + g_lz  # multiplies q_i for every i
        val_k = (s_k - log_z[:, None]).exp() * coef_q[:, None] - g_kl[:, None] * p
        if ctx.has_rest:
            scale = (m_rest - log_z).exp() * coef_q - g_kl * r / rest_sum
            grad = e * scale[:, None]  # e is 0 at the top k: those entries are set just below
        else:
            grad = torch.zeros(ctx.shape, dtype=s_k.dtype, device=s_k.device)
        grad.scatter_(-1, ids, val_k)
        return grad, None, None, None


def topk_kl(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-row top-k + bucket KL `[n]` (fp32) of full-vocabulary student logits `[n, V]` against a top-k teacher
    (`teacher_topk`): `TopkBucketKL` with the bucket of `bucket_log_mass`, differentiable in the logits."""
    return TopkBucketKL.apply(student_logits.float(), topk_ids, topk_logprobs.float(),
                              bucket_log_mass(topk_logprobs))[0]


def _topk_chunk_stats(project, names, with_ce_grad, ids, logp, log_r, labels, *students, topk_agree=0):
    """One chunk of `topk_distill_loss`: like `_chunk_stats` with a top-k + bucket teacher.

    ids `[c, k]` (long), logp `[c, k]` teacher log-probs, log_r `[c]` log remaining mass (-inf: none), labels `[c]`,
    students `[c, H]`. Returns (sums [E, 2], kl_tok [E, c], argmax [E + 1, c], top-k hits [E, c] or empty) with the
    teacher's argmax last.
    CE is `log Z - s[label]` (no extra pass over the vocabulary); it carries a gradient only if `with_ce_grad`.
    """
    has_label = labels != IGNORE_INDEX
    sums, kl_tok, tops, hits = [], [], [], []
    for s in students:
        s_logits = project(s).float()  # [c, V]
        if topk_agree:
            hits.append(_topk_hits(s_logits, ids[:, 0], topk_agree))
        kl, log_z, arg = TopkBucketKL.apply(s_logits, ids, logp, log_r)
        with torch.set_grad_enabled(with_ce_grad and torch.is_grad_enabled()):
            picked = s_logits.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
            ce = ((log_z - picked) * has_label).sum()
        sums.append(torch.stack([kl.sum(), ce]))
        kl_tok.append(kl.detach())
        tops.append(arg)
    tops.append(ids[:, 0])
    return torch.stack(sums), torch.stack(kl_tok), torch.stack(tops), _stack_hits(hits, ids[:, 0])


def topk_distill_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    students: dict[str, torch.Tensor],
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    pairs: tuple[tuple[str, str], ...] = (),
    per_token: bool = False,
    topk_agree: int = 0,
) -> DistillOutput:
    """Chunked "top-k + one bucket" distillation loss over N tokens (see module docstring).

    students: `{exit: [N, H]}` head features; topk_ids `[N, k]` and topk_logprobs `[N, k]`: the teacher's k most
    likely next tokens (descending) and their log-probabilities at temperature 1; labels `[N]` next-token ids or
    IGNORE_INDEX (used when `ce_weight > 0`). The loss is `sum over exits of (1 - ce_weight) * mean KL +
    ce_weight * mean CE`.
    """
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    if topk_ids.shape != topk_logprobs.shape or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_logprobs {tuple(topk_logprobs.shape)} must "
                         "both be [N, k]")
    names = list(students)
    n = topk_ids.shape[0]
    device = topk_ids.device
    ids = topk_ids.long()
    logp = topk_logprobs.float()
    log_r = bucket_log_mass(logp)
    if labels is None:
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.long, device=device)
    first = next(iter(students.values()))
    if chunk_size is None or chunk_size <= 0:
        chunk_size = auto_chunk_size(vocab_size or project(first[:1]).shape[-1])
    need_grad = torch.is_grad_enabled() and any(s.requires_grad for s in students.values())
    use_ckpt = need_grad and n > chunk_size

    sums, kl_tok, tops, hits = _over_chunks(_topk_chunk_stats, (project, names, ce_weight > 0),
                                            (ids, logp, log_r, labels, *(students[k] for k in names)), n, chunk_size,
                                            use_ckpt, topk_agree)
    return _assemble(names, sums, kl_tok, tops, labels, n, 1.0, ce_weight, pairs, per_token, device,
                     hits if topk_agree else None)


def _assemble(names, sums, kl_tok, tops, labels, n, temperature, ce_weight, pairs, per_token, device, hits=None):
    """Per-chunk sums and per-token stats -> DistillOutput (shared by both losses)."""
    kl_tok = torch.cat(kl_tok, 1) if kl_tok else torch.zeros(len(names), 0, device=device)
    tops = torch.cat(tops, 1) if tops else torch.zeros(len(names) + 1, 0, dtype=torch.long, device=device)
    denom = max(n, 1)
    n_labels = max(int((labels != IGNORE_INDEX).sum()), 1)
    kl_mean, ce_mean = sums[:, 0] / denom, sums[:, 1] / n_labels
    per_exit = (1.0 - ce_weight) * temperature**2 * kl_mean + (ce_weight * ce_mean if ce_weight > 0 else 0.0)
    loss = per_exit.sum()

    hit = None
    if per_token and hits is not None:
        hit = torch.cat(hits, 1) if hits else torch.zeros(len(names), 0, device=device)
    agree_tok = {k: (tops[i] == tops[-1]).float() for i, k in enumerate(names)}
    for x, y in pairs:
        agree_tok[f"{x}_{y}"] = (tops[names.index(x)] == tops[names.index(y)]).float()
    return DistillOutput(
        loss=loss,
        kl={k: kl_mean[i].detach() for i, k in enumerate(names)},
        ce={k: ce_mean[i].detach() for i, k in enumerate(names)},
        agree={k: v.sum() / denom for k, v in agree_tok.items()},
        n_tokens=n,
        kl_tokens={k: kl_tok[i] for i, k in enumerate(names)} if per_token else None,
        agree_tokens=agree_tok if per_token else None,
        topk_tokens=({k: hit[i] for i, k in enumerate(names)} if hit is not None else None),
    )
