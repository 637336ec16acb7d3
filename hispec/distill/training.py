"""The head training step, its schedule and the evaluation, shared by `train/heads.py` (through
`hispec.distill.trainer`) and `hispec-probe` (and any other loop that trains exit heads by distillation).

- `lr_at`: warm-up then constant / linear / cosine learning rate per optimizer step (decaying to `min_lr_ratio` of
  the peak); `take_step`: one optimizer step at that rate (the trainer's loop and `fit_head` share it);
- `fit_head` / `exit_logits`: one head trained in memory on precomputed exit states against a top-k teacher
  (`hispec-probe`: no accelerate, no data loader);
- `context_settings` / `context_ranges`: a context head's settings and the frontier distances training draws
  (`draw_distances`, `distance_sampler`, `fixed_distances`, seeded per step so resume is exact);
- `HeadsForTraining`: the one module `accelerate.prepare` sees (both heads; the frozen backbone stays outside);
- the step's inputs from a batch on the fly (`_batch_inputs`: the backbone once, no grad) or from the feature
  cache (`_cached_inputs`), and its loss (`_loss_fn`: full KL, or top-k + bucket KL from the cache);
- `evaluate` / `format_agreement`: held-out KL, top-1 / top-5 agreement with the final layer's argmax and expected
  tokens per round, per exit (context heads also per frontier distance).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from hispec.distill.args import EVAL_DISTANCES, ConfigError, ModelArguments, TrainArguments
from hispec.distill.features import FeatureCacheError
from hispec.distill.losses import (
    IGNORE_INDEX, distill_loss, exit_states, next_token_labels, topk_distill_loss, topk_kl,
)
from hispec.distill.metrics import expected_tokens_per_round
from hispec.io import parse_dtype
from hispec.layers import positions_from_mask


# ---------------------------------------------------------------------------------------------------- schedule
def lr_at(step: int, total: int, cfg: TrainArguments) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`: warm-up, then constant / linear / cosine,
    decaying from the peak to `min_lr_ratio` of it."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler_type == "constant":
        return cfg.learning_rate
    span = max(1, total - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        return cfg.learning_rate * (floor + (1.0 - floor) * (1.0 - frac))
    return cfg.learning_rate * (floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def take_step(optimizer, loss, lr: float, *, backward=None, clip=None) -> None:
    """One optimizer step at learning rate `lr`: backward (`backward(loss)`, e.g. accelerate's; default
    `loss.backward()`), `clip()` when given, step, zero the gradients. The trainer's loop and `fit_head` share it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    (backward or torch.Tensor.backward)(loss)
    if clip is not None:
        clip()
    optimizer.step()
    optimizer.zero_grad()


def exit_logits(head, adapter, feats: torch.Tensor) -> torch.Tensor:
    """One exit head on exit hidden states `[n, H]` (any dtype / device) -> full-vocabulary logits `[n, V]` (fp32)
    through the frozen lm_head; a `shared` head runs in the backbone's dtype, trained ones in fp32."""
    dtype = adapter.dtype if head.head_type == "shared" else torch.float32
    return _project_fn(adapter)(head(feats.to(adapter.device, dtype))).float()


def fit_head(head, adapter, feats: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, *,
             steps: int, schedule: TrainArguments, batch_tokens: int, seed: int = 0, on_step=None) -> list[float]:
    """Train one exit head in memory (no accelerate; `hispec-probe`) on precomputed exit states and a top-k
    teacher: AdamW (`schedule.weight_decay`) on the mean top-k + bucket KL (`topk_kl`), the learning rate of
    `lr_at(step, steps, schedule)`, `take_step`. Batches are consecutive `batch_tokens` slices of seeded
    permutations of the N positions (a new one each epoch). Returns the per-step losses."""
    params = [p for p in head.parameters() if p.requires_grad]
    if not params or steps <= 0:
        return []
    opt = torch.optim.AdamW(params, lr=schedule.learning_rate, weight_decay=schedule.weight_decay)
    g = torch.Generator().manual_seed(seed)
    n = feats.shape[0]
    bt = min(batch_tokens, n)
    perm, ptr = torch.randperm(n, generator=g), 0
    losses = []
    head.train()
    for step in range(steps):
        if ptr + bt > n:
            perm, ptr = torch.randperm(n, generator=g), 0
        idx = perm[ptr : ptr + bt]
        ptr += bt
        logits = exit_logits(head, adapter, feats[idx])
        loss = topk_kl(logits, topk_ids[idx].to(logits.device), topk_logprobs[idx].to(logits.device)).mean()
        take_step(opt, loss, lr_at(step, steps, schedule))
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    head.eval()
    return losses


# ---------------------------------------------------------------------------------------------------- context heads
def context_settings(m: ModelArguments) -> dict:
    """The `context` dict `EarlyExitModel.from_base` takes (hispec.drafters.heads.CONTEXT_DEFAULTS keys)."""
    out = {"window": m.context_window, "heads": m.context_heads, "head_dim": m.context_head_dim,
           "mlp_mult": m.context_mlp_mult, "frontier": int(m.context_frontier)}
    return {k: v for k, v in out.items() if v is not None}


def context_ranges(m: ModelArguments, t: TrainArguments) -> dict | None:
    """Distance ranges (inclusive) that training draws each position's frontier distance from, like decoding
    produces them (design.md §4): {"draft": (lo, hi), "verify": (lo, hi), "mid": (lo, hi) or None}; None for other
    head types. Measured in hispec's decoder: with gamma g and window N a draft sits 1..g positions past the
    verified frontier in self-spec, 1..N+g-1 in hispec (1..g past the verifier's), and the verifier's queries
    1..N+g. Defaults follow the recipe's gamma / window when it sets them, else draft 1..4, verifier 1..8 (mid
    1..4). Raises ConfigError for unusable settings."""
    ctx_fields = ("context_draft_distance", "context_verify_distance", "context_mid_distance")
    if m.head_type != "context":
        if m.context_mid or any(getattr(t, f) for f in ctx_fields):
            raise ConfigError(f"context_mid and context_*_distance apply to head_type: context, not "
                              f"{m.head_type!r}")
        return None
    for name in ("context_window", "context_heads", "context_mlp_mult"):
        v = getattr(m, name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if m.context_head_dim is not None and m.context_head_dim < 1:
        raise ConfigError(f"context_head_dim must be >= 1 (or unset: min(64, hidden / heads)), got "
                          f"{m.context_head_dim}")
    g, n = t.gamma, t.window
    if getattr(t, "decoding_given", False):
        defaults = {"draft": (1, g + n - 1), "verify": (1, g + n), "mid": (1, g)}
    else:
        defaults = {"draft": (1, 4), "verify": (1, 8), "mid": (1, 4)}
    if t.context_mid_distance and not m.context_mid:
        raise ConfigError("context_mid_distance is the draft's distance to the verifier's frontier: set "
                          "context_mid: true to use it")
    out = {}
    for key in ("draft", "verify", "mid"):
        given = getattr(t, f"context_{key}_distance")
        if not given:
            out[key] = defaults[key]
            continue
        if len(given) != 2 or not all(isinstance(x, int) for x in given) or not 1 <= given[0] <= given[1]:
            raise ConfigError(f"context_{key}_distance must be two integers LO HI with 1 <= LO <= HI (a draft is "
                              f"never verified itself: distance 1 = the newest position), got {list(given)}")
        out[key] = (int(given[0]), int(given[1]))
    if not m.context_mid:
        out["mid"] = None
    elif out["mid"][0] > out["draft"][0]:
        raise ConfigError(f"context_mid_distance starts at {out['mid'][0]}, above the draft's smallest final "
                          f"distance {out['draft'][0]}: the verifier's frontier is never behind the full model's")
    return out


# ---------------------------------------------------------------------------------------------------- module
class HeadsForTraining(torch.nn.Module):
    """The only module `accelerate.prepare` sees: both heads, features for given exit hidden states."""

    def __init__(self, heads, adapter=None):
        super().__init__()
        self.heads = heads
        self._adapter = [adapter]  # not a submodule (the frozen backbone stays outside accelerate)

    def forward(self, hidden: dict):
        # {exit: [N, H]} -> {exit: [N, H]} features for the frozen lm_head. A `layer` head gets its exit's
        # whole sequences instead, (states [B, T, H], attention mask [B, T], loss positions [B*T]), and
        # attends over them causally (a fresh cache per batch). A `context` head gets a dict (see
        # `_context_input`): whole sequences of every layer it reads and each position's frontier distance(s).
        out = {}
        for k, h in hidden.items():
            if isinstance(h, dict):
                head = self.heads[k]
                ctx = head.sequence_context(h["states"], h["distance"], h["mid_distance"], h["start"])
                feats = head(h["states"][head.context_layers[0]], context=ctx)
                out[k] = feats.reshape(-1, feats.shape[-1])[h["flat"]]
            elif isinstance(h, tuple):
                states, mask, flat = h
                head = self.heads[k]
                feats = head(states, head.run_layer_fresh(self._adapter[0], mask.long()))
                out[k] = feats.reshape(-1, feats.shape[-1])[flat]
            else:
                out[k] = self.heads[k](h)
        return out


# ---------------------------------------------------------------------------------------------------- steps
def draw_distances(n: int, rng: tuple[int, int], generator, cap=None):
    """`n` frontier distances uniform over `rng` = (lo, hi) inclusive (long, CPU); with `cap` `[n]` each is drawn
    uniformly from lo..min(hi, cap) instead (a draft's distance to the verifier's frontier never exceeds its
    distance to the full model's; `context_ranges` guarantees lo <= cap)."""
    lo, hi = rng
    if cap is None:
        return torch.randint(lo, hi + 1, (n,), generator=generator)
    top = cap.clamp(max=hi)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.minimum(lo + (u * (top - lo + 1).double()).long(), top)


def distance_sampler(ranges: dict, generator):
    """-> dist(name, n) -> (final distances [n], mid distances [n] or None) drawn like decoding produces them:
    uniform over the exit's range; for the draft head with mid, the mid distance uniform in lo..min(hi, final)."""

    def dist(name, n):
        d = draw_distances(n, ranges[name], generator)
        mid = draw_distances(n, ranges["mid"], generator, cap=d) if name == "draft" and ranges.get("mid") else None
        return d, mid

    return dist


def fixed_distances(d: int, mid: int | None = None):
    """-> dist(name, n): every position at final distance `d` (and, for the draft head, mid distance `mid`)."""
    def dist(name, n):
        full = torch.full((n,), d, dtype=torch.long)
        return full, (torch.full((n,), min(mid, d), dtype=torch.long) if mid is not None and name == "draft" else None)

    return dist


def _distance_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """Seed of one micro-batch's distance draws: fixed by (seed, optimizer step, micro-batch, process), so a resumed
    run draws exactly what an uninterrupted one did."""
    return (((seed * 1_000_003 + step) * 1009 + micro) * 101 + rank) % (1 << 62)


def _context_input(name, layers, states, mask, flat, dist, param_dtype):
    """What `HeadsForTraining.forward` hands a context head: whole sequences `{layer: [B, T, H]}` of every layer
    it reads (mask `[B, T]`, left or right padded), loss positions `flat` `[B*T]`, and per position a frontier
    distance `[B, T]` (plus a mid distance for a draft head reading the verifier exit). Distances are drawn for the
    real positions in (sequence, position) order, so the backbone-on-the-fly and the feature-cache paths draw the
    same distances for the same batch."""
    B, T = mask.shape
    d, mid = dist(name, int(mask.sum()))

    def spread(v):
        if v is None:
            return None
        out = torch.ones(B, T, dtype=torch.long, device=mask.device)
        out[mask] = v.to(mask.device)
        return out

    return {"states": {L: states[L].to(param_dtype) for L in layers}, "mask": mask, "flat": flat,
            "distance": spread(d), "mid_distance": spread(mid), "start": mask.long().argmax(1)}


def _batch_inputs(batch, adapter, exits, param_dtype, seq_heads=(), ctx_heads=None, dist=None):
    """Backbone pass -> exit states, teacher features and next-token labels of the loss tokens (valid tokens
    inside the batch's `loss_mask` when it has one), flattened; and the batch row of each. Context heads
    (`ctx_heads` {name: layers read}) get whole sequences and frontier distances from `dist` (`_context_input`)."""
    ctx_heads = ctx_heads or {}
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    pos = positions_from_mask(mask)
    layers = tuple(sorted({*exits, *(x for ls in ctx_heads.values() for x in ls)}))
    states, final = exit_states(adapter, ids, pos, mask, layers)
    flat = (mask & batch["loss_mask"].bool() if "loss_mask" in batch else mask).reshape(-1)
    hidden = {name: (_context_input(name, ctx_heads[name], states, mask, flat, dist, param_dtype)
                     if name in ctx_heads else
                     (states[layer].to(param_dtype), mask, flat) if name in seq_heads else
                     states[layer].reshape(-1, states[layer].shape[-1])[flat].to(param_dtype))
              for name, layer in zip(("draft", "verify"), exits)}
    teacher = final.reshape(-1, final.shape[-1])[flat]
    labels = next_token_labels(ids, mask).reshape(-1)[flat]
    row = _row_index(mask)[flat]
    return hidden, teacher, labels, row


def _left_padded(flat_states, offsets, sel):
    """Concatenated sequences `[N, H]` (boundaries `offsets` [B + 1]) -> left-padded `[B, T, H]`, attention mask
    `[B, T]` and the flat index `[B * T]` of the positions in `sel` [N], in the same (sequence, position) order as
    `flat_states[sel]` -- the whole-sequence input a `layer` head takes (`HeadsForTraining.forward`)."""
    lengths = offsets[1:] - offsets[:-1]
    B, T = lengths.numel(), int(lengths.max())
    row = torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths)
    col = torch.arange(flat_states.shape[0], device=lengths.device) - offsets[:-1][row] + (T - lengths)[row]
    states = flat_states.new_zeros(B, T, flat_states.shape[-1])
    states[row, col] = flat_states
    mask = torch.zeros(B, T, dtype=torch.bool, device=lengths.device)
    mask[row, col] = True
    flat = torch.zeros(B, T, dtype=torch.bool, device=lengths.device)
    flat[row, col] = sel
    return states, mask, flat.reshape(-1)


def _cached_inputs(batch, exits, param_dtype, seq_heads=(), ctx_heads=None, dist=None):
    """A `train.features.CachedCollator` batch -> loss-token exit states, teacher top-k ids / log-probs, labels and
    the batch row of each token. A `layer` head (named in `seq_heads`) gets its exit's whole sequences rebuilt from
    the cache's offsets instead (see `_left_padded`): the cache stores every position, not only the loss ones; a
    context head (`ctx_heads`) those of every layer it reads, with frontier distances (`_context_input`)."""
    ctx_heads = ctx_heads or {}
    sel = batch["loss_mask"].bool()

    def context(name):
        states, mask, flat = {}, None, None
        for L in ctx_heads[name]:
            if f"hidden.{L}" not in batch:
                raise FeatureCacheError(f"the feature cache batch has no hidden.{L}, which the {name} context head "
                                        "reads; build the cache with that layer")
            states[L], mask, flat = _left_padded(batch[f"hidden.{L}"], batch["offsets"], sel)
        return _context_input(name, ctx_heads[name], states, mask, flat, dist, param_dtype)

    hidden = {name: (context(name) if name in ctx_heads else
                     _left_padded(batch[f"hidden.{layer}"].to(param_dtype), batch["offsets"], sel)
                     if name in seq_heads else batch[f"hidden.{layer}"][sel].to(param_dtype))
              for name, layer in zip(("draft", "verify"), exits)}
    return (hidden, batch["teacher_topk_ids"][sel], batch["teacher_topk_logprobs"][sel], batch["labels"][sel],
            batch["row"][sel])


def _loss_fn(adapter, exits, t: TrainArguments, param_dtype, cached: bool):
    """-> f(batch, heads, pairs=(), per_token=False, dist=None, topk_agree=0) -> (DistillOutput, row of each token,
    batch size): the backbone-on-the-fly loss (`distill_loss`) or the feature-cache loss (`topk_distill_loss`).
    `dist(name, n)` gives context heads their frontier distances (`distance_sampler`, `fixed_distances`)."""
    project = _project_fn(adapter, parse_dtype(t.loss_dtype))
    chunk = t.loss_chunk_size or None

    def on_the_fly(batch, heads, pairs=(), per_token=False, dist=None, topk_agree=0):
        hidden, teacher, labels, row = _batch_inputs(batch, adapter, exits, param_dtype, _seq_heads(heads),
                                                     _ctx_heads(heads, dist), dist)
        out = distill_loss(project, teacher, heads(hidden), labels, temperature=t.temperature, ce_weight=t.ce_weight,
                           chunk_size=chunk, vocab_size=adapter.vocab_size, pairs=pairs, per_token=per_token,
                           topk_agree=topk_agree)
        return out, row, batch["input_ids"].shape[0]

    def from_cache(batch, heads, pairs=(), per_token=False, dist=None, topk_agree=0):
        hidden, ids, logp, labels, row = _cached_inputs(batch, exits, param_dtype, _seq_heads(heads),
                                                        _ctx_heads(heads, dist), dist)
        proj, size = project, adapter.vocab_size
        vocab = _training_vocab(heads)
        if vocab is not None:
            proj, ids, logp, labels = narrow_to_vocab(project_sub, vocab, adapter.vocab_size, ids, logp, labels)
            size = vocab.numel() + 1
        out = topk_distill_loss(proj, heads(hidden), ids, logp, labels, ce_weight=t.ce_weight, chunk_size=chunk,
                                vocab_size=size, pairs=pairs, per_token=per_token, topk_agree=topk_agree)
        return out, row, batch["offsets"].shape[0] - 1

    def project_sub(features, vocab):
        return project(features, vocab)

    if not cached:
        def checked(batch, heads, *a, **k):
            if _training_vocab(heads) is not None:
                raise ValueError("heads with a training vocabulary (train_vocab_size) need the feature-cache loss")
            return on_the_fly(batch, heads, *a, **k)

        return checked
    return from_cache


OUTSIDE_LOGIT = -1.0e4  # the extra column standing for every token outside a training vocabulary: never likely


def _training_vocab(heads) -> torch.Tensor | None:
    """The vocabulary both heads are restricted to (`train_vocab_size`), or None; heads with different ones are
    refused (the loss projects every head through one narrowed lm_head)."""
    inner = getattr(heads, "module", heads).heads
    vocabs = [inner[k].vocab for k in ("draft", "verify")]
    if all(v is None for v in vocabs):
        return None
    if any(v is None for v in vocabs) or not torch.equal(vocabs[0], vocabs[1]):
        raise ValueError("both heads must share one training vocabulary (train_vocab_size) or have none")
    return vocabs[0]


def narrow_to_vocab(project_sub, vocab: torch.Tensor, vocab_size: int, ids, logp, labels):
    """The top-k + bucket loss over a head vocabulary of K ids (sorted) instead of all V tokens: -> (project
    `[n, H] -> [n, K + 1]` logits over the K ids plus one column at OUTSIDE_LOGIT, ids remapped into 0..K (K: outside),
    logp with the outside entries at OUTSIDE_LOGIT so that their mass joins the bucket, labels outside -> ignored).

    The student is then the softmax over the K ids (what a head with that vocabulary proposes from), the teacher
    keeps its k tokens inside the set and one bucket for the rest of its mass (outside tokens included): the same
    grouped KL as `topk_kl`, against the distribution a restricted head can represent. The outside column is never
    a student token (probability e^-1e4) and carries no gradient (its teacher probability is 0)."""
    K = vocab.numel()
    lookup = torch.full((vocab_size,), K, dtype=torch.long, device=ids.device)
    lookup[vocab.to(ids.device)] = torch.arange(K, device=ids.device)
    ids = lookup[ids]
    logp = logp.masked_fill(ids == K, OUTSIDE_LOGIT)
    keep = labels != IGNORE_INDEX
    mapped = lookup[labels.clamp(min=0)]
    labels = torch.where(keep & (mapped < K), mapped, torch.full_like(labels, IGNORE_INDEX))
    sub = vocab.to(ids.device)

    def project(features):
        s = project_sub(features, sub)
        return torch.cat([s, s.new_full((*s.shape[:-1], 1), OUTSIDE_LOGIT)], -1)

    return project, ids, logp, labels


def _seq_heads(heads) -> tuple[str, ...]:
    """Names of the heads that attend over whole sequences (`layer` heads) in a (DDP-)wrapped HeadsForTraining."""
    inner = getattr(heads, "module", heads).heads
    return tuple(k for k, h in inner.items() if getattr(h, "stateful", False))


def _ctx_heads(heads, dist=None) -> dict[str, list[int]]:
    """Names of the `context` heads -> the layers each reads, in a (DDP-)wrapped HeadsForTraining."""
    inner = getattr(heads, "module", heads).heads
    out = {k: list(h.context_layers) for k, h in inner.items() if getattr(h, "needs_context", False)}
    if out and dist is None:
        raise ValueError("context heads need frontier distances: pass dist=distance_sampler(...) or "
                         "fixed_distances(d)")
    return out


def _row_index(mask):
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask).reshape(-1)


def _project_fn(adapter, dtype=None):
    """The frozen lm_head as a function of features. With a `dtype` other than the backbone's, a copy of the output
    layers in that dtype runs the same `DecoderAdapter.project` code (the loss's softmax stays fp32)."""
    if dtype is None or dtype == adapter.dtype:
        def project(features, vocab=None):
            return adapter.project(features.to(adapter.dtype), vocab)

        return project

    parts = adapter.parts
    shim = copy.copy(adapter)
    shim.parts = dataclasses.replace(
        parts, lm_head=copy.deepcopy(parts.lm_head).to(dtype),
        project_out=None if parts.project_out is None else copy.deepcopy(parts.project_out).to(dtype))

    def project_cast(features, vocab=None):
        return shim.project(features.to(dtype), vocab)

    return project_cast


def _eval_pass(accelerator, heads, loss_fn, eval_dl, dist=None) -> dict:
    """One pass over the held-out loss tokens: per exit top-1 / top-5 agreement with the final layer's argmax and
    KL, the draft-verify top-1 agreement, the token count (summed over processes)."""
    totals = torch.zeros(8, dtype=torch.float64)  # top1 d/v, draft_verify, top5 d/v, kl d/v, tokens
    for batch in eval_dl:
        out, row, B = loss_fn(batch, heads, pairs=(("draft", "verify"),), per_token=True, dist=dist, topk_agree=5)
        cols = [out.agree_tokens["draft"], out.agree_tokens["verify"], out.agree_tokens["draft_verify"],
                out.topk_tokens["draft"], out.topk_tokens["verify"], out.kl_tokens["draft"], out.kl_tokens["verify"],
                torch.ones_like(out.kl_tokens["draft"])]
        per_row = torch.zeros(B, totals.numel(), dtype=torch.float64, device=row.device)
        for j, v in enumerate(cols):
            per_row[:, j].index_add_(0, row, v.double())
        totals += accelerator.gather_for_metrics(per_row).sum(0).cpu()
    n = max(totals[-1].item(), 1.0)
    res = {k: {"top1_agreement": totals[j].item() / n, "top5_agreement": totals[3 + j].item() / n,
               "kl": totals[5 + j].item() / n} for j, k in enumerate(("draft", "verify"))}
    res["draft_verify"] = totals[2].item() / n
    res["tokens"] = int(totals[-1].item())
    return res


def evaluate(accelerator, heads, adapter, eval_dl, exits, t: TrainArguments, param_dtype,
             cached: bool = False, ranges: dict | None = None, by_distance: bool = False) -> dict:
    """Per exit top-1 / top-5 agreement with the final layer's argmax, KL, and expected tokens per round on
    held-out loss tokens (from the feature cache when `cached`: there the KL is the top-k + bucket KL).

    Context heads (`ranges` from `context_ranges`): the headline numbers are at frontier distances drawn as in
    training (a fixed seed, so every evaluation sees the same draws); with `by_distance` also at every distance d in
    EVAL_DISTANCES for all positions (`<exit>.by_distance[d]`), and for a draft head reading the verifier exit at
    mid distance 1 (`draft.by_distance_mid1[d]`: hispec right after the verifier passed the previous token)."""
    loss_fn = _loss_fn(adapter, exits, t, param_dtype, cached)
    dist = None
    if ranges:
        gen = torch.Generator().manual_seed(_distance_seed(t.seed + 1, 0, 0, accelerator.process_index))
        dist = distance_sampler(ranges, gen)
    heads.eval()
    with torch.no_grad():
        main = _eval_pass(accelerator, heads, loss_fn, eval_dl, dist)
        extra = {}
        if ranges and by_distance:
            for d in EVAL_DISTANCES:
                extra[("by_distance", d)] = _eval_pass(accelerator, heads, loss_fn, eval_dl, fixed_distances(d))
                if ranges.get("mid"):
                    extra[("by_distance_mid1", d)] = _eval_pass(accelerator, heads, loss_fn, eval_dl,
                                                                fixed_distances(d, mid=1))
    heads.train()
    result = {"eval_tokens": main["tokens"], "gamma": t.gamma,
              "teacher": "feature cache: top-k + bucket" if cached else "full distribution"}
    inner = getattr(heads, "module", heads).heads
    for j, k in enumerate(("draft", "verify")):
        alpha = main[k]["top1_agreement"]
        result[k] = {**main[k], "expected_tokens_per_round": expected_tokens_per_round(alpha, t.gamma),
                     "layer": exits[j], "head_type": inner[k].head_type, "vocab_size": inner[k].vocab_size}
    result["draft_verify"] = {"top1_agreement": main["draft_verify"],
                              "expected_tokens_per_round": expected_tokens_per_round(main["draft_verify"], t.gamma)}
    if ranges:
        result["context"] = {"ranges": {k: list(v) if v else None for k, v in ranges.items()},
                             "eval_distances": list(EVAL_DISTANCES) if by_distance else []}
    for (kind, d), res in extra.items():
        for k in ("draft", "verify") if kind == "by_distance" else ("draft",):
            result[k].setdefault(kind, {})[str(d)] = res[k]
    return result


def format_agreement(res: dict) -> str:
    """A final evaluation as a small table: per exit top-1 / top-5 agreement; context heads per frontier distance."""
    lines = []
    for k in ("draft", "verify"):
        r = res[k]
        head = f"{k:<6} L{r['layer']:<3} {r.get('head_type', '?'):<8}"
        lines.append(f"{head} top-1 {r['top1_agreement']:.3f}  top-5 {r['top5_agreement']:.3f}  KL {r['kl']:.3f}"
                     + ("  (distances drawn as in training)" if "by_distance" in r else ""))
        for kind in ("by_distance", "by_distance_mid1"):
            if kind in r:
                cells = "  ".join(f"d={d} {v['top1_agreement']:.3f}/{v['top5_agreement']:.3f}"
                                  for d, v in r[kind].items())
                lines.append(f"{'':<19}top-1/top-5 {'' if kind == 'by_distance' else 'mid 1 '}{cells}")
    lines.append(f"draft-verify top-1 {res['draft_verify']['top1_agreement']:.3f}; {res['eval_tokens']} held-out "
                 "tokens")
    return "\n".join(lines)
