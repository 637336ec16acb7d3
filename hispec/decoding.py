"""Decoding strategies on one machinery: a *hierarchy* of levels, each proposing to or verifying the one below.

A level is one of
- `ngram`: prompt lookup over the row's own prompt and output (`hispec.ngram`); no model cost; only at level 0;
- an exit: the decoder layers up to the exit's layer plus its trained head (`draft` at L_d, `verify` at L_i);
- `full`: the whole model, always the top;
- `ngram|EXIT` (level 0 only): both drafters in one level, the n-gram lookup first and the exit wherever the lookup
  finds nothing. They are strong in different places (the lookup where answers copy from the context: code edits,
  RAG, summaries; the head elsewhere), and a row pays the exit only when the lookup missed.
Level 0 drafts; each level k >= 1 verifies, in one pass, what level k-1 gathered, and the top level is the full
model. Named strategies are hierarchies: `ar` = full, `self-spec` = draft>full, `hispec` = draft>verify>full,
`ngram` = ngram>full, `ngram-self-spec` = ngram>draft>full, `ngram-hispec` = ngram>draft>verify>full,
`self-spec-lookup` = ngram|draft>full, `hispec-lookup` = ngram|draft>verify>full; any other
spec string (e.g. `"ngram>L8>full"`, exits named or given by layer) works too, and `auto` picks one from the
checkpoint's calibration (`hispec.latency`) and adapts it per row while decoding (see `_AutoPolicy`).

The model layers form one *range* per level, `[e_{k-1}, e_k)` (an `ngram` level's range is empty); each range keeps
its own KV length, and the hidden state entering range k is kept for every position that passed range k-1 but not
range k (hidden-state reuse). A verification at level k "advances" ranges 0..k over exactly the positions still
pending for them, so KV written for a token that is later accepted is never recomputed (KV reuse); rejected
positions are rolled back in every range.

Per row (all tensors are `[B, ...]`; rows keep their own counts):
- `tok[b, i]` is the i-th real token of row b, its absolute position is i; `seq[b]` tokens are known.
- `ver[k][b]` tokens have been verified by level k (k >= 1); `ver[K]` are committed.
- `done[j][b]` positions have passed range j. Invariant for j >= 1: `done[j] == ver[j] - 1`.
- `gam[k][b]` (k < K): how many tokens level k gathers before level k+1 verifies them (for `ngram`: the longest
  proposal). 0 means the row does not use level k nor anything below it: level k+1 produces its tokens itself (a
  verification with nothing to verify yields one token, like a plain decoding step). So one batch can hold rows
  that speculate with different depths and lengths, and rows that decode plainly.

A round at level k, over the rows `active` for it: while some active row has gathered fewer than `gam[k-1]` tokens
(and is not at its length limit, and an `ngram` level below it still has proposals), run a round at level k-1 for
those rows only; then verify the active rows. The prompt is prefilled through all layers at once and the full
model picks the first new token.

Lossless: greedy verification keeps the longest prefix equal to the level's argmax; sampling uses speculative
sampling at every level, with level k-1's stored probability rows as proposal and level k's as target (an `ngram`
proposal is a point mass: accepted with probability p(x), else resampled from p without x), so the tokens a level
accepts are exact samples of that level, and committed tokens are exact samples of the model. `verification="hsd"`
replaces the per-token rule at every level by the sequence-level one (`hispec.sampling.hsd_accept`), which is
exact for the same reason and accepts at least as many tokens; greedy decoding does not use either. How many tokens a
level gathers, and which levels a row uses, depend only on tokens already drawn, which keeps the argument valid.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from . import latency
from .heads import ContextInputs
from .latency import LOOKUP, Calibration, CalibrationError, level_pairs
from .ngram import NgramConfig, propose_batch
from .sampling import (check_verification, greedy_accept, hsd_accept, logits_to_probs, rank_among, sample,
                       speculative_accept)
from .tree import TreeSpec, check_tree, parse_tree, tree_round

NAMED = {
    "ar": ("full",),
    "self-spec": ("draft", "full"),
    "hispec": ("draft", "verify", "full"),
    "ngram": ("ngram", "full"),
    "ngram-self-spec": ("ngram", "draft", "full"),
    "ngram-hispec": ("ngram", "draft", "verify", "full"),
    "self-spec-lookup": ("ngram|draft", "full"),
    "hispec-lookup": ("ngram|draft", "verify", "full"),
}
STRATEGIES = ("auto",) + tuple(NAMED)


@dataclass
class LevelStats:
    """Counters of one level, summed over the batch."""

    name: str
    proposed: int = 0  # tokens the level below asked this level to verify (level 0: tokens it drafted)
    accepted: int = 0  # of those, accepted
    rejections: int = 0  # row verifications that rejected one of their proposals (i.i.d. MLE: acc / (acc + rej))
    proposals: int = 0  # level 0: row draft steps that proposed anything (an n-gram may find nothing)
    lookups: int = 0  # level 0 `ngram|EXIT`: of those, the ones the n-gram lookup served (the rest: the exit)
    passes: int = 0  # batched passes (draft steps at level 0, verifications above)
    row_passes: int = 0  # the same, counted per participating row
    layer_evals: int = 0  # decoder-layer evaluations of real tokens in this level's range (+ its head layer)
    seconds: float = 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance"] = self.acceptance
        return d


@dataclass
class GenerationStats:
    """Counters summed over the batch: one `LevelStats` per level of the hierarchy (bottom-up, the full model last).
    The flat fields below are derived from them for the common two- and three-level strategies."""

    levels: list[LevelStats] = field(default_factory=lambda: [LevelStats("full")])
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    strategy: str = ""
    verification: str = "token"  # the sampling acceptance rule ("token" | "hsd"; greedy decoding uses neither)
    plain_row_rounds: int = 0  # auto: rounds in which a row decoded plainly (all its speculation switched off)
    row_rounds: int = 0  # auto: rounds summed over rows
    guarded_rounds: int = 0  # auto: batch rounds `_PlainGuard` decoded plainly although the rule chose to speculate

    @property
    def top(self) -> LevelStats:
        return self.levels[-1]

    @property
    def layer_evals(self) -> int:
        return sum(lv.layer_evals for lv in self.levels)

    @property
    def target_passes(self) -> int:
        return self.top.passes  # the prefill included

    @property
    def target_row_passes(self) -> int:
        return self.top.row_passes

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / max(self.target_row_passes, 1)

    @property
    def drafted(self) -> int:
        return self.levels[0].proposed if len(self.levels) > 1 else 0

    @property
    def accepted_at_target(self) -> int:
        return self.top.accepted

    @property
    def proposed_to_target(self) -> int:
        return self.top.proposed

    @property
    def accepted_at_verify(self) -> int:
        return sum(lv.accepted for lv in self.levels[1:-1])

    @property
    def proposed_to_verify(self) -> int:
        return sum(lv.proposed for lv in self.levels[1:-1])

    @property
    def verify_passes(self) -> int:
        return sum(lv.passes for lv in self.levels[1:-1])

    @property
    def verify_acceptance(self) -> float:
        return self.accepted_at_verify / max(self.proposed_to_verify, 1)

    @property
    def target_acceptance(self) -> float:
        return self.accepted_at_target / max(self.proposed_to_target, 1)

    @property
    def seconds(self) -> dict:
        """Wall seconds by stage: prefill, draft (level 0), verify (intermediate levels), target (the full model)."""
        K = len(self.levels) - 1
        return {"prefill": self.prefill_seconds,
                "draft": self.levels[0].seconds if K else 0.0,
                "verify": sum(lv.seconds for lv in self.levels[1:-1]),
                "target": self.top.seconds}

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy, "verification": self.verification, "new_tokens": self.new_tokens,
            "levels": [lv.as_dict() for lv in self.levels],
            "seconds": self.seconds, "layer_evals": self.layer_evals, "drafted": self.drafted,
            "tokens_per_target_pass": self.tokens_per_target_pass, "target_passes": self.target_passes,
            "target_row_passes": self.target_row_passes,
            "accepted_at_verify": self.accepted_at_verify, "proposed_to_verify": self.proposed_to_verify,
            "accepted_at_target": self.accepted_at_target, "proposed_to_target": self.proposed_to_target,
            "verify_acceptance": self.verify_acceptance, "target_acceptance": self.target_acceptance,
            "plain_row_rounds": self.plain_row_rounds, "row_rounds": self.row_rounds,
            "guarded_rounds": self.guarded_rounds,
        }


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N]: the prompt as given, then new tokens, padded after a row finishes
    stats: GenerationStats
    new_tokens: list[list[int]]  # per row, the generated tokens (through EOS / stop string)


@dataclass(frozen=True)
class Level:
    kind: str  # 'ngram' | 'exit' | 'full'
    exit_layer: int  # decoder layers run to reach this level (0 for ngram, num_layers for full)
    head: str | None = None  # the exit head's name ('draft' / 'verify') for kind 'exit'
    threshold: int = 1  # default gamma: tokens gathered before the next level verifies them (ngram: longest proposal)
    lookup: bool = False  # an exit at level 0 that tries the n-gram lookup first (`ngram|EXIT`)

    @property
    def name(self) -> str:
        name = {"ngram": "ngram", "full": "full"}.get(self.kind, f"L{self.exit_layer}")
        return LOOKUP + name if self.lookup else name


def parse_hierarchy(spec, model) -> list[str]:
    """A strategy name or spec (`"ngram>L4>full"`, `"draft>verify>full"`, a list of such names) -> level names
    bottom-up (`ngram`, exit head names, `full`); raises ValueError on anything malformed."""
    if isinstance(spec, str):
        if spec in NAMED:
            return list(NAMED[spec])
        parts = [p.strip() for p in spec.split(">")]
    else:
        parts = [str(p).strip() for p in spec]
    by_layer = {f"L{model.hispec_config.layer_of(n)}": n for n in model.exit_names}
    names = []
    for p in parts:
        lookup = p.startswith(LOOKUP)
        if lookup:
            p = p[len(LOOKUP):].strip()
            if p in ("ngram", "full") or (p not in model.exit_names and p not in by_layer):
                raise ValueError(f"level {LOOKUP + p!r} in {spec!r}: '{LOOKUP}' pairs the lookup with an exit of "
                                 f"this checkpoint ({', '.join(model.exit_names)}), e.g. 'ngram|draft>full'")
            names.append(LOOKUP + by_layer.get(p, p))
            if len(names) > 1:
                raise ValueError(f"hierarchy {spec!r}: '{LOOKUP}EXIT' can only be the lowest level (it drafts)")
            continue
        if p in ("ngram", "full") or p in model.exit_names:
            names.append(p)
        elif p in by_layer:
            names.append(by_layer[p])
        else:
            known = ", ".join(list(NAMED) + ["auto"])
            exits = ", ".join(f"{n} (L{model.hispec_config.layer_of(n)})" for n in model.exit_names)
            raise ValueError(f"unknown strategy or level {p!r} in {spec!r}: strategies are {known}; a hierarchy is "
                             f"levels joined by '>' from ngram, this checkpoint's exits {exits}, and full")
    if not names or names[-1] != "full":
        raise ValueError(f"hierarchy {spec!r} must end with the full model ('full')")
    if "ngram" in names[1:]:
        raise ValueError(f"hierarchy {spec!r}: 'ngram' can only be the lowest level (it drafts, it cannot verify)")
    depth = [0 if n == "ngram" else model.num_layers if n == "full"
             else model.hispec_config.layer_of(n.removeprefix(LOOKUP)) for n in names]
    if any(b <= a for a, b in zip(depth, depth[1:])):
        raise ValueError(f"hierarchy {spec!r}: each level must be strictly deeper than the one below it "
                         f"(layers {depth})")
    return names


def build_levels(model, names: list[str], gammas=None, *, gamma: int, window: int, ngram: NgramConfig) -> list[Level]:
    """Level objects for level names; default thresholds: ngram -> its max_len, the lowest exit -> gamma, higher
    exits -> window; `gammas` (one per non-top level) overrides them."""
    levels = []
    first_exit = next((n for n in names if n not in ("ngram", "full")), None)
    for n in names:
        if n == "ngram":
            levels.append(Level("ngram", 0, None, ngram.max_len))
        elif n == "full":
            levels.append(Level("full", model.num_layers, None, 1))
        elif n.startswith(LOOKUP):
            exit_name = n[len(LOOKUP):]
            levels.append(Level("exit", model.hispec_config.layer_of(exit_name), exit_name, gamma, lookup=True))
        else:
            levels.append(Level("exit", model.hispec_config.layer_of(n), n, gamma if n == first_exit else window))
    if gammas is not None:
        gammas = list(gammas)
        if len(gammas) != len(levels) - 1:
            raise ValueError(f"gammas has {len(gammas)} values; the hierarchy {'>'.join(names)} needs one per level "
                             f"below the full model ({len(levels) - 1})")
        for g in gammas:
            if not isinstance(g, int) or g < 1:
                raise ValueError(f"gammas must be integers >= 1, got {gammas}")
        levels = [Level(lv.kind, lv.exit_layer, lv.head, g, lv.lookup) for lv, g in zip(levels, gammas)] + [levels[-1]]
    return levels


class _Run:
    """State and steps of one batched generation call."""

    def __init__(self, model, levels, prompts, limits, *, do_sample, warp, eos, generator, stop_check, streamer,
                 ngram: NgramConfig, policy=None, tree=None, verification: str = "token", cache=None, ids=None):
        self.model, self.adapter, self.levels = model, model.adapter, levels
        self.tree = tree  # a hispec.tree.TreeSpec: level 0 drafts trees (hispec/tree.py), else chains
        self.K = len(levels) - 1
        self.bounds = [0] + [lv.exit_layer for lv in levels]
        self.do_sample, self.warp, self.generator = do_sample, warp, generator
        self.eos = eos  # LongTensor of EOS ids (may be empty)
        self.stop_check, self.streamer = stop_check, streamer
        self.ngram, self.policy = ngram, policy
        self.verification = verification
        self.committed_tokens = 0  # new tokens handed over so far, all rows (`_PlainGuard` counts rounds by it)
        self.stats = GenerationStats(levels=[LevelStats(lv.name) for lv in levels], verification=verification)
        dev = self.adapter.device
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        self.limit = torch.as_tensor(limits, device=dev)
        cap = int(self.limit.max()) + sum(lv.threshold for lv in levels) + max(ngram.max_len, 8) + len(levels) + 2
        self.tok = torch.zeros(B, cap, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.tok[b, : len(p)] = torch.as_tensor(p, device=dev)
        self.prompt_len = lens.clone()
        self.seq = lens.clone()
        self.ver = [None] + [lens.clone() for _ in range(self.K)]
        self.done = [torch.zeros_like(lens) for _ in range(self.K + 1)]
        self.gam = [torch.full_like(lens, lv.threshold) for lv in levels[:-1]]
        # an ngram level 0 has no more proposals, or (`ngram|EXIT`) its lookup proposed: verify them now
        self.exhausted = torch.zeros(B, dtype=torch.bool, device=dev)
        H = self.adapter.hidden_size
        self.hid = [None] + [torch.zeros(B, cap, H, dtype=self.adapter.dtype, device=dev) for _ in range(self.K)]
        # `context` heads read the final layer's states of verified positions: kept per row (valid below done[K])
        self.fin = (torch.zeros(B, cap, H, dtype=self.adapter.dtype, device=dev)
                    if any(lv.kind == "exit" and model.heads[lv.head].needs_context for lv in levels) else None)
        # `layer` heads keep their own KV as extra cache layers, advanced and rolled back with their exit's range
        self.cache = self.adapter.new_cache(B, extra=model.extra_cache_layers) if cache is None else cache
        self.state_heads = [None] * (self.K + 1)
        for j, lv in enumerate(levels[:-1]):
            if lv.kind == "exit" and model.heads[lv.head].stateful:
                self.state_heads[j] = model.heads[lv.head]
        # each row's id in `results` (continuous batching gives its request ids; rows leave and join by id)
        self.orig = torch.arange(B, device=dev) if ids is None else torch.as_tensor(ids, dtype=torch.long, device=dev)
        self.results: dict[int, list[int]] = {}
        self.row_stop: dict[int, object] = {}  # per-row stop checkers by id (continuous batching), else stop_check
        self._pre = None  # chunked prefill: each row's final state at its last prompt position
        # Sampling: probability rows of each level (except the top) by position, offset by `base`.
        self.rows: list[torch.Tensor | None] = [None] * self.K
        self.base = lens.clone()

    # ------------------------------------------------------------------ machinery
    def _advance(self, j: int, end: torch.Tensor):
        """Run range j over positions [done[j], end) of every row; returns (output [B, T, H] or None, start,
        head features [B, T, H] of level j's stateful head or None)."""
        start = self.done[j]
        n = (end - start).clamp(min=0)
        T = int(n.max()) if n.numel() else 0
        if T == 0:
            return None, start, None
        ar = torch.arange(T, device=start.device)
        idx = start[:, None] + ar  # [B, T] absolute positions
        valid = ar < n[:, None]
        idx = torch.where(valid, idx, start[:, None]).clamp(max=self.tok.shape[1] - 1)
        a, b = self.bounds[j], self.bounds[j + 1]
        if j == 0:
            inp = self.adapter.embed(self.tok.gather(1, idx), idx)
        else:
            inp = self.hid[j].gather(1, idx[..., None].expand(-1, -1, self.adapter.hidden_size))
        out = inp if a == b else self.adapter.run_layers(inp, a, b, position_ids=idx, cache=self.cache, valid=valid)
        self.stats.levels[j].layer_evals += int(n.sum()) * (b - a)
        dest = self.hid[j + 1] if j + 1 <= self.K else self.fin
        if dest is not None:
            r, c = valid.nonzero(as_tuple=True)
            dest[r, idx[r, c]] = out[r, c]
        feats = None
        head = self.state_heads[j]
        if head is not None:  # the head's own layer sees exactly the positions its exit's range saw
            def run_layer(module, hidden):
                return self.adapter.run_module(module, head.layer_type, hidden, cache_index=head.cache_index,
                                               position_ids=idx, cache=self.cache, valid=valid)

            feats = head(out, run_layer)
            self.stats.levels[j].layer_evals += int(n.sum())
        self.done[j] = torch.maximum(start, end)
        return out, start, feats

    def _logits(self, k: int, hidden: torch.Tensor, head_feats: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """Level k's logits for its states `hidden` `[B, T, H]` at positions `pos` `[B, T]` (context heads)."""
        head = self.levels[k].head
        if head is None:
            return self.adapter.final_logits(hidden)
        if head_feats is not None:  # a stateful head already ran while its range advanced
            return self.model.project_exit(head, head_feats)
        ctx = self._context(k, pos) if self.model.heads[head].needs_context else None
        return self.model.exit_logits(head, hidden, context=ctx)

    def _context(self, k: int, pos: torch.Tensor) -> ContextInputs:
        """What level k's `context` head may read for queries at `pos`: for each layer it reads, the decoder's
        buffer of that layer's states and, per row, the positions below which they are valid (the final layer's:
        what the full model verified, done[K]; an exit's: what its range has run, done of the range below it). A
        layer this hierarchy does not run is never available."""
        head = self.model.heads[self.levels[k].head]
        states, avail = [], []
        for L in head.context_layers:
            if L == self.adapter.num_layers:
                buf, ok = self.fin, self.done[self.K]
            elif L in self.bounds[1:self.K + 1]:
                i = self.bounds.index(L, 1)  # hid[i] holds the output of range i - 1, i.e. the state at bounds[i]
                buf, ok = self.hid[i], self.done[i - 1]
            else:
                buf, ok = self.hid[k + 1], torch.zeros_like(self.seq)
            states.append(buf)
            avail.append(ok)
        return ContextInputs(states=states, avail=avail, query_pos=pos, layers=list(head.context_layers))

    def _stop_pos(self) -> torch.Tensor:
        """Per row, the first position that must not be extended: min(limit, first EOS after the prompt + 1)."""
        end = self.limit.clone()
        if self.eos.numel():
            committed = self.ver[self.K] if self.K else self.seq
            width = int((self.seq - committed).max()) if self.seq.numel() else 0
            if width > 0:
                idx = committed[:, None] + torch.arange(width, device=end.device)
                inside = idx < self.seq[:, None]
                t = self.tok.gather(1, idx.clamp(max=self.tok.shape[1] - 1))
                is_eos = torch.isin(t, self.eos) & inside
                first = torch.where(is_eos.any(1), idx[torch.arange(len(idx)), is_eos.float().argmax(1)] + 1, end)
                end = torch.minimum(end, first)
        return end

    def _ensure_rows(self, k: int, width: int, V: int, like: torch.Tensor):
        r = self.rows[k]
        if r is None or r.shape[1] < width:
            new = torch.zeros(like.shape[0], max(width, 2 * (0 if r is None else r.shape[1])), V,
                              dtype=like.dtype, device=like.device)
            if r is not None:
                new[:, : r.shape[1]] = r
            self.rows[k] = new
        return self.rows[k]

    def _store_rows(self, k: int, first_pos: torch.Tensor, probs: torch.Tensor, only: torch.Tensor | None = None):
        # probs [B, W, V] are level k's rows predicting positions first_pos + 0..W-1 (for the rows `only`, else all)
        off = first_pos - self.base
        W = probs.shape[1]
        rows = self._ensure_rows(k, int(off.max()) + W, probs.shape[-1], probs)
        idx = (off[:, None] + torch.arange(W, device=off.device))[..., None].expand(-1, -1, probs.shape[-1])
        if only is not None:
            probs = torch.where(only[:, None, None], probs.to(rows.dtype), rows.gather(1, idx))
        rows.scatter_(1, idx, probs)

    def _read_rows(self, k: int, first_pos: torch.Tensor, W: int) -> torch.Tensor:
        off = first_pos - self.base
        rows = self.rows[k]
        idx = (off[:, None] + torch.arange(W, device=off.device)).clamp(max=rows.shape[1] - 1)
        return rows.gather(1, idx[..., None].expand(-1, -1, rows.shape[-1]))

    # ------------------------------------------------------------------ steps
    def prefill(self, chunk: int | None = None) -> bool:
        """All prompt tokens through all layers in one call per range (the same chunking as a plain forward, so
        low-precision numerics match transformers), then the first new token from the full model.

        `chunk` (continuous batching, `hispec.serve`): at most that many prompt positions per row and call, so a
        long prompt is prefilled over several engine steps while other rows decode; returns True once every row's
        prompt is in and its first token is picked (always, without `chunk`)."""
        t0 = time.perf_counter()
        end = self.prompt_len if chunk is None else torch.minimum(self.prompt_len, self.done[0] + chunk)
        out = start = None
        for j in range(self.K + 1):
            out, start, _ = self._advance(j, end)
        if out is not None:  # keep the final state at the last prompt position of rows whose prompt just ended
            rows = torch.arange(len(end), device=end.device)
            feats = out[rows, (end - 1 - start).clamp(min=0, max=out.shape[1] - 1)]  # [B, H]
            got = (end == self.prompt_len) & (end > start)
            self._pre = feats if self._pre is None else torch.where(got[:, None], feats, self._pre)
        if not bool((self.done[self.K] >= self.prompt_len).all()):
            self.stats.prefill_seconds += time.perf_counter() - t0
            return False
        end = self.prompt_len
        logits = self._logits(self.K, self._pre[:, None])[:, 0]
        self._pre = None
        token = sample(logits_to_probs(logits, **self.warp), self.generator) if self.do_sample else logits.argmax(-1)
        self.tok.scatter_(1, end[:, None], token[:, None])
        self.seq = end + 1
        self.ver = [None] + [self.seq.clone() for _ in range(self.K)]
        self.base = self.seq.clone()
        self.stats.levels[-1].passes += 1
        self.stats.levels[-1].row_passes += len(end)
        self.stats.prefill_seconds += time.perf_counter() - t0
        return True

    def draft_step(self, active: torch.Tensor):
        """Level 0 proposes for the active rows that may still grow: one token (an exit, or the full model for
        `ar`, where it is committed), or a whole n-gram continuation of up to gam[0] tokens; `ngram|EXIT`: the
        lookup's continuation (up to ngram.max_len) where it matches, else the exit's token."""
        t0 = time.perf_counter()
        st = self.stats.levels[0]
        stop = self._stop_pos()
        grow = active & (self.seq < stop)
        if self.levels[0].kind == "ngram":
            n = self._propose_ngram(grow, torch.minimum(self.gam[0], stop - self.seq))
            self.exhausted |= grow
            st.proposed += int(n.sum())
            st.proposals += int((n > 0).sum())
            st.passes += int(bool(grow.any()))
            st.row_passes += int(grow.sum())
            st.seconds += time.perf_counter() - t0
            return
        if self.levels[0].lookup:  # `ngram|EXIT`: rows the lookup serves skip the exit and are verified next
            n = self._propose_ngram(grow, torch.minimum(torch.full_like(stop, self.ngram.max_len), stop - self.seq))
            hit = n > 0
            self.exhausted |= hit
            st.proposed += int(n.sum())
            st.proposals += int(hit.sum())
            st.lookups += int(hit.sum())
            grow = grow & ~hit
        end = torch.where(grow, self.seq, self.done[0])
        out, start, hf = self._advance(0, end)
        if out is not None:
            last = (end - start - 1).clamp(min=0)
            rows = torch.arange(len(last))
            feats = out[rows, last][:, None]  # [B, 1, H]
            logits = self._logits(0, feats, None if hf is None else hf[rows, last][:, None],
                                  pos=(start + last)[:, None])[:, 0]
            if self.do_sample:
                probs = logits_to_probs(logits, **self.warp)
                token = sample(probs, self.generator)
                if self.K:  # (`ngram|EXIT`: only the exit's rows; the lookup's rows hold their point masses)
                    self._store_rows(0, self.seq, probs[:, None], only=grow if self.levels[0].lookup else None)
            else:
                token = logits.argmax(-1)
            pos = self.seq.clamp(max=self.tok.shape[1] - 1)
            self.tok.scatter_(1, pos[:, None], torch.where(grow, token, self.tok.gather(1, pos[:, None])[:, 0])[:, None])
            self.seq = self.seq + grow.long()
            st.proposed += int(grow.sum()) if self.K else 0
            st.proposals += int(grow.sum()) if self.K else 0
            st.passes += 1
            st.row_passes += int(grow.sum())
        st.seconds += time.perf_counter() - t0

    def _propose_ngram(self, rows: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
        """The n-gram lookup for `rows` (an `ngram` level 0, or the first try of `ngram|EXIT`): writes up to `room`
        proposed tokens after each row's known ones (as point masses when sampling) and advances `seq`; returns
        the proposal lengths (0 where nothing matched)."""
        props, n = propose_batch(self.tok, self.seq, rows, room.clamp(min=0), self.ngram)
        hit = n > 0
        if bool(hit.any()):
            W = props.shape[1]
            pos = (self.seq[:, None] + torch.arange(W, device=n.device)).clamp(max=self.tok.shape[1] - 1)
            put = torch.arange(W, device=n.device) < n[:, None]
            self.tok.scatter_(1, pos, torch.where(put, props, self.tok.gather(1, pos)))
            if self.do_sample and self.K:  # an n-gram proposal is a point mass
                onehot = torch.nn.functional.one_hot(props, self.adapter.vocab_size).float()
                self._store_rows(0, self.seq, onehot, only=hit)
            self.seq = self.seq + n
        return n

    def _ready(self, k: int) -> torch.Tensor:
        """Rows for which level k may verify now: gathered gam[k-1] tokens, at their limit/EOS, or (ngram below)
        out of proposals."""
        stop = self._stop_pos()
        count = torch.minimum(self.seq, stop) - self.ver[k]
        ready = (count >= self.gam[k - 1]) | (self.seq >= stop)
        if k == 1 and (self.levels[0].kind == "ngram" or self.levels[0].lookup):
            ready |= self.exhausted
        return ready

    def verify(self, k: int, active: torch.Tensor):
        """Level k verifies, for the active rows, the tokens level k-1 gathered beyond ver[k]; a row with nothing
        gathered (its level k-1 is switched off, or an n-gram found nothing) gets one token of level k's own."""
        t0 = time.perf_counter()
        stop = self._stop_pos()
        m = (torch.minimum(self.seq, stop) - self.ver[k]).clamp(min=0)
        part = active & ((m > 0) | (self.seq < stop))
        if not bool(part.any()):
            return
        m = torch.where(part, m, torch.zeros_like(m))
        out = hf = start = None
        for j in range(k + 1):
            out, start, hf = self._advance(j, torch.where(part, self.seq, self.done[j]))
        M = int(m.max())
        feats = out[:, : M + 1]  # range k started at ver[k] - 1 for participating rows
        pos = start[:, None] + torch.arange(M + 1, device=start.device)
        logits = self._logits(k, feats, None if hf is None else hf[:, : M + 1], pos=pos)  # [B, M+1, V]
        cidx = (self.ver[k][:, None] + torch.arange(M, device=m.device)).clamp(max=self.tok.shape[1] - 1)
        cands = self.tok.gather(1, cidx)
        probs = None
        if self.do_sample:
            probs = logits_to_probs(logits, **self.warp)
            q = self._read_rows(k - 1, self.ver[k], M) if M else probs[:, :0]
            accept = hsd_accept if self.verification == "hsd" else speculative_accept
            a, new = accept(cands, m, q, probs, self.generator)
            if k < self.K:
                self._store_rows(k, self.ver[k], probs)
        else:
            a, new = greedy_accept(cands, m, logits)
        a = torch.where(part, a, torch.zeros_like(a))
        if self.policy is not None:
            self.policy.observe(self, k, part, m, a, new, probs)
        newpos = self.ver[k] + a
        has_new = part & (newpos < stop)
        pos = newpos.clamp(max=self.tok.shape[1] - 1)
        keep_tok = self.tok.gather(1, pos[:, None])[:, 0]
        self.tok.scatter_(1, pos[:, None], torch.where(has_new, new, keep_tok)[:, None])
        # Roll back every range past the last kept position of participating rows.
        big = torch.full_like(newpos, torch.iinfo(torch.long).max)
        keep_below = torch.where(part, newpos, big)
        for j in range(self.K + 1):
            if self.bounds[j] < self.bounds[j + 1]:
                self.cache.truncate(self.bounds[j], self.bounds[j + 1], keep_below)
            if self.state_heads[j] is not None:
                c = self.state_heads[j].cache_index
                self.cache.truncate(c, c + 1, keep_below)
            self.done[j] = torch.minimum(self.done[j], keep_below)
        new_seq = torch.where(part, newpos + has_new.long(), self.seq)
        self.seq = new_seq
        for i in range(1, k + 1):
            self.ver[i] = torch.where(part, new_seq, self.ver[i])
        if k == 1:
            self.exhausted &= ~part
        st = self.stats.levels[k]
        st.accepted += int(a.sum())
        st.proposed += int(m.sum())
        st.rejections += int((part & (a < m)).sum())
        st.passes += 1
        st.row_passes += int(part.sum())
        if k == self.K:
            self.base = torch.where(part, new_seq, self.base)
        st.seconds += time.perf_counter() - t0

    def run_level(self, k: int, active: torch.Tensor):
        """One round at level k for the active rows (see the module docstring)."""
        if k == 0:
            self.draft_step(active)
            return
        while True:
            todo = active & ~self._ready(k)
            if not bool(todo.any()):
                break
            self.run_level(k - 1, todo)
        self.verify(k, active)

    def commit(self) -> bool:
        """Hand over newly committed tokens, finish rows (EOS, length, stop strings); returns True while rows
        remain. Linear in the output: each round reads, scans and streams only the tokens it committed."""
        committed = self.ver[self.K] if self.K else self.seq
        stop = self._stop_pos()
        finished = (committed >= torch.minimum(stop, self.limit)).tolist()
        keep = []
        eos_ids = set(self.eos.tolist())
        ends = (committed - self.prompt_len).tolist()
        for b, rid in enumerate(self.orig.tolist()):
            toks = self.results.setdefault(rid, [])
            prev = len(toks)
            if ends[b] > prev:
                p0 = int(self.prompt_len[b])
                toks.extend(self.tok[b, p0 + prev : p0 + ends[b]].tolist())
                if eos_ids:
                    cut = next((i for i in range(prev, len(toks)) if toks[i] in eos_ids), None)
                    if cut is not None:
                        del toks[cut + 1 :]
                        finished[b] = True
                stop_check = self.row_stop.get(rid, self.stop_check)
                if stop_check is not None:
                    cut = stop_check(toks, prev)
                    if cut is not None:
                        del toks[cut:]
                        finished[b] = True
                if self.streamer is not None and len(toks) > prev:
                    self.streamer.put(torch.tensor(toks[prev:]))
                self.committed_tokens += max(len(toks) - prev, 0)
            if not finished[b]:
                keep.append(b)
        if len(keep) < len(committed):
            self._keep_rows(torch.tensor(keep, dtype=torch.long, device=committed.device))
        return bool(keep)

    # the per-row state: batch-first tensors, and lists of them (one per level); None entries stay None
    ROW_TENSORS = ("tok", "seq", "limit", "prompt_len", "exhausted", "fin", "base", "orig")
    ROW_LISTS = ("ver", "done", "gam", "hid", "rows")

    def _map_rows(self, fn, other: "_Run | None" = None) -> None:
        """Replace every per-row tensor t by fn(t) (or fn(t, other's t) with `other`): one list of fields for
        dropping rows and for admitting them."""
        two = (lambda name: (getattr(self, name), getattr(other, name))) if other is not None else None
        for name in self.ROW_TENSORS:
            setattr(self, name, fn(*two(name)) if two else fn(getattr(self, name)))
        for name in self.ROW_LISTS:
            setattr(self, name, [fn(*ab) for ab in zip(*two(name))] if two else [fn(t) for t in getattr(self, name)])

    def _keep_rows(self, idx: torch.Tensor):
        self._map_rows(lambda t: None if t is None else t.index_select(0, idx))
        self.cache.reorder_batch(idx)
        if self.policy is not None:
            self.policy.keep_rows(idx)

    def drop(self, ids) -> None:
        """Remove the rows with these ids (cancelled requests); their cache rows go too (a paged cache frees their
        blocks)."""
        ids = set(ids)
        keep = [b for b, rid in enumerate(self.orig.tolist()) if rid not in ids]
        if len(keep) < len(self.orig):
            self._keep_rows(torch.tensor(keep, dtype=torch.long, device=self.seq.device))

    def extend(self, other: "_Run") -> None:
        """Append the rows of `other`, a prefilled run of the same hierarchy and sampling settings whose cache shares
        this cache's storage: continuous batching admits requests between rounds this way. Per-position buffers are
        padded to the wider run (each row only reads below its own limit); the caches join with `cache.extend`."""
        def cat(a, b):
            if a is None and b is None:
                return None
            if a is None or b is None:  # e.g. sampling rows one run has not needed yet
                ref = a if a is not None else b
                z = ref.new_zeros((B1 if a is None else B2,) + tuple(ref.shape[1:]))
                a, b = (z, b) if a is None else (a, z)
            if a.dim() > 1 and a.shape[1] != b.shape[1]:
                w = max(a.shape[1], b.shape[1])
                pad = lambda t: torch.cat([t, t.new_zeros((t.shape[0], w - t.shape[1]) + tuple(t.shape[2:]))], 1)  # noqa: E731
                a, b = pad(a), pad(b)
            return torch.cat([a, b])

        B1, B2 = len(self.seq), len(other.seq)
        if [lv.name for lv in self.levels] != [lv.name for lv in other.levels] or self.do_sample != other.do_sample \
                or self.warp != other.warp or self.verification != other.verification:
            raise ValueError("extend: runs differ in hierarchy or sampling settings")
        self._map_rows(cat, other)
        self.results.update(other.results)
        self.row_stop.update(other.row_stop)
        self.cache.extend(other.cache)
        if self.policy is not None:
            self.policy.extend(other.policy)

    def begin_round(self) -> None:
        """Before a round: the policy (if any) sets every row's gammas; `auto`'s guard may then make the round
        plain (`_PlainGuard`)."""
        if self.policy is None:
            return
        self.policy.choose(self)
        guard = getattr(self.policy, "guard", None)
        if guard is not None:
            guard.begin(self)

    def end_round(self) -> None:
        """After a round's last commit: the guard times it."""
        guard = getattr(self.policy, "guard", None) if self.policy is not None else None
        if guard is not None:
            guard.end(self)

    def run(self):
        self.prefill()
        alive = self.commit()
        while alive:
            self.begin_round()
            if self.tree is not None and (self.policy is None or bool((self.gam[0] > 0).any())):
                tree_round(self, self.tree)
            else:  # a chain round (with trees: every row plain this round)
                self.run_level(self.K, torch.ones_like(self.seq, dtype=torch.bool))
            alive = self.commit()
            self.end_round()
        self.stats.new_tokens = sum(len(t) for t in self.results.values())
        return self.results


class _AutoPolicy:
    """`strategy="auto"`: per-row online choice of how much of the hierarchy to use, by the latency model.

    The hierarchy (`chain`, bottom-up, the full model last) is the latency-optimal speculative one for the
    checkpoint's calibration. Each row keeps, for every adjacent pair of levels (i -> i+1), a decayed count of
    accepted tokens and of rejections (each observation round: `acc = DECAY * acc + accepted`, `rej = DECAY * rej +
    (accepted < proposed)`), started from the calibration's acceptance with the weight of PRIOR rounds; its
    acceptance estimate is the i.i.d. maximum-likelihood `acc / (acc + rej)` (`latency.acceptance_from_counts`), and
    for an n-gram level 0 also its match rate. A lookup-first level 0 (`ngram|EXIT`) has two rates, counted apart by
    who proposed a row's round (its exit's, like any exit, and its n-gram's), and the lookup's match rate. Before
    every round the rule picks, per row, the lowest level s the row uses (s = K: plain decoding) and the gammas of
    levels s..K-1 minimising the latency model's predicted time per token (`latency.best_gammas`) under the row's
    own estimates, and writes them into `gam` (0 below s).
    A row that has switched level s-1 off keeps measuring it almost for free: when level s produces a token itself,
    the switched-off level's proposal for that position (its head on the exit state the pass just computed, every
    SHADOW_EVERY-th such pass; or an n-gram lookup, every time) is compared with it (greedy: equal top-1;
    sampling: the exact acceptance probability sum(min(p, q)), or p(x) for an n-gram point mass). So a row drops
    to cheaper hierarchies, down to plain decoding, when speculation stops paying, and climbs back when it pays
    again. Hysteresis: a row decoding plainly starts speculating only when the predicted time per token is more
    than MARGIN below plain decoding's (within the latency model's measured error a gain is not a gain); a row
    already speculating keeps doing so while any gain is predicted.

    The rule only changes how many tokens a level gathers and which levels a row uses, from tokens already drawn;
    every token is still verified by the full model exactly as in a fixed hierarchy, so output is unchanged.
    """

    DECAY = 0.85
    PRIOR = 2.0
    SHADOW_EVERY = 3  # plain verifications per shadow measurement of a switched-off exit (n-gram lookups: every one)
    MARGIN = 0.05  # a plain row starts speculating only for a predicted gain over 5% (the latency model's error)

    def __init__(self, chain: list[Level], cal, B: int, device, *, max_gamma: int = 8, tree=None):
        self.latency, self.cal, self.chain, self.max_gamma = latency, cal, chain, max_gamma
        self.tree = tree  # a TreeSpec: level 0 drafts this tree (or, per row, nothing: plain), see `_choose_tree`
        self.names = [lv.name for lv in chain]
        K = len(chain) - 1
        # per adjacent pair (i -> i+1) the rates its verification depends on: its own, or for a lookup-first level 0
        # its exit's (estimated in acc/rej, like any exit) and the n-gram's (in lacc/lrej)
        self.pairs = [level_pairs(a, b) for a, b in zip(self.names, self.names[1:])]
        self.lookup = bool(chain[0].lookup)
        prior = [float(cal.acceptance.get(p[0], 0.0)) for p in self.pairs]
        self.acc = torch.tensor([[self.PRIOR * p for p in prior]] * B, dtype=torch.float64).reshape(B, K)
        self.rej = torch.tensor([[self.PRIOR * (1 - p) for p in prior]] * B, dtype=torch.float64).reshape(B, K)
        p_ng = float(cal.acceptance.get(self.pairs[0][1], 0.0)) if self.lookup else 0.0
        self.lacc = torch.full((B,), self.PRIOR * p_ng, dtype=torch.float64)
        self.lrej = torch.full((B,), self.PRIOR * (1 - p_ng), dtype=torch.float64)
        match = float(getattr(cal, "ngram_match", 0.0) or 0.0)
        self.hit = torch.full((B,), self.PRIOR * match, dtype=torch.float64)
        self.miss = torch.full((B,), self.PRIOR * (1 - match), dtype=torch.float64)
        # per row, the lowest level it used in the last round; rows start as plain, so the first round needs MARGIN
        self.lowest = torch.full((B,), K, dtype=torch.long)
        self._shadow_tick = 0
        # trees, greedy: per row a decayed count of rounds whose model token is among the exit's top-k at the root,
        # for each distinct width k of the tree (`khit`, out of `kseen` rounds; prior: the calibration's r(k))
        self.kwidths = sorted(set(tree.widths)) if tree is not None else []
        r = cal.topk.get(self.latency.pair_key(self.names[0].removeprefix(LOOKUP), "full")) if self.kwidths else []
        self.khit = torch.tensor([[self.PRIOR * float(r[min(k, len(r)) - 1]) for k in self.kwidths]] * B,
                                 dtype=torch.float64).reshape(B, len(self.kwidths))
        self.kseen = torch.full((B,), self.PRIOR, dtype=torch.float64)
        self.guard = _PlainGuard()  # measured floor: the batch decodes plainly where its speculation loses

    ROW_STATE = ("acc", "rej", "lacc", "lrej", "hit", "miss", "lowest", "khit", "kseen")

    # ---------------------------------------------------------------- estimates
    def _update(self, i: int | None, rows: torch.Tensor, accepted: torch.Tensor, rejected: torch.Tensor):
        """Decay and count, for pair i (None: the lookup-first level's n-gram)."""
        if rows.numel():
            acc, rej = (self.lacc, self.lrej) if i is None else (self.acc[:, i], self.rej[:, i])
            acc[rows] = self.DECAY * acc[rows] + accepted.double()
            rej[rows] = self.DECAY * rej[rows] + rejected.double()

    def _match(self, rows: torch.Tensor, hit: torch.Tensor):
        if rows.numel():
            self.hit[rows] = self.DECAY * self.hit[rows] + hit.double()
            self.miss[rows] = self.DECAY * self.miss[rows] + (1 - hit.double())

    def observe(self, run: _Run, k: int, part, m, a, new, probs):
        """Called by `verify(k)` with its outcome, before the state moves on."""
        i = k - 1
        lower = run.levels[i]
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        part, m, a = cpu(part), cpu(m), cpu(a)
        gam_off = cpu(run.gam[i]) == 0
        spoke = part & (m > 0)
        tried = part & ~gam_off  # level i was asked to propose
        if lower.lookup:  # the rows the lookup served count for the n-gram's rate, the others for the exit's
            served = spoke & cpu(run.exhausted)
            for pair, rows in ((None, served), (i, spoke & ~served)):
                rows = rows.nonzero().flatten()
                self._update(pair, rows, a[rows].double(), (a[rows] < m[rows]).double())
            self._match(tried.nonzero().flatten(), served[tried].double())
        else:
            rows = spoke.nonzero().flatten()
            self._update(i, rows, a[rows].double(), (a[rows] < m[rows]).double())
            if lower.kind == "ngram":
                self._match(rows, torch.ones(len(rows)))
                nothing = (tried & (m == 0)).nonzero().flatten()  # the n-gram was asked and found nothing
                self._match(nothing, torch.zeros(len(nothing)))
        shadow = (part & (m == 0) & gam_off).nonzero().flatten()
        if not shadow.numel():
            return
        if lower.kind == "ngram" or lower.lookup:
            self._shadow_lookup(run, None if lower.lookup else i, shadow, new, probs)
        if lower.kind == "exit":
            self._shadow_exit(run, k, shadow, new, probs)

    def _shadow_lookup(self, run: _Run, pair: int | None, shadow, new, probs):
        """A switched-off lookup's first proposed token at the position the verifier just produced (every time)."""
        dev_rows = shadow.to(run.seq.device)
        ones = torch.ones_like(dev_rows)
        props, n = propose_batch(run.tok[dev_rows], run.seq[dev_rows], ones.bool(), ones, run.ngram)
        has = n.cpu() > 0
        self._match(shadow, has.double())
        if probs is not None:
            x = probs[dev_rows, 0].gather(-1, props[:, :1])[:, 0]
        else:
            x = (props[:, 0] == new[dev_rows]).double()
        x = x.detach().cpu().double()[has]
        self._update(pair, shadow[has], x, 1 - x)

    def _shadow_exit(self, run: _Run, k: int, shadow, new, probs):
        """A switched-off exit's proposal at that position (every SHADOW_EVERY-th time)."""
        i = k - 1
        if run.state_heads[i] is not None:  # a `layer` head needs its own KV: no free shadow, keep the estimate
            return
        self._shadow_tick += 1
        if self._shadow_tick % self.SHADOW_EVERY:  # an exit head costs a few % of a plain step: sample, not always
            return
        dev_rows = shadow.to(run.seq.device)
        # the switched-off exit's state at each row's last known position (all rows: one batched head call)
        last = (run.seq - 1).clamp(min=0)
        h = run.hid[k][torch.arange(len(last), device=last.device), last][:, None]
        logits = run._logits(i, h, pos=last[:, None])[:, 0][dev_rows]
        if probs is not None:
            q = logits_to_probs(logits, **run.warp)
            x = torch.minimum(q, probs[dev_rows, 0]).sum(-1)
        else:
            x = (logits.argmax(-1) == new[dev_rows]).double()
            if self.kwidths and i == 0:  # a tree's exit: the top-k counts too
                self._topk(shadow, rank_among(logits.topk(max(self.kwidths), dim=-1).indices, new[dev_rows]))
        x = x.detach().cpu().double()
        self._update(i, shadow, x, 1 - x)

    def _topk(self, rows: torch.Tensor, rank: torch.Tensor):
        """One observation, for each of `rows`, of whether the model's token is among the exit's top-k, for every
        width k of the tree (`rank` [len(rows)]: its rank among the exit's top choices, >= k when not in them)."""
        if rows.numel():
            hits = (rank.detach().cpu()[:, None] < torch.tensor(self.kwidths)).double()
            self.khit[rows] = self.DECAY * self.khit[rows] + hits
            self.kseen[rows] = self.DECAY * self.kseen[rows] + 1

    def observe_tree(self, run: _Run, drafted, top1, part, new, probs, rank=None):
        """Called by a tree round (`hispec.tree`) after its verification, before the state moves on. `top1` is,
        for every row of `part` (still decoding), one observation of its exit's top-1 rate at the root (greedy:
        whether the full model's token is the exit's top-1; sampling: the exact acceptance probability
        sum(min(p, q)) of one draft from the exit's q): the pass computes the exit's root logits for every row,
        so rows decoding plainly (not `drafted`) are measured exactly and for free, `layer` heads too. Greedy,
        `rank` [B] is the model token's rank among the root's children (the exit's top-k_1; k_1 when not among
        them): one observation of the row's top-k rate for each width of the tree. Switched-off rows' lookup is
        shadowed as in `observe` (`new`, probabilities `probs[:, 0]`)."""
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        drafted, part = cpu(drafted), cpu(part)
        rows = part.nonzero().flatten()
        x = cpu(top1).double()[rows]
        self._update(0, rows, x, 1 - x)
        if rank is not None and self.kwidths:
            self._topk(rows, cpu(rank)[rows])
        shadow = (part & ~drafted).nonzero().flatten()
        if shadow.numel() and self.lookup:
            self._shadow_lookup(run, None, shadow, new, probs)

    def lookup_missed(self, rows: torch.Tensor):
        """Rows (bool [B]) whose lookup-first exit tried the n-gram before a tree round and found nothing (the rows
        it served are counted by `observe`, when their chain is verified)."""
        rows = rows.detach().cpu().nonzero().flatten()
        self._match(rows, torch.zeros(len(rows)))

    # ---------------------------------------------------------------- choice
    def _choose_tree(self, run: _Run, cal, alphas, lookup, match):
        """Per row: the tree, or plain decoding (gam 0), whichever the latency model predicts faster under the row's
        own estimates (greedy: its top-k rates at the tree's widths, counted by `observe_tree`; sampling, where only
        the top-1 acceptance is observed exactly: the calibration's top-k rates scaled to the row's, by
        `latency.scaled_topk`; for a lookup-first exit also the n-gram's rate and match rate), with the same
        hysteresis as chains."""
        exit_level = self.names[0].removeprefix(LOOKUP)
        key = self.latency.pair_key(exit_level, "full")
        rates, widths = cal.topk[key], list(self.tree.widths)
        plain = cal.plain_seconds_per_token()
        own = None if run.do_sample else (self.khit / self.kseen[:, None].clamp(min=1e-9)).tolist()
        gam = [0] * alphas.shape[0]
        for b in range(alphas.shape[0]):
            margin = self.MARGIN if int(self.lowest[b]) == 1 else 0.0
            row = self.latency.scaled_topk(rates, float(alphas[b, 0]))
            for k, r in zip(self.kwidths, own[b] if own is not None else ()):
                row[k - 1] = r
            topk = {key: row}
            ng = {self.pairs[0][1]: float(lookup[b])} if self.lookup else None  # the row's n-gram rate
            t = self.latency.tree_time_per_token(widths, cal, exit_level, topk, lookup=self.lookup,
                                                 acceptance=ng, match=float(match[b]))
            on = t < plain * (1 - margin)
            gam[b] = 1 if on else 0
            self.lowest[b] = 0 if on else 1
        run.gam = [torch.tensor(gam, dtype=run.gam[0].dtype, device=run.gam[0].device)]

    def choose(self, run: _Run):
        alphas = self.acc / (self.acc + self.rej).clamp(min=1e-9)  # [B, K]: latency.acceptance_from_counts
        lookup = self.lacc / (self.lacc + self.lrej).clamp(min=1e-9)
        match = self.hit / (self.hit + self.miss).clamp(min=1e-9)
        K = len(self.chain) - 1
        cal = self.cal.at_batch(alphas.shape[0])  # priced at this batch's costs (`Calibration.at_batch`)
        if self.tree is not None:
            self._choose_tree(run, cal, alphas, lookup, match)
            run.stats.row_rounds += alphas.shape[0]
            run.stats.plain_row_rounds += int((self.lowest == K).sum())
            return
        gam = [g.clone() for g in run.gam]
        for b in range(alphas.shape[0]):
            margin = self.MARGIN if int(self.lowest[b]) == K else 0.0  # hysteresis: climbing needs a clear gain
            rates = {p[0]: a for p, a in zip(self.pairs, alphas[b].tolist())}
            if self.lookup:
                rates[self.pairs[0][1]] = float(lookup[b])
            gs = self.latency.best_gammas(self.names, cal, rates, max_gamma=self.max_gamma,
                                          ngram_match=float(match[b]), margin=margin)
            self.lowest[b] = next((i + 1 for i in range(K - 1, -1, -1) if gs[i] == 0), 0)
            for i in range(K):
                gam[i][b] = gs[i]
        run.gam = gam
        run.stats.row_rounds += alphas.shape[0]
        run.stats.plain_row_rounds += int((self.lowest == K).sum())

    def extend(self, other: "_AutoPolicy"):  # (the guard's timings stay: they are per token, not per row)
        for name in self.ROW_STATE:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))

    def keep_rows(self, idx: torch.Tensor):
        idx = idx.cpu()
        for name in self.ROW_STATE:
            setattr(self, name, getattr(self, name).index_select(0, idx))


class _PlainGuard:
    """`auto`'s measured floor: a batch does not keep speculating where its own speculative rounds, timed, cost more
    wall time per committed token than its own plain rounds.

    The rule above prices rounds with the calibration's single-row pass costs (scaled by `Calibration.at_batch`);
    that holds for one row but not for every batch: a verification pass spans the widest row's proposal for every
    row, and its attention runs over each row's own cache, so on a CPU a batch of 16 can pay several times the
    predicted cost for the positions one speculating row adds (tools/batch_speed.py measured auto at 0.77x of plain
    rows at batch 16 with the rule alone). The guard does not model that; it measures it. Two arms, per run:
    `spec` (the rule's choice, whenever it speculates for any row) and `plain` (every row one token, which is `ar`).
    Each round's wall time from `begin` (after the rule chose) to `end` (after its last commit) and the tokens it
    committed go to the arm it ran, as decayed sums (a round's weight decays by DECAY per round since, so an arm
    measured long ago, at a shorter cache or another batch, counts little once re-measured); an arm's cost is
    seconds / tokens. While both arms are measured the round runs the cheaper one, except that the other is measured
    again (one round) once EXPLORE times its last round's seconds have gone to the cheaper one; while `plain` is not
    yet measured, the round after WARM speculative rounds is plain. So exploring takes at most ~1/EXPLORE of the
    time, and a user ends up near plain decoding's speed where speculation loses (the warm-up's WARM rounds aside),
    whatever the calibration predicted.

    Only which rows speculate changes (a plain round is the rule's own all-plain choice), never how tokens are
    verified: output is unchanged. `clock` is replaceable (tests use a cost model instead of wall time)."""

    DECAY = 0.9  # per round since an arm's last measurement
    EXPLORE = 16  # the arm not in use is measured again once EXPLORE of its rounds' time went to the other
    WARM = 2  # speculative rounds before the first plain measurement
    clock = staticmethod(time.perf_counter)

    def __init__(self):
        self.sec = {"spec": 0.0, "plain": 0.0}
        self.tok = {"spec": 0.0, "plain": 0.0}
        self.last = {"spec": None, "plain": None}  # per arm: (round, elapsed seconds) of its last measurement
        self.round_sec = {"spec": 0.0, "plain": 0.0}  # per arm: its last round's seconds
        self.spec_rounds = 0
        self.round = 0
        self.elapsed = 0.0  # seconds of every measured round
        self._open = None  # (arm, start time, committed tokens at the start)

    def cost(self, arm: str) -> float | None:
        """Measured seconds per committed token of `arm` (None: not measured yet)."""
        return self.sec[arm] / self.tok[arm] if self.tok[arm] > 0 else None

    def _arm(self, speculating: bool) -> str:
        if not speculating:
            return "plain"
        spec, plain = self.cost("spec"), self.cost("plain")
        if plain is None:
            return "plain" if self.spec_rounds >= self.WARM else "spec"
        if spec is None:
            return "spec"
        best, other = ("spec", "plain") if spec <= plain else ("plain", "spec")
        # exploring costs at most one round of the other arm per EXPLORE such rounds' time: <= 1/EXPLORE of the time
        due = self.elapsed - self.last[other][1] >= self.EXPLORE * self.round_sec[other]
        return other if due else best

    def begin(self, run) -> None:
        speculating = any(bool((g > 0).any()) for g in run.gam)
        arm = self._arm(speculating)
        if speculating and arm == "plain":
            rows = len(run.seq)
            was_plain = int((torch.stack([g.cpu() for g in run.gam]) == 0).all(0).sum()) if run.gam else rows
            run.gam = [torch.zeros_like(g) for g in run.gam]
            run.stats.plain_row_rounds += rows - was_plain
            run.stats.guarded_rounds += 1
        self._open = (arm, self.clock(), run.committed_tokens)

    def end(self, run) -> None:
        if self._open is None:
            return
        arm, t0, n0 = self._open
        self._open = None
        seconds, tokens = self.clock() - t0, run.committed_tokens - n0
        if tokens <= 0:
            return
        if self.last[arm] is not None:
            w = self.DECAY ** (self.round - self.last[arm][0])
            self.sec[arm] *= w
            self.tok[arm] *= w
        self.sec[arm] += seconds
        self.tok[arm] += tokens
        self.elapsed += seconds
        self.round_sec[arm] = seconds
        self.last[arm] = (self.round, self.elapsed)
        self.spec_rounds += arm == "spec"
        self.round += 1


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, (list, tuple, set)):
        return [int(v) for v in x]
    return [int(x)]


def _stop_checker(stop_strings, tokenizer):
    if not stop_strings:
        return None
    if tokenizer is None:
        raise ValueError("stop_strings need a tokenizer: pass tokenizer=... or load the model with one")
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    # A stop string of c characters spans at most c tokens that decode to text (plus a few for tokens that decode
    # to nothing, e.g. parts of a multi-byte character): decoding that far back before the new tokens suffices.
    back = 2 * max(len(s) for s in stops) + 8

    def check(toks: list[int], new_from: int = 0):
        """The length to cut `toks` to (just after the first token that completes a stop string), or None; tokens
        before `new_from` were checked already."""
        lo = max(0, new_from - back)
        decode = lambda i: tokenizer.decode(toks[lo:i], skip_special_tokens=False)  # noqa: E731
        if not any(s in decode(len(toks)) for s in stops):
            return None
        for i in range(max(new_from, lo) + 1, len(toks) + 1):  # the first token that completes a stop string
            if any(s in decode(i) for s in stops):
                return i
        return len(toks)

    return check


_warned: set = set()


def default_strategy(model) -> str:
    """`auto` when the checkpoint holds a calibration made on this kind of machine, else plain decoding (`ar`),
    with a warning once: without measurements nothing says speculation pays here, and it must never be slower."""
    cal = getattr(model.hispec_config, "calibration", None)
    if cal:
        try:
            _calibration(model)
            return "auto"
        except CalibrationError as e:
            why = str(e)
    else:
        why = "the checkpoint holds no calibration"
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"hispec: {why}; decoding plainly (strategy='ar'). Measure this machine with "
                      "`hispec-export RUN --output-dir OUT --calibrate` or `hispec-bench --model CKPT --calibrate`, "
                      "or choose a strategy yourself.", stacklevel=3)
    return "ar"


def _calibration(model):
    cal = getattr(model.hispec_config, "calibration", None)
    if not cal:
        raise CalibrationError(
            "strategy='auto' needs a calibration of this checkpoint on this machine: run `hispec-export RUN "
            "--output-dir OUT --calibrate` or `hispec-bench --model CKPT --calibrate`, or pick a strategy")
    cal = cal if isinstance(cal, Calibration) else Calibration.from_dict(cal)
    cal.check(model)
    return cal


def _plan_levels(model, names, gammas, *, gamma, window, ngram) -> list[Level]:
    """Level objects for a plan in calibration level names ("L4", "ngram|L4", ...)."""
    by_name = {f"L{model.hispec_config.layer_of(n)}": n for n in model.exit_names}
    by_name.update({LOOKUP + k: LOOKUP + v for k, v in by_name.items()})
    return build_levels(model, [by_name.get(n, n) for n in names], list(gammas) or None, gamma=gamma, window=window,
                        ngram=ngram)


def _auto_chain(model, cal, *, gamma, window, ngram) -> list[Level]:
    """The latency-optimal speculative chain hierarchy for the calibration (rows may still decode plainly)."""
    plan = latency.auto_plan(cal, trees=False)
    return _plan_levels(model, plan.levels, plan.gammas, gamma=gamma, window=window, ngram=ngram)


def _auto_trees(do_sample: bool, verification: str | None) -> bool:
    """Whether `auto` may draft trees: not when sampling verifies sequence-level (`verification="hsd"`), a rule
    for chains (a tree's children are verified token-wise, `hispec.sampling.recursive_accept`)."""
    return not do_sample or verification == "token"


def _auto_plan(model, cal, *, gamma, window, ngram, max_new_tokens: int | None = None, trees: bool = True):
    """`auto`'s plan: (levels, tree, predicted seconds per token), `latency.auto_plan` (the latency-optimal
    speculative chain, or a static tree with some width > 1 where predicted faster; `hispec.tree`) as the model's
    levels; trees never deeper than `max_new_tokens`. `generate` and the bench's prediction both plan through
    here."""
    plan = latency.auto_plan(cal, trees=trees, max_depth=5 if max_new_tokens is None else min(5, max_new_tokens))
    levels = _plan_levels(model, plan.levels, plan.gammas if plan.widths is None else (), gamma=gamma, window=window,
                          ngram=ngram)
    return levels, None if plan.widths is None else TreeSpec(plan.widths), plan.seconds_per_token


def ngram_config(model, ngram=None) -> NgramConfig:
    """The n-gram level's config: `ngram` (an `NgramConfig` or its fields) if given, else the checkpoint's
    `decoding.ngram` if it sets one, else the one its calibration measured (and chose: `latency.calibrate`), else
    the defaults. The calibration's acceptance figures hold for its own config, so `auto` plans with what it runs."""
    if isinstance(ngram, NgramConfig):
        return ngram
    if ngram:
        return NgramConfig(**ngram)
    cfg = model.hispec_config
    if getattr(cfg, "ngram", None):
        return NgramConfig(**cfg.ngram)
    cal = getattr(cfg, "calibration", None)
    measured = cal.ngram if isinstance(cal, Calibration) else (cal or {}).get("ngram")
    return NgramConfig(**measured) if measured else NgramConfig()


@torch.no_grad()
def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int = 128,
    strategy: str | list | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    gamma: int | None = None,
    window: int | None = None,
    gammas: list[int] | None = None,
    ngram: NgramConfig | dict | None = None,
    eos_token_id=None,
    pad_token_id: int | None = None,
    stop_strings=None,
    streamer=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    policy=None,
    tree=None,
    verification: str | None = None,
) -> GenerationOutput:
    """Generate with an `EarlyExitModel`. `input_ids` `[B, P]` may be left-padded (give `attention_mask`).

    `strategy`: `auto` (the default when the checkpoint holds a calibration for this machine, else `ar`), a named
    hierarchy (`ar`, `self-spec`, `hispec`, `ngram`, `ngram-self-spec`, `ngram-hispec`) or a spec such as
    `"ngram>L8>full"`. `gamma` sets the lowest exit's draft count, `window` the higher exits', `gammas` every
    level's (one per level below the full model); `ngram` configures the n-gram level (`NgramConfig` or its fields:
    max_ngram, min_ngram, max_len — max_len is that level's gamma). Defaults come from the checkpoint's config;
    eos/pad from the base model's generation config. Strategies ignore what they do not use.

    `tree`: draft a static tree at level 0 instead of a chain and verify it in one full pass (`hispec.tree`):
    widths per depth, `[4, 2, 1]` or `"4x2x1"` (the root's top-4, each one's top-2, then top-1: 4 + 8 + 8 nodes;
    sampling draws the children without replacement), or `"dyn-D-K-B-N"`, a dynamic EAGLE-2-style tree (depth D,
    top-K per expanded node, B nodes expanded per depth, the N best verified; greedy only). Needs a hierarchy of one draft exit under the full model
    (`self-spec`, `draft>full`, `L4>full`), or the lookup-first exit (`self-spec-lookup`: the n-gram lookup first,
    the tree where it misses); `gamma` is then unused. Default None: chains (`auto` may still plan a tree itself,
    `_auto_plan`).
    `verification`: the acceptance rule when sampling, at every level of the hierarchy: `"token"` (speculative
    sampling, token by token) or `"hsd"` (sequence-level, `hispec.sampling.hsd_accept`: the same output
    distribution, at least as many accepted tokens); default: the checkpoint's `decoding.verification`, else
    "token". Greedy decoding (`do_sample=False`) matches exact prefixes and is identical under both.

    `policy` (advanced): an object with `choose(run)`, `observe(run, k, part, m, a, new, probs)` and
    `keep_rows(idx)` that sets the per-row gammas `run.gam` between rounds (see `_AutoPolicy`, which `auto` uses).
    """
    cfg = model.hispec_config
    explicit_verification = verification
    verification = check_verification(getattr(cfg, "verification", "token") if verification is None
                                      else verification)
    gamma = cfg.gamma if gamma is None else gamma
    window = cfg.window if window is None else window
    for name, v in (("gamma", gamma), ("window", window)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    ngram = ngram_config(model, ngram)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    tree = parse_tree(tree)
    if strategy is None:
        strategy = "self-spec" if tree is not None else default_strategy(model)
    if tree is not None and strategy == "auto":
        raise ValueError("tree drafts need a fixed hierarchy of one draft exit under the full model (e.g. "
                         "strategy='self-spec'), not 'auto'")
    policy_cal = auto_tree = levels = None
    if strategy == "auto":
        policy_cal = _calibration(model)  # (planned below, once the batch size is known)
    else:
        levels = build_levels(model, parse_hierarchy(strategy, model), gammas, gamma=gamma, window=window,
                              ngram=ngram)
    if tree is not None:
        check_tree(tree, levels, max_new_tokens=max_new_tokens, policy=policy, do_sample=do_sample)
        if do_sample and explicit_verification == "hsd":
            raise ValueError("verification='hsd' verifies chains; a tree's children are verified by recursive "
                             "rejection sampling (hispec.sampling.recursive_accept): drop tree= or verification=")
    dev = model.device
    input_ids = torch.as_tensor(input_ids, device=dev)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, length] tensor of token ids (the prompt is empty)")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask, device=dev)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    vocab = model.adapter.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids contain ids outside the vocabulary 0..{vocab - 1}")
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {b} is empty (its attention_mask has no 1s)")
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if max_pos and longest + max_new_tokens > max_pos:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{max_pos} positions; shorten the prompt or lower max_new_tokens"
        )
    gen_cfg = getattr(model.base, "generation_config", None)
    if eos_token_id is None and gen_cfg is not None:
        eos_token_id = gen_cfg.eos_token_id
    eos = torch.tensor(_as_list(eos_token_id), dtype=torch.long, device=dev)
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None) if gen_cfg is not None else None
        if pad_token_id is None:
            pad_token_id = int(eos[0]) if eos.numel() else 0
    if streamer is not None and len(prompts) != 1:
        raise ValueError("streaming supports batch size 1 only")

    if policy_cal is not None:
        # planned at this batch's costs (`Calibration.at_batch`): a full batch is compute-bound, where fewer extra
        # positions pay
        levels, auto_tree, _ = _auto_plan(model, policy_cal.at_batch(len(prompts)), gamma=gamma, window=window,
                                          ngram=ngram, max_new_tokens=max_new_tokens,
                                          trees=_auto_trees(do_sample, verification))
        policy = _AutoPolicy(levels, policy_cal, len(prompts), dev, tree=auto_tree)
        tree = auto_tree
    run = _Run(
        model,
        levels,
        prompts,
        [len(p) + max_new_tokens for p in prompts],
        do_sample=do_sample,
        warp=dict(temperature=temperature, top_k=top_k, top_p=top_p),
        eos=eos,
        generator=generator,
        stop_check=_stop_checker(stop_strings, tokenizer if tokenizer is not None else model.tokenizer),
        streamer=streamer,
        ngram=ngram,
        policy=policy,
        tree=tree,
        verification=verification,
    )
    run.stats.strategy = ("auto:" if policy_cal is not None else "") + ">".join(lv.name for lv in levels)
    if tree is not None:
        run.stats.strategy += f"[tree {tree}]"
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if max_new_tokens == 0:
        results = {b: [] for b in range(len(prompts))}
    else:
        results = run.run()
    if streamer is not None:
        streamer.end()
    new = [results[b] for b in range(len(prompts))]
    width = max((len(t) for t in new), default=0)
    tail = torch.full((len(new), width), pad_token_id, dtype=torch.long, device=dev)
    for b, t in enumerate(new):
        if t:
            tail[b, : len(t)] = torch.tensor(t, device=dev)
    return GenerationOutput(sequences=torch.cat([input_ids, tail], 1), stats=run.stats, new_tokens=new)
