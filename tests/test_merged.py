"""hispec.merged: QKV and gate/up as one product each, equal to the separate products bit for bit, used by the
standard layers (hispec.fused) and lossless in decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tiny import tiny_model

import hispec
from hispec import matvec, merged, packed
from hispec.merged import MergedLinear

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN prepacked linear")

STANDARD = ["llama", "mistral-sliding", "qwen2", "qwen3"]
KERNEL_PAIRS = [(packed.TRANSPOSED, packed.PACKED), (packed.PACKED, packed.PACKED),
                pytest.param((packed.STREAMED, packed.STREAMED), marks=pytest.mark.skipif(
                    not matvec.available(), reason="no AVX2 + FMA x86 CPU or no C compiler here"))]


def _members(bias: bool, kernels=(packed.TRANSPOSED, packed.PACKED), sizes=(24, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        lin = nn.Linear(32, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 32, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        p = packed.PackedLinear.wrap(lin)
        p.set_kernels(*kernels)
        out.append(p)
    return out


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
@pytest.mark.parametrize("bias", [True, False])
def test_the_merged_product_is_the_members_products_bit_for_bit(kernels, bias):
    members = _members(bias, kernels)
    m = MergedLinear(members)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in (1, 2, 3, 7):
            x = torch.randn(2 if t == 3 else 1, t, 32, generator=g)
            parts = m(x)
            assert parts is not None and [p.shape[-1] for p in parts] == [24, 8, 8]
            for part, member in zip(parts, members):
                assert torch.equal(part, member(x))
                assert torch.allclose(part, nn.functional.linear(x, member.weight, member.bias), atol=1e-5)


@torch.no_grad()
def test_stock_kernels_are_never_merged_and_the_members_copies_are_dropped_once_merged():
    members = _members(False, (packed.STOCK, packed.STOCK))
    assert MergedLinear(members)(torch.randn(1, 1, 32)) is None
    members = _members(False)
    x = torch.randn(1, 1, 32)
    for lin in members:
        lin(x)
        assert packed.TRANSPOSED in lin._copies
    assert MergedLinear(members)(x) is not None
    assert all(not lin._copies for lin in members)  # one copy of these weights, the merged one
    with packed.stock():
        assert MergedLinear(members)(x) is None  # `packed.stock()`: the unpacked products, member by member


def test_a_changed_weight_or_kernel_remakes_the_merged_copy():
    members = _members(True)
    m = MergedLinear(members)
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        m(x)
        members[1].weight.mul_(2.0)  # an in-place update (a fine-tune step, a load_state_dict)
        assert torch.equal(m(x)[1], members[1](x))
        members[0].set_kernels(packed.PACKED, packed.PACKED)
        members[1].set_kernels(packed.PACKED, packed.PACKED)
        members[2].set_kernels(packed.PACKED, packed.PACKED)
        assert torch.equal(m(x)[0], members[0](x)) and m._key[0][-2:] == (packed.PACKED, packed.PACKED)


def test_a_kernel_whose_merged_product_is_not_exact_multiplies_member_by_member(monkeypatch):
    members = _members(False)
    m = MergedLinear(members)
    real = MergedLinear._product
    monkeypatch.setattr(MergedLinear, "_product", lambda self, k, c, x: real(self, k, c, x) * (1 + 1e-6))
    with torch.no_grad():
        assert m(torch.randn(1, 1, 32)) is None and m._copies == {packed.TRANSPOSED: None}


def test_only_linears_over_one_input_merge():
    a, b = nn.Linear(32, 8), nn.Linear(16, 8)
    assert not merged.mergeable(a, b) and not merged.mergeable(a) and merged.mergeable(a, nn.Linear(32, 4))
    with pytest.raises(ValueError, match="share their input size"):
        MergedLinear([packed.PackedLinear.wrap(a), packed.PackedLinear.wrap(b)])


def _greedy_model(family):
    base = tiny_model(family)
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    return hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="linear")


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
@pytest.mark.parametrize("family", STANDARD)
def test_greedy_decoding_through_merged_products_equals_hf_generate(family, kernels):
    """Lossless with respect to the model it runs: transformers' greedy `generate` calls the packed projections one
    by one; hispec's standard layers multiply QKV and gate/up as one product each, and every strategy's output is
    the same."""
    model = _greedy_model(family)
    packed.pack(model.base, kernels)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 40), generator=g)  # (a prompt of 80 rows: past matvec.MAX_ROWS)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    ids[am == 0] = 0
    with torch.no_grad():
        ref = model.base.generate(input_ids=ids, attention_mask=am, max_new_tokens=14, do_sample=False,
                                  pad_token_id=0)
    fused = model.adapter.standard
    assert fused is not None and fused.gated_mlp
    for strategy in ("ar", "hispec", "ngram-hispec", "self-spec-lookup"):
        out = model.generate(ids, am, max_new_tokens=14, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy
    out = model.generate(ids, am, max_new_tokens=14, strategy="self-spec", tree=[3, 2])
    assert torch.equal(out.sequences, ref)
    used = {k for _, group in fused._groups.values() if group is not None
            for k, copy in group._copies.items() if copy is not None}
    beyond = {packed.PACKED} if kernels[1] is packed.STREAMED and ids.numel() > matvec.MAX_ROWS else set()
    assert used == set(kernels) | beyond and len(fused._groups) == 2 * model.adapter.num_layers
    fused.merge = False
    out = model.generate(ids, am, max_new_tokens=14, strategy="ar")
    assert torch.equal(out.sequences, ref)
