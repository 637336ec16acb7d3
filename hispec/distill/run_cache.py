"""A training run's feature cache (`data.feature_cache`; the cache itself is `hispec.distill.features`).

Contract:
- `cache_layers(exits, num_layers, m, d)` -> (layers the cache stores, layers this run reads: an `eagle3` drafter's
  aux layers, or the exits and for context heads the final layer);
- `check_feature_cache(m, d, exits, num_layers)`: before any model is loaded, a cache folder that exists but lacks
  a layer this run reads is a `ConfigError` naming what is missing and how to rebuild;
- `prepare_feature_cache(state, model, adapter, exits, m, d, g, t, train_ds, eval_ds, pad_id)` builds (or resumes
  / reuses) DIR/train and DIR/eval, alone or shard-wise over all processes with the main one writing each plan
  and manifest, -> (train, eval `CachedSequences`, what the run records about the cache). Cache errors surface as
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
from hispec.distill.features import (
    CachedSequences, FeatureCacheError, build_feature_cache, check_cache_layers, model_identity, write_manifest,
)

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
                      pad_id=pad_id, extra=extra)
        t0 = time.time()
        try:
            with generation_dtype(model.base, d.feature_cache_backbone_dtype):
                _build_split(state, adapter, ds, folder, kwargs, extra, t0)
            out[split] = CachedSequences(folder, layers=read)
        except FeatureCacheError as e:
            raise ConfigError(str(e)) from e
        man = out[split].manifest
        logger.info("feature cache %s: %d sequences, %d tokens (%d in the loss), layers %s, k=%d (%.1fs)", folder,
                    man["num_sequences"], man["num_tokens"], man["num_loss_tokens"], man["layers"], man["k"],
                    time.time() - t0)
    info = {"dir": str(root), "k": d.feature_cache_k, "hidden_dtype": d.feature_cache_dtype,
            "backbone_dtype": identity["dtype"],
            **{f"{s}_tokens": c.manifest["num_tokens"] for s, c in out.items()},
            **{f"{s}_loss_tokens": c.manifest["num_loss_tokens"] for s, c in out.items()}}
    return out["train"], out.get("eval"), info
