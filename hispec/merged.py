"""Several linear layers that read the same input, multiplied as one product: a layer's Q, K and V projections, its
MLP's gate and up projections.

Contract: `MergedLinear(members)` takes `hispec.packed.PackedLinear`s with the same input size, dtype and kernels;
`merged(x)` returns the members' outputs (views of one product, in the members' order) where their kernel for `x`
is the prepacked or the transposed one and the merged product was checked equal to theirs bit for bit; else None,
and the caller multiplies member by member as before. The concatenated copy for a kernel is made on first use and
remade when a member's weight or kernels change; the members' own copies for that kernel are then dropped (they
are remade if a member is ever called alone), so merging costs no memory beyond a layer's worth while it builds.

Why: a one-position pass of a small model multiplies ~7 weights per layer, each a matrix-vector product of a few
MB; per product the library's fixed cost and the prefetchers' ramp are a large share (fp32 SmolLM2 on an AVX2-only
EPYC core, 30 layers' linears: 39 ms as 210 products, 33 ms as 120; docs/results.md §The pass). Four products per
layer read the same bytes with fewer starts.

Exactness: each output column of a product is one dot product over the input size. The transposed kernel (`x @
W^T` from an `[in, out]` copy), the streamed one (`hispec.matvec`) and oneDNN's prepacked kernel block over the
output columns and reduce each column in the same order whatever the number of columns, so the merged product
equals the members' products bit for bit
(checked on fp32 SmolLM2: every layer, 1-16 positions). The stock `nn.functional.linear` does not promise that
(its many-row products differed in the last bits merged), so stock kernels are never merged, and every kernel is
checked once per merged group on random inputs of 1, 2, 5 and 16 positions before it is used (`_exact`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import packed
from .packed import STOCK, PackedLinear

PROBE_POSITIONS = (1, 2, 5, 16)  # the input sizes `_exact` compares merged and separate products on


class MergedLinear:
    """The members' products as one (module docstring); not an `nn.Module`: it owns no Parameters, only copies."""

    def __init__(self, members: list[PackedLinear]):
        if len(members) < 2 or not all(type(m) is PackedLinear for m in members):
            raise ValueError("MergedLinear merges two or more hispec.packed.PackedLinear layers")
        if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) != 1:
            raise ValueError("merged linears must share their input size, dtype and device")
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._key = None
        self._copies: dict[str, torch.Tensor | None] = {}  # kernel -> the concatenated copy, None: not exact
        self._bias = None

    def _state(self):
        """What the copies depend on: each member's weight (pointer, version) and kernels."""
        return tuple((*m._weight_key(), m.one, m.many) for m in self.members)

    def _copy(self, kernel: str) -> torch.Tensor | None:
        state = self._state()
        if state != self._key:
            self._key, self._copies = state, {}
            biases = [m.bias for m in self.members]
            self._bias = (None if all(b is None for b in biases) else
                          torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                                     for b, m in zip(biases, self.members)]))
        if kernel not in self._copies:
            with torch.no_grad():
                copy = packed.kernel_copy(kernel, torch.cat([m.weight.detach() for m in self.members]))
            self._copies[kernel] = copy if self._exact(kernel, copy) else None
            for m in self.members:  # the members' own copies for this kernel are no longer read
                m.drop_copy(kernel)
        return self._copies[kernel]

    def _product(self, kernel: str, copy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return packed.multiply(kernel, x, copy, self._bias)

    def _exact(self, kernel: str, copy: torch.Tensor) -> bool:
        """Whether the merged product equals the members' own, bit for bit, on random inputs of `PROBE_POSITIONS`
        positions that take `kernel`."""
        m0 = self.members[0]
        g = torch.Generator().manual_seed(0)
        for t in PROBE_POSITIONS:
            x = torch.randn(1, t, m0.in_features, generator=g).to(m0.weight.device, m0.weight.dtype)
            if m0._kernel(x) is not kernel:
                continue
            merged = self._product(kernel, copy, x)
            if not torch.equal(merged, torch.cat([m(x) for m in self.members], -1)):
                return False
        return True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        kernel = self.members[0]._kernel(x)
        if kernel is STOCK:
            return None
        copy = self._copy(kernel)
        if copy is None:
            return None
        return self._product(kernel, copy, x).split(self.sizes, -1)


def mergeable(*linears: nn.Module) -> bool:
    """Whether `linears` can be a `MergedLinear` now or once packed: plain or packed linears over one input size."""
    return (len(linears) >= 2 and all(isinstance(m, nn.Linear) for m in linears)
            and len({(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) == 1)
