"""The drafter's confidence gate priced by the latency model: a gated chain's expected round (closed form) against
a simulation of the process, the full chain as its special case, the calibration's gates through JSON, `calibrate`
measuring them along the decoder's own rounds and keeping the gate `auto` is predicted fastest with, and the
bench's predictions for gated strategies."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_eagle_auto import _cal, _prompts, _with_drafter

from hispec import NgramConfig, latency
from hispec.latency import EAGLE, FULL, LOOKUP, Calibration, CalibrationError, plain_seconds_per_token


def _gated_cal(a_full=0.5, a_gated=0.75, q=0.6, steep=True) -> Calibration:
    """`_cal` with a verification cost that grows with its width (fp32 on a CPU: `steep`) and gate 0.3 measured."""
    cal = _cal(2e-4, a_full)
    layer = {T: 1e-3 * (1 + (0.25 * (T - 1) if steep else 0.0)) for T in cal.costs["layer"]}
    gates = {"0.3": {"acceptance": a_gated, "pass": q}}
    return dataclasses.replace(cal, costs={**cal.costs, "layer": layer, "drafter_gates": gates, "drafter_gate": 0.0})


def _simulate(cal: Calibration, gamma: int, alpha: float, q: float, match: float = 0.0, rounds: int = 200_000,
              seed: int = 0) -> float:
    """Seconds per token of the drafter's chains (lookup-first when `match` > 0) by simulating rounds as the decoder
    runs them: before each draft step (lookup-first) the lookup is tried and with probability `match` proposes n
    tokens after the drafts so far, which ends the round (the n-gram's accepted like the n-gram's, all verified in
    one pass); else the draft step passes the gate with probability q, or the chain ends there, its pass spent;
    proposals are accepted with probability alpha until the first rejection, the lookup's only where every draft
    before them was. The drafter takes in the verified tokens as its context (all of a round's where it did not
    run, all but the newest where it did)."""
    rng = random.Random(seed)
    o = cal.step_overhead + cal.drafter_verify_overhead
    D = latency.model._draft_cost(cal, EAGLE)
    level = LOOKUP + EAGLE if match else EAGLE
    a_n, n, c = cal.acceptance["ngram>full"], cal.ngram_max_len, cal.ngram_cost if match else 0.0
    cost = tokens = entries = 0.0
    for _ in range(rounds):
        passes = proposed = lookups = 0
        served = False
        for _ in range(gamma):
            if match:
                lookups += 1
                if rng.random() < match:
                    served = True
                    break
            passes += 1
            if rng.random() >= q:
                break
            proposed += 1
        acc = 0
        while acc < proposed and rng.random() < alpha:
            acc += 1
        if served and acc == proposed:
            while acc < proposed + n and rng.random() < a_n:
                acc += 1
        width = proposed + (n if served else 0) + 1
        cost += passes * D + lookups * c + latency.model._pass_cost(cal, level, FULL, width) + o
        tokens, entries = tokens + acc + 1, entries + acc + (1 if passes == 0 else 0)
    return (cost / rounds + latency.model._drafter_context(cal, entries / rounds)) / (tokens / rounds)


def test_a_gated_chain_is_priced_by_its_expected_round():
    cal = _gated_cal().with_gate(0.3)
    for gamma in (1, 3, 6):
        want = _simulate(cal, gamma, 0.75, 0.6)
        assert latency.time_per_token([EAGLE, FULL], [gamma], cal) == pytest.approx(want, rel=0.01), gamma
        want = _simulate(cal, gamma, 0.75, 0.6, match=cal.ngram_match)
        assert latency.time_per_token([LOOKUP + EAGLE, FULL], [gamma], cal) == pytest.approx(want, rel=0.01), gamma
    rounds = latency.model.gated_rounds(0.75, 4, 0.6)
    assert sum(p for p, *_ in rounds) == pytest.approx(1.0)
    assert [j for _, j, _, _ in rounds] == [0, 1, 2, 3, 4] and [k for _, _, k, _ in rounds] == [1, 2, 3, 4, 4]


def test_the_full_chain_is_the_gates_special_case():
    """q = 1 (every step passes) prices exactly the ungated chain; gate 0 is the calibration's full chains."""
    cal = _gated_cal(a_full=0.6, a_gated=0.6, q=1.0)
    for levels in ([EAGLE, FULL], [LOOKUP + EAGLE, FULL]):
        for gamma in (1, 4):
            assert latency.time_per_token(levels, [gamma], cal.with_gate(0.3)) == pytest.approx(
                latency.time_per_token(levels, [gamma], cal.with_gate(0)), rel=1e-12)
    assert cal.with_gate(0) is cal and cal.drafter_pass == 1.0 and cal.rate("eagle3>full") == 0.6


def test_a_gate_pays_where_verifying_many_positions_is_expensive_and_not_where_it_is_free():
    steep, flat = _gated_cal(steep=True), _gated_cal(steep=False)
    for cal, pays in ((steep, True), (flat, False)):
        full = latency.auto_plan(cal).seconds_per_token
        gated = latency.auto_plan(cal.with_gate(0.3)).seconds_per_token
        assert (gated < full) == pays, (pays, gated, full)
    # the tools' prediction table: the named strategies' full chains, and the gated ones the calibration chose
    g = steep.with_gate(0.3)
    rows = {r["name"]: r for r in latency.predictions(g)}
    assert rows["eagle"]["seconds_per_token"] == pytest.approx(
        {r["name"]: r for r in latency.predictions(steep)}["eagle"]["seconds_per_token"])
    assert rows["eagle-gate:0.3"]["seconds_per_token"] < rows["eagle"]["seconds_per_token"]
    steep.drafter_gates["0.3"]["seconds_per_token"] = latency.auto_plan(g).seconds_per_token
    assert "drafter confidence gate 0.3 chosen" in latency.format_predictions(g, list(rows.values()))
    # auto's online estimates of the gated chains' acceptance are priced with the gate's pass rate
    assert latency.best_gammas([EAGLE, FULL], g, {"eagle3>full": 0.95}) != [0]
    assert latency.best_gammas([EAGLE, FULL], g, {"eagle3>full": 0.0}) == [0]


def test_the_calibrations_gates_go_through_json_and_are_checked():
    cal = _gated_cal().with_gate(0.3)
    assert cal.drafter_gate == 0.3 and cal.drafter_pass == 0.6 and cal.rate("eagle3>full") == 0.75
    assert cal.acceptance["eagle3>full"] == 0.5  # (the full chains' rate stays: fixed strategies, trees)
    back = Calibration.from_dict(cal.to_dict())
    assert back.drafter_gate == 0.3 and back.drafter_gates == cal.drafter_gates
    assert back.with_gate(0).drafter_gate == 0.0 and back.with_gate(0).rate("eagle3>full") == 0.5
    with pytest.raises(CalibrationError, match="no drafter gate 0.4"):
        back.with_gate(0.4)
    assert back.at_batch(4).drafter_gate == 0.3
    bare = back.without_drafter()
    assert bare.drafter_gate == 0.0 and not bare.drafter_gates
    old = {k: v for k, v in cal.to_dict().items()}  # a calibration from before gates
    old["costs"] = {k: v for k, v in old["costs"].items() if k not in ("drafter_gate", "drafter_gates")}
    assert Calibration.from_dict(old).drafter_gate == 0.0


def test_calibrate_measures_the_gates_along_the_decoders_own_rounds():
    """fp32: per gate, the acceptance of what the gated chains propose and the share of draft steps that pass are
    the decoder's own (`generate(draft_gate=g)`); the gate kept is the one auto's plan is predicted fastest with."""
    model = _with_drafter(steps=120)
    with torch.no_grad():
        model.drafter.lm_head.weight.mul_(20)  # confident enough that gates 0.1-0.6 cut its chains differently
    prompts = _prompts()
    cal = latency.calibrate(model, prompts, max_new_tokens=12, repeats=1, max_gamma=8, ngram=NgramConfig())
    assert set(cal.drafter_gates) == {latency.levels.gate_key(g) for g in latency.measure.DRAFT_GATES}
    passes = [cal.drafter_gates[k]["pass"] for k in sorted(cal.drafter_gates, key=float)]
    assert all(0.0 <= p <= 1.0 for p in passes) and passes == sorted(passes, reverse=True)
    assert sum(0.2 < p < 0.95 for p in passes) >= 2
    # what a gate lets through is accepted more often than the full chains' drafts
    assert cal.drafter_gates["0.6"]["acceptance"] > cal.acceptance["eagle3>full"]
    for key in ("0.2", "0.5"):
        accepted = rejections = proposed = stops = 0
        for p in prompts:
            st = model.generate(torch.tensor([p]), max_new_tokens=12, strategy="eagle", gamma=8,
                                draft_gate=float(key)).stats.levels
            accepted, rejections = accepted + st[1].accepted, rejections + st[1].rejections
            proposed, stops = proposed + st[0].proposed, stops + st[0].gated
        entry = cal.drafter_gates[key]
        assert entry["acceptance"] == pytest.approx(accepted / max(accepted + rejections, 1))
        assert entry["pass"] == pytest.approx(proposed / (proposed + stops))
    times = {0.0: latency.auto_plan(cal.with_gate(0), max_depth=5).seconds_per_token}
    times.update({float(k): e["seconds_per_token"] for k, e in cal.drafter_gates.items()})
    best = min(times, key=times.get)
    want = best if times[best] < times[0.0] * (1 - latency.measure.GATE_MIN_GAIN) else 0.0
    assert cal.drafter_gate == want


def test_the_bench_predicts_gated_strategies_with_their_gate():
    from hispec.bench.runner import BenchConfig, predict_speedups

    model = _with_drafter(steps=30)
    cal = latency.calibrate(model, _prompts()[:2], max_new_tokens=8, repeats=1, max_gamma=4, ngram=NgramConfig())
    model.hispec_config.calibration = cal.to_dict()
    model.drafter.default_gamma = g = model.hispec_config.gamma + 1  # (a shipped drafter's own default gamma,
    # which `generate` drafts the fixed strategies' chains with, not the checkpoint's exit gamma: priced so)
    strategies = ("ar", "eagle", "eagle-gate:0.3", "eagle-lookup-gate:0.5", "eagle-gate:0.35", "auto")
    out, fns = predict_speedups(model, BenchConfig(strategies=strategies, max_new_tokens=8))
    plain = plain_seconds_per_token(cal)
    for s, levels, c in (("eagle", [EAGLE, FULL], cal.with_gate(0)), ("eagle-gate:0.3", [EAGLE, FULL],
                         cal.with_gate(0.3)), ("eagle-lookup-gate:0.5", [LOOKUP + EAGLE, FULL], cal.with_gate(0.5))):
        assert out[s] == pytest.approx(plain / latency.time_per_token(levels, [g], c)), s
    assert "eagle-gate:0.35" not in out  # (a gate the calibration did not measure: not predicted)
    assert fns["eagle-gate:0.3"]({"eagle3>full": 0.9}) == pytest.approx(
        plain / latency.time_per_token([EAGLE, FULL], [g], cal.with_gate(0.3), {"eagle3>full": 0.9}))
