"""Decoding strategies on one machinery: `ar`, `self-spec` (L_d -> L) and `hispec` (L_d -> L_i -> L).

A strategy is a list of *levels*, each an exit layer with a head: level 0 drafts token by token, level k >= 1
verifies what level k-1 gathered, and the top level is the full model. The layers form one *range* per level,
`[e_{k-1}, e_k)`; each range keeps its own KV length, and the hidden state entering range k is kept for every
position that passed range k-1 but not range k (hidden-state reuse). A verification at level k "advances" ranges
0..k over exactly the positions still pending for them, so KV written for a token that is later accepted is never
recomputed (KV reuse); rejected positions are rolled back in every range.

Per row (all tensors are `[B, ...]`; rows keep their own counts):
- `tok[b, i]` is the i-th real token of row b, its absolute position is i; `seq[b]` tokens are known.
- `ver[k][b]` tokens have been verified by level k (k >= 1); `ver[K]` are committed.
- `done[j][b]` positions have passed range j. Invariant for j >= 1: `done[j] == ver[j] - 1`.

The prompt is prefilled through all layers at once and the full model picks the first new token.

Lossless: greedy verification keeps the longest prefix equal to the level's argmax; sampling uses speculative
sampling at every level, with level k-1's stored probability rows as proposal and level k's as target, so the
tokens a level accepts are exact samples of that level, and committed tokens are exact samples of the model.
Whether a level verifies depends only on tokens already drawn, which keeps the argument valid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import greedy_accept, logits_to_probs, sample, speculative_accept

STRATEGIES = ("ar", "self-spec", "hispec")


@dataclass
class GenerationStats:
    """Counters summed over the batch. Derived rates are properties."""

    new_tokens: int = 0
    drafted: int = 0  # tokens proposed by the draft head
    accepted_at_verify: int = 0  # drafts the intermediate verifier accepted (hispec)
    proposed_to_verify: int = 0
    accepted_at_target: int = 0  # tokens the full model accepted of those proposed to it
    proposed_to_target: int = 0
    target_passes: int = 0  # batched full-model verification passes (ar: decode steps)
    target_row_passes: int = 0  # the same, counted per participating row
    verify_passes: int = 0
    layer_evals: int = 0  # decoder-layer evaluations of real tokens, summed over positions
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "target": 0.0})

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / max(self.target_row_passes, 1)

    @property
    def verify_acceptance(self) -> float:
        return self.accepted_at_verify / max(self.proposed_to_verify, 1)

    @property
    def target_acceptance(self) -> float:
        return self.accepted_at_target / max(self.proposed_to_target, 1)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["seconds"] = dict(self.seconds)
        d["tokens_per_target_pass"] = self.tokens_per_target_pass
        d["verify_acceptance"] = self.verify_acceptance
        d["target_acceptance"] = self.target_acceptance
        return d


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N]: the prompt as given, then new tokens, padded after a row finishes
    stats: GenerationStats
    new_tokens: list[list[int]]  # per row, the generated tokens (through EOS / stop string)


@dataclass(frozen=True)
class Level:
    exit_layer: int
    head: str | None  # 'draft' / 'verify', or None for the model's own final norm + lm_head
    threshold: int  # how many tokens this level gathers before the next level verifies them


def levels_for(strategy: str, num_layers: int, draft_layer: int, verify_layer: int, gamma: int, window: int):
    if strategy == "ar":
        return [Level(num_layers, None, 1)]
    if strategy == "self-spec":
        return [Level(draft_layer, "draft", gamma), Level(num_layers, None, 1)]
    if strategy == "hispec":
        return [Level(draft_layer, "draft", gamma), Level(verify_layer, "verify", window), Level(num_layers, None, 1)]
    raise ValueError(f"unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")


class _Run:
    """State and steps of one batched generation call."""

    def __init__(self, model, levels, prompts, limits, *, do_sample, warp, eos, generator, stop_check, streamer):
        self.model, self.adapter, self.levels = model, model.adapter, levels
        self.K = len(levels) - 1
        self.bounds = [0] + [lv.exit_layer for lv in levels]
        self.do_sample, self.warp, self.generator = do_sample, warp, generator
        self.eos = eos  # LongTensor of EOS ids (may be empty)
        self.stop_check, self.streamer = stop_check, streamer
        self.stats = GenerationStats()
        dev = self.adapter.device
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        self.limit = torch.as_tensor(limits, device=dev)
        cap = int(self.limit.max()) + sum(lv.threshold for lv in levels) + len(levels) + 2
        self.tok = torch.zeros(B, cap, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.tok[b, : len(p)] = torch.as_tensor(p, device=dev)
        self.prompt_len = lens.clone()
        self.seq = lens.clone()
        self.ver = [None] + [lens.clone() for _ in range(self.K)]
        self.done = [torch.zeros_like(lens) for _ in range(self.K + 1)]
        H = self.adapter.hidden_size
        self.hid = [None] + [torch.zeros(B, cap, H, dtype=self.adapter.dtype, device=dev) for _ in range(self.K)]
        # `layer` heads keep their own KV as extra cache layers, advanced and rolled back with their exit's range
        self.cache = self.adapter.new_cache(B, extra=2 if model.stateful_heads else 0)
        self.state_heads = [None] * (self.K + 1)
        for j, lv in enumerate(levels[:-1]):
            head = model.heads[lv.head]
            if head.stateful:
                self.state_heads[j] = head
        self.orig = torch.arange(B, device=dev)
        self.results: dict[int, list[int]] = {}
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
        out = self.adapter.run_layers(inp, a, b, position_ids=idx, cache=self.cache, valid=valid)
        self.stats.layer_evals += int(n.sum()) * (b - a)
        if j + 1 <= self.K:
            r, c = valid.nonzero(as_tuple=True)
            self.hid[j + 1][r, idx[r, c]] = out[r, c]
        feats = None
        head = self.state_heads[j]
        if head is not None:  # the head's own layer sees exactly the positions its exit's range saw
            def run_layer(module, hidden):
                return self.adapter.run_module(module, head.layer_type, hidden, cache_index=head.cache_index,
                                               position_ids=idx, cache=self.cache, valid=valid)

            feats = head(out, run_layer)
            self.stats.layer_evals += int(n.sum())
        self.done[j] = torch.maximum(start, end)
        return out, start, feats

    def _logits(self, k: int, hidden: torch.Tensor, head_feats: torch.Tensor | None = None) -> torch.Tensor:
        head = self.levels[k].head
        if head is None:
            return self.adapter.final_logits(hidden)
        if head_feats is not None:  # a stateful head already ran while its range advanced
            return self.model.project_exit(head, head_feats)
        return self.model.exit_logits(head, hidden)

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

    def _store_rows(self, k: int, first_pos: torch.Tensor, probs: torch.Tensor):
        # probs [B, W, V] are level k's rows predicting positions first_pos + 0..W-1
        off = first_pos - self.base
        W = probs.shape[1]
        rows = self._ensure_rows(k, int(off.max()) + W, probs.shape[-1], probs)
        idx = off[:, None] + torch.arange(W, device=off.device)
        rows.scatter_(1, idx[..., None].expand(-1, -1, probs.shape[-1]), probs)

    def _read_rows(self, k: int, first_pos: torch.Tensor, W: int) -> torch.Tensor:
        off = first_pos - self.base
        rows = self.rows[k]
        idx = (off[:, None] + torch.arange(W, device=off.device)).clamp(max=rows.shape[1] - 1)
        return rows.gather(1, idx[..., None].expand(-1, -1, rows.shape[-1]))

    # ------------------------------------------------------------------ steps
    def prefill(self):
        """All prompt tokens through all layers in one call per range (the same chunking as a plain forward, so
        low-precision numerics match transformers), then the first new token from the full model."""
        t0 = time.perf_counter()
        end = self.prompt_len
        out = None
        for j in range(self.K + 1):
            out, _, _ = self._advance(j, end)
        feats = out[torch.arange(len(end), device=end.device), end - 1][:, None]  # [B, 1, H]
        logits = self._logits(self.K, feats)[:, 0]
        token = sample(logits_to_probs(logits, **self.warp), self.generator) if self.do_sample else logits.argmax(-1)
        self.tok.scatter_(1, end[:, None], token[:, None])
        self.seq = end + 1
        self.ver = [None] + [self.seq.clone() for _ in range(self.K)]
        self.base = self.seq.clone()
        self.stats.target_passes += 1
        self.stats.target_row_passes += len(end)
        self.stats.seconds["prefill"] += time.perf_counter() - t0

    def draft_step(self):
        """Level 0 proposes one token per row that still may grow (for `ar` that token is committed)."""
        t0 = time.perf_counter()
        grow = self.seq < self._stop_pos()
        end = torch.where(grow, self.seq, self.done[0])
        out, start, hf = self._advance(0, end)
        if out is not None:
            last = (end - start - 1).clamp(min=0)
            rows = torch.arange(len(last))
            feats = out[rows, last][:, None]  # [B, 1, H]
            logits = self._logits(0, feats, None if hf is None else hf[rows, last][:, None])[:, 0]
            if self.do_sample:
                probs = logits_to_probs(logits, **self.warp)
                token = sample(probs, self.generator)
                if self.K:
                    self._store_rows(0, self.seq, probs[:, None])
            else:
                token = logits.argmax(-1)
            pos = self.seq.clamp(max=self.tok.shape[1] - 1)
            self.tok.scatter_(1, pos[:, None], torch.where(grow, token, self.tok.gather(1, pos[:, None])[:, 0])[:, None])
            self.seq = self.seq + grow.long()
            if self.K:
                self.stats.drafted += int(grow.sum())
            else:
                self.stats.target_passes += 1
                self.stats.target_row_passes += int(grow.sum())
        stage = "draft" if self.K else "target"
        self.stats.seconds[stage] += time.perf_counter() - t0

    def needs_verify(self, k: int) -> bool:
        """Level k must verify: some row gathered enough level-(k-1) tokens, or hit its length limit / EOS."""
        stop = self._stop_pos()
        count = torch.minimum(self.seq, stop) - self.ver[k]
        full = (count >= self.levels[k - 1].threshold) | ((count > 0) & (self.seq >= stop))
        return bool(full.any())

    def verify(self, k: int):
        """Level k verifies the tokens level k-1 gathered beyond ver[k], in every row that has some."""
        t0 = time.perf_counter()
        stop = self._stop_pos()
        m = (torch.minimum(self.seq, stop) - self.ver[k]).clamp(min=0)
        part = m > 0
        if not bool(part.any()):
            return
        out = hf = None
        for j in range(k + 1):
            out, _, hf = self._advance(j, torch.where(part, self.seq, self.done[j]))
        M = int(m.max())
        feats = out[:, : M + 1]  # range k started at ver[k] - 1 for participating rows
        logits = self._logits(k, feats, None if hf is None else hf[:, : M + 1])  # [B, M+1, V]
        cidx = (self.ver[k][:, None] + torch.arange(M, device=m.device)).clamp(max=self.tok.shape[1] - 1)
        cands = self.tok.gather(1, cidx)
        if self.do_sample:
            probs = logits_to_probs(logits, **self.warp)
            q = self._read_rows(k - 1, self.ver[k], M)
            a, new = speculative_accept(cands, m, q, probs, self.generator)
            if k < self.K:
                self._store_rows(k, self.ver[k], probs)
        else:
            a, new = greedy_accept(cands, m, logits)
        a = torch.where(part, a, torch.zeros_like(a))
        newpos = self.ver[k] + a
        has_new = part & (newpos < stop)
        pos = newpos.clamp(max=self.tok.shape[1] - 1)
        keep_tok = self.tok.gather(1, pos[:, None])[:, 0]
        self.tok.scatter_(1, pos[:, None], torch.where(has_new, new, keep_tok)[:, None])
        # Roll back every range past the last kept position of participating rows.
        big = torch.full_like(newpos, torch.iinfo(torch.long).max)
        keep_below = torch.where(part, newpos, big)
        for j in range(self.K + 1):
            self.cache.truncate(self.bounds[j], self.bounds[j + 1], keep_below)
            if self.state_heads[j] is not None:
                c = self.state_heads[j].cache_index
                self.cache.truncate(c, c + 1, keep_below)
            self.done[j] = torch.minimum(self.done[j], keep_below)
        new_seq = torch.where(part, newpos + has_new.long(), self.seq)
        self.seq = new_seq
        for i in range(1, k + 1):
            self.ver[i] = torch.where(part, new_seq, self.ver[i])
        s = self.stats
        if k == self.K:
            s.accepted_at_target += int(a.sum())
            s.proposed_to_target += int(m.sum())
            s.target_passes += 1
            s.target_row_passes += int(part.sum())
            self.base = torch.where(part, new_seq, self.base)
            s.seconds["target"] += time.perf_counter() - t0
        else:
            s.accepted_at_verify += int(a.sum())
            s.proposed_to_verify += int(m.sum())
            s.verify_passes += 1
            s.seconds["verify"] += time.perf_counter() - t0

    def run_level(self, k: int):
        if k == 0:
            self.draft_step()
            return
        while not self.needs_verify(k):
            self.run_level(k - 1)
        self.verify(k)

    def commit(self) -> bool:
        """Hand over committed tokens, finish rows (EOS, length, stop strings); returns True while rows remain."""
        committed = self.ver[self.K] if self.K else self.seq
        stop = self._stop_pos()
        finished = committed >= torch.minimum(stop, self.limit)
        keep = []
        eos_ids = set(self.eos.tolist())
        for b in range(len(committed)):
            rid = int(self.orig[b])
            toks = self.tok[b, int(self.prompt_len[b]) : int(committed[b])].tolist()
            if eos_ids:
                cut = next((i for i, t in enumerate(toks) if t in eos_ids), None)
                if cut is not None:
                    toks, finished[b] = toks[: cut + 1], True
            if self.stop_check is not None:
                cut = self.stop_check(toks)
                if cut is not None:
                    toks, finished[b] = toks[:cut], True
            if self.streamer is not None:
                prev = len(self.results.get(rid, []))
                if len(toks) > prev:
                    self.streamer.put(torch.tensor(toks[prev:]))
            self.results[rid] = toks
            if not finished[b]:
                keep.append(b)
        if len(keep) < len(committed):
            self._keep_rows(torch.tensor(keep, dtype=torch.long, device=committed.device))
        return bool(keep)

    def _keep_rows(self, idx: torch.Tensor):
        sel = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
        self.tok, self.seq, self.limit, self.prompt_len = map(sel, (self.tok, self.seq, self.limit, self.prompt_len))
        self.ver = [sel(v) for v in self.ver]
        self.done = [sel(d) for d in self.done]
        self.hid = [sel(h) for h in self.hid]
        self.rows = [sel(r) for r in self.rows]
        self.base, self.orig = sel(self.base), sel(self.orig)
        self.cache.reorder_batch(idx)

    def run(self):
        self.prefill()
        alive = self.commit()
        while alive:
            self.run_level(self.K)
            alive = self.commit()
        self.stats.new_tokens = sum(len(t) for t in self.results.values())
        return self.results


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

    def check(toks: list[int]):
        text = tokenizer.decode(toks, skip_special_tokens=False)
        if not any(s in text for s in stops):
            return None
        for i in range(1, len(toks) + 1):  # the first token that completes a stop string
            if any(s in tokenizer.decode(toks[:i], skip_special_tokens=False) for s in stops):
                return i
        return len(toks)

    return check


@torch.no_grad()
def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int = 128,
    strategy: str = "hispec",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    gamma: int | None = None,
    window: int | None = None,
    eos_token_id=None,
    pad_token_id: int | None = None,
    stop_strings=None,
    streamer=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
) -> GenerationOutput:
    """Generate with an `EarlyExitModel`. `input_ids` `[B, P]` may be left-padded (give `attention_mask`).

    Strategies ignore what they do not use (`ar` ignores gamma/window). Defaults for gamma/window come from the
    checkpoint's config; eos/pad from the base model's generation config.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")
    cfg = model.hispec_config
    gamma = cfg.gamma if gamma is None else gamma
    window = cfg.window if window is None else window
    for name, v in (("gamma", gamma), ("window", window)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
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

    levels = levels_for(strategy, model.num_layers, model.draft_layer, model.verify_layer, gamma, window)
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
    )
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
