"""Agreement metrics of exit heads with the final layer: the trainer's evaluation (`hispec.distill.training`),
`hispec-probe` and its checkpoint evaluation all count with these.

- `expected_tokens_per_round(alpha, gamma)`: tokens per verification round for i.i.d. acceptance alpha (the one
  closed form, `hispec.latency.expected_tokens`); `simulate_rounds` / `tokens_per_pass`: the same measured on
  actual agree/disagree sequences of greedy self-speculation, answer by answer.
- `head_agreement(logits_of, feats, t_ids, t_logp)`: per position top-1 agreement (head argmax == the teacher's),
  top-5 agreement (the teacher's argmax within the head's top-5), the top-k + bucket KL, and top-1 agreement with
  the head's argmax restricted to reduced vocabularies (`vocab_masks`, chosen by `hispec.vocab.select_vocab`).
- `exit_head_predictions(model, sequences)`: teacher-forced argmax / top-5 of an `EarlyExitModel`'s own heads at
  every scored position (a reduced head vocabulary honoured through `project_exit`), and `hierarchy_figures`: the
  verifier exit against the draft.
"""

from __future__ import annotations

import torch

from hispec.distill.features import ScoredLayout, scored_batches
from hispec.distill.losses import _topk_hits, topk_kl
from hispec.latency import expected_tokens as expected_tokens_per_round

EXIT_NAMES = ("draft", "verify")

__all__ = ["EXIT_NAMES", "exit_head_predictions", "expected_tokens_per_round", "head_agreement", "hierarchy_figures",
           "mean", "restricted_argmax", "simulate_rounds", "tokens_per_pass"]


def mean(x: torch.Tensor, given: torch.Tensor | None = None) -> float | None:
    """Mean of `x` (bool or float; over the positions where `given` holds); None when there are none."""
    x = x if given is None else x[given]
    return None if x.numel() == 0 else float(x.float().mean())


def simulate_rounds(agree, gamma: int) -> tuple[int, int]:
    """Greedy self-speculation over one answer: (tokens, full-model passes).

    `agree[j]` says whether the exit's token at position j equals the full model's. A round starting at j drafts
    positions j..j+gamma-1; the leading run of agreements m (<= gamma) is accepted and the full pass adds one more
    token (the correction, or the bonus after gamma accepted drafts): m + 1 tokens, the next round starts at
    j + m + 1 (the last round is cut at the answer's end). `agree[j]` may also be a sequence over frontier distances
    (a `context` head: entry d - 1 at distance d): the round's k-th draft (k = 0..) is at distance k + 1 (the last
    entry beyond its length)."""
    agree = [[bool(x) for x in a] if isinstance(a, (list, tuple)) else [bool(a)] for a in agree]
    n, j, passes = len(agree), 0, 0
    while j < n:
        m = 0
        while m < gamma and j + m < n and agree[j + m][min(m, len(agree[j + m]) - 1)]:
            m += 1
        j += m + 1
        passes += 1
    return n, passes


def tokens_per_pass(agree: torch.Tensor, segment: torch.Tensor, gamma: int) -> float | None:
    """Expected tokens per full-model pass over all answers (total tokens / total passes); `segment` `[n]` gives
    each position's answer id (positions of one answer contiguous and in order). `agree` `[n]`, or `[n, D]` by
    frontier distance (`simulate_rounds`)."""
    if agree.numel() == 0:
        return None
    tokens = passes = 0
    _, counts = torch.unique_consecutive(segment, return_counts=True)
    for part in torch.split(agree.bool(), counts.tolist()):
        t, p = simulate_rounds(part.tolist(), gamma)
        tokens, passes = tokens + t, passes + p
    return tokens / passes


def restricted_argmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Argmax over the ids where `mask` `[V]` is True."""
    return logits.masked_fill(~mask.to(logits.device), float("-inf")).argmax(-1)


@torch.no_grad()
def head_agreement(logits_of, feats: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor, *,
                   vocab_masks: dict[int, torch.Tensor] | None = None, chunk: int = 512) -> dict[str, torch.Tensor]:
    """Per-position results on `feats` `[n, H]` (`logits_of(feats chunk)` -> full-vocabulary logits): agree1,
    agree5 (bool `[n]`), kl (`[n]`), and for each reduced vocabulary K `agree_v{K}` (its restricted argmax == the
    teacher's argmax `t_ids[:, 0]`)."""
    vocab_masks = vocab_masks or {}
    out: dict[str, list] = {"agree1": [], "agree5": [], "kl": [], **{f"agree_v{k}": [] for k in vocab_masks}}
    for c in range(0, feats.shape[0], chunk):
        logits = logits_of(feats[c : c + chunk])
        ids, logp = t_ids[c : c + chunk].to(logits.device), t_logp[c : c + chunk].to(logits.device)
        tt = ids[:, 0]
        out["agree1"].append((logits.argmax(-1) == tt).cpu())
        out["agree5"].append(_topk_hits(logits, tt, 5).bool().cpu())
        out["kl"].append(topk_kl(logits, ids, logp).cpu())
        for k, mask in vocab_masks.items():
            out[f"agree_v{k}"].append((restricted_argmax(logits, mask) == tt).cpu())
    return {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.float32 if k == "kl" else torch.bool)
            for k, v in out.items()}


@torch.no_grad()
def exit_head_predictions(model, sequences, *, batch_tokens: int = 4096, chunk: int = 512,
                          distances: tuple[int, ...] = (1,)) -> dict:
    """Teacher-forced predictions of an `EarlyExitModel`'s own heads at every scored position of `sequences`
    (`hispec.distill.items.Sequence`).

    One frozen pass per batch (`scored_batches`) keeps the residual stream after the draft and verifier layers; each
    head runs on it (a stateful `layer` head over the whole sequence with a fresh cache, `ExitHead.run_layer_fresh`)
    and projects through `EarlyExitModel.project_exit`, so a reduced head vocabulary is honoured (argmax and top-5
    only ever inside it). Returns flat `[N]` tensors (CPU): `final` (the final layer's argmax), `<exit>_top1` (the
    head's argmax), `<exit>_top5` (bool: final argmax within the head's top-5, top-k capped at the head's vocabulary
    size), and `layout` (`ScoredLayout`).

    A `context` head reads the final layer's states up to `t - d` (the frontier the full model verified, as in
    decoding) for each distance d of `distances` (>= 1): `<exit>_top1` / `<exit>_top5` hold the first distance, and
    `<exit>_by_distance` {d: (top1, top5)} every one (all from the same frozen pass)."""
    if not distances or min(distances) < 1:
        raise ValueError(f"distances must be >= 1, got {distances}")
    adapter = model.adapter
    lay = ScoredLayout.of(sequences)
    exits = {name: getattr(model, f"{name}_layer") for name in EXIT_NAMES}
    layers = sorted({*exits.values(), *(x for h in model.heads.values() if h.needs_context for x in h.context_layers)})
    out = {"final": torch.empty(lay.n, dtype=torch.long)}
    for name in EXIT_NAMES:
        ds = distances if model.heads[name].needs_context else distances[:1]
        out[f"{name}_by_distance"] = {d: (torch.empty(lay.n, dtype=torch.long), torch.empty(lay.n, dtype=torch.bool))
                                      for d in ds}
    for valid, rows, cols, dest, saved, final in scored_batches(adapter, sequences, layers, lay.offsets, batch_tokens):
        for c in range(0, final.shape[0], chunk):
            out["final"][dest[c : c + chunk]] = adapter.project(final[c : c + chunk]).float().argmax(-1).cpu()
        for name, layer in exits.items():
            head = model.heads[name]
            k = min(5, head.vocab_size or adapter.vocab_size)  # -inf outside a reduced vocabulary: never "hits"
            for dist, (top1, top5) in out[f"{name}_by_distance"].items():
                if head.needs_context:  # rows are right-padded: every row starts at 0
                    feats = head(saved[layer], context=head.sequence_context(saved, dist))[rows, cols]
                elif head.stateful:  # attends over the exit's previous positions: run it over the whole sequences
                    feats = head(saved[layer], head.run_layer_fresh(adapter, valid.long()))[rows, cols]
                else:
                    feats = saved[layer][rows, cols]
                whole = head.stateful or head.needs_context  # the head already ran
                for c in range(0, feats.shape[0], chunk):
                    x = feats[c : c + chunk]
                    logits = model.project_exit(name, x if whole else head(x)).float()
                    d = dest[c : c + chunk]
                    top1[d] = logits.argmax(-1).cpu()
                    top5[d] = _topk_hits(logits, out["final"][d].to(logits.device), k).bool().cpu()
    for name in EXIT_NAMES:
        out[f"{name}_top1"], out[f"{name}_top5"] = out[f"{name}_by_distance"][distances[0]]
    out["layout"] = lay
    return out


def hierarchy_figures(pred: dict, sel: torch.Tensor | None = None) -> dict:
    """The intermediate verifier against the draft: `verify_agrees_draft` (share of draft tokens whose verifier-exit
    argmax is the same token), `final_agrees_given_verify_agrees` (of those, the share the final layer keeps) and
    `verify_agrees_given_final_agrees` (of the drafts the final layer would accept, the share the verifier passes)."""
    d, v, t = pred["draft_top1"], pred["verify_top1"], pred["final"]
    if sel is not None:
        d, v, t = d[sel], v[sel], t[sel]
    vd, fd = v == d, t == d
    return {"verify_agrees_draft": mean(vd), "final_agrees_given_verify_agrees": mean(fd, vd),
            "verify_agrees_given_final_agrees": mean(vd, fd)}
