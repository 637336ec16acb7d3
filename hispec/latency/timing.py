"""Timing the latency model's unit costs on this machine.

Contract: `measure_costs(model, rows, context)` returns {"layer": {T: s}, "head": {"L<k>": {T: s}}, "final": {T: s}}
for an `EarlyExitModel` (and "drafter": {T: s} when an EAGLE-3 drafter is attached): medians of interleaved timings (`median_times`, on `hispec.timing`'s clock after the device
finished its queued work, so a GPU's asynchronous kernels are timed, not their launch) of passes over T new
positions behind a KV cache of `context` random positions (`KVBench`, which rolls every timed pass back), each
table fitted non-decreasing in T (`nondecreasing`); `measure_layer_costs` is the per-layer table alone (raw
medians). Given a time budget (`fit`: repeats for the seconds of one round) it times fewer repeats rather than run
past it. Only unit costs are measured here; the rest of a calibration is `hispec.latency.measure`'s.
"""

from __future__ import annotations

import statistics
import sys

import torch
from tqdm.auto import tqdm

from .. import timing
from ..drafters.eagle3 import KVBuffer
from ..drafters.heads import ContextInputs
from .levels import level_name
from .model import DEFAULT_MAX_GAMMA


def median_times(fns: dict, repeats: int, *, device=None, fit=None, progress: str | None = None) -> dict:
    """Median wall time of each callable, interleaved round by round (drift hits all alike), after a warm-up round.
    `device`: the work the callables queue there is waited for before each clock read (`hispec.timing.now`).
    `fit(seconds of the warm-up round) -> repeats` (optional) may lower `repeats` (at least 1: a time budget).
    `progress`: a tqdm bar with that label on stderr."""
    with tqdm(total=len(fns) * (repeats + 1), desc=progress, disable=not progress, file=sys.stderr) as bar:
        t0 = timing.now(device)
        for fn in fns.values():
            fn()
            bar.update()
        if fit is not None:
            repeats = max(1, min(repeats, fit(timing.now(device) - t0)))
            bar.total = len(fns) * (repeats + 1)
            bar.refresh()
        samples = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                t0 = timing.now(device)
                fn()
                samples[k].append(timing.now(device) - t0)
                bar.update()
    return {k: statistics.median(v) for k, v in samples.items()}


class KVBench:
    """A KV cache of `context` random positions through every layer (and the exit heads' own layers), to time
    passes over T new positions after it; every timed call rolls its positions back."""

    def __init__(self, model, context: int = 256, seed: int = 0):
        self.model = model
        ad = self.adapter = model.adapter
        self.context = context
        self.gen = torch.Generator().manual_seed(seed)
        stateful = getattr(model, "stateful_heads", False)
        heads = getattr(model, "heads", {})
        self.cache = ad.new_cache(1, extra=2 if stateful else 0)
        ids = torch.randint(0, ad.vocab_size, (1, context), generator=self.gen).to(ad.device)
        pos = torch.arange(context, device=ad.device)[None]
        valid = torch.ones_like(pos, dtype=torch.bool)
        with torch.no_grad():
            h = ad.run_layers(ad.embed(ids, pos), 0, ad.num_layers, position_ids=pos, cache=self.cache, valid=valid)
            for head in (heads.values() if stateful else ()):
                ad.run_module(head.layer, head.layer_type, h, cache_index=head.cache_index, position_ids=pos,
                              cache=self.cache, valid=valid)
        self.keep = torch.tensor([context], device=ad.device)

    def hidden(self, T: int) -> torch.Tensor:
        ad = self.adapter
        return torch.randn(1, T, ad.hidden_size, generator=self.gen).to(ad.device, ad.dtype)

    def _pos(self, T):
        ad = self.adapter
        return (self.context + torch.arange(T, device=ad.device)[None],
                torch.ones(1, T, dtype=torch.bool, device=ad.device))

    def layers(self, T: int, start: int = 0, end: int | None = None):
        """A callable: layers [start, end) over T new positions, then rolled back."""
        ad, end = self.adapter, self.adapter.num_layers if end is None else end
        x, (pos, valid) = self.hidden(T), self._pos(T)

        def run():
            with torch.no_grad():
                ad.run_layers(x, start, end, position_ids=pos, cache=self.cache, valid=valid)
            self.cache.truncate(start, end, self.keep)

        return run

    def head(self, exit_name: str, T: int):
        """A callable: exit head `exit_name` over T positions, as the decoder calls it (logits included)."""
        model, ad = self.model, self.adapter
        x, (pos, valid) = self.hidden(T), self._pos(T)
        head = model.heads[exit_name]

        def run_layer(module, hidden):
            return ad.run_module(module, head.layer_type, hidden, cache_index=head.cache_index, position_ids=pos,
                                 cache=self.cache, valid=valid)

        ctx = None
        if head.needs_context:  # its window of states: the cost depends on the window, not on the context length
            S = self.context + T
            states = [torch.randn(1, S, ad.hidden_size, generator=self.gen).to(ad.device, ad.dtype)
                      for _ in head.context_layers]
            avail = [pos[:, -1] + 1 if L == head.context_layers[0] else pos[:, 0] for L in head.context_layers]
            ctx = ContextInputs(states=states, avail=avail, query_pos=pos, layers=list(head.context_layers))

        def run():
            with torch.no_grad():
                model.exit_logits(exit_name, x, run_layer=run_layer if head.stateful else None, context=ctx)
            if head.stateful:
                self.cache.truncate(head.cache_index, head.cache_index + 1, self.keep)

        return run

    def drafter(self, T: int):
        """A callable: the EAGLE-3 drafter's pass over T entries behind `context` entries of its own keys, as the
        decoder runs it (`hispec.decoding.eagle`: embeddings, fc over the aux states, its layer, norm, draft
        lm_head, the last entry's argmax as a target id); it writes its keys into scratch slots."""
        d, ad = self.model.drafter, self.adapter
        c, p = d.config, next(d.parameters())
        S = self.context + T
        kv = [torch.randn(1, c.num_key_value_heads, S + 1, c.head_dim, generator=self.gen).to(p) for _ in "kv"]
        aux = torch.randn(1, T, len(c.aux_layers) * c.hidden_size, generator=self.gen).to(p)
        tokens = torch.randint(0, ad.vocab_size, (1, T), generator=self.gen).to(ad.device)
        pos = self.context + torch.arange(T, device=ad.device)[None]
        keys = torch.arange(S, device=ad.device)
        embed = self.model.base.get_input_embeddings()

        def run():
            with torch.no_grad():
                mask = (keys >= 1) & (keys <= pos[..., None])
                out = d.step(embed(tokens).to(p.dtype), d.fuse(aux), pos, KVBuffer(kv[0], kv[1], pos), mask)
                d.to_target(out.logits[:, -1].argmax(-1))

        return run

    def final(self, T: int):
        ad, x = self.adapter, self.hidden(T)

        def run():
            with torch.no_grad():
                ad.final_logits(x)

        return run


def nondecreasing(table: dict) -> dict:
    """The least-squares non-decreasing fit of `{T: seconds}` (pool adjacent violators): a pass over more positions
    is not cheaper than over fewer, so a dip between measured T is timing noise (shared or busy cores)."""
    keys = sorted(table)
    blocks: list[list[float]] = []  # [sum, count]
    for k in keys:
        blocks.append([table[k], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    values = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return dict(zip(keys, values))


def measure_layer_costs(model, rows=(1, 2, 4, 8), context: int = 256, repeats: int = 10,
                        bench: KVBench | None = None) -> dict:
    """{T: seconds of one decoder layer over T new positions}: a pass over all layers / depth (not one layer
    timed alone, whose weights would stay in cache between repeats). Raw medians, not smoothed."""
    bench = bench or KVBench(model, context)
    L = model.adapter.num_layers
    times = median_times({T: bench.layers(T) for T in rows}, repeats, device=model.adapter.device)
    return {T: t / L for T, t in times.items()}


def measure_costs(model, rows=tuple(range(1, DEFAULT_MAX_GAMMA + 2)), context: int = 256, repeats: int = 10, *,
                  fit=None, progress: str | None = None) -> dict:
    """Unit costs of an `EarlyExitModel`: {"layer": {T: s}, "head": {"L<k>": {T: s}}, "final": {T: s}}, medians
    of `repeats` interleaved timings (fewer where `fit` says so: `median_times`), each made non-decreasing in T
    (`nondecreasing`). A layer's cost is a pass over all layers / depth (see `measure_layer_costs`)."""
    bench = KVBench(model, context)
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    fns = {("final", T): bench.final(T) for T in rows}
    fns.update({(name, T): bench.head(name, T) for name in exits for T in rows})
    fns.update({("layers", T): bench.layers(T) for T in rows})
    drafter = getattr(model, "drafter", None) is not None
    if drafter:
        fns.update({("drafter", T): bench.drafter(T) for T in rows})
    t = median_times(fns, repeats, device=model.adapter.device, fit=fit, progress=progress)
    L = model.adapter.num_layers
    out = {"layer": nondecreasing({T: t[("layers", T)] / L for T in rows}),
           "head": {level_name(layer): nondecreasing({T: t[(name, T)] for T in rows})
                    for name, layer in exits.items()},
           "final": nondecreasing({T: t[("final", T)] for T in rows})}
    if drafter:
        out["drafter"] = nondecreasing({T: t[("drafter", T)] for T in rows})
    return out