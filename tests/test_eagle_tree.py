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
from hispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter


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


def test_the_latency_model_prices_a_drafter_tree_and_a_chain_shaped_one_as_the_chain():
    import dataclasses

    from test_eagle_auto import _cal

    from hispec import latency
    from hispec.latency import EAGLE, FULL, LOOKUP, Calibration

    c, a = 1e-3, 0.6
    cal = dataclasses.replace(_cal(c, a), topk={"eagle3>full": [a, 0.75, 0.8]})
    d = lambda T: c * (1 + 0.1 * (T - 1))  # noqa: E731 (the hand-made drafter curve)
    V = lambda T: 10 * 1e-3 + 2e-3  # noqa: E731 (the full model, flat in T)
    o = 1e-4
    # [2, 1]: depths of 2 and 2 nodes; passes over 1 and 2 entries, then the model over 5 positions
    E = 1 + 0.75 + 0.75 * a
    R = (d(1) + o) + (d(2) + o) + V(5) + o
    assert latency.tree_round_seconds([2, 1], cal, EAGLE) == pytest.approx(R)
    want = (R + d(1 + (E - 1)) - d(1)) / E  # + the context: every verified token passes the drafter once
    assert latency.tree_time_per_token([2, 1], cal, EAGLE) == pytest.approx(want)
    # a chain-shaped tree is the chain, alone and lookup-first, also where the step-0 top-1 (0.7) is above the
    # chain's rate a: the calibrated step-0 rates are moved to a (r(k) a / r(1))
    step0 = dataclasses.replace(cal, topk={"eagle3>full": [0.7, 0.8, 0.9]})
    for c_ in (cal, step0):
        for g in (1, 2, 4):
            assert latency.tree_time_per_token([1] * g, c_, EAGLE) == pytest.approx(
                latency.time_per_token([EAGLE, FULL], [g], c_))
        assert latency.tree_time_per_token([1], c_, EAGLE, lookup=True) == pytest.approx(
            latency.time_per_token([LOOKUP + EAGLE, FULL], [1], c_))
    E2 = 1 + 0.8 * a / 0.7 + 0.8 * a / 0.7 * a  # [2, 1] at the moved rates
    assert latency.tree_time_per_token([2, 1], step0, EAGLE) == pytest.approx((R + d(E2) - d(1)) / E2)
    # the decoder's fitted overheads join as in a chain round; a tree round pays tree_overhead on top
    od, ov, ot = 3e-4, 7e-4, 2e-4
    over = dataclasses.replace(cal, costs={**cal.costs, "drafter_overhead": od, "drafter_verify_overhead": ov,
                                           "tree_overhead": ot})
    assert latency.tree_round_seconds([2, 1], over, EAGLE) == pytest.approx(R + 2 * od + ov + ot)
    assert latency.tree_time_per_token([1, 1], over, EAGLE) == pytest.approx(
        latency.time_per_token([EAGLE, FULL], [2], over) + ot / (1 + a + a * a))
    # the drafter trees' own fit, where calibrate timed them, replaces the exit trees' (older calibrations: theirs)
    own = dataclasses.replace(over, costs={**over.costs, "drafter_tree_overhead": 5 * ot})
    assert latency.tree_round_seconds([2, 1], own, EAGLE) == pytest.approx(R + 2 * od + ov + 5 * ot)
    assert own.at_batch(2).drafter_tree_overhead == pytest.approx(2.5 * ot)
    assert Calibration.from_dict(own.to_dict()).drafter_tree_overhead == pytest.approx(5 * ot)
    assert latency.tree_round_seconds([2, 2], own, "L2") == latency.tree_round_seconds([2, 2], over, "L2")
    with pytest.raises(latency.CalibrationError, match="no top-k agreement"):
        latency.tree_time_per_token([2], _cal(c, a), EAGLE)


def test_calibrate_measures_the_drafters_top_k_agreement():
    """`calibrate` records r(k), k = 1..8, for the drafter (the share of answer positions whose greedy token is
    among its step-0 top-k, the first draft of a round): non-decreasing in k, and the drafter's trees get a price."""
    from test_eagle_auto import _prompts, _with_drafter

    from hispec import NgramConfig, latency

    model = _with_drafter()
    prompts = _prompts()[:3]
    cal = latency.calibrate(model, prompts, max_new_tokens=12, repeats=1, max_gamma=4, ngram=NgramConfig())
    rates = cal.topk["eagle3>full"]
    assert len(rates) == 8 and all(0 <= x <= y <= 1 for x, y in zip(rates, rates[1:]))
    assert 0 < rates[0] < rates[-1]
    assert latency.tree_time_per_token([4, 2], cal, "eagle3") > 0
    assert cal.costs["drafter_tree_overhead"] >= 0  # timed on real rounds of the drafter's probe tree


def test_a_tight_calibration_budget_times_the_drafters_rounds_before_the_exits_tree(monkeypatch):
    """Step 4's real runs start only while they fit the budget, so their order is what a tight budget keeps: with a
    drafter attached, its chain and tree runs (what `auto` plans with) come right after the n-gram runs, before the
    exit's tree; a run the budget cuts is recorded under its own name (chain and tree runs apart)."""
    from test_eagle_auto import _prompts, _with_drafter

    from hispec import NgramConfig, latency
    from hispec.latency import budget as budget_mod
    from hispec.latency import measure

    order = []
    real = measure._decoder_runs

    def spy(model, ids_list, max_new_tokens, budget, step, strategy, progress=False, **kw):
        order.append(strategy + ("-tree" if kw.get("tree") else ""))
        return real(model, ids_list, max_new_tokens, budget, step, strategy, progress, **kw)

    monkeypatch.setattr(measure, "_decoder_runs", spy)
    model = _with_drafter()
    prompts = _prompts()[:3]
    latency.calibrate(model, prompts, max_new_tokens=12, repeats=1, max_gamma=4, ngram=NgramConfig())
    assert order == ["self-spec", "ngram", "eagle", "eagle-tree", "self-spec-tree"], order
    monkeypatch.setattr(budget_mod.Budget, "fits", lambda self, step, estimate: step != "decoder")
    cal = latency.calibrate(model, prompts, max_new_tokens=12, repeats=1, max_gamma=4, ngram=NgramConfig(),
                            max_seconds=60)
    assert {"ngram_step_runs", "eagle_step_runs", "eagle_tree_step_runs",
            "self-spec_tree_step_runs"} <= set(cal.budget["skipped"]), cal.budget


def _tree_priors(model, eagle=0.5, topk=(0.5, 0.85, 0.95), ngram=0.0, match=0.0, prompts=None):
    """Priors under which `auto` plans a drafter tree: a drafter whose top-k agrees far more often than its top-1
    (and the realistic cost shape of `_drafter_priors`: wide verifications nearly free)."""
    import dataclasses

    from test_eagle_auto import _drafter_priors

    cal = _drafter_priors(model, eagle=eagle, ngram=ngram, match=match, prompts=prompts)
    rates = list(topk) + [topk[-1]] * (8 - len(topk))
    cal = dataclasses.replace(cal, topk={"eagle3>full": rates})
    model.hispec_config.calibration = cal.to_dict()
    return cal


def test_auto_plans_a_drafter_tree_where_its_top_k_pays_and_a_chain_where_it_does_not():
    from test_eagle_auto import _with_drafter

    from hispec import latency

    model = _with_drafter(steps=1)
    plan = latency.auto_plan(_tree_priors(model))
    assert plan.levels[0].removeprefix("ngram|") == "eagle3" and plan.widths and max(plan.widths) > 1
    assert plan.seconds_per_token < latency.auto_plan(_tree_priors(model), trees=False).seconds_per_token
    flat = latency.auto_plan(_tree_priors(model, topk=(0.5,) * 8))  # top-k no better than top-1: no tree
    assert flat.widths is None or max(flat.widths) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_auto_with_a_drafter_tree_is_greedy_identical(family):
    from test_eagle_auto import _with_drafter

    model = _with_drafter(family, steps=60)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    # (a lookup that matches often makes the lookup-first chain faster: its lookup is retried after every draft)
    for ngram, match, topk in ((0.0, 0.0, (0.5, 0.85, 0.95)), (0.9, 0.3, (0.5, 0.95, 0.99))):
        _tree_priors(model, ngram=ngram, match=match, topk=topk)
        out = model.generate(ids, am, max_new_tokens=17, strategy="auto")
        assert torch.equal(out.sequences, ref)
        assert "[tree" in out.stats.strategy and out.stats.levels[0].proposed > 0
        assert out.stats.strategy.startswith("auto:" + ("ngram|" if ngram else "") + "eagle3>full")


def test_rows_of_a_drafter_tree_climb_back_from_plain_by_the_shadow(monkeypatch):
    """Every row starts sure the drafter never agrees (plain): the shadow measures the drafter in the tree rounds'
    plain rows (top-1 and top-k), and rows climb back to drafting trees; without it they stay plain. Output is
    plain greedy decoding's either way."""
    from test_eagle_auto import _start_plain

    model = _fitted()
    ids, am = _fitted_prompts()
    ref = _hf_greedy(model.base, ids, am, 20)
    _tree_priors(model)
    _start_plain(monkeypatch, lookup=False, topk=True, shadow_every=10**9)  # no shadow: the rows never draft
    off = model.generate(ids, am, max_new_tokens=20, strategy="auto")
    assert torch.equal(off.sequences, ref) and off.stats.levels[0].proposed == 0
    monkeypatch.undo()
    calls = _start_plain(monkeypatch, lookup=False, topk=True)
    back = model.generate(ids, am, max_new_tokens=20, strategy="auto")
    assert calls
    assert torch.equal(back.sequences, ref) and "[tree" in back.stats.strategy
    assert back.stats.levels[0].proposed > 0 and 0 < back.stats.plain_row_rounds < back.stats.row_rounds


@pytest.mark.parametrize("shadowed", [False, True], ids=["priors", "from-plain"])
@pytest.mark.parametrize("lookup", [False, True], ids=["eagle3", "ngram|eagle3"])
def test_auto_with_a_drafter_tree_sampling_matches_the_exact_distribution(lookup, shadowed, monkeypatch):
    """`from-plain`: every row starts sure the drafter never agrees and is measured by shadows (the drafter's exact
    acceptance probability, its context caught up) in the tree rounds' plain rows."""
    from test_eagle_auto import _start_plain

    calls = _start_plain(monkeypatch) if shadowed else []
    model = _tiny_vocab_model()
    model.attach_drafter(_confident_drafter(model, None))
    _tree_priors(model, eagle=0.5, topk=(0.5, 0.9, 0.95), ngram=0.9 if lookup else 0.0,
                 match=0.6 if lookup else 0.0, prompts=([1, 3, 2],))
    prompt, n, warp = [1, 3, 2, 1, 3], 3, dict(temperature=0.8)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="auto", do_sample=True,
                         generator=torch.Generator().manual_seed(5), **warp)
    assert "[tree" in out.stats.strategy and out.stats.strategy.startswith("auto:" + ("ngram|" if lookup else ""))
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) > 1e-4
    lv = out.stats.levels[1]
    if not (shadowed and lookup):  # (from plain, a lookup-first level climbs back too slowly for 3 tokens)
        assert 0 < lv.accepted < lv.proposed
    assert bool(calls) == shadowed and (out.stats.plain_row_rounds > 0) == shadowed
