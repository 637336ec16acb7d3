"""Reuse earlier feature caches when building a new one: growing the data should not rerun the backbone over the
sequences that are already cached (a Qwen2.5-Coder-1.5B cache takes over an hour on one CPU core).

A new cache (`hispec.distill.features.build_feature_cache(..., reuse=[DIR, ...])`) copies the rows of every
sequence whose tokens AND loss mask equal a sequence of an earlier complete cache, and runs the backbone only over
the others. The earlier caches must come from the same model (weights fingerprint, architecture, backbone dtype),
store the hidden states in the same dtype, hold at least the layers asked for and at least k teacher tokens per
position (the top-k is stored descending, so its first k columns are exactly a smaller cache's). Anything else
is an error naming what differs: the user asked for reuse, so silently rebuilding would hide a
mistake (another model, a bf16 cache for an fp32 run).

Why by sequence and not by shard: a shard is a contiguous run of the plan, and adding data (more self-written
prompts, another teacher-forced file) shifts which sequences fall into which shard, so shard fingerprints of the
old and new plan rarely agree; sequence fingerprints do.

Contract:
- `sequence_key(ids, mask)` -> the sha1 hex digest a sequence is found under.
- `ReuseIndex.open(dirs, misfit)`: every complete cache in `dirs` (each a cache folder holding manifest.json, or a
  `feature_cache` root whose train/ and eval/ are caches), each manifest checked by `misfit` (-> what differs from
  the new cache; `features` passes its spec comparison); raises `ReuseError` (a ValueError, which
  `build_feature_cache` raises as its `FeatureCacheError`) for a folder with no complete cache or one that does
  not fit.
- `index.find(ids, mask)` -> a `Source` (shard file + row range) or None; `index.rows(source, layers, k)` -> that
  sequence's tensors under the cache's names (`hidden.<layer>`, `teacher_topk_ids`, `teacher_topk_logprobs`).
- `check_reusable(dirs, layers, k, hidden_dtype)`: the cheap check before any work (JSON only; the model identity
  is compared once the model is loaded, by `ReuseIndex.open`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

MANIFEST = "manifest.json"


def sequence_key(ids, mask) -> str:
    """The key a sequence is found under: its token ids (int32) and loss mask (bool), hashed."""
    h = hashlib.sha1()
    h.update(np.asarray(ids, dtype=np.int32).tobytes())
    h.update(b"|")
    h.update(np.asarray(mask, dtype=np.bool_).tobytes())
    return h.hexdigest()


def cache_folders(root) -> list[Path]:
    """The complete caches a reuse folder names: itself when it holds a manifest, else its train/ and eval/."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return [root]
    return [root / s for s in ("train", "eval") if (root / s / MANIFEST).is_file()]


class ReuseError(ValueError):
    """An earlier cache cannot be reused as asked (`build_feature_cache` raises it as a `FeatureCacheError`)."""


def _manifests(dirs):
    """(folder, manifest) of every complete cache the reuse folders name; ReuseError for a folder with none."""
    for root in dirs:
        folders = cache_folders(root)
        if not folders:
            raise ReuseError(f"feature_cache_reuse: {root} holds no complete feature cache (a manifest.json in it or "
                             "in its train/ or eval/); finish building it, or drop it from feature_cache_reuse")
        for folder in folders:
            yield folder, json.loads((folder / MANIFEST).read_text())


def _fit(manifest: dict, layers, k: int, hidden_dtype: str | None) -> list[str]:
    """Why a cache's manifest cannot serve a cache of `layers`, `k`, `hidden_dtype` (JSON fields only)."""
    diffs = []
    missing = sorted(set(int(x) for x in layers) - set(manifest.get("layers") or []))
    if missing:
        diffs.append(f"it lacks layers {missing} (holds {manifest.get('layers')})")
    if int(manifest.get("k") or 0) < int(k):
        diffs.append(f"it keeps the teacher's top-{manifest.get('k')}, fewer than k={k}")
    if hidden_dtype is not None and manifest.get("hidden_dtype") != hidden_dtype:
        diffs.append(f"hidden states in {manifest.get('hidden_dtype')}, not {hidden_dtype}")
    return diffs


def check_reusable(dirs, layers, k: int, hidden_dtype: str) -> None:
    """Before any work: each reuse folder holds a complete cache with `layers`, >= k teacher tokens, `hidden_dtype`
    (a dtype name as manifests record it, e.g. "bfloat16"). ReuseError naming the folder otherwise."""
    for folder, manifest in _manifests(dirs):
        diffs = _fit(manifest, layers, k, hidden_dtype)
        if diffs:
            raise ReuseError(f"feature_cache_reuse: {folder} cannot serve this run: {'; '.join(diffs)}")


@dataclass(frozen=True)
class Source:
    folder: Path
    file: str
    start: int
    end: int


class ReuseIndex:
    """Sequences of earlier caches by `sequence_key`; see the module docstring."""

    def __init__(self):
        self.by_key: dict[str, Source] = {}
        self.folders: list[Path] = []
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, dirs, misfit) -> ReuseIndex:
        """`misfit(manifest) -> [what differs]` says whether a cache fits the new one (empty: it does)."""
        index = cls()
        for folder, manifest in _manifests(dirs):
            diffs = misfit(manifest)
            if diffs:
                raise ReuseError(f"feature_cache_reuse: {folder} was built for something else ({'; '.join(diffs)}); "
                                 "only a cache of the same model, backbone dtype and hidden dtype can be reused")
            index._add(folder, manifest)
        return index

    def _add(self, folder: Path, manifest: dict) -> None:
        self.folders.append(folder)
        for s in manifest["shards"]:
            with safe_open(str(folder / s["file"]), framework="np") as f:
                ids, off, mask = f.get_tensor("input_ids"), f.get_tensor("offsets"), f.get_tensor("loss_mask")
            for j in range(len(off) - 1):
                a, b = int(off[j]), int(off[j + 1])
                self.by_key.setdefault(sequence_key(ids[a:b], mask[a:b]), Source(folder, s["file"], a, b))

    def __len__(self) -> int:
        return len(self.by_key)

    def find(self, ids, mask) -> Source | None:
        return self.by_key.get(sequence_key(ids, mask))

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def rows(self, src: Source, layers, k: int) -> dict[str, torch.Tensor]:
        f = self._handle(src.folder / src.file)
        out = {f"hidden.{layer}": f.get_slice(f"hidden.{layer}")[src.start : src.end] for layer in layers}
        out["teacher_topk_ids"] = f.get_slice("teacher_topk_ids")[src.start : src.end][:, :k]
        out["teacher_topk_logprobs"] = f.get_slice("teacher_topk_logprobs")[src.start : src.end][:, :k]
        return out
