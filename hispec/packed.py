"""Prepacked CPU linear layers: `nn.Linear`'s product through oneDNN with the weight laid out for it once.

Why. On CPU `nn.functional.linear` hands the weight to the GEMM in its plain `[out, in]` layout, and the library
re-lays it out (packs) on every call; for decoding, where a pass is 1-16 positions, that repacking is most of the
time. Measured here (2-core AMD EPYC, Zen 4, AVX-512 + AVX512-bf16, torch 2.13, 2 threads), one 8960 x 1536
product (Qwen2.5-Coder-1.5B's MLP) for 1 / 2 / 4 / 16 positions: fp32 3.9 / 7.2 / 7.8 / 8.5 ms plain against
1.7 / 1.9 / 1.6 / 2.9 ms prepacked; bf16 1.3 / 1.1 / 1.3 / 2.1 ms against 0.45 / 0.53 / 0.62 / 1.5 ms. On the whole
model transformers' own greedy `generate` goes from 3.4 to 7.2 tok/s in bf16 and from 2.1 to 4.1 in fp32 with the
same tokens, and a pass over 8 positions costs about one over 1 position again (in fp32 it cost 2x), which is the
condition under which speculation pays. So `pack(model)` speeds up plain decoding and speculative decoding alike;
the benchmark runs transformers' strategies (`hf`, ...) unpacked, as a user gets them, and reports hispec's plain
loop `ar` next to them so the kernel's share and speculation's share stay apart.

Ecosystem: these are PyTorch's own ops (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), the ones
its inductor emits for a frozen CPU model (`torch._inductor.config.freezing`); `torch.compile` itself does not fit a
decoder whose passes change shape every round (dynamic T, growing cache, tree masks) and costs minutes of
compilation on small machines, `torch.utils.mkldnn.to_mkldnn` converts activations to and from the opaque layout on
every call (measured 1.5-2x slower than this at 4-16 positions), and intel-extension-for-pytorch's `ipex.optimize`
is not a dependency. The ops are private to torch, so `available(dtype)` probes them once and `pack` refuses clearly
where they are missing; every `PackedLinear` falls back to `nn.functional.linear` for inputs it does not cover
(another device or dtype, autograd on the weight, `stock()`).

Exactness. The packed product sums in a different order from the plain one, so logits differ in the last bits
(|diff| ~1e-4 on fp32 logits of size ~10); greedy tokens can therefore differ from the unpacked model only where
its top two logits tie to that precision, like bf16's batch effects (the benchmark re-evaluates every divergence in
fp32 and reports its margin). hispec's own decoding is lossless with respect to the model it runs: packed or not,
speculative output equals that model's plain greedy output (tested per family).

Where it pays is measured, not assumed. On a 2-core Intel Xeon with AMX (torch 2.13, one thread; docs/results.md)
transformers' greedy `generate` on SmolLM2-135M ran at 0.83-0.87x of its stock speed packed in fp32 but 1.29x in bf16,
and a single product that fits the cache (4096 x 1024) misjudged fp32 (0.80 of the stock time packed): what decides
is the whole model streaming its weights. So the default (`pack=None`) packs the model and times all its linear
layers (`speed_ratio`: every weight streamed once) over 1, 2 and 4 positions with each kernel: stock, the prepacked
one, a transposed `[in, out]` copy (`x @ W^T`) and, in fp32 where it builds, `hispec.matvec`'s streamed product
over a copy in column panels. A kernel's ratio is the median over 5 rounds of its time over the stock time measured
next to it. Per input size the fastest kernel that took at most `PAYS_BELOW` of the stock time
is kept (`kernels_that_pay`: one kernel for one-row products, one for the rest). fp32 SmolLM2 on an AVX2-only EPYC
core (tools/pass_profile.py): a one-position pass 72 ms stock, 92 ms packed, 67 ms transposed; two positions 137 ms
stock against 93 ms packed. The answer is kept per machine (`memo_path`: CPU model, torch version, architecture,
size, dtype, thread count) so that only the first load measures (`measured_ratio` reads it).
`pack=True` / `--pack` and `pack=False` / `--no-pack` decide as told.

Memory: each kernel's copy sits beside the weight (the `weight` Parameter stays, so tying, `state_dict`, saving and
every reader of `.weight` are unchanged): the linear layers' weights once more per non-stock kernel in use (with
`STREAMED` for several rows, the prepacked copy too, made on a prompt's first product past `matvec.MAX_ROWS` rows).
Packing by default must never make a model that fits fail to run, so `apply(model)` (pack=None) leaves the stock
kernels in place, with a warning, when two copies would take more than `MEMORY_SHARE` of the available memory
(`available_memory()`, Linux's MemAvailable); an explicit `pack=True` packs regardless.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from . import matvec
from .io import cpu_model, write_json

KIND = "onednn-packed"  # what `kind(model)` reports for a packed model (recorded in latency calibrations)
STOCK = "stock"
PACKED = KIND  # a kernel: the oneDNN-prepacked product
TRANSPOSED = "transposed"  # a kernel: x @ W^T from a contiguous [in, out] copy of W (a one-row product as long reads)
STREAMED = "streamed"  # `hispec.matvec` over its panel copy (fp32, AVX2; past its MAX_ROWS rows: PACKED's product)
KERNELS = (STOCK, PACKED, TRANSPOSED, STREAMED)
MANY = 4  # the "several positions" pass `speed_ratio` times beside the one-position pass
PACK_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 4  # oneDNN's layout choice for "about this many rows"; 4 measured best at 1-16 rows here
MEMORY_SHARE = 0.7  # default packing only when the copies fit in this share of the available memory
PAYS_BELOW = 0.9  # a kernel other than stock only where the linears take at most this share of their stock time
MEASURED_BYTES = 512 * 2**20  # `time_kernels` times the linears in module order up to this much weight: far beyond
# a core's caches, so each is streamed from memory as in a pass, while its copies per kernel stay bounded
_pays: dict[tuple, float] = {}  # _pays_key(module) -> speed_ratio, measured once per process
_enabled = contextvars.ContextVar("hispec_packed_enabled", default=True)
_available: dict[torch.dtype, bool] = {}  # dtype -> whether this CPU packs it (`available`)
_packable: frozenset = frozenset()  # the dtypes probed and found packable
_op = None  # torch.ops.mkldnn._linear_pointwise's overload, resolved on first use (`_linear_pointwise`)


class PackingUnavailable(RuntimeError):
    """This torch build (or device) has no usable oneDNN prepacked linear."""


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build can run prepacked oneDNN linears on this CPU in `dtype` (probed once per dtype, on a
    tiny product). oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU packs fp32 alone.
    """
    global _packable
    if dtype not in _available:
        try:
            ok = (dtype in PACK_DTYPES and torch.backends.mkldnn.is_available()
                  and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
            if ok:
                w, x = torch.randn(8, 16).to(dtype), torch.randn(3, 16).to(dtype)
                y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT),
                                                       None, "none", [], "")
                ok = bool(torch.allclose(y.float(), (x @ w.t()).float(), atol=1e-4 if dtype == torch.float32 else 0.1))
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _available[dtype] = ok
        _packable = frozenset(d for d, a in _available.items() if a)
    return _available[dtype]


def packable_dtypes() -> frozenset:
    """The dtypes of `PACK_DTYPES` this CPU packs (`available`)."""
    for dtype in PACK_DTYPES:
        available(dtype)
    return _packable


def _linear_pointwise():
    """oneDNN's prepacked product, its overload resolved once (calling the packet resolves it on every call:
    ~1.5 us of a ~50 us product)."""
    global _op
    if _op is None:
        _op = torch.ops.mkldnn._linear_pointwise.default
    return _op


@contextlib.contextmanager
def stock():
    """Within this block every `PackedLinear` computes `nn.functional.linear` (the unpacked model, e.g. to time or
    check transformers' own `generate` as a user runs it)."""
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)


def kernel_copy(kernel: str, weight: torch.Tensor) -> torch.Tensor:
    """The copy of an `[out, in]` weight that `kernel` (`PACKED`, `TRANSPOSED` or `STREAMED`) multiplies by."""
    with torch.no_grad():
        w = weight.detach()
        if kernel is PACKED:
            return torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        if kernel is STREAMED:
            return matvec.panels(w)
        return w.t().contiguous()


def multiply(kernel: str, x: torch.Tensor, copy: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` through `kernel` (`PACKED`, `TRANSPOSED` or `STREAMED`) and its `kernel_copy` of W."""
    if bias is not None:
        bias = bias.detach()
    if kernel is STREAMED:
        return matvec.matvec(x, copy, bias)  # (the bias added in the kernel, as `y + bias` adds it)
    if kernel is TRANSPOSED:
        y = torch.matmul(x, copy)
        return y if bias is None else y + bias
    return _linear_pointwise()(x if x.is_contiguous() else x.contiguous(), copy, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same `weight` / `bias` Parameters) that multiplies through the kernel chosen for its input's
    size: `one` for one-row inputs (one position of one row: a decoding step), `many` for the rest (verification
    passes, batches, prompts). Kernels: `PACKED` (a oneDNN-prepacked copy of the weight), `TRANSPOSED` (a contiguous
    `[in, out]` copy, `x @ copy`: a one-row product reads the weight as long contiguous rows, measured faster than
    the stock GEMV on an AVX2-only EPYC, tools/pass_profile.py), `STREAMED` (`hispec.matvec` over a copy in column
    panels: a row's product is the same alone or among others; past `matvec.MAX_ROWS` rows, a prompt's, `PACKED`,
    whose GEMM is faster there) and `STOCK` (`nn.functional.linear`). The copies (`_copies`, one per kernel) are
    made on first use and remade when the weight changes (in-place update, `.to()`); they are not part of the state
    dict and are dropped by copy / pickle."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties (lm_head = embeddings) and readers stay intact
        self.bias = linear.bias
        self._copies: dict[str, tuple] = {}  # kernel -> (the weight's key when copied, the copy)
        available(linear.weight.dtype)  # probe once, so the kernels know whether this CPU packs the dtype
        self.set_kernels(PACKED, PACKED)

    def set_kernels(self, one: str, many: str, keep_copies: bool = False) -> None:
        """The kernels for one-row inputs and for the rest (`KERNELS`); `PACKED` where this CPU cannot pack the
        weight's dtype runs `STOCK`. A copy no kernel uses any more is dropped, unless `keep_copies` (timing them
        in turn)."""
        ok = self.weight.dtype in _packable
        canonical = {k: k for k in KERNELS}  # (`forward` compares by identity; names read from JSON are copies)
        unknown = {one, many} - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown linear kernel(s) {sorted(unknown)}; choose from {', '.join(KERNELS)}")
        streams = self.weight.dtype == torch.float32 and matvec.available()
        self.one, self.many = [STOCK if (k == PACKED and not ok) or (k == STREAMED and not streams) else canonical[k]
                               for k in (one, many)]
        self._beyond = PACKED if ok else STREAMED  # past `matvec.MAX_ROWS` rows, where `many` is STREAMED
        if not keep_copies:
            used = {self.one, self.many, self._beyond if self.many is STREAMED else STOCK}
            self._copies = {k: v for k, v in self._copies.items() if k in used}

    @classmethod
    def wrap(cls, linear: nn.Linear) -> PackedLinear:
        out = cls(linear)
        out.train(linear.training)
        out._forward_hooks.update(linear._forward_hooks)
        out._forward_pre_hooks.update(linear._forward_pre_hooks)
        return out

    def _weight_key(self):
        w = self.weight  # (the device is checked per call: `_kernel`)
        return w.data_ptr(), w._version, w.dtype

    def copy(self, kernel: str) -> torch.Tensor:
        """`kernel`'s copy of the weight (`kernel_copy`), made on first use and again after the weight changed."""
        key = self._weight_key()
        held = self._copies.get(kernel)
        if held is None or held[0] != key:
            held = self._copies[kernel] = (key, kernel_copy(kernel, self.weight))
        return held[1]

    def drop_copy(self, kernel: str) -> None:
        """Forget `kernel`'s copy (e.g. where a merged product holds the same weights; remade if called again)."""
        self._copies.pop(kernel, None)

    def _kernel(self, x: torch.Tensor) -> str:
        """The kernel for `x`: `one` / `many` by its size, `STOCK` where none applies (another device or dtype,
        autograd on the weight, `stock()`). Ordered cheapest first, attribute reads that cost ~0.1 us: `forward`
        runs ~200 times per pass of a 30-layer model, where every microsecond is 0.5% of a 135M model's one-row pass
        (measured: this form and the op's resolved overload took 54 instead of 58 us per 576 x 1536 bf16 product,
        one Zen 4 core)."""
        w = self.weight
        if (x.is_cpu and w.is_cpu and x.dtype == w.dtype and x.dim() >= 2 and x.shape[-1] == self.in_features
                and _enabled.get() and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            n = x.numel()
            if n == self.in_features:
                return self.one
            if self.many is STREAMED and n > matvec.MAX_ROWS * self.in_features:
                return self._beyond  # a prompt's many rows: bound by arithmetic, where oneDNN's GEMM is faster
            return self.many
        return STOCK

    def covers(self, x: torch.Tensor) -> bool:
        """Whether a kernel other than the stock one multiplies `x`."""
        return self._kernel(x) != STOCK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel(x)
        if kernel is STOCK:
            return nn.functional.linear(x, self.weight, self.bias)
        return multiply(kernel, x, self.copy(kernel), self.bias)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_copies"] = {}  # remade on first use
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernels: one row {self.one}, more {self.many}"


def pack(module: nn.Module, kernels: tuple[str, str] = (PACKED, PACKED)) -> int:
    """Replace every `nn.Linear` under `module` (in place) by a `PackedLinear` sharing its Parameters, multiplying
    through `kernels` (one-row inputs, the rest: `PackedLinear.set_kernels`); returns how many were replaced
    (already packed ones keep their place and take `kernels`). Raises `PackingUnavailable` when this torch
    cannot (no oneDNN), when the module is not on the CPU, or when this CPU packs none of its linears' dtypes (fp32
    and bf16 are the candidates; bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if not available():
        raise PackingUnavailable("this torch build has no usable oneDNN prepacked linear "
                                 "(torch.ops.mkldnn._linear_pointwise); decode unpacked (--no-pack / pack=False)")
    params = [p for p in module.parameters()]
    devices = {p.device.type for p in params}
    if devices - {"cpu"}:
        raise PackingUnavailable(f"prepacked linears are a CPU kernel; this model is on {sorted(devices)}")
    linears = [m for m in module.modules() if type(m) is nn.Linear]
    dtypes = {m.weight.dtype for m in linears}
    if linears and not dtypes & packable_dtypes():
        raise PackingUnavailable(
            f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no oneDNN prepacked linear for "
            f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))} (it packs "
            f"{', '.join(sorted(str(d).removeprefix('torch.') for d in packable_dtypes())) or 'nothing'}); "
            "decode unpacked (--no-pack / pack=False) or in float32")
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in _packable:
                child = PackedLinear.wrap(child)
                setattr(parent, name, child)
                n += 1
            if isinstance(child, PackedLinear):
                child.set_kernels(*kernels)
    return n


def kind(module: nn.Module) -> str:
    """The linear kernels `module` runs, as a latency calibration records them (they set the costs): `KIND` (packed
    for every input), `STOCK` (no `PackedLinear`, or stock for every input), else "one row K1, more K2"."""
    pairs = {(m.one, m.many) for m in module.modules() if isinstance(m, PackedLinear)}
    one, many = min(pairs) if pairs else (STOCK, STOCK)
    return one if one == many else f"one row {one}, more {many}"


@contextlib.contextmanager
def for_generation(module: nn.Module):
    """Within this block `module`'s linears are packed; afterwards the very same original modules are back (training
    and the feature cache see the stock model). The distillation core's generator uses it: transformers' batched
    `generate` over 16 rows of Qwen2.5-Coder-1.5B in bf16 went from 20.5 to 27.0 tokens/s (1.32x) with the same tokens
    (one thread, 2-core AMD EPYC Zen 4; 32 rows: 1.09x, where the products are compute-bound either way); the sums
    run in another order (see Exactness above), so a greedy or sampled token can differ where two logits are within
    ~1e-4: generated data is the model's either way, but not bit-reproducible across packed / stock kernels. Does
    nothing where packing would not apply (`wanted(None, ...)`: another device or dtype, no oneDNN), where the
    copies would not fit in `MEMORY_SHARE` of the available memory, or where it does not pay on this CPU (measured
    as `pack_if_it_pays` does). Yields how many linears it packed."""
    params = list(module.parameters())
    swapped = []
    try:  # (a swap interrupted half-way is undone too)
        if params and wanted(None, params[0].device, params[0].dtype) and params[0].device.type == "cpu":
            free = available_memory()
            if free is None or packed_bytes(module) <= MEMORY_SHARE * free:
                for parent in list(module.modules()):
                    for name, child in list(parent.named_children()):
                        if type(child) is nn.Linear and child.weight.dtype in packable_dtypes():
                            swapped.append((parent, name, child))
                            setattr(parent, name, PackedLinear.wrap(child))
                kernels = kernels_that_pay(_ratio_for(module))
                if kernels is None:  # no gain on this CPU: the stock kernels again
                    for parent, name, child in reversed(swapped):
                        setattr(parent, name, child)
                    swapped = []
                for parent, name, _ in swapped:
                    getattr(parent, name).set_kernels(*kernels)
        yield len(swapped)
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def unpack(module: nn.Module) -> int:
    """Undo `pack`: every `PackedLinear` under `module` becomes an `nn.Linear` with the very same Parameters and
    hooks again; returns how many."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                plain.train(child.training)
                plain._forward_hooks.update(child._forward_hooks)
                plain._forward_pre_hooks.update(child._forward_pre_hooks)
                setattr(parent, name, plain)
                n += 1
    return n


def _pays_key(module: nn.Module) -> tuple:
    p = next(module.parameters())
    return (type(module).__name__, sum(q.numel() for q in module.parameters()), p.dtype, torch.get_num_threads())


def offered(dtype: torch.dtype) -> list[str]:
    """The kernels other than `STOCK` this CPU runs for `dtype`: `PACKED` where it packs, `TRANSPOSED`, and
    `STREAMED` in fp32 where `hispec.matvec` builds."""
    return ([PACKED] if available(dtype) else []) + [TRANSPOSED] + (
        [STREAMED] if dtype == torch.float32 and matvec.available() else [])


def time_kernels(module: nn.Module, rows=(1, 2, MANY), repeats: int = 5) -> dict[int, dict[str, list[float]]]:
    """Seconds to run the linear layers of `module` once over each of `rows` positions of random input (every weight
    streamed from memory, as a pass streams it) through each kernel this CPU offers for its dtype (`STOCK`, `PACKED`
    where it packs, `TRANSPOSED`, `STREAMED` in fp32 where `hispec.matvec` builds), per round: `{rows: {kernel:
    [seconds per round]}}`. The linears are taken in module order up to `MEASURED_BYTES` of weight (all of a small
    model; a few layers of a large one, which hold every shape but the lm_head's): each kernel keeps a copy of what
    it times while the kernels take turns, and three copies of a 6 GB fp32 model beside it would not fit in 24 GB.
    The kernels take turns within a round (adjacent in time, so a neighbour's load or drift hits all of them); a
    first round warms up (and makes the copies) untimed. Packs `module` (in place) and leaves it packed with
    `PACKED`, the other kernels' copies dropped. Why the linears and not the forward: the rest of a pass (norms,
    attention, Python) is the same under every kernel and only blurs the comparison."""
    pack(module)
    linears, total = [], 0
    for m in module.modules():
        if isinstance(m, PackedLinear) and (not linears or total < MEASURED_BYTES):
            linears.append(m)
            total += m.weight.numel() * m.weight.element_size()
    dtype = next(module.parameters()).dtype
    kernels = [STOCK, *offered(dtype)]
    g = torch.Generator().manual_seed(0)
    xs = {t: {n: torch.randn(1, t, n, generator=g).to(dtype) for n in {m.in_features for m in linears}}
          for t in rows}
    took = {t: {k: [] for k in kernels} for t in rows}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for t, x in xs.items():
                for k in kernels:
                    for m in linears:
                        m.set_kernels(k, k, keep_copies=True)
                    t0 = time.perf_counter()
                    for m in linears:
                        m(x[m.in_features])
                    if rep:
                        took[t][k].append(time.perf_counter() - t0)
    for m in linears:
        m.set_kernels(PACKED, PACKED)
    return took


def speed_ratio(module: nn.Module, rows=(1, 2, MANY), repeats: int = 5) -> dict[int, dict[str, float]]:
    """Time of the linear layers of `module` (up to `MEASURED_BYTES`) once over each of `rows` positions through each
    kernel over the time through the stock kernel (`time_kernels`), per positions count: `{1: {PACKED: r, TRANSPOSED: r}, 4: {...}}`,
    < 1 where the kernel is faster. Each ratio is the median over `repeats` rounds of the kernel's time over the
    stock time of the same round. Packs `module` (in place) to measure and leaves it packed."""
    took = time_kernels(module, rows, repeats)
    return {t: {k: statistics.median(a / max(b, 1e-12) for a, b in zip(times, per[STOCK]))
                for k, times in per.items() if k is not STOCK and times}
            for t, per in took.items()}


def _ratios(measured) -> dict[int, dict[str, float]]:
    """A measurement as `{positions: {kernel: ratio}}`, also from one number (the packed kernel at every size) or
    `{positions: ratio}` (the packed kernel); JSON keys are strings."""
    if isinstance(measured, (int, float)):
        measured = {1: measured, MANY: measured}
    return {int(t): ({PACKED: float(r)} if isinstance(r, (int, float)) else {k: float(v) for k, v in r.items()})
            for t, r in measured.items()}


def describe_ratios(measured) -> str:
    """A measurement in words: "1 position: onednn-packed 1.25, transposed 0.77; 4 positions: ..."."""
    return "; ".join(f"{t} position{'s' if t > 1 else ''}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.items()))
                     for t, r in sorted(_ratios(measured).items()))


def kernels_that_pay(measured) -> tuple[str, str] | None:
    """The kernels for one-row inputs and for the rest: for one row, and for several (the mean of the ratios measured
    over 2+ positions), the fastest kernel that takes at most `PAYS_BELOW` of the stock time, else `STOCK`; None when
    both are stock. (fp32 SmolLM2 on an AVX2-only EPYC core, one whole pass, interleaved: one position 77.9 ms stock,
    66.6 transposed, 89.4 packed; two positions 147 stock, 106 packed; four 166 stock, 137 packed.)"""
    r = _ratios(measured)

    def best(sizes):
        per = {}
        for t in sizes:
            for k, v in r[t].items():
                per.setdefault(k, []).append(v)
        k, v = min(((k, sum(v) / len(v)) for k, v in per.items()), key=lambda kv: kv[1], default=(STOCK, 1.0))
        return k if v <= PAYS_BELOW else STOCK

    pair = (best([t for t in r if t == 1]), best([t for t in r if t > 1]))
    return None if pair == (STOCK, STOCK) else pair


def memo_path() -> Path | None:
    """Where measured ratios persist between processes: `$HISPEC_CACHE_DIR/packing.json`, else
    ~/.cache/hispec/packing.json (keyed by CPU model, torch version, architecture, size, dtype and threads)."""
    root = os.environ.get("HISPEC_CACHE_DIR") or Path.home() / ".cache" / "hispec"
    return Path(root).expanduser() / "packing.json"


def _ratio_for(module: nn.Module) -> dict[int, dict[str, float]]:
    """`speed_ratio(module)`, measured once per process and machine (see `memo_path`); packs `module` when it
    measures."""
    key = _pays_key(module)
    if key in _pays:
        return _pays[key]
    path = memo_path()
    kernels = [PACKED, TRANSPOSED] + ([STREAMED] if STREAMED in offered(key[2]) else [])
    disk_key = json.dumps([cpu_model(), torch.__version__, *map(str, key), "linears-median-3",
                           *kernels])  # (what speed_ratio times: a memo without a kernel this machine has is redone)
    try:
        memo = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        memo = {}  # unreadable: measure again and rewrite it
    entry = memo.get(disk_key)
    if not (isinstance(entry, dict) and all(isinstance(v, dict) for v in entry.values())):  # older memos: again
        memo[disk_key] = {str(t): r for t, r in _ratios(speed_ratio(module)).items()}
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, memo)
            except OSError:
                pass  # a read-only home: the answer still holds for this process
    _pays[key] = _ratios(memo[disk_key])
    return _pays[key]


def pack_if_it_pays(module: nn.Module) -> tuple[str, str] | None:
    """Pack `module` (a causal LM on CPU) with the kernels that pay on this CPU (`kernels_that_pay`; measured once per
    machine for its architecture, size, dtype and thread count: `_ratio_for`); returns them, or None when it stays
    unpacked."""
    kernels = kernels_that_pay(_ratio_for(module))
    if kernels is not None:
        pack(module, kernels)
        return kernels
    unpack(module)
    return None


def measured_ratio(module: nn.Module) -> dict[int, dict[str, float]] | None:
    """The `speed_ratio` measured for a module like `module` (architecture, size, dtype, threads), or None."""
    return _pays.get(_pays_key(module))


def wanted(pack_arg, device, dtype) -> bool:
    """Resolve a `pack=` argument: True / False as given; None ("auto") packs on CPU in fp32 / bf16 when this torch
    and CPU can (`available(dtype)`; whether it then pays on this CPU is `pack_if_it_pays`'s measurement)."""
    if pack_arg is not None:
        return bool(pack_arg)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return dev.type == "cpu" and available(torch.float32 if dtype is None else dtype)


def packed_bytes(module: nn.Module) -> int:
    """Bytes one copy of `module`'s packable linears takes (about their weights' size; a weight shared by two
    linears, e.g. tied embeddings, is copied for each). Measuring the kernels copies at most `MEASURED_BYTES` of them
    per kernel (`time_kernels`)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in module.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in packable_dtypes())


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable; free pages elsewhere), or None
    when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def apply(model, pack_arg=None):
    """Pack an `EarlyExitModel`'s base and heads when `wanted(pack_arg, ...)`; returns the model. With pack_arg None
    (the default) a model whose packed copies would not fit in `MEMORY_SHARE` of the available memory stays
    unpacked, with a warning (plain kernels are slower; running out of memory is worse), and so does one whose
    packed forward is not faster on this CPU (`pack_if_it_pays`)."""
    if wanted(pack_arg, model.device, model.dtype):
        if pack_arg is None:
            need, free = 2 * (packed_bytes(model.base) + packed_bytes(model.heads)), available_memory()
            if free is not None and need > MEMORY_SHARE * free:  # (two copies: the one-row and the many-row kernels')
                warnings.warn(f"hispec: not prepacking the linear layers: their packed copies need "
                              f"{need / 2**30:.1f} GiB and the system has {free / 2**30:.1f} GiB available; "
                              "decoding uses the stock kernels (hispec.load(..., pack=True) packs regardless)",
                              stacklevel=2)
                return model
            kernels = pack_if_it_pays(model.base)  # heads and drafter follow the base's measured answer
            if kernels is None:
                return model
        else:
            kernels = (PACKED, PACKED)
        pack(model.base, kernels)
        pack(model.heads, kernels)
        if getattr(model, "drafter", None) is not None:  # an EAGLE-3 drafter's layer, fc and lm_head too
            pack(model.drafter, kernels)
        model.adapter.refresh_modules()  # its lm_head (and other parts) were replaced
    return model


def rows_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """A `PackedLinear` over given frozen tensors (e.g. a reduced vocabulary's lm_head rows), sharing their
    storage."""
    shell = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    shell.weight = nn.Parameter(weight.detach(), requires_grad=False)
    shell.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    return PackedLinear.wrap(shell)


def add_argument(parser) -> None:
    """The CLIs' `--pack` / `--no-pack` flags (hispec-generate, hispec-bench, hispec-serve); `pack_arg(args)` reads
    them."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--no-pack", action="store_true",
                       help="keep the stock linear kernels (default on CPU in fp32 / bf16: multiply through "
                            "oneDNN-prepacked weights, hispec.packed, where a ~50 ms check finds them faster on "
                            "this CPU: ~2x faster decoding on AMD Zen 4, none on Xeons with AMX; twice the "
                            "linear weights' memory)")
    group.add_argument("--pack", action="store_true",
                       help="multiply through oneDNN-prepacked weights even where the check finds no gain")


def pack_arg(args) -> bool | None:
    """`pack=` for `hispec.load` / `apply` from parsed CLI args: False with --no-pack, True with --pack, else None
    (auto: measured)."""
    return False if args.no_pack else (True if getattr(args, "pack", False) else None)
