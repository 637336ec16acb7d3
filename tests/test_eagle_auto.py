"""The EAGLE-3 drafter priced by the latency model: `calibrate` measures its cost curve and its acceptance along
the rounds the decoder runs, `auto` picks `eagle3>full` / `ngram|eagle3>full` where predicted fastest (and never
for a drafter the calibration did not measure), and whatever it picks, output is plain decoding's."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch
from test_auto import _calibrated
from test_decoding import _chi2_pvalue, _exact_joint, _hf_greedy, _ragged, _tiny_vocab_model, _wrap
from test_eagle_decoding import _trained_drafter
from tiny import FAMILIES, tiny_model

from hispec import NgramConfig, decoding, latency
from hispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from hispec.latency import EAGLE, FULL, LOOKUP, NGRAM, Calibration, plain_seconds_per_token


def _with_drafter(family="llama", steps=120, seed=0):
    model = _wrap(tiny_model(family))
    model.attach_drafter(_trained_drafter(model, draft_vocab_size=60 if family != "llama" else None, steps=steps,
                                          seed=seed))
    return model


def _prompts():
    return torch.randint(3, 97, (6, 5), generator=torch.Generator().manual_seed(1)).tolist()


def test_drafter_rounds_count_as_the_decoder_verifies():
    # drafts (target ids) per step from every entry; P = 2 prompt tokens, answer of 6 tokens
    answer = [10, 11, 12, 13, 14, 15]
    pred = [[0] * 8 for _ in range(3)]
    pred[0][1], pred[1][1], pred[2][1] = 11, 12, 99  # round 1 (entry P + 1 - 2 = 1): 2 accepted, then rejected
    pred[0][4], pred[1][4] = 14, 15  # round 2: the model's token was answer token 3, drafts start at token 4
    # (entry 4): both accepted, then the answer ends (censored: no rejection)
    assert latency.drafter_rounds(pred, 2, answer, answer[1:], 3) == (4, 5, 1, 5)
    assert latency.drafter_rounds(pred, 2, answer, answer[1:], 1) == (2, 3, 1, 3)  # gamma 1: one draft per round
    # a confidence gate 0.5: round 1 stops at its second draft (0.3: that pass spent, one draft proposed and
    # accepted, no rejection); round 2 (entry 3) proposes 3 wrong drafts; round 3 (entry 4) two right ones
    conf = [[0.9] * 8 for _ in range(3)]
    conf[1][1] = 0.3
    assert latency.drafter_rounds(pred, 2, answer, answer[1:], 3, conf, 0.5) == (3, 6, 1, 7)
    assert latency.drafter_rounds(pred, 2, answer, answer[1:], 3, conf, 0.2) == (4, 5, 1, 5)  # nothing below 0.2


def test_calibrated_acceptance_equals_the_decoders_own_rounds():
    """fp32: the training-time-test drafts `calibrate` counts are the decoder's drafts, so the i.i.d. counts of a
    real `eagle` run at gamma 8 on the calibration's own prompts are exactly the calibration's."""
    model = _with_drafter()
    prompts = _prompts()[:3]
    cal = latency.calibrate(model, prompts, max_new_tokens=12, repeats=1, max_gamma=8, ngram=NgramConfig())
    accepted = rejections = 0
    for p in prompts:
        st = model.generate(torch.tensor([p]), max_new_tokens=12, strategy="eagle", gamma=8).stats.levels[1]
        accepted, rejections = accepted + st.accepted, rejections + st.rejections
    assert rejections > 0 and accepted > 0
    assert cal.acceptance["eagle3>full"] == pytest.approx(accepted / (accepted + rejections))


def test_the_calibration_prices_the_drafter_and_keeps_it_through_json():
    model = _with_drafter(steps=30)
    cal = latency.calibrate(model, _prompts()[:2], max_new_tokens=8, repeats=1, max_gamma=4, ngram=NgramConfig())
    assert cal.has_drafter and sorted(cal.costs["drafter"]) == sorted(cal.costs["layer"])
    assert cal.drafter_overhead >= 0 and cal.drafter_verify_overhead >= 0 and "drafter_overhead" in cal.costs
    assert all(b >= a for a, b in zip(list(cal.costs["drafter"].values()), list(cal.costs["drafter"].values())[1:]))
    assert 0.0 <= cal.acceptance["eagle3>full"] <= 1.0
    assert cal.model["drafter"] == latency.drafter_identity(model.drafter)
    assert {EAGLE, LOOKUP + EAGLE} <= set(cal.levels) and cal.depth(EAGLE) == 0
    back = Calibration.from_dict(cal.to_dict())
    assert back.costs["drafter"] == cal.costs["drafter"] and back.has_drafter
    names = {r["name"] for r in latency.predictions(back)}
    assert {"eagle", "eagle-lookup"} <= names
    assert back.at_batch(4).head_cost(EAGLE, 1) == pytest.approx(latency.interp(cal.costs["drafter"], 4) / 4)
    # an older calibration (no drafter) still loads and plans without one
    old = Calibration.from_dict({k: v for k, v in cal.without_drafter().to_dict().items()})
    assert not old.has_drafter and EAGLE not in old.levels
    assert EAGLE not in {lv.removeprefix(LOOKUP) for lv in latency.auto_plan(old).levels}


def test_the_drafters_figures_hold_only_for_the_drafter_they_were_measured_with():
    model = _with_drafter(steps=30)
    cal = latency.calibrate(model, _prompts()[:2], max_new_tokens=8, repeats=1, max_gamma=4, ngram=NgramConfig())
    assert cal.for_model(model) is cal
    model.attach_drafter(_trained_drafter(model, steps=30, seed=5))  # retrained: same shape, other weights
    assert not cal.for_model(model).has_drafter
    model.drafter = None
    assert not cal.for_model(model).has_drafter
    model.hispec_config.calibration = cal.to_dict()
    assert not decoding._calibration(model).has_drafter  # what `auto` plans with


def _cal(drafter_cost: float, acceptance: float, **kw) -> Calibration:
    """A hand-made calibration: 10 layers of 1 ms flat in T, final 2 ms, a drafter pass d(T) = drafter_cost *
    (1 + 0.1 (T - 1)), overhead 0.1 ms."""
    Ts = range(1, 10)
    return Calibration(
        machine={}, dtype="float32", threads=1,
        model={"num_layers": 10, "exits": {"draft": 2, "verify": 5}},
        costs={"layer": {T: 1e-3 for T in Ts}, "head": {"L2": {T: 5e-4 for T in Ts}, "L5": {T: 5e-4 for T in Ts}},
               "final": {T: 2e-3 for T in Ts}, "drafter": {T: drafter_cost * (1 + 0.1 * (T - 1)) for T in Ts},
               "ngram": 1e-5, "step_overhead": 1e-4},
        acceptance={"L2>L5": 0.3, "L2>full": 0.2, "L5>full": 0.3, "ngram>full": 0.5, "ngram>L2": 0.5,
                    "ngram>L5": 0.5, "eagle3>full": acceptance, **kw}, ngram_match=0.1)


def test_the_latency_model_prices_a_drafter_round():
    c, a, g = 1e-3, 0.6, 3
    cal = _cal(c, a)
    E = latency.expected_tokens(a, g)
    D = c + 1e-4
    context = c * 0.1 * (E - 1)  # d(E) - d(1): the verified tokens taken in by the round's first pass
    V = 10 * 1e-3 + 2e-3  # the full model over g + 1 positions (flat costs)
    want = (g * D + context + V + 1e-4) / E
    assert latency.time_per_token([EAGLE, FULL], [g], cal) == pytest.approx(want)
    # lookup-first: the lookup is tried before each draft step; where it matches after j drafts (probability
    # (1 - m)^j m) its proposal follows them and all are verified in one pass (flat costs: V), yielding the drafts'
    # accepted prefix and, where all j held, the lookup's; where it never matches, the drafter's chain. Context:
    # every verified token once (the drafter's own first entry aside, where it ran)
    m, n, a_n = 0.1, cal.ngram_max_len, 0.5
    E_n = latency.expected_tokens(a_n, n)

    def lookup_first(od=0.0, ov=0.0):  # -> (cost, tokens) per round
        num = den = 0.0
        for j in range(g):
            p = (1 - m) ** j * m
            tokens = latency.expected_tokens(a, j) + a ** j * (E_n - 1)
            num += p * ((j + 1) * 1e-5 + j * (D + od) + V + 1e-4 + ov + c * 0.1 * (tokens if j == 0 else tokens - 1))
            den += p * tokens
        p = (1 - m) ** g
        return num + p * (g * 1e-5 + g * (D + od) + V + 1e-4 + ov + c * 0.1 * (E - 1)), den + p * E

    num, den = lookup_first()
    assert latency.time_per_token([LOOKUP + EAGLE, FULL], [g], cal) == pytest.approx(num / den)
    # the old pricing (a lookup before the first draft only) under-counts what the later lookups bring
    assert den > m * E_n + (1 - m) * E
    with pytest.raises(ValueError, match="drafts directly for the full model"):
        latency.time_per_token([EAGLE, "L5", FULL], [1, 1], cal)
    # the decoder's own extra per drafter pass (o_d) and per verification under the drafter (o_v)
    od, ov = 3e-4, 7e-4
    over = dataclasses.replace(cal, costs={**cal.costs, "drafter_overhead": od, "drafter_verify_overhead": ov})
    want = (g * (D + od) + context + V + 1e-4 + ov) / E
    assert latency.time_per_token([EAGLE, FULL], [g], over) == pytest.approx(want)
    num, den = lookup_first(od, ov)
    assert latency.time_per_token([LOOKUP + EAGLE, FULL], [g], over) == pytest.approx(num / den)
    assert latency.time_per_token([NGRAM, FULL], [g], over) == latency.time_per_token([NGRAM, FULL], [g], cal)
    assert over.at_batch(4).drafter_overhead == pytest.approx(od / 4)
    back = Calibration.from_dict(over.to_dict())
    assert (back.drafter_overhead, back.drafter_verify_overhead) == (od, ov)
    assert Calibration.from_dict(cal.to_dict()).drafter_overhead == 0.0  # (older calibrations: none)


def test_the_drafters_decoder_overheads_are_fitted_from_real_runs():
    from hispec.latency.measure import fit_drafter_costs
    # runs: (drafter s/pass, entries/pass, verify s/pass, positions/verification)
    runs = [(3e-3, 2.0, 40e-3, 4.0), (2.5e-3, 1.0, 36e-3, 2.0), (9e-3, 1.0, 50e-3, 4.0)]
    od, ov = fit_drafter_costs(runs, drafter=lambda n: 1e-3 * n, verify=lambda p: 30e-3 + 1e-3 * p, o=5e-4)
    assert od == pytest.approx(statistics.median([3e-3 - 2e-3 - 5e-4, 2.5e-3 - 1e-3 - 5e-4, 9e-3 - 1e-3 - 5e-4]))
    assert ov == pytest.approx(statistics.median([40e-3 - 34e-3 - 5e-4, 36e-3 - 32e-3 - 5e-4, 50e-3 - 34e-3 - 5e-4]))
    assert fit_drafter_costs([(1e-4, 1.0, 1e-3, 1.0)], drafter=lambda n: 1e-3, verify=lambda p: 1e-2, o=0.0) == (0, 0)
    assert fit_drafter_costs([], drafter=None, verify=None, o=0.0) == (0.0, 0.0)
    # (the runs carry level 0's passes per verification too, for trees)
    assert fit_drafter_costs([r + (3.0,) for r in runs], drafter=lambda n: 1e-3 * n,
                             verify=lambda p: 30e-3 + 1e-3 * p, o=5e-4) == (pytest.approx(od), pytest.approx(ov))


def test_auto_plans_the_drafter_where_it_pays_and_not_where_it_does_not():
    good = latency.auto_plan(_cal(2e-4, 0.8))
    assert good.levels[0].removeprefix(LOOKUP) == EAGLE and good.levels[-1] == FULL and len(good.levels) == 2
    assert good.seconds_per_token < plain_seconds_per_token(_cal(2e-4, 0.8))
    bad = latency.auto_plan(_cal(5e-3, 0.1))
    assert EAGLE not in {lv.removeprefix(LOOKUP) for lv in bad.levels}
    for choice in (latency.best_hierarchy(_cal(2e-4, 0.8)), latency.best_hierarchy(_cal(2e-4, 0.8, **{
            "L5>full": 0.99}))):  # never eagle3 under an exit, however good that exit is
        assert all(lv.removeprefix(LOOKUP) != EAGLE or i == len(choice.levels) - 2
                   for i, lv in enumerate(choice.levels))


def _drafter_priors(model, eagle=0.9, ngram=0.0, match=0.0, prompts=None, gate=0.0):
    """Priors (and a real model's cost shape) under which auto drafts with the drafter; `gate` > 0: its chains
    priced (and run) with that confidence gate, passed by 70% of draft steps."""
    cal = _calibrated(model, lambda k: {"eagle3>full": eagle, "ngram>full": ngram}.get(k, 0.0), match,
                      prompts=prompts or ([5, 6, 7, 8, 9, 5, 6],), realistic=True)
    Ts = list(cal.costs["layer"])
    gates = {"drafter_gates": {f"{gate:g}": {"acceptance": eagle, "pass": 0.7}}, "drafter_gate": gate} if gate else {}
    cal = dataclasses.replace(cal, costs={**cal.costs, "drafter": {T: 2e-4 * (1 + 0.02 * min(int(T), 32))
                                                                 for T in Ts}, **gates},  # (flat far out)
                              model={**cal.model, "drafter": latency.drafter_identity(model.drafter)},
                              acceptance={**cal.acceptance, "eagle3>full": eagle}, topk=None)  # (no exit trees)
    model.hispec_config.calibration = cal.to_dict()
    return cal


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "opt"])
def test_auto_with_the_drafter_is_greedy_identical_for_every_family(family):
    model = _with_drafter(family, steps=60)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    for ngram, match, want in ((0.0, 0.0, "auto:eagle3>full"), (0.9, 0.6, "auto:ngram|eagle3>full")):
        cal = _drafter_priors(model, ngram=ngram, match=match)
        chain = decoding._auto_chain(model, cal, gamma=1, window=1, ngram=NgramConfig())
        assert ">".join(lv.name for lv in chain) == want.removeprefix("auto:")
        out = model.generate(ids, am, max_new_tokens=17, strategy="auto")
        assert torch.equal(out.sequences, ref), want
        assert out.stats.strategy == want and out.stats.levels[0].proposed > 0
        gated = model.generate(ids, am, max_new_tokens=17, strategy="auto", draft_gate=0.5)  # auto runs its
        assert torch.equal(gated.sequences, ref) and gated.stats.levels[0].gated == 0  # calibration's gate: 0
        _drafter_priors(model, ngram=ngram, match=match, gate=0.5)  # a calibration that chose gate 0.5
        gated = model.generate(ids, am, max_new_tokens=17, strategy="auto")
        assert torch.equal(gated.sequences, ref) and gated.stats.strategy == want
        lv0 = gated.stats.levels[0]  # its chains stopped at drafts below 0.5 (where the drafter drafted at all)
        assert lv0.gated > 0 if want == "auto:eagle3>full" else lv0.gated > 0 or lv0.passes == 0
    # measured (not forced) priors: whatever auto picks, the output is the same
    model.hispec_config.calibration = latency.calibrate(model, _prompts()[:2], max_new_tokens=8, repeats=1,
                                                        max_gamma=4, ngram=NgramConfig()).to_dict()
    assert torch.equal(model.generate(ids, am, max_new_tokens=17, strategy="auto").sequences, ref)


def _start_plain(monkeypatch, lookup: bool = True, topk: bool = False, shadow_every: int = 1) -> list:
    """Every row of `auto` starts sure that its drafter never agrees (and its lookup, `lookup`; and its top-k,
    `topk`), so it decodes plainly until shadow measurements (every `shadow_every`-th plain verification) bring
    it back; returns the list every drafter shadow call appends to."""
    from hispec.decoding.auto import _AutoPolicy
    from hispec.decoding.eagle import _EagleDrafting

    init, shadow, calls = _AutoPolicy.__init__, _EagleDrafting._eagle_shadow, []

    def pessimist(self, *a, **kw):
        init(self, *a, **kw)
        for agreed, disagreed in ((self.acc, self.rej),) + (((self.lacc, self.lrej),) if lookup else ()):
            agreed.zero_()
            disagreed.fill_(self.PRIOR)
        if topk:
            self.khit.zero_()

    monkeypatch.setattr(_AutoPolicy, "__init__", pessimist)
    monkeypatch.setattr(_AutoPolicy, "SHADOW_EVERY", shadow_every)
    monkeypatch.setattr(_AutoPolicy, "SHADOW_SHARE", float("inf"))  # (the budget has its own test)
    monkeypatch.setattr(_AutoPolicy, "REDECIDE_PLAIN", 1)  # every round (the cadence has its own test)
    monkeypatch.setattr(_EagleDrafting, "_eagle_shadow", lambda *a: calls.append(1) or shadow(*a))
    return calls


@pytest.mark.parametrize("shadowed,gate", [(False, 0.0), (True, 0.0), (False, 0.6)],
                         ids=["priors", "from-plain", "gated"])
@pytest.mark.parametrize("lookup", [False, True], ids=["eagle3", "ngram|eagle3"])
def test_auto_with_the_drafter_sampling_matches_the_exact_distribution(lookup, shadowed, gate, monkeypatch):
    """`from-plain`: every row starts sure the drafter never agrees and climbs back by shadow measurements (the
    drafter's exact acceptance probability, its context caught up), every plain verification. `gated`: a
    calibration that chose confidence gate 0.6 for the drafter's chains, which auto then runs."""
    calls = _start_plain(monkeypatch) if shadowed else []
    model = _tiny_vocab_model()
    d = Eagle3Drafter(Eagle3Config.for_target(model.base.config))
    with torch.no_grad():
        d.lm_head.weight.mul_(30)  # a confident drafter, clearly different from the target
    model.attach_drafter(d)
    cal = _drafter_priors(model, eagle=0.6, ngram=0.7 if lookup else 0.0, match=0.5 if lookup else 0.0,
                          prompts=([1, 3, 2],), gate=gate)
    chain = decoding._auto_chain(model, cal, gamma=1, window=1, ngram=NgramConfig())
    assert [lv.name for lv in chain] == [(LOOKUP if lookup else "") + EAGLE, FULL]
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=0.8)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="auto", do_sample=True,
                         generator=torch.Generator().manual_seed(11), **warp)
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) > 1e-4
    lv = out.stats.levels[1]
    assert out.stats.strategy.startswith("auto:")
    if shadowed:
        assert calls
    assert (out.stats.levels[0].gated > 0) == (gate > 0)
    if not (shadowed and lookup):  # (from plain, a lookup-first level climbs back too slowly for 3 tokens)
        assert 0 < lv.accepted < lv.proposed  # drafts accepted and rejected


def test_a_switched_off_drafters_shadow_passes_stay_within_their_budget(monkeypatch):
    """Rows that decode plainly measure their drafter only while the shadow passes' predicted cost stays within
    SHADOW_SHARE / rows of what the rounds so far cost plainly: the first pass, over every row's whole prompt (the
    drafter's context, padded to the longest), waits until the rounds have paid for it, so a drafter that is
    never switched on costs plain decoding at most that share. Output is plain decoding's either way."""
    from hispec.decoding.auto import _AutoPolicy

    calls = _start_plain(monkeypatch, lookup=False)  # every row plain, a shadow every plain verification
    policies, init = [], _AutoPolicy.__init__
    monkeypatch.setattr(_AutoPolicy, "__init__", lambda self, *a, **kw: init(self, *a, **kw) or policies.append(self))
    model = _with_drafter()
    cal = _drafter_priors(model, eagle=0.9)
    steep = {T: 2e-4 * (1 + 0.1 * int(T)) for T in cal.costs["drafter"]}  # a drafter pass grows with its entries
    model.hispec_config.calibration = dataclasses.replace(cal, costs={**cal.costs, "drafter": steep}).to_dict()
    ids = torch.randint(3, 97, (3, 40), generator=torch.Generator().manual_seed(2))
    ref = model.generate(ids, max_new_tokens=48, strategy="ar").sequences
    out = model.generate(ids, max_new_tokens=48, strategy="auto")  # no budget (`_start_plain`)
    assert torch.equal(out.sequences, ref)
    unbudgeted, first = len(calls), policies[-1]
    monkeypatch.setattr(_AutoPolicy, "SHADOW_SHARE", 0.05)
    calls.clear()
    out = model.generate(ids, max_new_tokens=48, strategy="auto")
    assert torch.equal(out.sequences, ref)
    p = policies[-1]
    assert 0 < p.shadow_seconds <= 0.05 / 3 * p.rounds_seconds, (p.shadow_seconds, p.rounds_seconds)
    assert first.shadow_seconds > 0.05 / 3 * first.rounds_seconds  # (without the budget it spends more)
    assert 0 < len(calls) < unbudgeted, (len(calls), unbudgeted)


def test_a_switched_off_drafter_is_measured_in_the_shadow_and_switched_back_on(monkeypatch):
    """Rows that decode plainly keep measuring the drafter (every SHADOW_EVERY-th plain verification: its context
    caught up, its proposal compared with the full model's token). fp32: each shadow measurement is exactly the
    training-time test's step-0 draft at that position; rows started with a zero estimate climb back to drafting
    because of it (without the shadow they stay plain); output is plain decoding's."""
    from hispec.decoding.auto import _AutoPolicy
    from hispec.decoding.eagle import _EagleDrafting

    model = _with_drafter()
    _drafter_priors(model, eagle=0.9)  # the plan is eagle3>full ...
    init = _AutoPolicy.__init__

    def pessimist(self, *a, **kw):  # ... but every row starts sure that the drafter never agrees
        init(self, *a, **kw)
        self.acc.zero_()
        self.rej.fill_(self.PRIOR)

    monkeypatch.setattr(_AutoPolicy, "__init__", pessimist)
    monkeypatch.setattr(_AutoPolicy, "SHADOW_SHARE", float("inf"))  # (the budget has its own test)
    seen = []
    shadow = _EagleDrafting._eagle_shadow

    def record(self, rows, new, probs):
        x = shadow(self, rows, new, probs)
        seen.append((rows.clone(), self.seq.clone(), self.tok[:, :P].clone(), x.clone()))  # (rows: finished go)
        return x

    monkeypatch.setattr(_EagleDrafting, "_eagle_shadow", record)
    ids = torch.tensor(_prompts()[:3])
    P = ids.shape[1]
    ref = model.generate(ids, max_new_tokens=32, strategy="ar").sequences
    monkeypatch.setattr(_AutoPolicy, "SHADOW_EVERY", 10**9)  # no shadow: the rows never draft
    off = model.generate(ids, max_new_tokens=32, strategy="auto")
    assert torch.equal(off.sequences, ref) and off.stats.levels[0].proposed == 0 and not seen
    monkeypatch.setattr(_AutoPolicy, "SHADOW_EVERY", 1)
    out = model.generate(ids, max_new_tokens=32, strategy="auto")
    assert torch.equal(out.sequences, ref)
    assert out.stats.strategy == "auto:eagle3>full" and out.stats.levels[0].proposed > 0  # back on
    # every shadow measurement == the drafter's step-0 draft with its whole context from the target's states
    d = model.drafter
    aux = {}
    with torch.no_grad():
        ad = model.adapter
        pos = torch.arange(ref.shape[1])[None].expand(len(ref), -1)
        ad.run_layers(ad.embed(ref, pos), 0, ad.num_layers, position_ids=pos, cache=ad.new_cache(len(ref)),
                      capture=(aux := {i: None for i in d.config.aux_layers}))
        fused = torch.cat([aux[i] for i in d.config.aux_layers], -1)[:, :-1]
        step0 = d.to_target(d.ttt_logits(fused, model.base.get_input_embeddings(), ref[:, 1:], 1)[0].argmax(-1))
    checked = hits = 0
    for rows, seq, prompt, x in seen:
        for b in rows.nonzero().flatten().tolist():
            r = next(r for r in range(len(ids)) if torch.equal(prompt[b], ids[r]))  # (its row in the batch)
            p = int(seq[b])  # the position the full model's token went to
            assert float(x[b]) == float(step0[r, p - 2] == ref[r, p]), (r, p)
            checked, hits = checked + 1, hits + int(x[b])
    assert checked >= 10 and 0 < hits < checked and all(int(s.min()) >= P for _, s, _, _ in seen)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafter_rows_drafting_by_the_lookup_alone_stay_greedy_identical(monkeypatch, tree):
    """`ngram|eagle3` under auto with some rows (then every row) drafting by the lookup alone: output is plain
    decoding's; with every row so the drafter drafts nothing (every proposal is the lookup's)."""
    from test_auto import _greedy_with_the_lookup_alone
    from test_eagle_tree import _tree_priors

    model = _with_drafter("llama", steps=60)
    if tree:  # (a tree wins over the lookup-first chain where the lookup matches less often)
        _tree_priors(model, topk=(0.5, 0.95, 0.99), ngram=0.9, match=0.3)
    else:
        _drafter_priors(model, ngram=0.9, match=0.6)
    _greedy_with_the_lookup_alone(monkeypatch, model, "auto:ngram|eagle3>full" + ("[tree" if tree else ""), tree)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafter_rows_drafting_by_the_lookup_alone_keep_the_exact_distribution(monkeypatch, tree):
    from test_auto import _force_lookup_alone
    from test_eagle_tree import _confident_drafter, _tree_priors

    model = _tiny_vocab_model()
    model.attach_drafter(_confident_drafter(model, None))
    if tree:
        _tree_priors(model, eagle=0.5, topk=(0.5, 0.9, 0.95), ngram=0.9, match=0.6, prompts=([1, 3, 2],))
    else:
        _drafter_priors(model, eagle=0.6, ngram=0.7, match=0.5, prompts=([1, 3, 2],))
    seen = _force_lookup_alone(monkeypatch, lambda r: r % 2)  # half the rows by the lookup alone, half as auto chose
    prompt, n, warp = [1, 3, 2, 1, 3], 3, dict(temperature=0.8)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="auto", do_sample=True,
                         generator=torch.Generator().manual_seed(5), **warp)
    s = out.stats
    assert s.strategy.startswith("auto:ngram|eagle3>full" + ("[tree" if tree else "")), s.strategy
    assert seen["forced"] > 0 and s.levels[0].lookups > 0 and s.levels[0].proposals > s.levels[0].lookups
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) > 1e-4
