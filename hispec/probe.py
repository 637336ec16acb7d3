"""Choosing exits from evidence: held-out agreement of exit heads with the final layer, by layer and head type.

The probe's own part is which exits and head types to try and how its results read (tables, plots); everything
else is the distillation core's (`hispec.distill`): data items, chat rendering and held-out splits (`items`),
greedy answers and their cache (`answers`), the frozen pass and the teacher's top-k at the scored positions
(`features.scored_features`), the top-k + bucket KL and the in-memory head training step and schedule
(`training.fit_head`), agreement and tokens per full pass (`metrics`), reduced draft vocabularies
(`hispec.vocab.select_vocab`).

- `run_probe(adapter, features, config)`: at each probed layer a head of each type: `shared` is the model's own
  final norm + lm_head, untrained; other `hispec.drafters.heads.ExitHead` types are trained by `fit_head` (AdamW,
  `batch_tokens` positions a step, warm-up over 5% of the steps then cosine decay to 10% of `lr`). Held out:
  top-1 / top-5 agreement with the final layer's argmax, the bucketed KL, E[tokens per full pass] of greedy
  self-speculation with gamma drafts measured on each answer's agree/disagree sequence (and for i.i.d.
  acceptance), top-1 by category, with reduced draft vocabularies (the K most frequent training answer tokens)
  the restricted top-1 and the set's coverage of teacher argmaxes, and optionally agreement vs training tokens.
  Deterministic given the seed; returns a `ProbeResult` that `format_table` and `plot` present.
- `evaluate_exit_heads(model, sequences, gamma=...)` (`hispec-probe --eval-heads`): an `EarlyExitModel`'s own draft
  and verifier heads (any head type, reduced vocabularies honoured) on held-out answers: top-1 / top-5, tokens per
  full pass, the verifier-vs-draft figures (`metrics.hierarchy_figures`), overall and per category, as the JSON
  dict that `format_eval_table` presents. Nothing here prints; progress bars go to stderr through tqdm.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .distill.args import TrainArguments
from .distill.features import Features
from .distill.items import seeded_hash
from .distill.metrics import (
    EXIT_NAMES, exit_head_predictions, expected_tokens_per_round, head_agreement, hierarchy_figures, mean,
    tokens_per_pass,
)
from .distill.training import exit_logits, fit_head
from .drafters.heads import STATELESS_HEAD_TYPES as HEAD_TYPES
from .drafters.heads import ExitHead
from .vocab import coverage, select_vocab

DEFAULT_HEAD_TYPES = ("shared", "norm", "linear")
DEFAULT_TOP_K = 64


class ProbeError(ValueError):
    """Bad input for the probe (layers, head types, data); the message says what and how to fix it."""


# ---------------------------------------------------------------------------------------------------- what to try
def parse_layers(spec: str | None, depth: int) -> list[int]:
    """'2,4,6', '2-28:2', '2-8' or a mix ('1,4-12:4') -> sorted unique layers, each in 1..depth-1; none: every
    second layer 2, 4, ... below the depth (layer 1 for a 2-layer model)."""
    if spec is None or not str(spec).strip():
        return list(range(2, depth, 2)) or [1]
    layers: set[int] = set()
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        m = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+)(?::(\d+))?)?", part)
        if not m:
            raise ProbeError(f"cannot read layer spec {part!r}; use e.g. '2,4,6' or '2-28:2'")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        step = int(m.group(3)) if m.group(3) is not None else 1
        if step < 1 or b < a:
            raise ProbeError(f"layer range {part!r} is empty; use start-end[:step] with start <= end, step >= 1")
        layers.update(range(a, b + 1, step))
    if not layers:
        raise ProbeError("no layers given")
    bad = sorted(x for x in layers if not 1 <= x < depth)
    if bad:
        raise ProbeError(f"layers {bad} are out of range for a {depth}-layer model; choose exits in 1..{depth - 1} "
                         "(the final layer is the teacher)")
    return sorted(layers)


def parse_head_types(spec: str | list[str]) -> list[str]:
    names = [x for x in ((y.strip() for y in spec.split(",")) if isinstance(spec, str) else spec) if x]
    if not names:
        raise ProbeError("no head types given")
    if "layer" in names:
        raise ProbeError("'layer' heads attend over whole sequences and are not probed layer by layer; train them "
                         "with train/heads.py --head_type layer (from a feature cache) and measure the checkpoint "
                         "with hispec-probe --eval-heads")
    unknown = [x for x in names if x not in HEAD_TYPES]
    if unknown:
        raise ProbeError(f"unknown head type(s) {unknown}; choose from {', '.join(HEAD_TYPES)}")
    return list(dict.fromkeys(names))


def make_head(head_type: str, adapter, rank: int = 64, seed: int = 0) -> ExitHead:
    """An ExitHead on the adapter's device; trainable types in fp32 (the backbone may be bf16)."""
    torch.manual_seed(seed)
    head = ExitHead(head_type, adapter.final_norm, adapter.hidden_size, rank=rank)
    return head if head_type == "shared" else head.to(device=adapter.device, dtype=torch.float32)


def _seed_for(seed: int, *parts) -> int:
    return int(seeded_hash(seed, *parts)[:8], 16)


def schedule(steps: int, lr: float) -> TrainArguments:
    """The probe's schedule in the core's terms (`fit_head`): warm-up over 5% of the steps, cosine decay to 10%
    of `lr`."""
    return TrainArguments(learning_rate=lr, warmup_steps=max(1, steps // 20), lr_scheduler_type="cosine",
                          min_lr_ratio=0.1)


# ---------------------------------------------------------------------------------------------------- run
@dataclass
class ProbeConfig:
    layers: list[int]
    head_types: list[str] = field(default_factory=lambda: list(DEFAULT_HEAD_TYPES))
    steps: int = 200
    lr: float = 2e-3
    batch_tokens: int = 512
    rank: int = 64
    top_k: int = DEFAULT_TOP_K
    gamma: int = 4
    draft_vocab_sizes: list[int] = field(default_factory=list)
    train_sizes: list[int] = field(default_factory=list)
    train_size_layers: list[int] | None = None  # None: all layers
    seed: int = 0
    feature_dtype: torch.dtype = torch.bfloat16
    feature_batch_tokens: int = 4096


@dataclass
class ProbeResult:
    config: ProbeConfig
    model: dict
    layers: list[int]
    head_types: list[str]
    grids: dict[str, list[list[float | None]]]  # name -> [layer][head type]: GRIDS
    categories: dict[str, dict]  # cat -> {"tokens": n, "top1": [layer][head], "tokens_per_pass": [layer][head]}
    draft_vocab: dict | None
    train_curve: dict | None
    sizes: dict
    seconds: dict
    loss_curves: dict = field(default_factory=dict)

    @property
    def top1(self) -> list[list[float | None]]:
        return self.grids["top1"]

    @property
    def top5(self) -> list[list[float | None]]:
        return self.grids["top5"]

    @property
    def tokens_per_pass(self) -> list[list[float | None]]:
        return self.grids["tokens_per_pass"]

    @property
    def best_head_type(self) -> str:
        def score(j):
            vals = [row[j] for row in self.top1 if row[j] is not None]
            return sum(vals) / len(vals) if vals else -1.0

        return self.head_types[max(range(len(self.head_types)), key=score)]

    def as_dict(self, full: bool = False) -> dict:
        c, best = self.config, self.best_head_type
        col = [row[self.head_types.index(best)] for row in self.top1]
        g = self.grids
        d = {"model": self.model, "layers": self.layers, "head_types": self.head_types, "top1": g["top1"],
             "top5": g["top5"], "tokens_per_pass": g["tokens_per_pass"], "iid_tokens_per_pass": g["iid"],
             "heldout_kl": g["kl"], "train_loss_first": g["loss_first"], "train_loss_last": g["loss_last"],
             "gamma": c.gamma, "best_head_type": best, "best_layer_top1": {str(x): v for x, v in zip(self.layers, col)},
             "categories": self.categories, "draft_vocab": self.draft_vocab, "train_sizes": self.train_curve,
             "sizes": self.sizes,
             "config": {"steps": c.steps, "lr": c.lr, "batch_tokens": c.batch_tokens, "rank": c.rank,
                        "top_k": c.top_k, "seed": c.seed, "feature_dtype": str(c.feature_dtype).replace("torch.", "")},
             "seconds": self.seconds}
        return rounded({**d, "loss_curves": self.loss_curves} if full else d)


GRIDS = ("top1", "top5", "tokens_per_pass", "iid", "kl", "loss_first", "loss_last")


def rounded(x, nd: int = 5):
    """Floats in nested lists / dicts rounded for JSON."""
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, list):
        return [rounded(v, nd) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v, nd) for k, v in x.items()}
    return x


def run_probe(adapter, features: Features, config: ProbeConfig, *, model_info: dict | None = None,
              sizes: dict | None = None, seconds: dict | None = None, progress: bool = False) -> ProbeResult:
    """Train (where needed) and evaluate every head type at every layer on precomputed `features`."""
    t0 = time.perf_counter()
    f, lay = features, features.layout
    tr, ev = (~lay.held_out).nonzero().squeeze(-1), lay.held_out.nonzero().squeeze(-1)
    trainable = [h for h in config.head_types if h != "shared"]
    if trainable and tr.numel() == 0:
        raise ProbeError("no training positions: trainable head types need training data")
    if ev.numel() == 0:
        raise ProbeError("no held-out positions to evaluate on")
    ev_ids, ev_logp, ev_seg, ev_cat = f.t_ids[ev], f.t_logp[ev], lay.segment[ev], lay.category[ev]
    L, Hn, V = len(config.layers), len(config.head_types), adapter.vocab_size

    def grid():
        return [[None] * Hn for _ in range(L)]

    vocab_masks, draft_vocab = {}, None
    if config.draft_vocab_sizes:
        counts = torch.bincount(lay.next_token[tr], minlength=V)[:V]
        draft_vocab = {"sizes": list(config.draft_vocab_sizes), "coverage": [], "top1": {},
                       "counted_tokens": int(tr.numel())}
        for k in config.draft_vocab_sizes:
            ids = select_vocab(k, V, counts)
            vocab_masks[k] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
            draft_vocab["coverage"].append(coverage(ids, f.t_top[ev]))
            draft_vocab["top1"][str(k)] = grid()
    g = {name: grid() for name in GRIDS}
    cats = {c: {"tokens": int((ev_cat == i).sum()), "top1": grid(), "tokens_per_pass": grid()}
            for i, c in enumerate(lay.categories) if int((ev_cat == i).sum()) > 0}
    curves, t_train, t_eval = {}, 0.0, 0.0
    bar = tqdm(total=config.steps * len(trainable) * L + L * Hn, desc="heads", unit="step", disable=not progress,
               dynamic_ncols=True)
    for li, layer in enumerate(config.layers):
        feats = f.hidden[layer]
        for hj, ht in enumerate(config.head_types):
            head = make_head(ht, adapter, config.rank, seed=_seed_for(config.seed, "init", layer, ht))
            ta = time.perf_counter()
            if ht != "shared":
                bar.set_description(f"train L{layer} {ht}")
                losses = fit_head(head, adapter, feats[tr], f.t_ids[tr], f.t_logp[tr], steps=config.steps,
                                  schedule=schedule(config.steps, config.lr), batch_tokens=config.batch_tokens,
                                  seed=_seed_for(config.seed, "batches", layer, ht), on_step=lambda *_: bar.update(1))
                curves[f"L{layer}/{ht}"] = losses
                if losses:
                    k = max(1, min(10, len(losses) // 10))
                    g["loss_first"][li][hj], g["loss_last"][li][hj] = sum(losses[:k]) / k, sum(losses[-k:]) / k
            tb = time.perf_counter()
            bar.set_description(f"eval L{layer} {ht}")
            res = head_agreement(lambda x, h=head: exit_logits(h, adapter, x), feats[ev], ev_ids, ev_logp,
                                 vocab_masks=vocab_masks)
            t_train, t_eval = t_train + tb - ta, t_eval + time.perf_counter() - tb
            bar.update(1)
            a1 = res["agree1"]
            g["top1"][li][hj], g["top5"][li][hj], g["kl"][li][hj] = mean(a1), mean(res["agree5"]), mean(res["kl"])
            g["tokens_per_pass"][li][hj] = tokens_per_pass(a1, ev_seg, config.gamma)
            g["iid"][li][hj] = expected_tokens_per_round(g["top1"][li][hj], config.gamma)
            for ci, c in enumerate(lay.categories):
                if c in cats:
                    sel = ev_cat == ci
                    cats[c]["top1"][li][hj] = mean(a1[sel])
                    cats[c]["tokens_per_pass"][li][hj] = tokens_per_pass(a1[sel], ev_seg[sel], config.gamma)
            for k in vocab_masks:
                draft_vocab["top1"][str(k)][li][hj] = mean(res[f"agree_v{k}"])
    bar.close()
    curve = _train_size_curve(adapter, f, tr, ev, config, trainable, progress) if config.train_sizes else None
    secs = {**(seconds or {}), "train": round(t_train, 2), "eval": round(t_eval, 2)}
    if curve is not None:
        secs["train_sizes"] = curve.pop("_seconds")
    secs["probe"] = round(time.perf_counter() - t0, 2)
    return ProbeResult(config=config, model=model_info or {}, layers=list(config.layers),
                       head_types=list(config.head_types), grids=g, categories=cats, draft_vocab=draft_vocab,
                       train_curve=curve, sizes=dict(sizes or {}), seconds=secs, loss_curves=curves)


def training_subset(features: Features, train_idx: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The first `size` training positions taken whole answer by answer in a seeded order of sequences."""
    seqs = features.layout.sequence[train_idx]
    uniq = torch.unique(seqs)
    order = uniq[torch.randperm(uniq.numel(), generator=torch.Generator().manual_seed(seed))]
    picked, n = [], 0
    for s in order.tolist():
        picked.append(train_idx[seqs == s])
        n += picked[-1].numel()
        if n >= size:
            break
    return torch.cat(picked)[:size] if picked else train_idx[:0]


def _train_size_curve(adapter, f: Features, tr, ev, config: ProbeConfig, trainable: list[str], progress: bool):
    t0 = time.perf_counter()
    layers, sizes = config.train_size_layers or config.layers, sorted(set(config.train_sizes))
    curve = {"sizes": sizes, "used_tokens": [min(s, int(tr.numel())) for s in sizes], "layers": list(layers),
             "head_types": trainable, "top1": {}}
    bar = tqdm(total=len(sizes) * len(layers) * len(trainable) * config.steps, desc="train-size curve", unit="step",
               disable=not progress or not trainable, dynamic_ncols=True)
    for ht in trainable:
        curve["top1"][ht] = rows = []  # [layer][size]
        for layer in layers:
            rows.append([])
            for size in sizes:
                sub = training_subset(f, tr, size, _seed_for(config.seed, "subset"))
                head = make_head(ht, adapter, config.rank, seed=_seed_for(config.seed, "init", layer, ht))
                fit_head(head, adapter, f.hidden[layer][sub], f.t_ids[sub], f.t_logp[sub], steps=config.steps,
                         schedule=schedule(config.steps, config.lr), batch_tokens=config.batch_tokens,
                         seed=_seed_for(config.seed, "batches", layer, ht, size), on_step=lambda *_: bar.update(1))
                res = head_agreement(lambda x, h=head: exit_logits(h, adapter, x), f.hidden[layer][ev], f.t_ids[ev],
                                     f.t_logp[ev])
                rows[-1].append(mean(res["agree1"]))
    bar.close()
    curve["_seconds"] = round(time.perf_counter() - t0, 2)
    return curve


# ---------------------------------------------------------------------------------------------------- checkpoint heads
def evaluate_exit_heads(model, sequences, *, gamma: int, batch_tokens: int = 4096, model_info: dict | None = None,
                        sizes: dict | None = None, seconds: dict | None = None, config: dict | None = None) -> dict:
    """Held-out top-1 / top-5 agreement with the final layer's argmax, E[tokens per full pass] for `gamma` drafts
    and the hierarchy figures of an `EarlyExitModel`'s own heads, overall and per category, on every scored
    position of `sequences`: the JSON dict ("mode": "eval-heads"; lists aligned with "exits")."""
    t0 = time.perf_counter()
    if not sequences or not any(s.n_scored for s in sequences):
        raise ProbeError("no held-out positions to evaluate on")
    # context heads: top-1 / top-5 at frontier distance 1; tokens per pass with the k-th draft of a round at k
    pred = exit_head_predictions(model, sequences, batch_tokens=batch_tokens, distances=tuple(range(1, gamma + 1)))
    final, lay = pred["final"], pred["layout"]
    heads = [model.heads[name] for name in EXIT_NAMES]
    agree = {name: pred[f"{name}_top1"] == final for name in EXIT_NAMES}
    by_d = {name: torch.stack([t1 == final for t1, _ in pred[f"{name}_by_distance"].values()], 1)
            for name in EXIT_NAMES}  # [N, D]: D = gamma for context heads, else 1
    top1 = [mean(agree[x]) for x in EXIT_NAMES]
    out = {"mode": "eval-heads", "model": model_info or {}, "exits": list(EXIT_NAMES),
           "layers": [int(getattr(model, f"{name}_layer")) for name in EXIT_NAMES],
           "head_types": [h.head_type for h in heads],
           "vocab_sizes": [h.vocab_size or model.adapter.vocab_size for h in heads],
           "reduced_vocab": [h.vocab is not None for h in heads],
           "vocab_coverage": [coverage(h.vocab.cpu(), final) if h.vocab is not None else 1.0 for h in heads],
           "top1": top1, "top5": [mean(pred[f"{x}_top5"]) for x in EXIT_NAMES],
           "tokens_per_pass": [tokens_per_pass(by_d[x], lay.segment, gamma) for x in EXIT_NAMES],
           "top1_by_distance": {x: {str(d): mean(t1 == final) for d, (t1, _) in pred[f"{x}_by_distance"].items()}
                                for x in EXIT_NAMES if heads[EXIT_NAMES.index(x)].needs_context},
           "iid_tokens_per_pass": [expected_tokens_per_round(a, gamma) for a in top1],
           "gamma": gamma, **hierarchy_figures(pred), "categories": {}}
    for ci, c in enumerate(lay.categories):
        sel = lay.category == ci
        if bool(sel.any()):
            out["categories"][c] = {
                "tokens": int(sel.sum()), "top1": [mean(agree[x][sel]) for x in EXIT_NAMES],
                "top5": [mean(pred[f"{x}_top5"][sel]) for x in EXIT_NAMES],
                "tokens_per_pass": [tokens_per_pass(by_d[x][sel], lay.segment[sel], gamma) for x in EXIT_NAMES],
                **hierarchy_figures(pred, sel)}
    out.update(sizes=dict(sizes or {}), config=dict(config or {}),
               seconds={**(seconds or {}), "eval": round(time.perf_counter() - t0, 2)})
    return out


# ---------------------------------------------------------------------------------------------------- output
def _f(v, fmt="{:.3f}", none="-"):
    return none if v is None else fmt.format(v)


def format_eval_table(r: dict) -> str:
    """Fixed-width text: one row per exit head (layer, head type, vocabulary, top-1, top-5, tokens per full pass),
    the verifier-vs-draft figures, then the same by category."""
    s, m = r["sizes"], r["model"]
    lines = [
        f"checkpoint {m.get('name', '?')} ({m.get('num_layers', '?')} layers, {m.get('dtype', '?')}); held-out "
        f"{s.get('eval_items', 0)} items / {s.get('eval_sequences', 0)} sequences / {s.get('eval_tokens', 0):,} "
        f"scored tokens",
        f"held-out agreement of the checkpoint's heads with the final layer's argmax: top-1, top-5, E[tokens per "
        f"full pass] for gamma={r['gamma']}", "",
        f"{'exit':<8}{'layer':>6}  {'head type':<10}{'vocab':>8}{'top1':>8}{'top5':>8}{'tok/pass':>10}"]
    for i, name in enumerate(r["exits"]):
        vocab = f"{r['vocab_sizes'][i]:,}" + ("*" if r["reduced_vocab"][i] else "")
        lines.append(f"{name:<8}{r['layers'][i]:>6}  {r['head_types'][i]:<10}{vocab:>8}{_f(r['top1'][i]):>8}"
                     f"{_f(r['top5'][i]):>8}{_f(r['tokens_per_pass'][i], '{:.2f}'):>10}")
    if any(r["reduced_vocab"]):
        lines.append("* reduced vocabulary; final-layer argmax inside it: " + ", ".join(
            f"{name} {_f(c)}" for name, c, red in zip(r["exits"], r["vocab_coverage"], r["reduced_vocab"]) if red))
    lines += ["", f"verifier exit agrees with the draft on {_f(r['verify_agrees_draft'])} of draft tokens; the final "
              f"layer agrees with {_f(r['final_agrees_given_verify_agrees'])} of those; the verifier passes "
              f"{_f(r['verify_agrees_given_final_agrees'])} of the drafts the final layer accepts"]
    if r["categories"]:
        lines += ["", "by category", f"{'category':<16}{'tokens':>7}{'draft top1':>12}{'verify top1':>13}"
                  f"{'draft t/p':>11}{'verify t/p':>12}{'verify=draft':>14}"]
        for c, d in sorted(r["categories"].items()):
            lines.append(f"{c[:15]:<16}{d['tokens']:>7}{_f(d['top1'][0]):>12}{_f(d['top1'][1]):>13}"
                         f"{_f(d['tokens_per_pass'][0], '{:.2f}'):>11}{_f(d['tokens_per_pass'][1], '{:.2f}'):>12}"
                         f"{_f(d['verify_agrees_draft']):>14}")
    return "\n".join(lines)


def format_table(r: ProbeResult) -> str:
    """Fixed-width text: per layer and head type top-1 / top-5 agreement and tokens per full pass; then top-1 by
    category for the best head type, reduced-vocabulary agreement and the training-size curve when asked."""
    s, m, c = r.sizes, r.model, r.config
    lines = [
        f"model {m.get('name', '?')} ({m.get('num_layers', '?')} layers, {m.get('dtype', '?')}); train "
        f"{s.get('train_sequences', 0)} sequences / {s.get('train_tokens', 0):,} scored tokens, held-out "
        f"{s.get('eval_sequences', 0)} / {s.get('eval_tokens', 0):,}; {c.steps} steps x {c.batch_tokens} tokens, "
        f"seed {c.seed}",
        f"held-out agreement with the final layer's argmax: top-1, top-5, E[tokens per full pass] for gamma={c.gamma}",
        "", f"{'layer':>5}  " + "".join(f"{h:>22}" for h in r.head_types),
        f"{'':>5}  " + "".join(f"{'top1  top5 tok/pass':>22}" for _ in r.head_types)]
    for i, layer in enumerate(r.layers):
        lines.append(f"{layer:>5}  " + "".join(
            f"{_f(r.top1[i][j]):>6}{_f(r.top5[i][j]):>6}{_f(r.tokens_per_pass[i][j], '{:.2f}'):>9}".rjust(22)
            for j in range(len(r.head_types))))
    best = r.best_head_type
    j = r.head_types.index(best)
    if r.categories:
        lines += ["", f"top-1 agreement by category ({best} heads), by exit layer",
                  f"{'category':<16}{'tokens':>7}  " + "".join(f"{'L' + str(x):>7}" for x in r.layers)]
        for cat, d in sorted(r.categories.items()):
            lines.append(f"{cat[:15]:<16}{d['tokens']:>7}  " + "".join(f"{_f(d['top1'][i][j]):>7}"
                                                                       for i in range(len(r.layers))))
    if r.draft_vocab:
        dv, heads = r.draft_vocab, r.head_types
        lines += ["", "top-1 agreement with the draft argmax restricted to the K most frequent training answer tokens",
                  "coverage (held-out teacher argmax inside the set): " + ", ".join(
                      f"K={k}: {_f(c)}" for k, c in zip(dv["sizes"], dv["coverage"])),
                  f"{'layer':>5}  " + "".join(f"{h + ' K=' + str(k):>{max(16, len(h) + 10)}}" for k in dv["sizes"]
                                              for h in heads)]
        for i, layer in enumerate(r.layers):
            lines.append(f"{layer:>5}  " + "".join(f"{_f(dv['top1'][str(k)][i][jj]):>{max(16, len(h) + 10)}}"
                                                   for k in dv["sizes"] for jj, h in enumerate(heads)))
    if r.train_curve and r.train_curve["head_types"]:
        tc = r.train_curve
        lines += ["", "top-1 agreement vs training tokens (" + ", ".join(
            f"{s:,}" + ("" if u == s else f" (only {u:,})") for s, u in zip(tc["sizes"], tc["used_tokens"])) + ")",
            f"{'head':>8}{'layer':>6}  " + "".join(f"{s:>10,}" for s in tc["sizes"])]
        for ht, rows in tc["top1"].items():
            for layer, row in zip(tc["layers"], rows):
                lines.append(f"{ht:>8}{layer:>6}  " + "".join(f"{_f(v):>10}" for v in row))
    return "\n".join(lines + ["", f"best head type (mean top-1 over layers): {best}"])


def _nan(ys):
    return [float("nan") if y is None else y for y in ys]


def plot(r: ProbeResult, path: str | os.PathLike) -> Path:
    """Left: top-1 (solid) and top-5 (dotted) agreement vs layer per head type. Right: agreement vs training
    tokens when a training-size curve was run, else top-1 by category for the best head type."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: only --plot needs matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for j, ht in enumerate(r.head_types):
        ax.plot(r.layers, _nan(row[j] for row in r.top1), marker="o", color=f"C{j}", label=f"{ht} top-1")
        ax.plot(r.layers, _nan(row[j] for row in r.top5), linestyle=":", color=f"C{j}", alpha=0.7, label=f"{ht} top-5")
    ax.set_ylabel("held-out agreement with final-layer argmax")
    ax.set_title(f"{r.model.get('name', '')}: agreement by exit layer", fontsize=9)
    tc = r.train_curve
    if tc and tc["head_types"]:
        for k, (ht, layer, row) in enumerate((ht, x, row) for ht, rows in tc["top1"].items()
                                             for x, row in zip(tc["layers"], rows)):
            ax2.plot(tc["used_tokens"], _nan(row), marker="o", color=f"C{k % 10}", label=f"{ht} L{layer}")
        ax2.set_xscale("log")
        ax2.set_xlabel("training tokens")
        ax2.set_title("top-1 agreement vs training data", fontsize=9)
    else:
        j = r.head_types.index(r.best_head_type)
        for k, c in enumerate(sorted(r.categories)):
            ax2.plot(r.layers, _nan(row[j] for row in r.categories[c]["top1"]), marker=".", color=f"C{k % 10}",
                     linestyle="-" if k < 10 else "--", label=c)
        ax2.set_title(f"top-1 agreement by category ({r.best_head_type} heads)", fontsize=9)
    for a, by_layer in ((ax, True), (ax2, not (tc and tc["head_types"]))):
        if by_layer:
            a.set_xlabel("exit layer")
            a.set_xticks(r.layers) if len(r.layers) <= 20 else a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_ylim(0, 1)
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
