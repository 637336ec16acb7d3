"""The files peer engines load: the base model's Hugging Face folder, and where converted files are cached.

Contract:
- `base_folder(source)` -> a local folder holding the base model's own files only. A plain model folder is returned
  as it is. A hispec checkpoint (its `model*.safetensors` are the unchanged base weights, docs/design.md §5) also
  holds `hispec_heads.safetensors` and maybe `hispec_drafter.*`, which an engine that loads every `*.safetensors`
  of a folder (vLLM) would take for the model's own weights: for it, a view is made under
  `cache_root()/base/` -- the same file names, each a symbolic link to the checkpoint's file, hispec's files left
  out. A Hub id is looked up in the local Hugging Face cache only (no download at run time). A `--heads-only`
  checkpoint (no base weights in it) or a GGUF file is refused with what to pass instead (PeerError).
- `cache_root()`: `$HISPEC_CACHE_DIR/peers`, else ~/.cache/hispec/peers.
- `fingerprint(folder)`: a short hash of the folder's resolved path and its weight files' names, sizes and
  modification times: a cache key that changes when the weights do.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .spec import PeerError

HISPEC_FILES = ("hispec_heads.safetensors", "hispec_drafter.safetensors", "hispec_drafter.json", "hispec_train.json",
                "README.md")


def cache_root() -> Path:
    root = os.environ.get("HISPEC_CACHE_DIR") or Path.home() / ".cache" / "hispec"
    return Path(root) / "peers"


def _weights(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("model") and p.suffix in (".safetensors", ".bin"))


def fingerprint(folder: str | os.PathLike, *extra: str) -> str:
    folder = Path(folder).resolve()
    h = hashlib.sha256(str(folder).encode())
    for p in _weights(folder):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:12]


def base_folder(source: str | os.PathLike) -> Path:
    """The local folder of the base model an engine loads (module docstring)."""
    path = Path(os.path.expanduser(str(source)))
    if path.suffix == ".gguf":
        raise PeerError(f"{source} is a GGUF file; peer engines load a Hugging Face folder of the base model: "
                        "pass the folder with --peer-model")
    if not path.is_dir():
        path = _from_hub_cache(str(source))
    if not (path / "config.json").is_file():
        raise PeerError(f"{path} has no config.json: peer engines need a Hugging Face model folder (--peer-model)")
    if not _weights(path):
        raise PeerError(f"{path} holds no model*.safetensors: a --heads-only checkpoint references its base; pass the "
                        "base model's folder with --peer-model")
    if not any((path / f).exists() for f in HISPEC_FILES[:3]):
        return path
    view = cache_root() / "base" / f"{path.name}-{fingerprint(path)}"
    if not view.is_dir():
        tmp = view.with_name(view.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for p in path.iterdir():
            if p.name not in HISPEC_FILES and not p.name.startswith("hispec_"):
                (tmp / p.name).symlink_to(p.resolve())
        os.replace(tmp, view)
    return view


def _from_hub_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 (not a local folder, not in the cache: say what to pass)
        raise PeerError(f"{repo_id!r} is not a local folder and not in the local Hugging Face cache ({type(e).__name__}"
                        "); peer engines load a local folder of the base model: pass it with --peer-model") from e


def read_config(folder: str | os.PathLike) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
