"""Products of a few fp32 rows at the core's bandwidth: `x @ W^T` from a copy of W laid out in column panels, as a
small C loop compiled on first use.

Contract: `available()` says whether this machine can run it (x86-64 with AVX2 and FMA, a C compiler on PATH, the
library built and checked against torch's product); `panels(weight)` lays an `[out, in]` weight out for it (same
size: W^T's columns in blocks of `WIDTH`, each block stored row after row, the last block narrower); `matvec(x,
copy, bias)` returns `x @ W^T (+ bias)` for fp32 `x` shaped as torch would shape it, any number of rows.
`hispec.packed` offers it as the kernel `STREAMED`, keeps it only where `speed_ratio` measures it faster than the
others on the model's own linears, and sends it up to `MAX_ROWS` rows (past that, a prompt's products are bound by
arithmetic, where oneDNN's GEMM can use wider vectors than this AVX2 loop).

Why: a one-position pass of a small model is ~120 matrix-vector products of 1-7 MB each, a verification pass the same
over 2-16 rows. torch hands them to its BLAS (or oneDNN), which on an AVX2 EPYC core streamed SmolLM2's layer
weights at 11-12 GB/s where one 450 MB product reaches 16-17 GB/s, and a product over 4 rows cost ~2x one row
(docs/results.md §The pass). Here the weight is read once, a few panels side by side as contiguous streams, while
the partial sums of every input row for those columns stay in registers over the whole input size (tiles of 1-6
rows x 2-8 panels, at most 12 accumulators; the C source is generated below, one function per tile): a product over
2-8 rows reads the weight once, like one row (SmolLM2's layer linears, one AVX2 EPYC core, docs/results.md §The
pass: one row 0.8x of the BLAS's time, 2-8 rows 0.5-0.6x of oneDNN's prepacked product, 64-256 rows still 0.8-1.0x
of it). Ecosystem: torch has no other CPU kernel for a few rows (its GEMV is the BLAS's; oneDNN's prepacked product
is the `PACKED` kernel); `torch.utils.cpp_extension` would need torch's headers, ninja and ~1 min of compilation per
machine, where this is a C file built by the system compiler in about a second and called through ctypes (~2 us per
call).

Exactness: every output element is one FMA chain over the input in index order, whatever the number of rows or
columns or how they are tiled. So a product over concatenated weights (`hispec.merged`) equals the separate
products bit for bit, and a row's product in a pass of any number of positions equals the same row's one-position
product. The bias is added after the chain, as `y + bias` would add it. Against torch's product the sums run in
another order, like every non-stock kernel (`hispec.packed`, Exactness): logits move in the last bits.
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

WIDTH = 8  # columns per panel: one AVX2 register
PANELS = {1: 8, 2: 6, 3: 4, 4: 3, 5: 2, 6: 2}  # rows of a register tile -> panels side by side (<= 12 accumulators)


def _tile(rows: int, cols: int) -> str:
    """C for one register tile: `rows` input rows times `cols` panels, each partial sum in a register over all of K
    (one FMA chain per output element, in k order), stored once at the end (plus the bias, if any)."""
    acc = [(r, c) for r in range(rows) for c in range(cols)]
    lines = [f"static void tile_{rows}_{cols}(const float* x, const float* w, const float* bias, float* y, "
             "long p, long K, long N) {",
             "    const float* b = w + p * K * 8;",
             *(f"    __m256 a{r}{c} = _mm256_setzero_ps();" for r, c in acc),
             "    for (long k = 0; k < K; k++) {",
             *(f"        __m256 w{c} = _mm256_loadu_ps(b + {c} * K * 8 + k * 8);" for c in range(cols))]
    for r in range(rows):
        lines.append(f"        {{ __m256 s = _mm256_broadcast_ss(x + {r} * K + k);")
        lines += [f"          a{r}{c} = _mm256_fmadd_ps(s, w{c}, a{r}{c});" for c in range(cols)]
        lines.append("        }")
    lines.append("    }")
    lines += [f"    put(y + {r} * N + (p + {c}) * 8, bias ? bias + (p + {c}) * 8 : 0, a{r}{c});" for r, c in acc]
    return "\n".join(lines + ["}"])


_TILES = [(r, c) for r, most in PANELS.items() for c in range(1, most + 1)]
SOURCE = r"""
#include <immintrin.h>
/* y[t, n] = sum_k x[t, k] * w[k, n] (+ bias[n]) with w in panels: columns in blocks of 8, each block [K, 8] row
   after row, the last block [K, N % 8]. One FMA chain per (t, n) in k order, whatever T, N or the tiling. */
static inline void put(float* y, const float* bias, __m256 a) {
    _mm256_storeu_ps(y, bias ? _mm256_add_ps(a, _mm256_loadu_ps(bias)) : a);
}
""" + "\n".join(_tile(r, c) for r, c in _TILES) + r"""
typedef void (*tile_fn)(const float*, const float*, const float*, float*, long, long, long);
static tile_fn pick(long rows, long cols) {
    switch (rows * 16 + cols) {
""" + "\n".join(f"        case {r * 16 + c}: return tile_{r}_{c};" for r, c in _TILES) + r"""
    }
    return 0;
}
static const long PANELS[7] = {0, """ + ", ".join(str(PANELS[r]) for r in range(1, 7)) + r"""};
static void narrow(const float* x, const float* w, const float* bias, float* y, long T, long K, long N) {
    long n0 = N / 8 * 8, width = N - n0;  /* the last, narrower panel: one chain per element, as above */
    const float* b = w + n0 * K;
    for (long t = 0; t < T; t++)
        for (long j = 0; j < width; j++) {
            float a = 0.f;
            for (long k = 0; k < K; k++) a = __builtin_fmaf(x[t * K + k], b[k * width + j], a);
            y[t * N + n0 + j] = bias ? a + bias[n0 + j] : a;
        }
}
void hispec_matvec(const float* x, const float* w, const float* bias, float* y, long T, long K, long N) {
    long full = N / 8, cols = 8;
    for (long t = 0; t < T;) {  /* rows in groups of <= 6; the panels side by side: the fewest any group takes */
        long rows = T - t > 8 ? 6 : T - t > 6 ? 4 : T - t;
        if (PANELS[rows] < cols) cols = PANELS[rows];
        t += rows;
    }
    for (long p = 0; p < full;) {
        long c = full - p < cols ? full - p : cols;  /* (the last few panels: a narrower tile) */
        for (long t = 0; t < T;) {  /* every group of rows over the same panels (still in L1 / L2) */
            long rows = T - t > 8 ? 6 : T - t > 6 ? 4 : T - t;
            pick(rows, c)(x + t * K, w, bias, y + t * N, p, K, N);
            t += rows;
        }
        p += c;
    }
    if (N % 8) narrow(x, w, bias, y, T, K, N);
}
"""
MAX_ROWS = 64  # rows `hispec.packed` multiplies here; a prompt's products beyond are bound by arithmetic (see `matvec`)
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
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
                fn.restype = None
                _lib = fn
                if not _agrees():
                    _lib = False
            except (OSError, subprocess.SubprocessError, AttributeError):
                _lib = False
    return _lib


def _agrees() -> bool:
    """Whether the library's products match torch's (to fp32 rounding) on shapes that take every code path (tiles of
    1-6 rows, 1-4 panels, the narrow last panel, the bias), and a row's result is the same alone or among others."""
    g = torch.Generator().manual_seed(0)
    for t, k, n in ((1, 19, 13), (1, 64, 8200), (2, 7, 40), (3, 19, 13), (5, 64, 1030), (8, 576, 960), (13, 33, 70)):
        x, w, b = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        y = matvec(x, panels(w), b)
        if not torch.allclose(y, (x.double() @ w.double().t() + b.double()).float(), rtol=1e-4, atol=1e-4):
            return False
        if not torch.equal(y[-1:], matvec(x[-1:], panels(w), b)):
            return False
    return True


def available() -> bool:
    """Whether `matvec` runs on this machine (built and checked on first call; False on non-x86 or pre-AVX2 CPUs,
    without a C compiler, or where the check fails)."""
    return bool(_load())


def panels(weight: torch.Tensor) -> torch.Tensor:
    """The copy `matvec` multiplies by, of an `[out, in]` weight (`nn.Linear`'s): a flat fp32 tensor of its size
    holding W^T (`[in, out]`) in blocks of `WIDTH` columns, each block row after row, the last block narrower."""
    w = weight.detach().float()
    n, k = w.shape
    full = n // WIDTH * WIDTH
    head = w[:full].reshape(n // WIDTH, WIDTH, k).transpose(1, 2).reshape(-1)  # [blocks, in, WIDTH]
    return torch.cat([head, w[full:].t().reshape(-1)]).contiguous()


def matvec(x: torch.Tensor, copy: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ bias)` for fp32 `x` (`[..., in]`) and `copy = panels(W)`, shaped `[..., out]`, any number of rows
    (`hispec.packed` sends it up to `MAX_ROWS`). Call only where `available()`."""
    k = x.shape[-1]
    if (x.dtype != torch.float32 or copy.dtype != torch.float32 or copy.dim() != 1 or not copy.is_contiguous()
            or k == 0 or copy.numel() % k):
        raise ValueError(f"matvec takes fp32 rows and a flat fp32 copy from matvec.panels of a weight with as many "
                         f"inputs; got {tuple(x.shape)} {x.dtype} and {tuple(copy.shape)} {copy.dtype}")
    n = copy.numel() // k
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n):
        raise ValueError(f"matvec's bias must be fp32 of {n}; got {tuple(bias.shape)} {bias.dtype}")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n)
    rows = x.numel() // k
    if rows:
        bias = None if bias is None else bias.contiguous()
        (_lib or _load())(x.data_ptr(), copy.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                          rows, k, n)
    return y
