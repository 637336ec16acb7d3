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
            assert ad.standard.direct_sdpa and ad.standard.lean and ad.standard.inline_rope  # all exact here
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


def test_direct_attention_that_is_not_exact_is_not_used(monkeypatch):
    from hispec.fused import StandardLayers

    real = StandardLayers._sdpa
    monkeypatch.setattr(StandardLayers, "_sdpa",
                        staticmethod(lambda attn, q, k, v, mask: real(attn, q, k, v, mask) * (1 + 1e-6)))
    ad = DecoderAdapter(tiny_model("llama"))
    assert ad.standard is not None and not ad.standard.direct_sdpa


def test_one_query_over_a_masked_cache_gives_the_layers_own_output():
    # transformers packs a K/V head's query heads as its queries there (`pack_gqa`); sdpa's enable_gqa differs by
    # an ulp, so `_sdpa` packs them too and the probe (`_matches`) includes this step.
    for standard in (True, False):
        ad = DecoderAdapter(tiny_model("qwen2"))
        if not standard:
            ad.standard = None
        cache = ad.new_cache(1)
        ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
        valid = torch.tensor([[True, True, False, True, True, True]])
        pos = torch.arange(6)[None]
        with torch.no_grad():
            ad.run_layers(ad.embed(ids, pos), 0, ad.num_layers, position_ids=pos, cache=cache, valid=valid)
            out = ad.run_layers(ad.embed(ids[:, :1], pos[:, :1] + 6), 0, ad.num_layers, position_ids=pos[:, :1] + 6,
                                cache=cache)
        if standard:
            fast = out
    assert torch.equal(fast, out)


def test_a_norm_or_rotary_of_another_form_runs_through_its_module(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    real_norm = llama.LlamaRMSNorm.forward
    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", lambda self, x: real_norm(self, x) + 1)  # Gemma-like offset
    ad = DecoderAdapter(tiny_model("llama"))
    assert ad.standard is not None and ad.standard.lean and ad.standard.inline_rope
    pos = torch.arange(4)[None]
    ids = torch.randint(3, 97, (1, 4))
    with torch.no_grad():
        h = ad.run_layers(ad.embed(ids, pos), 0, ad.num_layers, position_ids=pos, cache=ad.new_cache(1))
        assert not any(ad.standard._norms.values())  # probed, not Llama's form: called as modules
        ad.standard = None
        ref = ad.run_layers(ad.embed(ids, pos), 0, ad.num_layers, position_ids=pos, cache=ad.new_cache(1))
    assert torch.equal(h, ref)
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a: (q * 2, k))
    assert not DecoderAdapter(tiny_model("llama")).standard.inline_rope


@pytest.mark.parametrize("child", ["input_layernorm", "q_proj", "o_proj", "act_fn", "down_proj"])
def test_hooks_on_a_layers_parts_run(child):
    ad = DecoderAdapter(tiny_model("llama"))
    layer = ad.parts.layers[1]
    module = dict(layer.named_modules())[{"q_proj": "self_attn.q_proj", "o_proj": "self_attn.o_proj",
                                          "act_fn": "mlp.act_fn", "down_proj": "mlp.down_proj"}.get(child, child)]
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    pos = torch.arange(3)[None]
    with torch.no_grad():
        ad.run_layers(ad.embed(torch.randint(3, 97, (1, 3)), pos), 0, ad.num_layers, position_ids=pos,
                      cache=ad.new_cache(1))
    handle.remove()
    assert len(seen) == 1 and ad.standard is not None
