"""What the other engines get from hispec-bench: `peer_job(model, prompts, config, eos, threads)` -> a `PeerJob`.

Contract: the base-model folder is `config.peer_model`, else the folder the model was loaded from (its
`config._name_or_path`), made loadable by `folders.base_folder` (a hispec checkpoint's own files left out). The
drafter of the vllm-eagle3 rows is `speculators_folder(config.peer_drafter or that folder, base)`: a `speculators`
folder is used as it is; a drafter run or a checkpoint exported with `--drafter` (files `hispec_drafter.*`) is
exported once with `hispec.export.speculators` (its verifier recorded as the local base folder) into
`folders.cache_root()/speculators/`, keyed by the files' fingerprint; anything else gives None, and those rows fail
saying what to pass (`PeerJob.drafter_error`: why a drafter that was named could not be used). Raises PeerError when
there is no usable base folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .spec import PeerError, PeerJob
from .folders import base_folder, cache_root, fingerprint

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def is_speculators_folder(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(cfg.read_text())
    except ValueError:
        return False


def speculators_folder(source: str | os.PathLike | None, base: Path) -> Path | None:
    """The `speculators` folder vLLM loads as the drafter (module docstring), or None."""
    if source is None:
        return None
    path = Path(os.path.expanduser(str(source)))
    if is_speculators_folder(path):
        return path
    if not (path / "hispec_drafter.json").is_file():
        return None
    out = cache_root() / "speculators" / f"{path.name}-{fingerprint(path, str(base))}"
    if not out.is_dir():
        from ...export.speculators import export_speculators

        print(f"[hispec-bench] exporting the EAGLE-3 drafter of {path} to {out} (speculators format)",
              file=sys.stderr, flush=True)
        export_speculators(path, out, verifier=str(base))
    return out


def peer_job(model, prompts: list[list[int]], config, eos: list[int], threads: int | None) -> PeerJob:
    source = config.peer_model or getattr(model.base.config, "_name_or_path", None)
    if not source:
        raise PeerError("the model was not loaded from a folder: pass the base model's folder with --peer-model")
    base = base_folder(source)
    drafter, why = None, None
    if any(s.startswith("vllm-eagle3") for s in config.strategies):
        src = config.peer_drafter or (source if Path(os.path.expanduser(str(source))).is_dir() else None)
        try:
            drafter = speculators_folder(src, base)
        except Exception as e:  # noqa: BLE001 (e.g. `speculators` not installed: the eagle3 rows fail with it)
            why = f"exporting the drafter of {src} failed: {type(e).__name__}: {e}"
        if drafter is None and why is None and config.peer_drafter:
            why = (f"--peer-drafter {config.peer_drafter} is neither a speculators folder (config.json with "
                   "speculators_model_type) nor a drafter run or checkpoint (hispec_drafter.json)")
    dtype = DTYPES.get(str(model.dtype).replace("torch.", ""), str(model.dtype))
    return PeerJob(prompts=prompts, max_new_tokens=config.max_new_tokens, eos=list(eos), dtype=dtype,
                   model_dir=str(base), num_layers=model.num_layers, threads=threads, repeats=config.repeats,
                   warmup=config.warmup, drafter=None if drafter is None else str(drafter), drafter_error=why,
                   vllm_python=config.vllm_python)
