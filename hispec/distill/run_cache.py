"""A training run's feature cache (`data.feature_cache`; the cache itself is `hispec.distill.features`).

Contract:
- `validate_cache_args(d, t)`: the cache settings alone (no file read but the reuse folders' existence) -> a
  `ConfigError` naming the bad one;
- `cache_layers(exits, num_layers, m, d)` -> (layers the cache stores, layers this run reads: an `eagle3` drafter's
  aux layers, or the exits and for context heads the final layer);
- `check_feature_cache(m, d, exits, num_layers)`: before any model is loaded, a cache folder that exists but lacks
  a layer this run reads, or a `feature_cache_reuse` folder that is no complete cache with the layers, k and
  hidden dtype this run stores, is a `ConfigError` naming what is missing and how to rebuild;
- `prepare_feature_cache(state, model, adapter, exits, m, d, g, t, train_ds, eval_ds, pad_id)` builds (or resumes
  / reuses) DIR/train and DIR/eval, copying the sequences `feature_cache_reuse` folders already hold, alone or
  shard-wise over all processes with the main one writing each plan and manifest, -> (train, eval `CachedSequences`, what the run records about the cache). Cache errors surface as
  `ConfigError`; progress is logged on the trainer's logger ("hispec.train").
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

from hispec.distill.answers import generation_dtype
from hispec.distill.args import ConfigError, DataArguments, ModelArguments
from hispec.distill.data import expand_path
from hispec.distill.feature_reuse import ReuseError, check_reusable
from hispec.distill.features import (
    CachedSequences, FeatureCacheError, build_feature_cache, check_cache_layers, model_identity, write_manifest,
)
from hispec.io import DTYPES, dtype_name, parse_dtype

logger = logging.getLogger("hispec.train")


def _build_split(state, adapter, ds, folder, kwargs, extra, t0):
    """One cache folder: built by this process alone, or shard-wise by all processes and finished by the main."""
    if state.num_processes == 1:
        build_feature_cache(adapter, ds, folder, show_progress=state.is_local_main_process, **kwargs)
        return
    with state.main_process_first():  # the main process checks the folder and writes the plan first
        build_feature_cache(adapter, ds, folder, rank=state.process_index, world_size=state.num_processes,
                            plan_only=True, **kwargs)
    build_feature_cache(adapter, ds, folder, rank=state.process_index, world_size=state.num_processes,
                        show_progress=state.is_local_main_process, **kwargs)
    state.wait_for_everyone()
    if state.is_main_process and not (folder / "manifest.json").is_file():
        write_manifest(folder, extra=extra, build_seconds=time.time() - t0)
    state.wait_for_everyone()


def validate_cache_args(d: DataArguments, t) -> None:
    """The feature cache settings, before any work (`t`: the TrainArguments, for the distillation temperature)."""
    if not d.feature_cache:
        if d.feature_cache_reuse:
            raise ConfigError("feature_cache_reuse copies sequences into a new feature cache: set feature_cache too")
        return
    if t.temperature != 1.0:
        raise ConfigError(f"the feature cache stores the teacher at temperature 1; set temperature: 1.0 "
                          f"(got {t.temperature}) or train without feature_cache")
    if d.feature_cache_k < 1:
        raise ConfigError(f"feature_cache_k must be >= 1, got {d.feature_cache_k}")
    if d.feature_cache_dtype not in DTYPES:
        raise ConfigError(f"unknown feature_cache_dtype '{d.feature_cache_dtype}'; choose bf16, fp16 or fp32")
    try:
        parse_dtype(d.feature_cache_backbone_dtype)
    except ValueError as e:
        raise ConfigError(f"feature_cache_backbone_dtype: {e}") from e
    for name in ("feature_cache_shard_tokens", "feature_cache_batch_tokens"):
        if getattr(d, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(d, name)}")
    here = Path(expand_path(d.feature_cache)).absolute()
    for folder in d.feature_cache_reuse:
        there = Path(expand_path(folder)).absolute()
        if not there.is_dir():
            raise ConfigError(f"feature_cache_reuse: {folder} is not a folder")
        if there == here or here in there.parents:
            raise ConfigError(f"feature_cache_reuse: {folder} is (inside) this run's feature_cache; reuse an "
                              "earlier cache into a new feature_cache folder")


def _reuse_folders(d: DataArguments) -> list[Path]:
    return [Path(expand_path(x)).absolute() for x in d.feature_cache_reuse]


def cache_layers(exits, num_layers: int, m: ModelArguments, d: DataArguments) -> tuple[list[int], list[int]]:
    """(layers the feature cache stores, layers this run reads): the exits, plus the final layer's raw residual
    for context heads (read) or with `feature_cache_final_states` (stored for later context runs)."""
    if m.head_type == "eagle3":  # the drafter reads its aux layers only
        from hispec.distill.drafter import drafter_aux_layers

        read = sorted(set(drafter_aux_layers(m, num_layers)))
    else:
        read = sorted({*exits, *([num_layers] if m.head_type == "context" else [])})
    store = sorted({*read, *([num_layers] if d.feature_cache_final_states else [])})
    return store, read


def check_feature_cache(m: ModelArguments, d: DataArguments, exits, num_layers: int) -> None:
    """Before any work: a feature cache folder that exists but lacks layers this run reads is a ConfigError naming
    what is missing and how to rebuild (a context run on a cache built for linear heads, mostly)."""
    if not d.feature_cache:
        return
    _, read = cache_layers(exits, num_layers, m, d)
    need = (f"context heads read the final layer's raw residual, layer {num_layers}, for verified positions"
            if m.head_type == "context" else "the eagle3 drafter's aux layers" if m.head_type == "eagle3"
            else "the exit heads' layers")
    root = Path(expand_path(d.feature_cache))
    for split in ("train", "eval"):
        try:
            check_cache_layers(root / split, read, need)
        except FeatureCacheError as e:
            raise ConfigError(str(e)) from e
    if d.feature_cache_reuse:
        store, _ = cache_layers(exits, num_layers, m, d)
        try:
            check_reusable(_reuse_folders(d), store, d.feature_cache_k, dtype_name(DTYPES[d.feature_cache_dtype]))
        except ReuseError as e:
            raise ConfigError(str(e)) from e


def prepare_feature_cache(state, model, adapter, exits, m, d, g, t, train_ds, eval_ds, pad_id):
    """Build (or resume / reuse) DIR/train and DIR/eval, then -> (train, eval CachedSequences, info for the run)."""
    root = Path(expand_path(d.feature_cache)).absolute()
    with generation_dtype(model.base, d.feature_cache_backbone_dtype):  # the identity records the dtype used
        identity = model_identity(model.base, m.model_name_or_path)
    # Recorded for people, not compared: the sequences' fingerprint decides whether a cache fits.
    extra = {"data": {k: v for k, v in asdict(d).items() if not k.startswith("feature_cache")},
             "generation": asdict(g), "seed": t.seed}
    store, read = cache_layers(exits, adapter.num_layers, m, d)
    out = {}
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is None or len(ds) == 0:
            continue
        folder = root / split
        kwargs = dict(layers=store, k=d.feature_cache_k, identity=identity, hidden_dtype=d.feature_cache_dtype,
                      shard_tokens=d.feature_cache_shard_tokens, batch_tokens=d.feature_cache_batch_tokens,
                      pad_id=pad_id, extra=extra, reuse=_reuse_folders(d) or None)
        t0 = time.time()
        try:
            with generation_dtype(model.base, d.feature_cache_backbone_dtype):
                _build_split(state, adapter, ds, folder, kwargs, extra, t0)
            out[split] = CachedSequences(folder, layers=read)
        except FeatureCacheError as e:
            raise ConfigError(str(e)) from e
        man = out[split].manifest
        logger.info("feature cache %s: %d sequences, %d tokens (%d in the loss; %d copied from earlier caches), "
                    "layers %s, k=%d (%.1fs)", folder, man["num_sequences"], man["num_tokens"], man["num_loss_tokens"],
                    man.get("reused_tokens", 0), man["layers"], man["k"], time.time() - t0)
    info = {"dir": str(root), "k": d.feature_cache_k, "hidden_dtype": d.feature_cache_dtype,
            "backbone_dtype": identity["dtype"],
            **{f"{s}_tokens": c.manifest["num_tokens"] for s, c in out.items()},
            **{f"{s}_loss_tokens": c.manifest["num_loss_tokens"] for s, c in out.items()},
            **{f"{s}_reused_tokens": c.manifest.get("reused_tokens", 0) for s, c in out.items()},
            "reused_from": [str(x) for x in _reuse_folders(d)]}
    return out["train"], out.get("eval"), info
