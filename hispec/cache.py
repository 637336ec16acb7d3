"""KV bookkeeping for running a decoder in ranges of layers.

Contract: `KVCache` is the object handed to every decoder layer as its cache. Attention modules only call
`update(key, value, layer_idx)`; everything else here is for `hispec.layers.DecoderAdapter` and the decoders.

Every layer keeps its own physical length, so the ranges `[0, L_d)`, `[L_d, L_i)`, `[L_i, L)` can be at different
lengths (a drafted token has passed the first range but not the others). Each physical slot carries, per row,
a validity bit and the absolute position of its token. Rows in a batch accept different numbers of tokens: a slot
that one row rejected while another kept it stays in place as a masked-out *hole* for the first row. Masks are
built from `(valid, position)`, never from slot indices, so holes, left padding and sliding windows are exact.

Rollback (`truncate`) invalidates a row's slots from a position on and physically drops trailing slots that no row
still uses. `hispec.serve.paged.PagedKVCache` is a paged block-table store behind the same methods (continuous
batching; rollback frees blocks instead of leaving holes); `extend` appends rows here too.
"""

from __future__ import annotations

import torch


class KVCache:
    """Growable per-layer K/V buffers `[B, kv_heads, capacity, head_dim]` with per-slot row metadata."""

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int, device: torch.device | str | None = None):
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else None
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._length = [0] * num_layers
        # Per-layer slot metadata; layers advanced together share the same tensor objects.
        self._valid: list[torch.Tensor | None] = [None] * num_layers  # bool [B, S_l]
        self._pos: list[torch.Tensor | None] = [None] * num_layers  # long [B, S_l]

    # ------------------------------------------------------------------ the transformers Cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append `key_states`/`value_states` `[B, H, T, D]` to layer `layer_idx`; return all of its K and V."""
        n, t = self._length[layer_idx], key_states.shape[-2]
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or keys.shape[-2] < n + t:
            capacity = max(64, 2 * (n + t))
            new_k = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
            new_v = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
            if keys is not None and n:
                new_k[..., :n, :] = keys[..., :n, :]
                new_v[..., :n, :] = values[..., :n, :]
            keys, values = self._keys[layer_idx], self._values[layer_idx] = new_k, new_v
        keys[..., n : n + t, :] = key_states
        values[..., n : n + t, :] = value_states
        self._length[layer_idx] = n + t
        return keys[..., : n + t, :], values[..., : n + t, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length[layer_idx]

    # ------------------------------------------------------------------ range bookkeeping
    def seq_length(self, start: int, end: int) -> int:
        """Physical length shared by layers `[start, end)`; raises if they disagree."""
        lengths = set(self._length[start:end])
        if len(lengths) != 1:
            raise RuntimeError(
                f"layers {start}..{end - 1} are at different cache lengths {sorted(lengths)}; "
                "a range must be advanced as a whole"
            )
        return lengths.pop()

    def slot_meta(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(valid [B, S], position [B, S])` of layer `layer_idx` (empty tensors before the first write)."""
        valid, pos = self._valid[layer_idx], self._pos[layer_idx]
        if valid is None:
            dev = self.device
            valid = torch.zeros(self.batch_size, 0, dtype=torch.bool, device=dev)
            pos = torch.zeros(self.batch_size, 0, dtype=torch.long, device=dev)
        return valid, pos

    def set_slot_meta(self, start: int, end: int, valid: torch.Tensor, pos: torch.Tensor) -> None:
        for i in range(start, end):
            self._valid[i], self._pos[i] = valid, pos

    def row_lengths(self, layer_idx: int) -> torch.Tensor:
        """Number of valid (non-hole, non-pad) slots per row `[B]` at layer `layer_idx`."""
        return self.slot_meta(layer_idx)[0].sum(-1)

    def truncate(self, start: int, end: int, keep_below: torch.Tensor) -> None:
        """Roll layers `[start, end)` back: row b keeps only slots whose position is `< keep_below[b]`.

        Slots freed in every row at the tail are dropped physically; the rest become masked holes.
        """
        self.truncate_ranges([(start, end)], keep_below)

    def truncate_ranges(self, ranges, keep_below: torch.Tensor) -> None:
        """`truncate` of several layer ranges `[(start, end), ...]` at once: their new physical lengths are read from
        the device in one copy (the host needs them: they are shapes)."""
        todo = []
        for start, end in ranges:
            valid, pos = self.slot_meta(start) if start < end else (None, None)
            if valid is not None and valid.shape[1]:
                todo.append((start, end, valid & (pos < keep_below.to(pos.device)[:, None]), pos))
        if not todo:
            return
        # per range: 1 + the last slot some row still uses (0: none)
        last = [(v.any(0) * torch.arange(1, v.shape[1] + 1, device=v.device)).max() for _, _, v, _ in todo]
        for (start, end, valid, pos), new_len in zip(todo, torch.stack(last).tolist()):
            for i in range(start, end):
                self._length[i] = min(self._length[i], new_len)
            self.set_slot_meta(start, end, valid[:, :new_len], pos[:, :new_len])

    def compact(self, start: int, end: int, from_slot: int, index: torch.Tensor, keep: torch.Tensor) -> None:
        """Compact layers `[start, end)` past `from_slot`: row b's slot `from_slot + i` becomes its old slot
        `from_slot + index[b, i]` (`index`, `keep` `[B, A]`), valid only where `keep` (and valid before); the
        layers end at `from_slot + A`. Tree drafts keep each row's accepted path this way and drop the rest."""
        if start >= end:
            return
        valid, pos = self.slot_meta(start)
        A = index.shape[1]
        src = (from_slot + index).to(pos.device)
        if A and (int(src.max()) >= valid.shape[1] or int(src.min()) < from_slot):
            raise ValueError(f"compact: index points outside slots {from_slot}..{valid.shape[1] - 1}")
        new_valid = torch.cat([valid[:, :from_slot], valid.gather(1, src) & keep.to(valid.device)], 1)
        new_pos = torch.cat([pos[:, :from_slot], pos.gather(1, src)], 1)
        for i in range(start, end):
            k, v = self._keys[i], self._values[i]
            if k is None:
                continue
            idx = src[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            gk, gv = k.gather(2, idx), v.gather(2, idx)  # gathered before writing: the ranges overlap
            k[:, :, from_slot : from_slot + A] = gk
            v[:, :, from_slot : from_slot + A] = gv
            self._length[i] = from_slot + A
        self.set_slot_meta(start, end, new_valid, new_pos)

    def extend(self, other: "KVCache") -> None:
        """Append `other`'s rows (continuous batching admits prefilled requests this way). Each layer is padded to
        the longer of the two physical lengths with invalid slots, which `(valid, position)` masks ignore, so every
        row attends exactly as before; layers that shared slot metadata keep sharing it."""
        if other.num_layers != self.num_layers:
            raise ValueError(f"extend: caches have {self.num_layers} and {other.num_layers} layers")
        B1, B2 = self.batch_size, other.batch_size
        shared: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        metas_before = (list(self._valid), list(other._valid))  # keeps the ids below unique while layers change
        for i in range(self.num_layers):
            n = max(self._length[i], other._length[i])
            k1, k2 = self._keys[i], other._keys[i]
            if k1 is not None or k2 is not None:
                ref = k1 if k1 is not None else k2
                parts_k, parts_v = [], []
                for c, B in ((self, B1), (other, B2)):
                    k, v, m = c._keys[i], c._values[i], c._length[i]
                    pk = ref.new_zeros(B, ref.shape[1], n, ref.shape[-1])
                    pv = torch.zeros_like(pk)
                    if k is not None and m:
                        pk[..., :m, :] = k[..., :m, :]
                        pv[..., :m, :] = c._values[i][..., :m, :]
                    parts_k.append(pk)
                    parts_v.append(pv)
                self._keys[i], self._values[i] = torch.cat(parts_k), torch.cat(parts_v)
            key = (id(metas_before[0][i]), id(metas_before[1][i]))
            if key not in shared:
                metas = []
                for c, B in ((self, B1), (other, B2)):
                    v, p = c.slot_meta(i)
                    pad = n - v.shape[1]
                    metas.append((torch.cat([v, v.new_zeros(B, pad)], 1), torch.cat([p, p.new_zeros(B, pad)], 1)))
                shared[key] = (torch.cat([metas[0][0], metas[1][0]]), torch.cat([metas[0][1], metas[1][1]]))
            self._valid[i], self._pos[i] = shared[key]
            self._length[i] = n
        self.batch_size = B1 + B2

    def reorder_batch(self, index: torch.Tensor) -> None:
        """Keep rows `index` (e.g. drop finished rows)."""
        for i in range(self.num_layers):
            if self._keys[i] is not None:
                self._keys[i] = self._keys[i].index_select(0, index)
                self._values[i] = self._values[i].index_select(0, index)
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self.num_layers):
            v, p = self._valid[i], self._pos[i]
            if v is None:
                continue
            if id(v) not in seen:
                seen[id(v)] = (v.index_select(0, index), p.index_select(0, index))
            self._valid[i], self._pos[i] = seen[id(v)]
        self.batch_size = len(index)
