"""Small shared helpers: the dtype table, atomic file and folder writes, model-source resolution (local folder,
Hub id, .gguf), the bf16 speed probe, and handing freed heap memory back to the OS (`HeapTrimmer`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype | None:
    """'bf16' / 'float32' / torch.dtype / None / 'auto' -> torch.dtype or None; a clear error otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    if dtype == "auto":
        return None
    raise ValueError(f"unknown dtype {dtype!r}; choose one of fp32, bf16, fp16")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the name stored in manifests and configs)."""
    return str(dtype).replace("torch.", "")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary sibling folder; on success it replaces `target` in one rename.

    A crash or exception leaves `target` untouched (or absent) and removes the temporary folder, so a
    half-written folder never appears under the final name. An existing target is refused unless `overwrite`.
    """
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # the umask's usual permissions, not mkdtemp's 0700
    try:
        yield tmp
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Write a file through a temporary sibling + os.replace: `write(tmp_path)` fills the temporary file, which
    then takes the final name in one rename (with the umask's usual permissions, not mkstemp's 0600). A crash
    leaves the old file (or none) and no half-written one under the final name; the temporary file is removed on
    error. The one atomic-file helper of the package (JSON, text, safetensors shards, model cards)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`text` to `path` atomically (see `atomic_write`), flushed to disk before the rename."""
    def w(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(path, w)


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """Write `data` as indented JSON (and a final newline) atomically: a crash leaves the old file."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def emit_result(result: dict, json_out: str | os.PathLike | None = None) -> int:
    """A tool's last act: write `result` to `json_out` (when given, atomically) and print it as the one JSON line
    every benchmark and report ends with; returns 0, the exit status."""
    if json_out:
        write_text(json_out, json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0


def resolve_file(name_or_path: str, filename: str, revision: str | None = None) -> str:
    """Path of `filename` inside a local folder, or downloaded from the Hub repo `name_or_path`."""
    local = Path(name_or_path).expanduser()
    looks_local = local.exists() or str(name_or_path).startswith(("/", ".", "~")) or os.sep + os.sep in str(name_or_path)
    if looks_local and not local.is_dir():
        raise FileNotFoundError(f"{local} is not a folder")
    if local.is_dir():
        path = local / filename
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        return str(path)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(name_or_path, filename, revision=revision)


def matmul_speed_ratio(dtype=torch.bfloat16, size: int = 256, device="cpu") -> float:
    """How many times slower a `size`^2 matmul runs in `dtype` than in fp32 on `device` (a few ms to measure).

    CPUs without native bf16 instructions (e.g. AVX2-only x86: `torch.backends.cpu.get_cpu_capability()` ==
    "AVX2") run bf16 GEMMs through a slow fallback -- measured 1 GFLOPS against 140 GFLOPS in fp32 on a 2-core
    AMD EPYC without AVX-512, while CPUs with AVX-512 BF16 / AMX run bf16 faster than fp32. So whether bf16 pays
    is measured here, not assumed."""
    a = torch.randn(size, size, device=device)
    times = {}
    for dt in (torch.float32, dtype):
        x = a.to(dt)
        x @ x  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - t0)
        times[dt] = best
    return times[dtype] / max(times[torch.float32], 1e-9)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class HeapTrimmer:
    """Calling it hands the C heap's free pages back to the OS (glibc's `malloc_trim(0)`), at most once every
    `interval_s` seconds; a no-op where the C library has no `malloc_trim` (macOS, musl, Windows).

    Why: a training loop whose batches change shape every step (sequences of every length up to
    `max_seq_length`) leaves glibc's heap fragmented: freed blocks of one step's sizes do not fit the next step's,
    so the heap keeps growing although the live tensors do not (measured, SmolLM2 EAGLE-3 drafter, 8 x <= 384
    tokens, bf16 autocast, one thread: the same 343 live tensors, 653 MB, at every step, while resident memory
    grew ~25 MB per step, 0.8 -> 4.0 GB over 120 steps; the Qwen2.5-Coder-1.5B drafter reached 15.5 GB at step
    450 and two such trainings were OOM-killed on 24 GiB). Neither `MALLOC_ARENA_MAX=1`, a fixed
    `MALLOC_MMAP_THRESHOLD_`, nor torch's oneDNN / ideep cache sizes changed that; jemalloc or `malloc_trim` did.
    With a trim every 20 s (~5 steps) the same run stayed between 1.8 and 3.2 GB for 120 steps (the step's own
    working set plus what it faulted back in since the last trim) and trained the same weights bit for bit.
    Each trim returns pages the next steps fault back in (after every step: +17% training time; every 20 s:
    +5.6%, a census of the live tensors every 10 steps included), so it runs at most once a minute: the growth
    between two trims stays bounded whatever a step costs. torch has no CPU-heap release of its own, so this
    calls glibc."""

    def __init__(self, interval_s: float = 60.0, clock=time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.last = clock()
        self.trims = 0
        self._trim = _malloc_trim()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def __call__(self, force: bool = False) -> bool:
        """Trim if `interval_s` has passed since the last trim (or `force`); True when it trimmed."""
        if self._trim is None or not (force or self.clock() - self.last >= self.interval_s):
            return False
        self._trim(0)
        self.last, self.trims = self.clock(), self.trims + 1
        return True


def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
