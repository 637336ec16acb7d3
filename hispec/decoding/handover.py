"""Handing committed tokens over (`_Handover`, a base of `hispec.decoding.rounds._Run`): `commit()` after every round,
with the device read once.

Contract: `commit()` appends each row's newly committed tokens to `results[id]` (cut after an EOS or a completed stop
string), streams them, counts them in `committed_tokens`, drops finished rows and returns whether rows remain; it
also adds the round's deferred counters (`_count`) to `stats`. Everything it needs from the device (which rows
finished, how far each row committed, its id, the tokens committed since the last commit and the pending counters)
comes in one device-to-host copy: the tokens as a window of `_window` positions from each row's first token not yet
handed over (`handed`), widened for good (and read a second time) only when a round committed more than that.
So a round costs the host one wait for the device here, whatever the batch size, where reading row by row cost two
per row and four more for the counts; outputs and counters are the same.
"""

from __future__ import annotations

import torch


class _Handover:
    """`commit` and the deferred counters, mixed into `hispec.decoding.rounds._Run`."""

    def _init_handover(self, levels, eos: torch.Tensor) -> None:
        self.eos_ids = set(eos.tolist())  # (the run's EOS ids do not change)
        self.handed = self.prompt_len.clone()  # per row: absolute position of its first token not handed over
        self._tally: list[tuple[int, str, torch.Tensor]] = []  # counters not read from the device yet
        # tokens one round commits at most, as far as seen (a chain round: every level's threshold plus one)
        self._window = 1 + sum(lv.threshold for lv in levels[:-1])
        self._stop_memo = None  # `_stop_pos`, computed once per state
        # an upper bound of every row's tokens past its committed ones (`_stop_pos` scans that many): a draft step
        # adds at most its widest proposal, a verification below the top one token; after a commit every row left
        # has committed all it holds (a row that did not take part in the top verification had reached its stop,
        # so it finished), and the bound is 0 again
        self._pending = 0
        self._draft_width = None  # the next exit draft step's pass width, when already read (`_more_to_draft`)

    def _count(self, level: int, field: str, value: torch.Tensor) -> None:
        """Add `value` (a 0-d tensor on the device) to `stats.levels[level].<field>` at the next commit."""
        self._tally.append((level, field, value))

    def _apply_counts(self, values: list[int]) -> None:
        for (level, field, _), v in zip(self._tally, values):
            st = self.stats.levels[level]
            setattr(st, field, getattr(st, field) + v)
        self._tally = []

    def commit(self) -> bool:
        """Hand over newly committed tokens, finish rows (EOS, length, stop strings); returns True while rows
        remain. Linear in the output: each round reads, scans and streams only the tokens it committed."""
        committed = self.ver[self.K] if self.K else self.seq
        finished = committed >= torch.minimum(self._stop_pos(), self.limit)
        B, W = len(committed), self._window
        window = self.tok.gather(1, self._positions(self.handed, 0, W))
        parts = [finished, committed - self.prompt_len, self.orig, window] + [t for _, _, t in self._tally]
        flat = torch.cat([t.reshape(-1).long() for t in parts]).tolist() if B or self._tally else []
        over, ends, ids = flat[:B], flat[B: 2 * B], flat[2 * B: 3 * B]
        toks = flat[3 * B: 3 * B + B * W]
        self._apply_counts(flat[3 * B + B * W:])
        keep = []
        for b, rid in enumerate(ids):
            new = self._new_tokens(b, rid, ends[b], toks[b * W: (b + 1) * W])
            if not self._hand_over(rid, new) and not over[b]:
                keep.append(b)
        self.handed = committed
        self._pending = 0
        if len(keep) < B:
            self._keep_rows(torch.tensor(keep, dtype=torch.long, device=committed.device))
        return bool(keep)

    def _positions(self, start: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Positions start + lo .. start + hi - 1 of every row `[B, hi - lo]`, clamped into `tok`."""
        ar = torch.arange(lo, hi, device=start.device)
        return (start[:, None] + ar).clamp(max=self.tok.shape[1] - 1)

    def _new_tokens(self, b: int, rid: int, end: int, window: list[int]) -> list[int]:
        """Row b's tokens committed since the last commit (its committed length after the prompt is `end`)."""
        n = end - len(self.results.setdefault(rid, []))
        if n <= len(window):
            return window[:max(n, 0)]
        self._window = n  # a longer round than any before: read the rest, and a wider window from now on
        more = self.tok[b].gather(0, self._positions(self.handed[b: b + 1], len(window), n)[0]).tolist()
        return window + more

    def _hand_over(self, rid: int, new: list[int]) -> bool:
        """Append the tokens `new` to the result `rid`, cut after an EOS or a completed stop string, and stream
        them; returns True where the row ended there."""
        toks = self.results[rid]
        prev = len(toks)
        ended = False
        if new:
            toks.extend(new)
            if self.eos_ids:
                cut = next((i for i in range(prev, len(toks)) if toks[i] in self.eos_ids), None)
                if cut is not None:
                    del toks[cut + 1:]
                    ended = True
            stop_check = self.row_stop.get(rid, self.stop_check)
            if stop_check is not None:
                cut = stop_check(toks, prev)
                if cut is not None:
                    del toks[cut:]
                    ended = True
            if self.streamer is not None and len(toks) > prev:
                self.streamer.put(torch.tensor(toks[prev:]))
            self.committed_tokens += max(len(toks) - prev, 0)
        return ended
