"""The full-model level gives exactly the model's own distribution, whatever the family does to its logits.

`DecoderAdapter.final_logits` runs the model's own `*ForCausalLM.forward` from the decoder body's output on (see
hispec.layers), so a family that scales, caps or otherwise transforms its logits after lm_head (Cohere's
logit_scale, Granite's logits_scaling, Gemma2's soft-capping, or a custom model's own code) is followed without a
list of known quirks. Checked here: final logits over layer ranges equal `model(...).logits` for every tiny family
and for custom transforms transformers does not know; vocabulary subsets follow the same transform; and sampling
with `strategy="ar"` / "self-spec" on logit-transforming families matches the model's own softmax (chi-square),
with a power check that the same test rejects the old adapter (plain lm_head logits, no transform).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from test_decoding import _chi2_pvalue
from tiny import FAMILIES, tiny_config, tiny_model
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

import hispec
from hispec import sampling
from hispec.layers import DecoderAdapter

ATOL = 1e-5


def _three_ranges(ad: DecoderAdapter, ids: torch.Tensor) -> torch.Tensor:
    """Final logits of `ids` `[B, T]` through embed + layers in three ranges over one cache."""
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    cache = ad.new_cache(ids.shape[0])
    h = ad.embed(ids, pos)
    n = ad.num_layers
    for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)):
        h = ad.run_layers(h, a, b, position_ids=pos, cache=cache)
    return ad.final_logits(h)


def _ids(vocab: int, shape=(2, 9), seed=3) -> torch.Tensor:
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- exact logits, every family

@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_final_logits_over_layer_ranges_equal_the_model_forward(family):
    model = tiny_model(family)
    ad = DecoderAdapter(model)
    ids = _ids(ad.vocab_size)
    ref = model(input_ids=ids).logits
    torch.testing.assert_close(_three_ranges(ad, ids), ref, atol=ATOL, rtol=0)
    # Any leading shape: rows of hidden states as the probe and the feature cache hand them over.
    h = torch.randn(5, ad.hidden_size, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ad.final_logits(h), ad.final_logits(h[None])[0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_the_new_families_do_transform_their_logits_beyond_lm_head():
    """Guard for the test families: if a transformers release dropped the transform, the tests above would prove
    nothing about it."""
    for family in ("cohere", "granite"):
        model = tiny_model(family)
        ad = DecoderAdapter(model)
        normed = ad.final_norm(torch.randn(2, 3, ad.hidden_size, generator=torch.Generator().manual_seed(5)))
        plain = model.get_output_embeddings()(normed)
        assert not torch.allclose(ad.project(normed), plain, atol=1e-3), family
        assert ad.logits_elementwise and not ad._head_is_plain, family
    assert DecoderAdapter(tiny_model("granite")).embeds_by_model  # embedding_multiplier: the model's own code
    assert not DecoderAdapter(tiny_model("llama")).embeds_by_model


# ---------------------------------------------------------------- transforms transformers does not know

class _Warped(transformers.LlamaForCausalLM):
    """A custom family: an elementwise transform after lm_head that is neither a scale nor a cap."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2.0 * torch.asinh(1.7 * out.logits) - 0.3
        return out


class _Biased(transformers.LlamaForCausalLM):
    """A custom family whose post-lm_head code is not elementwise: a per-token bias and a log-softmax."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("token_bias", torch.linspace(-1.0, 1.0, config.vocab_size))

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = torch.log_softmax(out.logits + self.token_bias, dim=-1)
        return out


class _PreScaled(transformers.LlamaForCausalLM):
    """A custom family that scales the hidden states between its body and lm_head (as MiniCPM does)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(out.last_hidden_state / 2.5)
        return CausalLMOutputWithPast(logits=logits, cache=out.cache)


def _custom(cls, seed=0):
    torch.manual_seed(seed)
    model = cls(tiny_config("llama"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


@pytest.mark.parametrize(("cls", "elementwise"), [(_Warped, True), (_Biased, False), (_PreScaled, True)],
                         ids=["warped", "biased-log-softmax", "pre-scaled"])
@torch.no_grad()
def test_a_custom_logit_transform_is_followed_from_the_model_code(cls, elementwise):
    model = _custom(cls)
    ad = DecoderAdapter(model)
    assert ad.logits_elementwise == elementwise
    assert not ad._head_is_plain
    ids = _ids(ad.vocab_size)
    ref = model(input_ids=ids).logits
    torch.testing.assert_close(_three_ranges(ad, ids), ref, atol=ATOL, rtol=0)
    # A vocabulary subset (exit heads) gets the same transform: on lm_head's rows when it is elementwise,
    # gathered from the full logits when it is not.
    normed = ad.final_norm(torch.randn(2, 3, ad.hidden_size, generator=torch.Generator().manual_seed(8)))
    vocab = torch.tensor([0, 5, 96, 17, 5, 40])
    torch.testing.assert_close(ad.project(normed, vocab=vocab), ad.project(normed)[..., vocab], atol=1e-6, rtol=0)
    assert not torch.allclose(ad.project(normed), model.lm_head(normed), atol=1e-3)


@torch.no_grad()
def test_the_model_is_left_as_it_was_and_its_hooks_see_no_extra_pass():
    """The stand-ins are in place only during a call; hooks on the model (benchmark pass counters) and on its first
    layer see neither the logit path nor Granite's model-code embedding."""
    model = tiny_model("granite")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    ad = DecoderAdapter(model)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append("model"))
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append("layer0"))
    ad.embed(torch.tensor([[3, 4, 5]]), torch.tensor([[0, 1, 2]]))
    ad.final_logits(torch.randn(2, 3, ad.hidden_size))
    ad.project(torch.randn(2, ad.hidden_size), vocab=torch.tensor([3, 1]))
    assert calls == []
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(model.get_submodule(k) is m for k, m in modules.items())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@torch.no_grad()
def test_a_model_whose_forward_cannot_run_from_hidden_states_is_refused_by_name():
    class _NeedsIds(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            if input_ids is None:
                raise ValueError("input_ids are required")
            return super().forward(input_ids=input_ids, **kwargs)

    from hispec.layers import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"model type 'llama': could not run _NeedsIds.forward on given "
                                                    r"final hidden states .*input_ids are required"):
        DecoderAdapter(_custom(_NeedsIds))


# ---------------------------------------------------------------- sampling: the model's own distribution

def _tiny_vocab_model(family: str, seed: int = 0):
    """A 5-token model of a logit-transforming family, wrapped with linear heads that differ from the model."""
    extra = {"cohere": dict(logit_scale=2.5, bos_token_id=1, eos_token_id=2),
             "granite": dict(logits_scaling=0.4, embedding_multiplier=1.5)}[family]
    cls = FAMILIES[family][0]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls)(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                     **extra)
    base = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn_like(p) * 0.6)
    base.eval()
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    model = hispec.EarlyExitModel.from_base(base, draft_layer=1, verify_layer=2, head_type="linear")
    with torch.no_grad():  # heads clearly different from the final layer: q != r != p
        for head in model.heads.values():
            head.adapter.weight.copy_(torch.randn_like(head.adapter.weight) * 0.8)
    return model


def _exact_joint(model, prompt, n):
    """Exact distribution of the first n new tokens, enumerated from the model's own forward (its own softmax)."""
    V = model.adapter.vocab_size
    outcomes = list(itertools.product(range(V), repeat=n))
    probs = []
    with torch.no_grad():
        for seq in outcomes:
            logits = model.base(input_ids=torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1]
            p = sampling.logits_to_probs(logits, temperature=1.0)
            probs.append(float(torch.prod(p[torch.arange(n), torch.tensor(seq)])))
    return outcomes, torch.tensor(probs)


def _draw(model, prompt, n, strategy, draws, seed):
    g = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([prompt] * draws), max_new_tokens=n, strategy=strategy, do_sample=True,
                         gamma=2, window=2, generator=g, temperature=1.0)
    return [tuple(t) for t in out.new_tokens]


PROMPT, N, DRAWS = [1, 3, 2], 3, 6000


@pytest.mark.parametrize("strategy", ["ar", "self-spec", "hispec"])
@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_sampling_matches_the_model_own_softmax(family, strategy):
    model = _tiny_vocab_model(family)
    outcomes, probs = _exact_joint(model, PROMPT, N)
    samples = _draw(model, PROMPT, N, strategy, DRAWS, seed=11)
    assert _chi2_pvalue(samples, outcomes, probs) > 1e-4


def _old_project(self, normed, vocab=None):
    """The adapter before: lm_head (rows) and nothing else of the model's own logit code."""
    if self.parts.project_out is not None:
        normed = self.parts.project_out(normed)
    if vocab is None:
        return self.parts.lm_head(normed)
    weight, bias = self._vocab_rows(vocab)
    return nn.functional.linear(normed, weight, bias)


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_the_sampling_test_rejects_plain_lm_head_logits(family, monkeypatch):
    model = _tiny_vocab_model(family)
    outcomes, probs = _exact_joint(model, PROMPT, N)
    monkeypatch.setattr(DecoderAdapter, "project", _old_project)
    samples = _draw(model, PROMPT, N, "ar", DRAWS, seed=11)
    assert _chi2_pvalue(samples, outcomes, probs) < 1e-6
