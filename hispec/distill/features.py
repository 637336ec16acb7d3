"""Feature cache: run the frozen backbone ONCE over the training sequences, then train heads from disk.

Layout of a cache folder (one per split; `train/heads.py --feature_cache DIR` uses `DIR/train` and `DIR/eval`):

    plan.json                 written first: settings + which sequences go to which shard (+ their fingerprints)
    shard-00000.safetensors   one file per ~`shard_tokens` tokens, each written to a temporary name and renamed
    ...
    manifest.json             written LAST, once every shard exists: the cache is complete iff it is present

Each shard holds, for its S sequences of N tokens in total (concatenated, no padding):
    input_ids             [N]     int32   the tokens
    offsets               [S + 1] int64   sequence boundaries (sequence j is rows offsets[j]:offsets[j + 1]), so
                                          sequences can be rebuilt for heads that attend over previous positions
    loss_mask             [N]     bool    positions whose next-token distribution trains the heads
    hidden.<layer>        [N, H]  bf16    residual stream after `layer` decoder layers, for each exit layer: the
                                          same tensor `hispec.layers.DecoderAdapter.run_layers` hands an exit
                                          head during decoding (and `hispec.distill.losses.exit_states` during training);
                                          `hidden.<num_layers>` is the final layer's raw residual (before the final
                                          norm), which `context` heads read for verified positions
    teacher_topk_ids      [N, k]  int32   the final layer's k most likely next tokens, descending
    teacher_topk_logprobs [N, k]  fp32    their log-probabilities (final-layer log-softmax, temperature 1)
Every position is stored (also those outside the loss mask), teacher included.

Contract:
- `build_feature_cache(adapter, sequences, out_dir, *, layers, k, identity, ...)` builds the shards assigned to
  `rank` (shard s belongs to rank s % world_size) and, with one process, the manifest; several processes call
  `write_manifest(out_dir)` on one rank after all have built theirs. `sequences`: rows `{"input_ids": [int],
  "loss_mask": [bool]}` (a list or a `datasets.Dataset`). Resumable: existing shards whose fingerprint matches
  the plan are kept, missing ones built. A folder whose plan or manifest was made from other data, another
  model, k or dtype, or without one of the requested layers, raises `FeatureCacheError` (nothing is overwritten);
  a complete cache that matches is returned as is. Layers: a cache holding MORE layers than asked for fits (one
  cache built with the final layer's states serves linear and context heads alike; resuming a partly built one
  keeps building all of its planned layers). Bad arguments raise `FeatureCacheError` before any work.
  `reuse=[DIR, ...]`: sequences (tokens + loss mask) already in those earlier complete caches of the same model
  are copied from them, not recomputed (`hispec.distill.feature_reuse`); shards record how many tokens they copied.
- `check_cache_layers(out_dir, layers, need=...)` -> the cached layers of a folder's plan or manifest, or None when
  nothing is there yet; a cache lacking one of `layers` raises `FeatureCacheError` naming the missing
  `hidden.<layer>` and how to rebuild (callers check this before any expensive work).
- `open_feature_cache(out_dir)` -> the manifest of a complete cache (FeatureCacheError otherwise).
- `CachedSequences(out_dir, layers)` is a torch `Dataset` of sequences read lazily (memory-mapped) from the
  shards; `CachedCollator()` concatenates a batch into flat `[N, ...]` tensors plus `labels` (next token within
  the sequence, -100 at its end), `row` (index in the batch of each token) and `offsets`.
- `frozen_batches(adapter, rows, layers, batch_tokens)` is the one frozen pass over many sequences (longest first,
  right-padded batches of at most `batch_tokens` padded tokens): the cache builder, the probe's `scored_features`
  (this content in memory, for the scored positions of `hispec.distill.items.Sequence`s only, laid out by
  `ScoredLayout`) and checkpoint evaluation (`hispec.distill.metrics.exit_head_predictions`) run on it.
- The manifest: `format`, `version`, `model` (identity + weight fingerprint + backbone dtype), `layers`, `k`,
  `hidden_dtype`, `hidden_size`, `vocab_size`, `teacher_temperature` (1.0), `num_sequences`, `num_tokens`,
  `num_loss_tokens`, `reused_tokens`, `shards` (file, sequences, tokens, loss_tokens, fingerprint, reused_tokens),
  `fingerprint` (all data),
  `extra` (what the caller passes, e.g. the data settings), `build_seconds`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hispec.distill.feature_reuse import ReuseError, ReuseIndex
from hispec.distill.losses import auto_chunk_size, exit_states, teacher_topk
from hispec.io import DTYPES, atomic_write, dtype_name, write_json
from hispec.model import base_identity


FORMAT = "hispec-features"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
_IDENTITY_KEYS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "vocab_size", "weights",
                  "dtype")


class FeatureCacheError(ValueError):
    """The feature cache cannot be built or used as asked; the message says why and what to do."""


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _shard_hook(index: int) -> None:
    """Called after every shard written (tests replace it to simulate a kill)."""


# ---------------------------------------------------------------------------------------------------- identity
def weights_fingerprint(model: torch.nn.Module, samples: int = 64) -> str:
    """A cheap fingerprint of a model's weights: a strided sample of every parameter, hashed (dtype-sensitive)."""
    h = hashlib.sha1()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            h.update(name.encode())
            h.update(str(p.dtype).encode())
            h.update(flat[::step][:samples].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(model: torch.nn.Module, name_or_path: str | None = None) -> dict:
    """What a cache records about the model that made it (compared on reuse; the name is informative only)."""
    ident = dict(base_identity(model))
    if name_or_path is not None:
        ident["name_or_path"] = name_or_path
    ident["weights"] = weights_fingerprint(model)
    ident["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    return ident


def _seq_fingerprint(h, ids, mask) -> None:
    h.update(np.asarray(ids, dtype=np.int32).tobytes())
    h.update(np.asarray(mask, dtype=np.bool_).tobytes())
    h.update(b"|")


# ---------------------------------------------------------------------------------------------------- plan
def _rows(sequences):
    """Uniform (ids, mask) access to a list of dicts or a datasets.Dataset with the two columns."""
    if hasattr(sequences, "column_names"):
        missing = {"input_ids", "loss_mask"} - set(sequences.column_names)
        if missing:
            raise FeatureCacheError(f"the sequences lack column(s) {sorted(missing)}")
        return list(zip(sequences["input_ids"], sequences["loss_mask"]))
    out = []
    for i, r in enumerate(sequences):
        if "input_ids" not in r or "loss_mask" not in r:
            raise FeatureCacheError(f"sequence {i} lacks input_ids or loss_mask")
        out.append((list(r["input_ids"]), list(r["loss_mask"])))
    return out


def make_plan(rows, shard_tokens: int) -> dict:
    """Contiguous runs of sequences, each shard at most `shard_tokens` tokens (or one longer sequence)."""
    shards, start, tokens = [], 0, 0
    whole = hashlib.sha1()
    for j, (ids, mask) in enumerate(rows):
        if len(ids) != len(mask):
            raise FeatureCacheError(f"sequence {j}: {len(ids)} input_ids but {len(mask)} loss_mask entries")
        if len(ids) < 1:
            raise FeatureCacheError(f"sequence {j} is empty")
        if tokens and tokens + len(ids) > shard_tokens:
            shards.append((start, j))
            start, tokens = j, 0
        tokens += len(ids)
        _seq_fingerprint(whole, ids, mask)
    if tokens:
        shards.append((start, len(rows)))
    out = []
    for i, (a, b) in enumerate(shards):
        h = hashlib.sha1()
        for ids, mask in rows[a:b]:
            _seq_fingerprint(h, ids, mask)
        out.append({"file": _shard_name(i), "start": a, "end": b, "tokens": sum(len(r[0]) for r in rows[a:b]),
                    "loss_tokens": sum(int(sum(map(bool, r[1]))) for r in rows[a:b]),
                    "fingerprint": h.hexdigest()[:16]})
    return {"shards": out, "fingerprint": whole.hexdigest()[:16], "num_sequences": len(rows)}


def _spec(identity: dict, layers, k: int, hidden_dtype: str, hidden_size: int, vocab_size: int) -> dict:
    return {"format": FORMAT, "version": VERSION, "model": identity, "layers": sorted(int(x) for x in layers),
            "k": int(k), "hidden_dtype": dtype_name(DTYPES[hidden_dtype]),
            "hidden_size": int(hidden_size), "vocab_size": int(vocab_size), "teacher_temperature": 1.0}


def _same_spec(a: dict, b: dict, k_at_least: bool = False) -> list[str]:
    """Differences that make cache a unusable for spec b (the model name/path may differ; a may hold more layers,
    and with `k_at_least` more teacher tokens: a source of reused rows, whose top-k is sliced)."""
    diffs = []
    for key in ("format", "version", "k", "hidden_dtype", "hidden_size", "vocab_size", "teacher_temperature"):
        if key == "k" and k_at_least and int(a.get(key) or 0) >= int(b.get(key)):
            continue
        if a.get(key) != b.get(key):
            diffs.append(f"{key} {a.get(key)!r} != {b.get(key)!r}")
    missing = sorted(set(b.get("layers") or []) - set(a.get("layers") or []))
    if missing:
        diffs.append(f"layers {a.get('layers')!r} lack {missing} ({', '.join(f'hidden.{x}' for x in missing)})")
    ma, mb = a.get("model", {}), b.get("model", {})
    for key in _IDENTITY_KEYS:
        if ma.get(key) != mb.get(key):
            diffs.append(f"model {key} {ma.get(key)!r} != {mb.get(key)!r}")
    return diffs


# ---------------------------------------------------------------------------------------------------- build
@torch.no_grad()
def _project_topk(adapter, final_normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, H]` final normed features -> top-k ids `[n, k]` int32 and log-probs `[n, k]` fp32 (chunked over n)."""
    step = auto_chunk_size(adapter.vocab_size)
    ids, vals = [], []
    for a in range(0, final_normed.shape[0], step):
        i, v = teacher_topk(adapter.project(final_normed[a : a + step]), k)
        ids.append(i.to(torch.int32))
        vals.append(v)
    return torch.cat(ids), torch.cat(vals)


@torch.no_grad()
def frozen_batches(adapter, rows: list[list[int]], layers, batch_tokens: int, pad_id: int = 0):
    """The frozen pass over many sequences (the cache, the probe, checkpoint evaluation): longest first, as many
    right-padded rows a batch as fit `batch_tokens` padded tokens (at least one). Yields per batch `(row indices,
    valid [B, T] bool, {layer: residual after it [B, T, H]}, final normed [B, T, H])` on the adapter's device."""
    lengths = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda j: -lengths[j])
    device = adapter.device
    i = 0
    while i < len(order):
        T = lengths[order[i]]
        batch = order[i : i + max(1, batch_tokens // T)]
        i += len(batch)
        ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        valid = torch.zeros(len(batch), T, dtype=torch.bool)
        for r, j in enumerate(batch):
            ids[r, : lengths[j]] = torch.as_tensor(rows[j], dtype=torch.long)
            valid[r, : lengths[j]] = True
        pos = torch.arange(T).expand(len(batch), T)
        ids, valid, pos = ids.to(device), valid.to(device), pos.to(device)
        states, final = exit_states(adapter, ids, pos, valid, tuple(layers))
        yield batch, valid, states, final


@torch.no_grad()
def _build_shard(adapter, rows, layers, k, hidden_dtype, batch_tokens, pad_id, progress=None,
                 reuse: ReuseIndex | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """One shard's tensors (see the module docstring) and how many of its tokens were copied from `reuse`: rows
    found there are copied, the others go through `frozen_batches`."""
    lengths = [len(ids) for ids, _ in rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    n, H = int(offsets[-1]), adapter.hidden_size
    hidden = {layer: torch.empty(n, H, dtype=hidden_dtype) for layer in layers}
    top_ids = torch.empty(n, k, dtype=torch.int32)
    top_lp = torch.empty(n, k, dtype=torch.float32)
    fresh, reused = [], 0
    for j, (ids, mask) in enumerate(rows):
        src = reuse.find(ids, mask) if reuse is not None else None
        if src is None:
            fresh.append(j)
            continue
        a, b = int(offsets[j]), int(offsets[j + 1])
        old = reuse.rows(src, layers, k)
        for layer in layers:
            hidden[layer][a:b] = old[f"hidden.{layer}"]
        top_ids[a:b], top_lp[a:b] = old["teacher_topk_ids"], old["teacher_topk_logprobs"]
        reused += b - a
        if progress is not None:
            progress(b - a)
    for batch, valid, states, final in frozen_batches(adapter, [rows[j][0] for j in fresh], layers, batch_tokens,
                                                      pad_id):
        batch = [fresh[i] for i in batch]
        flat = valid.reshape(-1)
        t_ids, t_lp = _project_topk(adapter, final.reshape(-1, final.shape[-1])[flat], k)
        dest = torch.cat([torch.arange(int(offsets[j]), int(offsets[j + 1])) for j in batch])
        for layer in layers:
            hidden[layer][dest] = states[layer].reshape(-1, H)[flat].to(hidden_dtype).cpu()
        top_ids[dest] = t_ids.cpu()
        top_lp[dest] = t_lp.cpu()
        if progress is not None:
            progress(int(flat.sum()))
    out = {
        "input_ids": torch.cat([torch.as_tensor(ids, dtype=torch.int32) for ids, _ in rows]),
        "offsets": offsets,
        "loss_mask": torch.cat([torch.as_tensor(mask, dtype=torch.bool) for _, mask in rows]),
        "teacher_topk_ids": top_ids,
        "teacher_topk_logprobs": top_lp,
    }
    for layer in layers:
        out[f"hidden.{layer}"] = hidden[layer]
    return out, reused


def _shard_meta(path: Path) -> dict:
    """A shard file's metadata ({} when missing or damaged: it is rebuilt)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001  (a damaged file is rebuilt)
        return {}


def _shard_fingerprint(path: Path) -> str | None:
    return _shard_meta(path).get("fingerprint")


def build_feature_cache(adapter, sequences, out_dir, *, layers, k: int = 64, identity: dict | None = None,
                        hidden_dtype: str = "bf16", shard_tokens: int = 1 << 16, batch_tokens: int = 4096,
                        pad_id: int = 0, rank: int = 0, world_size: int = 1, extra: dict | None = None,
                        show_progress: bool = True, plan_only: bool = False, reuse=None) -> dict | None:
    """Build (or resume, or reuse) a feature cache; see the module docstring. Returns the manifest when this call
    completed the cache (one process) or found it complete, None when another rank must call `write_manifest`.
    `plan_only`: only check the folder against this run and (rank 0) write the plan, then return. `reuse`: earlier
    cache folders whose sequences are copied instead of recomputed (`hispec.distill.feature_reuse`)."""
    out_dir = Path(out_dir)
    layers = sorted({int(x) for x in layers})
    if not layers or any(not 1 <= x <= adapter.num_layers for x in layers):
        raise FeatureCacheError(f"exit layers {layers} must be in 1..{adapter.num_layers}")
    if not 1 <= k <= adapter.vocab_size:
        raise FeatureCacheError(f"k must be in 1..{adapter.vocab_size} (the vocabulary), got {k}")
    if hidden_dtype not in DTYPES:
        raise FeatureCacheError(f"unknown hidden dtype '{hidden_dtype}'; choose bf16, fp16 or fp32")
    if shard_tokens < 1 or batch_tokens < 1:
        raise FeatureCacheError("shard_tokens and batch_tokens must be >= 1")
    rows = _rows(sequences)
    if not rows:
        raise FeatureCacheError("no sequences to cache")
    if identity is None:
        identity = model_identity(adapter.model)
    spec = _spec(identity, layers, k, hidden_dtype, adapter.hidden_size, adapter.vocab_size)
    plan = {**spec, **make_plan(rows, shard_tokens), "shard_tokens": shard_tokens}

    manifest_path = out_dir / MANIFEST
    plan_path = out_dir / PLAN
    if not manifest_path.is_file() and plan_path.is_file():
        planned = json.loads(plan_path.read_text()).get("layers") or []
        if set(layers) < set(planned):  # resume a partly built cache of more layers: build all of them
            layers = sorted(int(x) for x in planned)
            spec = _spec(identity, layers, k, hidden_dtype, adapter.hidden_size, adapter.vocab_size)
            plan = {**spec, **{k_: v for k_, v in plan.items() if k_ not in spec}}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        diffs = _same_spec(manifest, spec)
        if manifest.get("fingerprint") != plan["fingerprint"]:
            diffs.append("the training sequences differ")
        if diffs:
            raise FeatureCacheError(f"{out_dir} holds a feature cache that does not fit this run ({'; '.join(diffs)});"
                                    " delete it or choose another feature_cache folder")
        return manifest
    if plan_path.is_file():
        old = json.loads(plan_path.read_text())
        diffs = _same_spec(old, spec)
        if old.get("fingerprint") != plan["fingerprint"] or old.get("shard_tokens") != shard_tokens:
            diffs.append("the training sequences (or shard size) differ")
        if diffs:
            raise FeatureCacheError(f"{out_dir} holds a partly built feature cache for something else "
                                    f"({'; '.join(diffs)}); delete it or choose another feature_cache folder")
    elif rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(plan_path, plan)
    if rank == 0 and (plan_only or world_size == 1):  # no other rank is writing yet: drop a killed run's leftovers
        for junk in out_dir.glob(".shard-*.tmp-*"):
            junk.unlink(missing_ok=True)
    if plan_only:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)

    dtype = DTYPES[hidden_dtype]
    mine = [(i, s) for i, s in enumerate(plan["shards"]) if i % world_size == rank]
    todo = [(i, s) for i, s in mine if _shard_fingerprint(out_dir / s["file"]) != s["fingerprint"]]
    index = None
    if reuse and todo:
        try:
            index = ReuseIndex.open(reuse, lambda manifest: _same_spec(manifest, spec, k_at_least=True))
        except ReuseError as e:
            raise FeatureCacheError(str(e)) from e
    bar = tqdm(total=sum(s["tokens"] for _, s in mine), initial=sum(s["tokens"] for _, s in mine)
               - sum(s["tokens"] for _, s in todo), desc=f"feature cache {out_dir.name}", unit="tok",
               disable=not show_progress)
    t0 = time.time()
    for i, s in todo:
        tensors, reused = _build_shard(adapter, rows[s["start"] : s["end"]], layers, k, dtype, batch_tokens,
                                       pad_id, progress=bar.update, reuse=index)
        final = out_dir / s["file"]
        meta = {"format": FORMAT, "fingerprint": s["fingerprint"], "sequences": str(s["end"] - s["start"]),
                "reused_tokens": str(reused)}
        atomic_write(final, lambda tmp, t=tensors, m=meta: save_file(t, str(tmp), metadata=m))
        _shard_hook(i)
    bar.close()
    if world_size == 1:
        return write_manifest(out_dir, extra=extra, build_seconds=time.time() - t0)
    return None


def write_manifest(out_dir, *, extra: dict | None = None, build_seconds: float | None = None) -> dict:
    """Check that every planned shard exists with its fingerprint, then write manifest.json (last)."""
    out_dir = Path(out_dir)
    plan_path = out_dir / PLAN
    if not plan_path.is_file():
        raise FeatureCacheError(f"{out_dir} has no {PLAN}: build the cache first")
    plan = json.loads(plan_path.read_text())
    metas = [_shard_meta(out_dir / s["file"]) for s in plan["shards"]]
    missing = [s["file"] for s, meta in zip(plan["shards"], metas) if meta.get("fingerprint") != s["fingerprint"]]
    if missing:
        raise FeatureCacheError(f"{out_dir}: shard(s) {missing[:5]} missing or stale; build the cache again")
    shards = [{"file": s["file"], "sequences": s["end"] - s["start"], "tokens": s["tokens"],
               "loss_tokens": s["loss_tokens"], "fingerprint": s["fingerprint"],
               "reused_tokens": int(meta.get("reused_tokens", 0))} for s, meta in zip(plan["shards"], metas)]
    manifest = {k: plan[k] for k in ("format", "version", "model", "layers", "k", "hidden_dtype", "hidden_size",
                                     "vocab_size", "teacher_temperature", "fingerprint", "num_sequences",
                                     "shard_tokens")}
    manifest.update(num_tokens=sum(s["tokens"] for s in shards), num_loss_tokens=sum(s["loss_tokens"] for s in shards),
                    reused_tokens=sum(s["reused_tokens"] for s in shards), shards=shards, extra=extra or {},
                    build_seconds=None if build_seconds is None else round(build_seconds, 1))
    write_json(out_dir / MANIFEST, manifest)
    return manifest


def check_cache_layers(out_dir, layers, need: str = "") -> list[int] | None:
    """The layers a (complete or partly built) cache folder holds, or None when it has neither manifest nor plan.
    A cache without one of `layers` raises FeatureCacheError naming what is missing (`need` says who needs it) and
    how to rebuild: cheap (two small JSON files), so callers check before any expensive work."""
    out_dir = Path(out_dir)
    for name in (MANIFEST, PLAN):
        path = out_dir / name
        if path.is_file():
            try:
                have = [int(x) for x in json.loads(path.read_text()).get("layers") or []]
            except (ValueError, TypeError) as e:
                raise FeatureCacheError(f"{path} is unreadable ({e}); delete {out_dir} to rebuild it") from e
            missing = sorted({int(x) for x in layers} - set(have))
            if missing:
                raise FeatureCacheError(
                    f"feature cache {out_dir} holds hidden states of layers {have}, not "
                    f"{', '.join(f'hidden.{x}' for x in missing)}" + (f" ({need})" if need else "")
                    + f"; rebuild it: delete {out_dir.parent if out_dir.name in ('train', 'eval') else out_dir} "
                    "(or point feature_cache at a new folder) and run again -- the backbone runs once more over "
                    "the same sequences (self-written prompts and answers are kept)")
            return have
    return None


def open_feature_cache(out_dir) -> dict:
    """The manifest of a complete cache; FeatureCacheError when there is none."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise FeatureCacheError(f"{out_dir} is not a complete feature cache (no {MANIFEST}); build it first")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise FeatureCacheError(f"{out_dir}: unknown cache format {manifest.get('format')!r} "
                                f"v{manifest.get('version')!r}")
    return manifest


# ---------------------------------------------------------------------------------------------------- read
class CachedSequences(torch.utils.data.Dataset):
    """Sequences of a complete cache, read lazily from memory-mapped shards. Item i: `input_ids` [n] long,
    `loss_mask` [n] bool, `hidden.<layer>` [n, H] (stored dtype) for the requested layers, `teacher_topk_ids`
    [n, k] long, `teacher_topk_logprobs` [n, k] fp32."""

    def __init__(self, out_dir, layers=None):
        self.dir = Path(out_dir)
        self.manifest = open_feature_cache(self.dir)
        self.layers = list(self.manifest["layers"] if layers is None else layers)
        missing = sorted(set(self.layers) - set(self.manifest["layers"]))
        if missing:
            raise FeatureCacheError(f"{self.dir} caches layers {self.manifest['layers']}, not {missing}; build a "
                                    "cache for these exits")
        self.index: list[tuple[int, int, int]] = []  # (shard, start, end)
        for si, s in enumerate(self.manifest["shards"]):
            with safe_open(str(self.dir / s["file"]), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
            self.index.extend((si, off[j], off[j + 1]) for j in range(len(off) - 1))
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.index)

    def teacher_top1_counts(self, vocab_size: int) -> torch.Tensor:
        """`[vocab_size]` how often each token is the teacher's top-1 over every cached position; reads only the
        first column of the top-k ids, shard by shard (the hidden states stay on disk)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for si in range(len(self.manifest["shards"])):
            ids = self._handle(si).get_slice("teacher_topk_ids")[:, :1]
            counts += torch.bincount(ids.flatten().long(), minlength=vocab_size)
        return counts

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}

    def _handle(self, si: int):
        if si not in self._handles:
            self._handles[si] = safe_open(str(self.dir / self.manifest["shards"][si]["file"]), framework="pt")
        return self._handles[si]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, a, b = self.index[i]
        f = self._handle(si)
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b],
                "teacher_topk_ids": f.get_slice("teacher_topk_ids")[a:b].long(),
                "teacher_topk_logprobs": f.get_slice("teacher_topk_logprobs")[a:b]}
        for layer in self.layers:
            item[f"hidden.{layer}"] = f.get_slice(f"hidden.{layer}")[a:b]
        return item


class CachedCollator:
    """Items of `CachedSequences` -> one flat batch: every tensor concatenated over tokens, plus `labels` [N]
    (next token within the sequence, -100 at its last position), `row` [N] (batch index of each token) and
    `offsets` [B + 1]."""

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        out = {key: torch.cat([it[key] for it in items]) for key in items[0]}
        lengths = torch.tensor([len(it["input_ids"]) for it in items], dtype=torch.long)
        offsets = torch.zeros(len(items) + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        labels = torch.full_like(out["input_ids"], -100)
        labels[:-1] = out["input_ids"][1:]
        labels[offsets[1:] - 1] = -100
        out["labels"] = labels
        out["row"] = torch.repeat_interleave(torch.arange(len(items)), lengths)
        out["offsets"] = offsets
        return out


# ---------------------------------------------------------------------------------------------------- in memory
@dataclass
class ScoredLayout:
    """Where the scored positions of `hispec.distill.items.Sequence`s go in flat `[N]` arrays (sequence order,
    answers contiguous): per position the token that follows, its answer (`segment`), sequence, category index
    (into `categories`) and held-out flag."""

    offsets: list[int]
    n: int
    categories: list[str]
    next_token: torch.Tensor
    segment: torch.Tensor
    sequence: torch.Tensor
    category: torch.Tensor
    held_out: torch.Tensor

    @classmethod
    def of(cls, sequences) -> ScoredLayout:
        cats = sorted({s.category for s in sequences})
        cat_index = {c: i for i, c in enumerate(cats)}
        offsets = [0]
        for s in sequences:
            offsets.append(offsets[-1] + s.n_scored)
        n = offsets.pop()
        out = cls(offsets, n, cats, *(torch.empty(n, dtype=torch.long) for _ in range(4)),
                  torch.empty(n, dtype=torch.bool))
        seg = 0
        for i, s in enumerate(sequences):
            o = offsets[i]
            for a, b in s.spans:
                out.next_token[o : o + b - a] = torch.tensor(s.ids[a:b])
                out.segment[o : o + b - a] = seg
                o, seg = o + b - a, seg + 1
            out.sequence[offsets[i] : o], out.category[offsets[i] : o] = i, cat_index[s.category]
            out.held_out[offsets[i] : o] = s.held_out
        return out


def scored_batches(adapter, sequences, layers, offsets, batch_tokens: int):
    """`frozen_batches` over `Sequence`s, with the scored positions picked out: yields `(valid, rows, cols, dest,
    states, final)` where position `(rows[i], cols[i])` of the batch (on device; position p - 1 predicts token p
    of a span) goes to flat index `dest[i]` (CPU) and `final` is the final normed features there."""
    for batch, valid, states, final in frozen_batches(adapter, [s.ids for s in sequences], layers, batch_tokens):
        rows, cols, dest = [], [], []
        for r, i in enumerate(batch):
            pos = [p - 1 for a, b in sequences[i].spans for p in range(a, b)]
            rows += [r] * len(pos)
            cols += pos
            dest += range(offsets[i], offsets[i] + len(pos))
        if dest:
            rows, cols = torch.tensor(rows, device=valid.device), torch.tensor(cols, device=valid.device)
            yield valid, rows, cols, torch.tensor(dest), states, final[rows, cols]


@dataclass
class Features:
    """Per scored position (N of them, `layout`): exit hidden states and the teacher's targets, in memory."""

    hidden: dict[int, torch.Tensor]  # layer -> [N, H] (feature dtype, CPU)
    t_ids: torch.Tensor  # [N, k] long: the teacher's top-k token ids, descending (t_ids[:, 0]: its argmax)
    t_logp: torch.Tensor  # [N, k] float32: their log-probabilities
    layout: ScoredLayout

    @property
    def t_top(self) -> torch.Tensor:
        return self.t_ids[:, 0]


@torch.no_grad()
def scored_features(adapter, sequences, layers, *, k: int = 64, batch_tokens: int = 4096,
                    feature_dtype=torch.bfloat16, progress: bool = False) -> Features:
    """The feature cache's content in memory for the scored positions of `sequences` only: one frozen pass, the
    residual after each of `layers` and the final layer's top-k (`_project_topk`)."""
    lay = ScoredLayout.of(sequences)
    k = min(k, adapter.vocab_size)
    hidden = {layer: torch.empty(lay.n, adapter.hidden_size, dtype=feature_dtype) for layer in layers}
    t_ids, t_logp = torch.empty(lay.n, k, dtype=torch.long), torch.empty(lay.n, k, dtype=torch.float32)
    bar = tqdm(total=lay.n, desc="frozen forward", unit="tok", disable=not progress, dynamic_ncols=True)
    for _, rows, cols, dest, states, final in scored_batches(adapter, sequences, layers, lay.offsets, batch_tokens):
        for layer, h in states.items():
            hidden[layer][dest] = h[rows, cols].to("cpu", feature_dtype)
        ids, logp = _project_topk(adapter, final, k)
        t_ids[dest], t_logp[dest] = ids.long().cpu(), logp.cpu()
        bar.update(len(dest))
    bar.close()
    return Features(hidden, t_ids, t_logp, lay)
