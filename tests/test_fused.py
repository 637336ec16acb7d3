"""hispec.fused: standard layers called without transformers' wrappers give the layers' own outputs, bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES, tiny_model

import hispec
from hispec.layers import DecoderAdapter

STANDARD = ["llama", "mistral", "mistral-sliding", "qwen2", "qwen2-sliding", "qwen3"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_standard_layouts_are_recognised_and_the_others_run_as_they_are(family):
    ad = DecoderAdapter(tiny_model(family))
    assert (ad.standard is not None) == (family in STANDARD)


@pytest.mark.parametrize("family", STANDARD)
def test_ranges_over_holes_and_tree_masks_give_the_layers_own_outputs(family):
    base = tiny_model(family)
    outs = []
    for standard in (True, False):
        ad = DecoderAdapter(base)
        if standard:
            assert ad.standard.grouped_sdpa  # GQA over several queries through sdpa's enable_gqa, exact here
        else:
            ad.standard = None
        g = torch.Generator().manual_seed(1)
        cache = ad.new_cache(2)
        ids = torch.randint(3, 97, (2, 7), generator=g)
        valid = torch.ones(2, 7, dtype=torch.bool)
        valid[1, :3] = False  # left padding
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            h = ad.run_layers(ad.embed(ids, pos), 0, 2, position_ids=pos, cache=cache, valid=valid)
            h = ad.run_layers(h, 2, ad.num_layers, position_ids=pos, cache=cache, valid=valid)
            step = pos[:, -1:] + 1
            tree = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
            allow = torch.cat([torch.ones(1, 3, 7, dtype=torch.bool), tree], -1)  # two siblings under one node
            x = ad.embed(torch.randint(3, 97, (2, 3), generator=g), torch.cat([step, step + 1, step + 1], 1))
            t = ad.run_layers(x, 0, ad.num_layers, position_ids=torch.cat([step, step + 1, step + 1], 1),
                              cache=cache, allow=allow)
        outs.append((h, t))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_greedy_decoding_is_the_same_with_and_without_the_wrappers():
    model = hispec.EarlyExitModel.from_base(tiny_model("qwen3"), 2, 4, "linear")
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    assert model.adapter.standard is not None
    fast = model.generate(ids, am, max_new_tokens=12, strategy="hispec").sequences
    model.adapter.standard = None
    assert torch.equal(model.generate(ids, am, max_new_tokens=12, strategy="hispec").sequences, fast)


def test_a_layer_with_hooks_is_called_as_it_is_so_its_hooks_run():
    ad = DecoderAdapter(tiny_model("llama"))
    seen = []
    handle = ad.parts.layers[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    pos = torch.arange(4)[None]
    with torch.no_grad():
        ad.run_layers(ad.embed(torch.randint(3, 97, (1, 4)), pos), 0, ad.num_layers, position_ids=pos,
                      cache=ad.new_cache(1))
    handle.remove()
    assert seen == [torch.Size([1, 4, ad.hidden_size])] and ad.standard is not None


def test_grouped_attention_that_is_not_exact_is_not_used(monkeypatch):
    from hispec.fused import StandardLayers

    real = StandardLayers._grouped_attention
    monkeypatch.setattr(StandardLayers, "_grouped_attention",
                        staticmethod(lambda attn, q, k, v, mask: real(attn, q, k, v, mask) * (1 + 1e-6)))
    ad = DecoderAdapter(tiny_model("llama"))
    assert ad.standard is not None and not ad.standard.grouped_sdpa
