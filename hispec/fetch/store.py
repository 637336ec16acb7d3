"""The model store: where converted models are cached, and the one call that makes sure one is there.

Contract: ``models_dir(cache_dir)`` is the parent folder of cached models: ``cache_dir``, else
``$HISPEC_MODELS_DIR``, else ``~/.cache/hispec/models``. ``ensure_model(cache_dir=None, force=False, model=None)``
(alias ``ensure_demo_model``; default model: SmolLM2) returns ``<models_dir>/<folder>``: a valid cached folder at
once, with no heavy imports; otherwise, under an inter-process lock, it fetches the GGUF
(``hispec.fetch.download``), converts and checks it in a temporary sibling (``hispec.fetch.convert``), writes the
marker (``.hispec-demo-ok``: source, Hub id, dtype, time) last and moves the folder into place with
``os.replace``: a crash never leaves a folder that looks valid, and a folder with the marker is reused as is.
``force`` rebuilds from the cached GGUF. Errors: :class:`DemoModelFetchError` when the download fails,
RuntimeError when a check fails, KeyError for an unknown model. ``describe(root)`` is the registry as text with
each entry's cache state.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time

from .convert import convert
from .download import DOWNLOADS, fetch_gguf, fix_permissions
from .registry import DEFAULT_MODEL, MODELS, ModelSpec, get_spec, log

MARKER = ".hispec-demo-ok"
ENV_VAR = "HISPEC_MODELS_DIR"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", MARKER)


def models_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The parent folder of cached models: ``cache_dir``, else ``$HISPEC_MODELS_DIR``, else ~/.cache/hispec/models."""
    if cache_dir is None:
        cache_dir = os.environ.get(ENV_VAR) or pathlib.Path.home() / ".cache" / "hispec" / "models"
    return pathlib.Path(cache_dir).expanduser().resolve()


def is_valid(folder: pathlib.Path) -> bool:
    """A finished conversion: every required file present (the marker is written last)."""
    return folder.is_dir() and all((folder / name).is_file() for name in REQUIRED_FILES)


@contextlib.contextmanager
def _lock(path: pathlib.Path):
    """An exclusive inter-process lock (POSIX), so parallel test workers convert only once."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no locking
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, force: bool = False,
                      model: str | ModelSpec | None = None) -> pathlib.Path:
    """The folder of the converted model (default: the SmolLM2 demo model), fetching and converting it first if
    it is not cached.

    A valid cached folder is returned at once (no heavy imports). ``force`` rebuilds the folder from the cached
    GGUF. Raises :class:`DemoModelFetchError` when the download fails, RuntimeError when a check fails,
    KeyError for an unknown ``model``.
    """
    spec = get_spec(model)
    root = models_dir(cache_dir)
    final = root / spec.name
    if not force and is_valid(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{spec.name}.lock"):
        if not force and is_valid(final):  # another process finished while we waited
            return final
        t0 = time.perf_counter()
        gguf_path = fetch_gguf(root, spec)
        t1 = time.perf_counter()
        if t1 - t0 > 1:
            log(f"download took {t1 - t0:.1f} s")
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.name}.tmp-"))
        try:
            convert(gguf_path, tmp, spec)
            fix_permissions(tmp)
            (tmp / MARKER).write_text(json.dumps(
                {"source": spec.source, "hub_id": spec.hub_id, "dtype": spec.dtype, "created": time.time()}) + "\n")
            old = None
            if final.exists():  # stale, partial or forced: move aside, then swap in the new folder
                old = root / f".{spec.name}.old-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log(f"conversion and checks took {time.perf_counter() - t1:.1f} s")
        log(f"ready in {time.perf_counter() - t0:.1f} s: {final}")
    return final


ensure_model = ensure_demo_model


def describe(root: pathlib.Path | None = None) -> str:
    """The registry as text: one block per model (the default first), with its cache state under ``root``."""
    lines = []
    for spec in MODELS.values():
        state = ""
        if root is not None:
            state = "converted" if is_valid(root / spec.name) else (
                "GGUF downloaded" if (root / DOWNLOADS / spec.gguf_name).is_file() else "not fetched")
            state = f"  [{state}]"
        default = " (default)" if spec.key == DEFAULT_MODEL else ""
        e = spec.expected
        lines.append(f"{spec.key}{default}{state}\n"
                     f"    {spec.hub_id} ({spec.license}), {e['architecture']}, {e['num_hidden_layers']} layers, "
                     f"hidden {e['hidden_size']}, vocab {e['vocab_size']}\n"
                     f"    {spec.quantization} GGUF from {spec.source}, ~{spec.download_mb} MB; saved as "
                     f"{spec.dtype} in <models_dir>/{spec.name}")
    return "\n".join(lines)
