"""Fetch llama.cpp's own HF -> GGUF converter for hispec-bench's llama.cpp rows (run by `make peers`).

    python tools/get_llama_cpp_converter.py               # the installed llama-cpp-python's version, from PyPI
    python tools/get_llama_cpp_converter.py --sdist llama_cpp_python-0.3.36.tar.gz

The llama-cpp-python sdist carries the llama.cpp sources its bindings are built from, converter included
(`vendor/llama.cpp/convert_hf_to_gguf.py`, the `conversion/` package it imports, and `gguf-py/`, the gguf library of
the same revision, which the converter puts first on its path). This tool downloads that sdist with pip (`pip
download --no-deps --no-binary :all: llama-cpp-python==VERSION`, VERSION = the installed bindings'), and extracts
those files (and llama.cpp's LICENSE) into hispec.bench.peers.llamacpp.converter_dir(VERSION), i.e.
~/.cache/hispec/peers/llama.cpp/VERSION/ (or under $HISPEC_CACHE_DIR), written atomically. hispec-bench then runs the
converter from there; nothing is fetched at benchmark time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def download(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(dest),
           f"llama-cpp-python=={version}"]
    print(f"[get_llama_cpp_converter] {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip downloaded no llama-cpp-python sdist into {dest}")
    return found[0]


def extract(sdist: Path, out: Path) -> list[str]:
    """The converter's files from `sdist` into `out` (atomically: a temporary sibling, then one rename)."""
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    names = []
    try:
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                parts = m.name.split("/", 3)  # llama_cpp_python-V / vendor / llama.cpp / rest
                if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not m.isfile():
                    continue
                rest = parts[3]
                if rest in KEEP or any(rest.startswith(k) for k in KEEP if k.endswith("/")):
                    target = tmp / rest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    names.append(rest)
        if "convert_hf_to_gguf.py" not in names:
            raise SystemExit(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", help="llama-cpp-python version (default: the installed one)")
    p.add_argument("--sdist", help="a llama-cpp-python sdist already on disk (no download)")
    p.add_argument("--force", action="store_true", help="fetch again even when the converter is there")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from hispec.bench.peers.llamacpp import converter_dir

    version = args.version or installed_version()
    if version is None and not args.sdist:
        raise SystemExit("llama-cpp-python is not installed: `make peers` (or pip install 'hispec[peers]') first, or "
                         "pass --version / --sdist")
    if args.sdist and version is None:
        version = Path(args.sdist).name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    out = converter_dir(version)
    converter = out / "convert_hf_to_gguf.py"
    if converter.is_file() and not args.force:
        print(json.dumps({"converter": str(converter), "version": version, "fetched": False}))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hispec-llama-sdist-") as tmp:
        sdist = Path(args.sdist) if args.sdist else download(version, Path(tmp))
        names = extract(sdist, out)
    print(f"[get_llama_cpp_converter] {len(names)} files -> {out}", file=sys.stderr, flush=True)
    print(json.dumps({"converter": str(converter), "version": version, "fetched": True, "files": len(names)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
