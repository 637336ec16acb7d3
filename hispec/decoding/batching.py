"""Rows leaving and joining a running batch (`_RowSet`, a base of `hispec.decoding.rounds._Run`): what continuous
batching (`hispec.serve`) and finished rows need.

Contract: every per-row field of a run is named in `ROW_TENSORS` (batch-first tensors) or `ROW_LISTS` (lists of
them, one per level; None entries stay None); `_keep_rows(idx)` keeps the rows `idx` in every such field, the cache
and the policy; `drop(ids)` removes rows by request id; `extend(other)` appends the rows of another prefilled run of
the same hierarchy and sampling settings. Rows keep their own counts, so no row's tokens change.
"""

from __future__ import annotations

import torch


class _RowSet:
    """Dropping and admitting rows of a `_Run` (which holds the fields named here, its `cache` and `policy`)."""

    # the per-row state: batch-first tensors, and lists of them (one per level); None entries stay None
    ROW_TENSORS = ("tok", "seq", "limit", "prompt_len", "exhausted", "lookup_only", "gated", "fin", "base", "orig",
                   "handed", "aux", "dk", "dv", "dctx", "dlen", "dh")  # (the last six: an EAGLE-3 level 0, else None)
    ROW_LISTS = ("ver", "done", "gam", "hid", "rows")

    def _map_rows(self, fn, other: _RowSet | None = None) -> None:
        """Replace every per-row tensor t by fn(t) (or fn(t, other's t) with `other`): one list of fields for
        dropping rows and for admitting them."""
        two = (lambda name: (getattr(self, name), getattr(other, name))) if other is not None else None
        for name in self.ROW_TENSORS:
            setattr(self, name, fn(*two(name)) if two else fn(getattr(self, name)))
        for name in self.ROW_LISTS:
            setattr(self, name, [fn(*ab) for ab in zip(*two(name))] if two else [fn(t) for t in getattr(self, name)])

    def _keep_rows(self, idx: torch.Tensor):
        """Keep the rows `idx` (in that order) of every per-row field, the cache and the policy."""
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

    def extend(self, other: _RowSet) -> None:
        """Append the rows of `other`, a prefilled run of the same hierarchy and sampling settings whose cache shares
        this cache's storage: continuous batching admits requests between rounds this way. Per-position buffers are
        padded to the wider run (each row only reads below its own limit; an EAGLE-3 drafter's keys by slot too:
        the narrower run's old scratch slot lies past its rows' limits, the last slot is the scratch of both); the
        caches join with `cache.extend`."""
        def cat(a, b):
            if a is None and b is None:
                return None
            if a is None or b is None:  # e.g. sampling rows one run has not needed yet
                ref = a if a is not None else b
                z = ref.new_zeros((B1 if a is None else B2,) + tuple(ref.shape[1:]))
                a, b = (z, b) if a is None else (a, z)
            if a.dim() > 1 and a.shape[1:] != b.shape[1:]:  # per-position buffers (and a drafter's KV by slot,
                shape = [max(x, y) for x, y in zip(a.shape[1:], b.shape[1:])]  # dim 2) of another width

                def pad(t):
                    out = t.new_zeros((t.shape[0], *shape))
                    out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
                    return out

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
