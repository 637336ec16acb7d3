"""Continuous batching for hispec's decoder: requests join and leave a running batch between speculative rounds.

One engine step:
1. **Cancel** rows whose request was cancelled (client gone): they leave their batch, their KV blocks are freed.
2. **Admit** queued requests, first come first served, while the batch has room (`max_batch` rows) and the KV
   pool can hold each request's worst case (prompt + max_tokens + 1 positions, reserved at admission, so a
   running row never runs out of blocks; no preemption). A request that could never fit is refused at submit.
3. **Prefill** the admitted requests, `prefill_chunk` prompt positions per row per step (a long prompt is
   prefilled over several steps while other rows keep decoding); a prefilled batch picks its first tokens and
   joins its *group*.
4. **Decode**: one speculative round (`_Run.run_level` at the top level, as `hispec.generate` runs it) for every
   group, then `commit`, which retires finished rows (EOS, max tokens, stop strings) and frees their blocks.

A group is one decoder batch (`hispec.decoding._Run`) of the rows that share a hierarchy and sampling settings
(the acceptance rules and the warped distributions are per batch); rows of a group still have their own gammas,
stop strings and max tokens. Several groups run one after another in a step. Rows never see each other:
attention masks are per row, so a request's greedy output is what it would be decoded alone (up to
floating-point ties: fp32 is exact in practice; tested with staggered arrivals).

The engine is single-threaded by design: `step()` runs in one thread (`start()` makes it a background thread);
`submit` and `cancel` may be called from any thread and take effect at the next step. Callbacks
(`on_update(handle, new_tokens, finished)`) run in the engine thread and must be quick (the server hands the
tokens to its event loop).
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch

from ..decoding import (GenerationStats, LevelStats, _as_list, _AutoPolicy, _auto_chain, _calibration, _Run,
                        _stop_checker, build_levels, default_strategy, ngram_config, parse_hierarchy)
from ..sampling import check_verification
from . import paged as paged_kv
from .paged import PagedKVCache, PagedKVStore


@dataclass
class Request:
    """One generation request: prompt token ids and its own settings."""

    prompt: list[int]
    max_new_tokens: int = 128
    strategy: str | None = None  # None: the engine's default
    gammas: list[int] | None = None  # one per level below the full model (None: the checkpoint's defaults)
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    verification: str | None = None


@dataclass
class Handle:
    """A submitted request's state, updated by the engine thread."""

    id: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    on_update: object = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class EngineError(ValueError):
    """A request the engine refuses (bad settings, too long, cannot ever fit the KV pool): a client error."""


class Engine:
    """Continuous batching over an `EarlyExitModel` (see the module docstring).

    `paged=True` keeps KV in a `PagedKVStore` of `kv_blocks` blocks (or `kv_memory_mb`) of `block_size`
    positions; `paged=False` uses the contiguous `KVCache` per group (rows joining pad it; `kv_blocks` is then only
    the admission budget), as does `paged=True` on a transformers without the paged pool's allocators (with a
    warning that says so: `hispec.serve.paged.PAGED_UNAVAILABLE`). `strategy`: the default for requests that give
    none (default: `hispec.decoding.default_strategy(model)`)."""

    def __init__(self, model, *, paged: bool = True, kv_blocks: int | None = None, kv_memory_mb: float | None = None,
                 block_size: int = 16, max_batch: int = 64, prefill_chunk: int | None = 512,
                 strategy: str | None = None, max_queue: int = 4096, eos_token_id=None):
        self.model = model
        if paged and paged_kv.PAGED_UNAVAILABLE is not None:
            warnings.warn(f"{paged_kv.PAGED_UNAVAILABLE}; serving with contiguous KV caches instead", RuntimeWarning,
                          stacklevel=2)
            paged = False
        self.paged = paged
        if paged:
            self.store = PagedKVStore.for_model(model, num_blocks=kv_blocks, memory_mb=kv_memory_mb,
                                                block_size=block_size)
            self.num_blocks, self.block_size = self.store.num_blocks, block_size
        else:
            self.store = None
            self.block_size = block_size
            self.num_blocks = kv_blocks if kv_blocks is not None else 1 << 30
        self.max_batch, self.prefill_chunk, self.max_queue = max_batch, prefill_chunk, max_queue
        self.default_strategy = strategy if strategy is not None else default_strategy(model)
        gen_cfg = getattr(model.base, "generation_config", None)
        if eos_token_id is None and gen_cfg is not None:
            eos_token_id = gen_cfg.eos_token_id
        self.eos = torch.tensor(_as_list(eos_token_id), dtype=torch.long, device=model.device)
        self.max_positions = getattr(model.adapter.config, "max_position_embeddings", None)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: list[Handle] = []
        self._cancel: set[int] = set()
        self.queue: deque[Handle] = deque()
        self.handles: dict[int, Handle] = {}  # admitted, not finished
        self.reserved: dict[int, int] = {}  # blocks reserved per admitted request
        self.prefilling: list[tuple[tuple, _Run]] = []
        self.groups: dict[tuple, _Run] = {}
        self._generators: dict[tuple, torch.Generator | None] = {}
        self._retired = GenerationStats(levels=[])
        self.counts = dict(submitted=0, finished=0, cancelled=0, rejected=0, errors=0, tokens=0)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self.started = time.perf_counter()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.accepting = True
        self._deadline: float | None = None

    # ------------------------------------------------------------------ requests
    def _levels(self, req: Request, with_gammas: bool = True):
        """(group key, levels, policy calibration, n-gram config, verification) for a request; raises ValueError
        when its settings are bad. The key holds no gammas: rows of a group keep their own (`_Run.gam`)."""
        cfg = self.model.hispec_config
        strategy = req.strategy or self.default_strategy
        verification = check_verification(req.verification if req.verification is not None
                                          else getattr(cfg, "verification", "token"))
        ngram = ngram_config(self.model)
        cal = None
        if strategy == "auto":
            cal = _calibration(self.model)
            levels = _auto_chain(self.model, cal, gamma=cfg.gamma, window=cfg.window, ngram=ngram)
        else:
            levels = build_levels(self.model, parse_hierarchy(strategy, self.model),
                                  req.gammas if with_gammas else None, gamma=cfg.gamma,
                                  window=cfg.window, ngram=ngram)
        warp = (req.temperature, req.top_k, req.top_p) if req.do_sample else (1.0, None, None)
        key = (("auto",) if cal is not None else ()) + tuple(lv.name for lv in levels) + (
            bool(req.do_sample), warp, verification)
        return key, levels, cal, ngram, verification

    def blocks_needed(self, req: Request) -> int:
        """The KV blocks a request may use at most (its positions never pass prompt + max_new_tokens)."""
        return -(-(len(req.prompt) + req.max_new_tokens + 1) // self.block_size)

    def validate(self, req: Request) -> None:
        """Raise EngineError with a clear message when the request cannot be served."""
        vocab = self.model.adapter.vocab_size
        if not req.prompt:
            raise EngineError("the prompt is empty")
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise EngineError(f"prompt token ids must be in 0..{vocab - 1}")
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise EngineError(f"max_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if self.max_positions and len(req.prompt) + req.max_new_tokens > self.max_positions:
            raise EngineError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_new_tokens}) exceeds the "
                              f"model's context of {self.max_positions} positions")
        if req.do_sample:
            if not req.temperature > 0:
                raise EngineError(f"temperature must be > 0 when sampling, got {req.temperature}")
            if req.top_k is not None and req.top_k < 1:
                raise EngineError(f"top_k must be >= 1, got {req.top_k}")
            if req.top_p is not None and not 0 < req.top_p <= 1:
                raise EngineError(f"top_p must be in (0, 1], got {req.top_p}")
        if req.stop is not None and not all(isinstance(s, str) and s for s in req.stop):
            raise EngineError("stop must be non-empty strings")
        if req.stop and self.model.tokenizer is None:
            raise EngineError("stop strings need the model's tokenizer")
        try:
            self._levels(req)
        except ValueError as e:
            raise EngineError(str(e)) from None
        need = self.blocks_needed(req)
        if need > self.num_blocks:
            raise EngineError(f"the request needs up to {need} KV blocks of {self.block_size} positions (prompt "
                              f"{len(req.prompt)} + max_tokens {req.max_new_tokens}); the pool has {self.num_blocks}: "
                              "lower max_tokens or shorten the prompt")

    def submit(self, req: Request, on_update=None) -> Handle:
        """Queue a request (thread-safe); raises EngineError for a request that cannot be served."""
        if not self.accepting:
            raise EngineError("the server is shutting down")
        try:
            self.validate(req)
        except EngineError:
            self.counts["rejected"] += 1
            raise
        with self._lock:
            if len(self._inbox) + len(self.queue) >= self.max_queue:
                self.counts["rejected"] += 1
                raise EngineError(f"the queue is full ({self.max_queue} requests)")
            h = Handle(next(self._ids), req, on_update=on_update)
            self._inbox.append(h)
            self.counts["submitted"] += 1
        self._wake.set()
        return h

    def cancel(self, rid: int) -> None:
        """Cancel a request (thread-safe): it leaves the batch at the next step and its blocks are freed."""
        with self._lock:
            self._cancel.add(rid)
        self._wake.set()

    # ------------------------------------------------------------------ state
    @property
    def active_rows(self) -> int:
        return sum(len(r.seq) for r in self.groups.values()) + sum(len(r.seq) for _, r in self.prefilling)

    @property
    def queue_length(self) -> int:
        return len(self.queue) + len(self._inbox)

    @property
    def in_flight(self) -> int:
        return self.queue_length + len(self.handles)

    def kv_blocks_used(self) -> int:
        return self.store.used_blocks if self.store is not None else 0

    def _finish(self, h: Handle, reason: str, error: str | None = None) -> None:
        if h.finished:
            return
        h.finished, h.finish_reason, h.error = True, reason, error
        h.finished_at = time.perf_counter()
        self.handles.pop(h.id, None)
        self.reserved.pop(h.id, None)
        key = {"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")
        self.counts[key] += 1
        if h.on_update is not None:
            h.on_update(h, [], True)
        h._done.set()

    def _fold(self, run: _Run) -> None:
        """Add a run's counters to the retired totals (a run that is merged away or emptied)."""
        _add_stats(self._retired, run.stats)
        run.stats = GenerationStats(levels=[LevelStats(lv.name) for lv in run.levels], verification=run.verification)

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One engine iteration (see the module docstring); returns whether there was anything to do."""
        with torch.no_grad():
            return self._step()

    def _step(self) -> bool:
        with self._lock:
            self.queue.extend(self._inbox)
            self._inbox.clear()
            cancel, self._cancel = self._cancel, set()
        if cancel:
            self._do_cancel(cancel)
        self._admit()
        worked = False
        for key, run in list(self.prefilling):
            worked = True
            if run.prefill(chunk=self.prefill_chunk):
                self.prefilling.remove((key, run))
                run.commit()  # the first token may already finish a row (max_tokens 1, EOS)
                self._emit(run)
                if not len(run.seq):
                    self._fold(run)
                    continue
                group = self.groups.get(key)
                if group is None:
                    self.groups[key] = run
                else:
                    self._fold(run)
                    group.extend(run)
        for key, run in list(self.groups.items()):
            worked = True
            run.begin_round()
            run.run_level(run.K, torch.ones_like(run.seq, dtype=torch.bool))
            run.commit()
            run.end_round()
            self._emit(run)
            if not len(run.seq):
                self._fold(run)
                del self.groups[key]
        return worked

    def _do_cancel(self, ids: set[int]) -> None:
        for h in [h for h in self.queue if h.id in ids]:
            self.queue.remove(h)
            self._finish(h, "cancelled")
        for _, run in self.prefilling + list(self.groups.items()):
            mine = [rid for rid in run.orig.tolist() if rid in ids]
            if mine:
                run.drop(mine)
                for rid in mine:
                    run.results.pop(rid, None)
        for rid in ids:
            h = self.handles.get(rid)
            if h is not None:
                self._finish(h, "cancelled")
        for key in [k for k, r in self.groups.items() if not len(r.seq)]:
            self._fold(self.groups.pop(key))
        for key, run in [(k, r) for k, r in self.prefilling if not len(r.seq)]:
            self.prefilling.remove((key, run))
            self._fold(run)

    def _admit(self) -> None:
        new: dict[tuple, list[Handle]] = {}
        rows = self.active_rows
        used = sum(self.reserved.values())
        while self.queue and rows < self.max_batch:
            h = self.queue[0]
            need = self.blocks_needed(h.request)
            if used + need > self.num_blocks:
                break  # FIFO: wait for blocks rather than let later, smaller requests overtake forever
            self.queue.popleft()
            key, *_ = self._levels(h.request)
            new.setdefault(key, []).append(h)
            self.reserved[h.id] = need
            self.handles[h.id] = h
            used += need
            rows += 1
        for key, hs in new.items():
            self.prefilling.append((key, self._new_run(key, hs)))

    def _new_run(self, key, hs: list[Handle]) -> _Run:
        req0 = hs[0].request
        _, levels, cal, ngram, verification = self._levels(req0, with_gammas=False)
        ids = [h.id for h in hs]
        prompts = [list(h.request.prompt) for h in hs]
        cache = PagedKVCache(self.store, ids) if self.paged else None
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=self.model.device).manual_seed(0) if req0.do_sample else None
        warp = dict(temperature=req0.temperature, top_k=req0.top_k, top_p=req0.top_p) if req0.do_sample else \
            dict(temperature=1.0, top_k=None, top_p=None)
        run = _Run(self.model, levels, prompts, [len(p) + h.request.max_new_tokens for p, h in zip(prompts, hs)],
                   do_sample=req0.do_sample, warp=warp, eos=self.eos, generator=self._generators[key],
                   stop_check=None, streamer=None, ngram=ngram,
                   policy=_AutoPolicy(levels, cal, len(hs), self.model.device) if cal is not None else None,
                   verification=verification, cache=cache, ids=ids)
        if run.policy is not None:
            run.policy.together = False  # each request returns when done (`_AutoPolicy._batch_pays`)
        run.stats.strategy = ("auto:" if cal is not None else "") + ">".join(lv.name for lv in levels)
        for b, h in enumerate(hs):
            if h.request.gammas is not None and cal is None:
                for i, g in enumerate(h.request.gammas):
                    run.gam[i][b] = g
            if h.request.stop:
                run.row_stop[h.id] = _stop_checker(h.request.stop, self.model.tokenizer)
        return run

    def _emit(self, run: _Run) -> None:
        """Hand each request its newly committed tokens; finish the rows `commit` retired."""
        now = time.perf_counter()
        alive = set(run.orig.tolist())
        eos = set(self.eos.tolist())
        n = 0
        for rid in list(run.results):
            h = self.handles.get(rid)
            toks = run.results[rid]
            if h is None:  # cancelled meanwhile
                run.results.pop(rid)
                continue
            new = toks[len(h.tokens):]
            if new:
                if h.first_token_at is None:
                    h.first_token_at = now
                h.tokens.extend(new)
                n += len(new)
                if h.on_update is not None:
                    h.on_update(h, new, False)
            if rid not in alive:
                run.results.pop(rid)
                stopped = len(h.tokens) < h.request.max_new_tokens or (h.tokens and h.tokens[-1] in eos)
                self._finish(h, "stop" if stopped else "length")
        if n:
            self.counts["tokens"] += n
            self._recent.append((now, n))

    # ------------------------------------------------------------------ running
    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until nothing is queued or in flight (tests, offline use)."""
        steps = 0
        while self.in_flight and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1

    def start(self) -> None:
        """Run the step loop in a background thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="hispec-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._deadline is not None and time.perf_counter() > self._deadline and self.in_flight:
                self._fail_all("the server shut down before the request finished")
            try:
                worked = self.step()
            except Exception as e:  # a bug or an OOM: fail what is in flight, clean up, keep serving
                self._fail_all(f"{type(e).__name__}: {e}")
                worked = False
            if not worked:
                self._wake.wait(0.05)
                self._wake.clear()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self.queue.extend(self._inbox)
            self._inbox.clear()
        for _, run in self.prefilling + list(self.groups.items()):
            if isinstance(run.cache, PagedKVCache):
                run.cache.free()
            self._fold(run)
        self.prefilling, self.groups = [], {}
        for h in list(self.handles.values()) + list(self.queue):
            self._finish(h, "error", why)
        self.queue.clear()

    def begin_drain(self, timeout: float) -> None:
        """Stop accepting requests; those in flight may finish for `timeout` seconds, then the engine thread ends
        them with an error (thread-safe: the server calls this from its signal handler)."""
        self.accepting = False
        deadline = time.perf_counter() + timeout
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
        self._wake.set()

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting requests, let those in flight finish for up to `drain_timeout` seconds, then end the
        rest with an error and stop the thread. Nothing is left waiting."""
        self.begin_drain(drain_timeout)
        deadline = time.perf_counter() + drain_timeout + 5
        while self._thread is not None and self.in_flight and time.perf_counter() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        if self.in_flight:
            self._fail_all("the server shut down before the request finished")

    # ------------------------------------------------------------------ metrics
    def stats(self) -> GenerationStats:
        total = GenerationStats(levels=[])
        _add_stats(total, self._retired)
        for _, run in self.prefilling + list(self.groups.items()):
            _add_stats(total, run.stats)
        return total

    def metrics(self, window: float = 10.0) -> dict:
        now = time.perf_counter()
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        span = min(window, now - self.started) or 1e-9
        st = self.stats()
        return {
            "tokens_per_second": sum(n for _, n in self._recent) / span,
            "tokens_generated": self.counts["tokens"],
            "requests": {k: v for k, v in self.counts.items() if k != "tokens"},
            "queue_length": self.queue_length,
            "active_requests": len(self.handles),
            "active_rows": self.active_rows,
            "kv_blocks_used": self.kv_blocks_used(),
            "kv_blocks_total": self.num_blocks if self.paged else None,
            "kv_blocks_reserved": sum(self.reserved.values()),
            "kv_block_size": self.block_size,
            "paged": self.paged,
            "acceptance": {lv.name: lv.acceptance for lv in st.levels if ">" in lv.name},
            "levels": [lv.as_dict() for lv in st.levels],
            "uptime_s": now - self.started,
        }


def _add_stats(into: GenerationStats, st: GenerationStats) -> None:
    """Sum `st`'s per-level counters into `into`, by level: a verifying level by the pair it verifies
    (`L4>full`, whose acceptance is what it accepted of what the level below proposed), a drafting level 0 as
    `L2` (its `proposed` counts drafts), so levels of different hierarchies add up only where they mean the same."""
    by = {lv.name: lv for lv in into.levels}
    names = [lv.name for lv in st.levels]
    for k, lv in enumerate(st.levels):
        name = lv.name if k == 0 or ">" in lv.name else f"{names[k - 1]}>{lv.name}"
        t = by.get(name)
        if t is None:
            t = by[name] = LevelStats(name)
            into.levels.append(t)
        for f in ("proposed", "accepted", "rejections", "proposals", "lookups", "passes", "row_passes",
                  "layer_evals", "seconds"):
            setattr(t, f, getattr(t, f) + getattr(lv, f))
    into.prefill_seconds += st.prefill_seconds
    into.new_tokens += st.new_tokens
