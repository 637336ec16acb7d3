"""Static trees drafted by the EAGLE-3 drafter (`hispec.decoding.eagle_tree`): greedy output equals plain greedy
decoding for every family, limits and EOS inside a tree, a chain-shaped tree does exactly what the chain does,
sampling keeps the target distribution (χ², with wrong rules rejected)."""

from __future__ import annotations

import pytest
import torch
from test_decoding import _chi2_pvalue, _exact_joint, _hf_greedy, _ragged, _tiny_vocab_model, _wrap
from test_eagle_decoding import EAGLE, _trained_drafter
from test_tree import _with_replacement_rule
from tiny import FAMILIES, tiny_model

from hispec import sampling
from hispec.eagle3 import Eagle3Config, Eagle3Drafter


def _fitted(family="llama", steps=120, **kw):
    model = _wrap(tiny_model(family))
    model.attach_drafter(_trained_drafter(model, steps=steps, **kw))
    return model


def _fitted_prompts():
    """The prompts `_trained_drafter` fitted on, two of them shortened (left padding): drafts get accepted."""
    ids = torch.randint(3, 97, (6, 5), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :2] = am[3, :1] = 0
    ids[am == 0] = 0
    return ids, am


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "opt"])
def test_greedy_drafter_trees_equal_hf_generate(family):
    model = _fitted(family, draft_vocab_size=60, steps=60)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    for strategy in EAGLE:
        for tree in ([2, 2, 1], [4, 2]):
            out = model.generate(ids, am, max_new_tokens=17, strategy=strategy, tree=tree)
            assert torch.equal(out.sequences, ref), (strategy, tree)
            assert out.stats.strategy.endswith(f"[tree {'x'.join(map(str, tree))}]")


def test_a_chain_shaped_drafter_tree_does_what_the_chain_does():
    model = _fitted()
    ids, am = _fitted_prompts()
    for g in (1, 3):
        chain = model.generate(ids, am, max_new_tokens=20, strategy="eagle", gamma=g)
        tree = model.generate(ids, am, max_new_tokens=20, strategy="eagle", tree=[1] * g)
        assert torch.equal(chain.sequences, tree.sequences)
        c, t = chain.stats.levels[1], tree.stats.levels[1]
        assert (t.accepted, t.proposed, t.passes) == (c.accepted, c.proposed, c.passes), g
        assert 0 < t.accepted < t.proposed


def test_wider_drafter_trees_accept_more_and_rows_equal_their_single_runs():
    model = _fitted()
    ids, am = _fitted_prompts()
    ref = _hf_greedy(model.base, ids, am, 20)
    per_pass = {}
    for tree in ([1, 1], [4, 2]):
        out = model.generate(ids, am, max_new_tokens=20, strategy="eagle", tree=tree)
        assert torch.equal(out.sequences, ref)
        lv = out.stats.levels[1]
        per_pass[str(tree)] = lv.accepted / lv.passes
    assert per_pass["[4, 2]"] > per_pass["[1, 1]"]
    for b in range(len(ids)):
        keep = am[b].bool()
        alone = model.generate(ids[b:b + 1, keep], max_new_tokens=20, strategy="eagle", tree=[4, 2])
        assert alone.new_tokens[0] == out.new_tokens[b]


@pytest.mark.parametrize("strategy", EAGLE)
@pytest.mark.parametrize("max_new", [3, 4, 5, 7])
def test_max_length_falling_inside_a_drafter_tree(strategy, max_new):
    model = _fitted()
    ids, am = _fitted_prompts()
    out = model.generate(ids, am, max_new_tokens=max_new, strategy=strategy, tree=[3, 2, 2])
    assert torch.equal(out.sequences, _hf_greedy(model.base, ids, am, max_new))
    assert all(len(t) == max_new for t in out.new_tokens)


@pytest.mark.parametrize("strategy", EAGLE)
def test_eos_inside_a_drafter_tree_stops_the_row_exactly_like_hf(strategy):
    model = _fitted()
    ids, am = _fitted_prompts()
    free = _hf_greedy(model.base, ids, am, 20)
    eos = int(free[0, 5 + 5])  # a token row 0 produces at step 6: it becomes EOS
    ref = _hf_greedy(model.base, ids, am, 20, eos_token_id=eos)
    out = model.generate(ids, am, max_new_tokens=20, strategy=strategy, tree=[3, 2, 1], eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) <= 6


def test_drafter_trees_are_static_only():
    model = _fitted(steps=1)
    with pytest.raises(ValueError, match="drafts static trees"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, strategy="eagle", tree="dyn-3-2-2-4")


def _confident_drafter(model, draft_vocab):
    d = Eagle3Drafter(Eagle3Config.for_target(model.base.config, draft_vocab_size=draft_vocab))
    if draft_vocab:  # a proposal with smaller support than the target's
        d.set_draft_vocab(torch.tensor([0, 2, 3]))
    with torch.no_grad():
        d.lm_head.weight.mul_(30)  # a confident drafter, clearly different from the target
    return d


def _draw(model, strategy, shape, warp, seed=11, prompt=(1, 3, 2), n=3):
    out = model.generate(torch.tensor([list(prompt)] * 6000), max_new_tokens=n, strategy=strategy, do_sample=True,
                         tree=shape, generator=torch.Generator().manual_seed(seed), **warp)
    return [tuple(t) for t in out.new_tokens], out.stats


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "warped"])
@pytest.mark.parametrize("strategy", EAGLE)
@pytest.mark.parametrize("shape,draft_vocab", [([3, 2], None), ([2, 2, 1], 3)], ids=["3x2", "2x2x1-dv3"])
def test_drafter_tree_sampling_matches_the_exact_distribution(shape, draft_vocab, strategy, warp):
    model = _tiny_vocab_model()
    model.attach_drafter(_confident_drafter(model, draft_vocab))
    prompt, n = [1, 3, 2, 1, 3], 3  # a repeat, so the lookup serves some rounds under eagle-lookup
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples, stats = _draw(model, strategy, shape, warp, prompt=prompt, n=n)
    pvalue = _chi2_pvalue(samples, outcomes, probs)
    print(f"{strategy} tree {shape} draft vocab {draft_vocab} {warp}: chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-4
    lv = stats.levels[1]
    assert 0 < lv.accepted < lv.proposed  # the test has teeth: drafts accepted and rejected
    assert (stats.levels[0].lookups > 0) == (strategy == "eagle-lookup")  # both drafters ran under eagle-lookup


def test_the_distribution_test_rejects_a_wrong_rule_with_drafter_trees(monkeypatch):
    model = _tiny_vocab_model()
    model.attach_drafter(_confident_drafter(model, None))
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    monkeypatch.setattr(sampling, "recursive_accept", _with_replacement_rule)
    samples, _ = _draw(model, "eagle", [3, 2], warp)
    assert _chi2_pvalue(samples, outcomes, probs) < 1e-6
