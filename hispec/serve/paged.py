"""A paged KV store behind the cache interface the decoder uses (`hispec.cache.KVCache`'s methods).

Storage and block allocation are transformers' own continuous-batching pieces
(`transformers.generation.continuous_batching`): one `FullAttentionCacheAllocator` (block tables per request, the
physical layout of pages and blocks in one flat tensor, the read/write-index `update`) over a `CachePool` (free
sectors and blocks). What hispec adds is the early-exit bookkeeping on top:

- **Per-level lengths.** A block holds `block_size` positions of *every* layer (transformers' "block": one page per
  layer), and a row's slot for absolute position p is `p // block_size` in its block table, offset `p %
  block_size`, in every layer. The layer ranges of the hierarchy are at different lengths per row (a draft has
  passed `[0, L_d)` but not the layers above), so each (layer, row) keeps its own length; a row owns the blocks
  covering the longest of its layers. Exit heads' extra layers (`layer` heads) are more layers of the same block.
- **No holes.** The decoder's positions in a range are always `[0, done)` per row, so a row's slots are dense:
  valid = `slot < length`, position = slot. Rollback of rejected drafts (`truncate`) shortens the lengths and
  frees the row's blocks past its longest layer, instead of leaving masked holes as the contiguous cache does.
- **Rows join and leave freely.** `extend` appends rows (their block tables live in the shared allocator, no KV
  is copied); `reorder_batch` frees the blocks of rows that leave.

Why not `PagedAttentionCache` itself (and the `paged|sdpa` attention it feeds): its `update` takes one flattened
varlen batch `[1, heads, total_tokens, dim]` whose read/write indices arrive in the attention kwargs that
transformers' own `ContinuousBatchingManager` computes once per *whole-model* forward from one `past_length` per
request; an early-exit pass runs a layer *range*, through the model's own attention modules (sdpa/eager, called
with a `Cache` object and batch-first `[B, heads, T, dim]` tensors), with a length per range. So this class
computes those indices itself, per range pass (`begin_pass`, called by `DecoderAdapter.run_layers` before the
range's layers run), by the allocator's formulas (`get_read_indices` / `get_write_indices`, vectorised over the
batch), and calls the allocator's `update` per layer with the batch flattened, exactly as transformers does with
its packed batch. Sliding-window layers use the full-attention allocator too: transformers'
`SlidingAttentionCacheAllocator` is a ring buffer of window size, and writing drafts into it would overwrite
in-window positions that a rollback needs again; the masks still apply the window, so output is exact (only the
memory saving of a ring buffer is lost). Block sharing / prefix caching is off (`allow_block_sharing=False`):
blocks are freed mid-row by rollback, which the ledger's content hashes do not model.
Tree drafts (`compact`) need several slots per position (siblings) and are refused here.

Transformers versions without those pieces (`cache_allocators` is newer than 5.17) still import this module:
`PAGED_UNAVAILABLE` then says why, `PagedKVStore` refuses to be built (`PagedKVUnavailable`, naming the version and
`--contiguous`), and `hispec.serve.Engine` falls back to its contiguous caches with a warning.
"""

from __future__ import annotations

from math import lcm

import torch
import transformers

try:
    from transformers.generation.continuous_batching.cache_allocators.cache_pool import CachePool
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
except ImportError as _e:  # an older transformers: no paged pool (`PAGED_UNAVAILABLE`), the rest of serving works
    CachePool = FullAttentionCacheAllocator = None
    PAGED_UNAVAILABLE: str | None = (
        f"transformers {transformers.__version__} has no continuous-batching cache allocators ({_e}); the paged KV "
        "pool needs a newer transformers (tested: 5.25.0), or serve with contiguous caches (--contiguous)")
else:
    PAGED_UNAVAILABLE = None


def find_num_key_value_heads(config) -> int:
    """Key/value heads per layer (as transformers' continuous batching reads them)."""
    heads = getattr(config, "num_key_value_heads", None)
    return int(heads if heads is not None else config.num_attention_heads)


def find_head_dim(config) -> int:
    """Per-head dimension (as transformers' continuous batching reads it)."""
    dim = getattr(config, "head_dim", None)
    return int(dim if dim is not None else config.hidden_size // config.num_attention_heads)


class KVPoolFull(RuntimeError):
    """The pool has no free block for a row that needs one (the engine's admission control prevents this)."""


class PagedKVUnavailable(RuntimeError):
    """This transformers has no continuous-batching cache allocators to build the paged pool on."""


class PagedKVStore:
    """The block pool shared by all rows of an engine: `num_blocks` blocks of `block_size` positions of every layer
    (the model's layers plus `extra_layers` exit-head layers)."""

    def __init__(self, config, num_layers: int, *, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device=None):
        if PAGED_UNAVAILABLE is not None:
            raise PagedKVUnavailable(PAGED_UNAVAILABLE)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.block_size, self.dtype = num_layers, block_size, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.allocator = FullAttentionCacheAllocator(
            index=0, config=config, num_key_value_heads=find_num_key_value_heads(config), cache_dtype=dtype,
            page_size=block_size, layer_indices=list(range(num_layers)), allow_block_sharing=False)
        a = self.allocator
        head_dim = find_head_dim(config)
        if a.head_dim != head_dim:
            raise ValueError("head dimension mismatch")
        bytes_per_sector = lcm(a.bytes_per_block, 128)
        self.blocks_per_sector = bytes_per_sector // a.bytes_per_block
        num_sectors = -(-num_blocks // self.blocks_per_sector)
        self.pool = CachePool(num_sectors, num_allocators=1)
        tensor = torch.zeros((num_sectors + 2) * bytes_per_sector, dtype=torch.uint8, device=self.device)
        a.register_cache_tensor(bytes_per_sector, num_sectors * bytes_per_sector, tensor, self.pool)
        self.num_blocks = a.num_blocks
        self.bytes_per_block = a.bytes_per_block

    @classmethod
    def for_model(cls, model, *, num_blocks: int | None = None, memory_mb: float | None = None,
                  block_size: int = 16) -> "PagedKVStore":
        """A store for an `EarlyExitModel` (its layers + its heads' extra layers), sized by blocks or megabytes."""
        ad = model.adapter
        layers = ad.num_layers + model.extra_cache_layers
        if num_blocks is None:
            per_block = (2 * find_num_key_value_heads(ad.config) * find_head_dim(ad.config) * ad.dtype.itemsize
                         * block_size * layers)
            num_blocks = max(1, int((memory_mb if memory_mb is not None else 512) * 2**20 // per_block))
        return cls(ad.config, layers, num_blocks=num_blocks, block_size=block_size, dtype=ad.dtype, device=ad.device)

    # ------------------------------------------------------------------ blocks
    @property
    def free_blocks(self) -> int:
        return self.pool.count_free_blocks(0) + self.pool.num_free_sectors * self.blocks_per_sector

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def allocate(self, rid, length: int) -> None:
        """Make row `rid`'s block table cover positions `[0, length)`."""
        a = self.allocator
        if a.needs_new_blocks(rid, 0, length) == 0:
            return
        sectors = a.needs_new_sectors(rid, 0, length)
        if sectors > self.pool.num_free_sectors:
            raise KVPoolFull(f"KV pool exhausted: row {rid} needs {a.needs_new_blocks(rid, 0, length)} more blocks, "
                             f"{self.free_blocks} free of {self.num_blocks}")
        for _ in range(sectors):
            self.pool.allocate_sector(0)
        a.allocate_cache_to_request(rid, 0, length)

    def keep_blocks(self, rid, n: int) -> None:
        """Free row `rid`'s blocks past its first `n` (rollback)."""
        table = self.allocator.block_table.get(rid)
        if table is None or len(table) <= n:
            return
        tail = table[n:]
        del table[n:]
        self.pool.free_blocks(0, [b for b in tail if self.allocator.ledger.release(b)])

    def free(self, rid) -> None:
        self.allocator.free_blocks(rid)

    def table(self, rids) -> torch.Tensor:
        """Block tables of `rids`, `[B, max blocks]` (padded with 0: only read where a row has slots)."""
        tables = [self.allocator.block_table.get(r, []) for r in rids]
        width = max((len(t) for t in tables), default=0)
        out = torch.zeros(len(rids), max(width, 1), dtype=torch.long)
        for b, t in enumerate(tables):
            if t:
                out[b, : len(t)] = torch.tensor(t)
        return out.to(self.device)

    def physical(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Physical token index of positions `pos` `[B, S]` (the allocator's get_read/write_indices formula)."""
        a = self.allocator
        blk = table.gather(1, (pos // self.block_size).clamp(max=table.shape[1] - 1))
        return blk * a.block_physical_stride + pos % self.block_size


class PagedKVCache:
    """The decoder's cache for one batch of rows (`rids`, their ids in the store) over a shared `PagedKVStore`;
    the same methods as `hispec.cache.KVCache` (see the module docstring for how they map onto blocks)."""

    is_compileable = False

    def __init__(self, store: PagedKVStore, rids):
        self.store = store
        self.rids = list(rids)
        self.num_layers = store.num_layers
        self.batch_size = len(self.rids)
        self.device = store.device
        self.lens = torch.zeros(self.num_layers, self.batch_size, dtype=torch.long, device=self.device)
        self._pass = None

    # ------------------------------------------------------------------ a range pass
    def begin_pass(self, start: int, end: int, position_ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Called before layers `[start, end)` run over new positions `position_ids` `[B, T]` (`valid` marks real
        ones): allocates blocks and computes the read index (each row's cached slots, padded, then the T new
        entries: the layout `DecoderAdapter` builds its masks for) and the write index of the real new tokens."""
        lens = self.lens[start]
        B, T = position_ids.shape
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=position_ids.device)
        expect = lens[:, None] + valid.long().cumsum(1) - 1
        if bool((valid & (position_ids != expect)).any()):
            raise ValueError("a paged cache stores each row's positions densely from 0: a pass must continue every "
                             "row at its cached length")
        new_len = lens + valid.sum(1)
        for b in torch.nonzero(new_len > lens).flatten().tolist():
            self.store.allocate(self.rids[b], int(new_len[b]))
        table = self.store.table(self.rids)
        S = int(lens.max()) if B else 0
        slots = torch.arange(S, device=lens.device).expand(B, S)
        old = torch.where(slots < lens[:, None], self.store.physical(table, slots), 0)  # 0: the read trash
        new = torch.where(valid, self.store.physical(table, position_ids.clamp(min=0)), 0)
        self._pass = (start, end, valid, torch.cat([old, new], 1).flatten(), new[valid], B, S + T, new_len)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the real new K/V of layer `layer_idx` into its blocks and return `[B, heads, S + T, dim]`: each
        row's cached slots (padding past its length reads zeros and is masked) followed by the T new entries."""
        if self._pass is None or not self._pass[0] <= layer_idx < self._pass[1]:
            raise RuntimeError(f"layer {layer_idx} updated outside a range pass (begin_pass was not called)")
        _, _, valid, read, write, B, S, _ = self._pass
        k = key_states.transpose(1, 2)[valid]  # [N, heads, dim]
        v = value_states.transpose(1, 2)[valid]
        k, v = self.store.allocator.update(k.to(self.store.dtype), v.to(self.store.dtype), layer_idx, read, write)
        shape = (B, S) + tuple(k.shape[1:])
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def set_slot_meta(self, start: int, end: int, valid: torch.Tensor, pos: torch.Tensor) -> None:
        """End of a range pass: the rows' lengths grow by their real new tokens (the metadata itself is implied)."""
        if self._pass is None or self._pass[:2] != (start, end):
            raise RuntimeError(f"set_slot_meta({start}, {end}) without a matching begin_pass")
        self.lens[start:end] = self._pass[-1]
        self._pass = None

    # ------------------------------------------------------------------ the KVCache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lens[layer_idx].max()) if self.batch_size else 0

    def seq_length(self, start: int, end: int) -> int:
        """Longest row of layers `[start, end)`; raises if the layers of the range disagree on any row."""
        lens = self.lens[start:end]
        if not bool((lens == lens[:1]).all()):
            raise RuntimeError(f"layers {start}..{end - 1} are at different cache lengths; a range must be advanced "
                               "as a whole")
        return self.get_seq_length(start)

    def slot_meta(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        S = self.get_seq_length(layer_idx)
        pos = torch.arange(S, device=self.device).expand(self.batch_size, S)
        return pos < self.lens[layer_idx][:, None], pos

    def row_lengths(self, layer_idx: int) -> torch.Tensor:
        return self.lens[layer_idx].clone()

    def truncate(self, start: int, end: int, keep_below: torch.Tensor) -> None:
        """Roll layers `[start, end)` back to positions `< keep_below[b]` and free each row's blocks past its
        longest layer."""
        self.truncate_ranges([(start, end)], keep_below)

    def truncate_ranges(self, ranges, keep_below: torch.Tensor) -> None:
        """`truncate` of several layer ranges at once (the blocks to keep are read from the device once)."""
        ranges = [(s, e) for s, e in ranges if s < e]
        if not ranges or not self.batch_size:
            return
        for start, end in ranges:
            self.lens[start:end] = torch.minimum(self.lens[start:end], keep_below.to(self.lens.device)[None])
        need = (self.lens.max(0).values + self.store.block_size - 1) // self.store.block_size
        for rid, n in zip(self.rids, need.tolist()):
            self.store.keep_blocks(rid, n)

    def compact(self, *args, **kwargs):
        raise NotImplementedError("tree drafts keep several slots per position (siblings); the paged cache stores one "
                                  "slot per position: decode trees with the contiguous hispec.cache.KVCache")

    def reorder_batch(self, index: torch.Tensor) -> None:
        """Keep rows `index`; the others' blocks go back to the pool."""
        keep = [int(i) for i in index.tolist()]
        for b in set(range(self.batch_size)) - set(keep):
            self.store.free(self.rids[b])
        self.rids = [self.rids[i] for i in keep]
        self.lens = self.lens[:, index.to(self.lens.device)]
        self.batch_size = len(self.rids)

    def extend(self, other: "PagedKVCache") -> None:
        """Append `other`'s rows (same store; their blocks stay where they are)."""
        if other.store is not self.store:
            raise ValueError("extend: the caches use different stores")
        self.rids += other.rids
        self.lens = torch.cat([self.lens, other.lens], 1)
        self.batch_size = len(self.rids)
        other.rids, other.batch_size = [], 0
        other.lens = other.lens[:, :0]

    def free(self) -> None:
        """Free every row's blocks."""
        for rid in self.rids:
            self.store.free(rid)
        self.rids, self.batch_size = [], 0
        self.lens = self.lens[:, :0]
