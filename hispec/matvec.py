"""Products of a few fp32 rows that stream the weight at the core's bandwidth: `x @ W^T` for 1-8 input rows from a
contiguous `[in, out]` copy of W, as a small C loop compiled on first use.

Contract: `available()` says whether this machine can run it (x86-64 with AVX2 and FMA, a C compiler on PATH, the
library built and checked against torch's product); `matvec(x, copy, bias)` returns `x @ copy (+ bias)` for fp32 `x`
as torch would shape it, through the loop for up to `MAX_ROWS` rows and torch's product beyond. `hispec.packed`
offers it as the kernel `STREAMED` and keeps it only where `speed_ratio` measures it faster than the others on the
model's own linears.

Why: a one-position pass of a small model is ~120 matrix-vector products of 1-7 MB each, a verification pass the same
over 2-8 rows. torch hands them to its BLAS (or oneDNN), which on an AVX2 EPYC core streamed SmolLM2's layer weights
at 11-12 GB/s where one 450 MB product reaches 16-17 GB/s (docs/results.md §The pass): the fixed cost per call and
the ramp of the hardware prefetchers over a few MB. This loop reads several weight rows at once, each a long
contiguous stream, and keeps the output block in L1: 0.79x of the BLAS time on one row, 0.6-0.75x of oneDNN's on
2-4 rows (SmolLM2's linears, interleaved). Ecosystem: torch has no other CPU kernel for a few rows (its GEMV is the
BLAS's; oneDNN's prepacked product was slower at one row here, `hispec.packed`); `torch.utils.cpp_extension` would
need torch's headers, ninja and ~1 min of compilation per machine, where this is a C file built by the system
compiler in under a second and called through ctypes (~2 us per call).

Exactness: every output element is one FMA chain over the input in index order, whatever the number of rows or
columns or how they are blocked. So a product over concatenated weights (`hispec.merged`) equals the separate
products bit for bit, and a row's product in a verification pass of up to 8 positions equals the same row's
one-position product. Against torch's product the sums run in another order, like every non-stock kernel
(`hispec.packed`, Exactness): logits move in the last bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = r"""
#include <immintrin.h>
/* y[t, n] = sum_k x[t, k] * w[k * N + n]: one FMA chain per (t, n) in k order, whatever T, N or the blocking, so a
   row's result is the same in a product of one row or of several, and a column's beside any other columns. */
#define COLS 8192 /* one row: output columns per block, kept in L1 */
static void one_row(const float* x, const float* w, float* y, long K, long N) {
    for (long n0 = 0; n0 < N; n0 += COLS) {
        long nb = N - n0 < COLS ? N - n0 : COLS;
        float* yb = y + n0;
        for (long n = 0; n < nb; n++) yb[n] = 0.f;
        long k = 0;
        for (; k + 8 <= K; k += 8) {  /* eight weight rows streamed at once */
            const float* r = w + k * N + n0;
            __m256 xv[8];
            for (int j = 0; j < 8; j++) xv[j] = _mm256_set1_ps(x[k + j]);
            long n = 0;
            for (; n + 8 <= nb; n += 8) {
                __m256 acc = _mm256_loadu_ps(yb + n);
                for (int j = 0; j < 8; j++) acc = _mm256_fmadd_ps(xv[j], _mm256_loadu_ps(r + j * N + n), acc);
                _mm256_storeu_ps(yb + n, acc);
            }
            for (; n < nb; n++) {
                float a = yb[n];
                for (int j = 0; j < 8; j++) a = __builtin_fmaf(x[k + j], r[j * N + n], a);
                yb[n] = a;
            }
        }
        for (; k < K; k++) {
            const float* r = w + k * N + n0;
            for (long n = 0; n < nb; n++) yb[n] = __builtin_fmaf(x[k], r[n], yb[n]);
        }
    }
}
#define RCOLS 1024 /* several rows: T x RCOLS partial sums kept in L1 */
static void few_rows(const float* x, const float* w, float* y, long T, long K, long N) {
    for (long n0 = 0; n0 < N; n0 += RCOLS) {
        long nb = N - n0 < RCOLS ? N - n0 : RCOLS;
        for (long t = 0; t < T; t++) for (long n = 0; n < nb; n++) y[t * N + n0 + n] = 0.f;
        long k = 0;
        for (; k + 4 <= K; k += 4) {  /* four weight rows loaded once for all T input rows */
            const float* r = w + k * N + n0;
            long n = 0;
            for (; n + 8 <= nb; n += 8) {
                __m256 w0 = _mm256_loadu_ps(r + n), w1 = _mm256_loadu_ps(r + N + n);
                __m256 w2 = _mm256_loadu_ps(r + 2 * N + n), w3 = _mm256_loadu_ps(r + 3 * N + n);
                for (long t = 0; t < T; t++) {
                    const float* xt = x + t * K + k;
                    float* yt = y + t * N + n0 + n;
                    __m256 acc = _mm256_loadu_ps(yt);
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xt), w0, acc);
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + 1), w1, acc);
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + 2), w2, acc);
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + 3), w3, acc);
                    _mm256_storeu_ps(yt, acc);
                }
            }
            for (; n < nb; n++) for (long t = 0; t < T; t++) {
                float a = y[t * N + n0 + n];
                for (int j = 0; j < 4; j++) a = __builtin_fmaf(x[t * K + k + j], r[j * N + n], a);
                y[t * N + n0 + n] = a;
            }
        }
        for (; k < K; k++) {
            const float* r = w + k * N + n0;
            for (long t = 0; t < T; t++) for (long n = 0; n < nb; n++)
                y[t * N + n0 + n] = __builtin_fmaf(x[t * K + k], r[n], y[t * N + n0 + n]);
        }
    }
}
void hispec_matvec(const float* x, const float* w, float* y, long T, long K, long N) {
    if (T == 1) one_row(x, w, y, K, N);
    else few_rows(x, w, y, T, K, N);
}
"""
MAX_ROWS = 8  # rows the loop multiplies; `matvec` hands larger inputs to torch's product over the same copy
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared")
_lib = None  # the loaded function, False where unavailable (decided once per process)


def library_path() -> Path:
    """Where the compiled library is kept: `$HISPEC_CACHE_DIR/kernels/`, else ~/.cache/hispec/kernels/, named by the
    hash of its source and flags."""
    root = os.environ.get("HISPEC_CACHE_DIR") or Path.home() / ".cache" / "hispec"
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
    return Path(root).expanduser() / "kernels" / f"matvec-{digest}.so"


def _supported() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def _build(path: Path) -> None:
    """Compile `SOURCE` into `path` (written to a temporary name in its folder, then renamed: never half a file)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "matvec.c", Path(tmp) / path.name
        src.write_text(SOURCE)
        subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
        os.replace(out, path)


def _load():
    global _lib
    if _lib is None:
        _lib = False
        if _supported():
            try:
                path = library_path()
                if not path.is_file():
                    _build(path)
                fn = ctypes.CDLL(str(path)).hispec_matvec
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
                fn.restype = None
                _lib = fn
                if not _agrees():
                    _lib = False
            except (OSError, subprocess.SubprocessError, AttributeError):
                _lib = False
    return _lib


def _agrees() -> bool:
    """Whether the library's products match torch's (to fp32 rounding) on shapes that take every code path, and a
    row's result is the same alone or among others."""
    g = torch.Generator().manual_seed(0)
    for t, k, n in ((1, 19, 13), (1, 64, 8200), (3, 19, 13), (5, 64, 1030), (8, 576, 960)):
        x, w = torch.randn(t, k, generator=g), torch.randn(k, n, generator=g)
        y = matvec(x, w)
        if not torch.allclose(y, (x.double() @ w.double()).float(), rtol=1e-4, atol=1e-4):
            return False
        if not torch.equal(y[-1:], matvec(x[-1:], w)):
            return False
    return True


def available() -> bool:
    """Whether `matvec` runs on this machine (built and checked on first call; False on non-x86 or pre-AVX2 CPUs,
    without a C compiler, or where the check fails)."""
    return bool(_load())


def matvec(x: torch.Tensor, copy: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ copy (+ bias)` for fp32 `x` (`[..., in]`) and a contiguous fp32 `[in, out]` `copy`, shaped `[..., out]`:
    through the loop for up to `MAX_ROWS` rows, through torch's product over the same copy beyond (prompts, where
    the product is bound by arithmetic, not by reading the weight). Call only where `available()`."""
    k, n = copy.shape
    if x.dtype != torch.float32 or copy.dtype != torch.float32 or x.shape[-1] != k or not copy.is_contiguous():
        raise ValueError(f"matvec takes fp32 rows of {k} and a contiguous fp32 [{k}, {n}] copy; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(copy.shape)} {copy.dtype}")
    rows = x.numel() // k if k else 0
    if rows > MAX_ROWS or rows == 0:
        y = torch.matmul(x, copy)
        return y if bias is None else y + bias
    fn = _lib or _load()
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n)
    fn(x.data_ptr(), copy.data_ptr(), y.data_ptr(), rows, k, n)
    return y if bias is None else y + bias
