"""hispec.latency: closed forms, the recursion against hand computations, the dynamic program against brute force,
calibration on a tiny model, storage in the checkpoint and refusal on another model or machine."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch
from tiny import tiny_model

import hispec
from hispec import latency as lt

ROWS = range(1, 10)


def synthetic(L=10, exits=(2, 5), layer=(1.0, 0.2), heads=((0.3, 0.05), (0.2, 0.05)), final=(2.0, 0.1),
              ngram=0.05, overhead=0.1, acceptance=None, match=0.5) -> lt.Calibration:
    """A calibration with linear unit costs: cost(T) = a + b (T - 1), measured at T = 1..9."""
    lin = lambda ab: {T: ab[0] + ab[1] * (T - 1) for T in ROWS}  # noqa: E731
    names = [f"L{e}" for e in exits]
    levels = ["ngram"] + names + ["full"]
    acc = {f"{a}>{b}": 0.5 for i, a in enumerate(levels) for b in levels[i + 1:]}
    acc.update(acceptance or {})
    return lt.Calibration(
        machine={"cpu": "test cpu", "cpu_capability": "AVX2", "device": "cpu", "cuda_name": None},
        dtype="float32", threads=1,
        model={"num_layers": L, "exits": {"draft": exits[0], "verify": exits[1]}},
        costs={"layer": lin(layer), "head": {n: lin(h) for n, h in zip(names, heads)}, "final": lin(final),
               "ngram": ngram, "step_overhead": overhead},
        acceptance=acc, ngram_match=match)


def random_calibration(rnd: random.Random) -> lt.Calibration:
    L = rnd.randint(6, 16)
    d = rnd.randint(1, L - 2)
    v = rnd.randint(d + 1, L - 1)
    levels = ["ngram", f"L{d}", f"L{v}", "full"]
    return synthetic(
        L=L, exits=(d, v), layer=(rnd.uniform(0.5, 1.5), rnd.uniform(0.0, 0.3)),
        heads=((rnd.uniform(0.05, 3), rnd.uniform(0, 0.3)), (rnd.uniform(0.05, 3), rnd.uniform(0, 0.3))),
        final=(rnd.uniform(0.5, 4), rnd.uniform(0, 0.5)), ngram=rnd.uniform(0, 0.5), overhead=rnd.uniform(0, 2),
        acceptance={f"{a}>{b}": rnd.choice([0.0, rnd.random(), rnd.uniform(0.8, 0.99)])
                    for i, a in enumerate(levels) for b in levels[i + 1:]},
        match=rnd.random())


# ---------------------------------------------------------------------------------------------- closed forms
def test_expected_tokens_edge_cases():
    assert lt.expected_tokens(0.7, 0) == 1.0
    assert lt.expected_tokens(0.0, 5) == 1.0
    assert lt.expected_tokens(1.0, 3) == 4.0
    assert lt.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert lt.expected_tokens(0.999999, 4) == pytest.approx(5.0, rel=1e-5)
    assert lt.expected_tokens(1.3, 2) == 3.0 and lt.expected_tokens(-0.2, 2) == 1.0  # clamped to [0, 1]


def test_acceptance_from_counts_is_the_censored_mle():
    assert lt.acceptance_from_counts(3, 5, 1) == 0.75
    assert lt.acceptance_from_counts(4, 4, 0) == 1.0  # all accepted: no rejection observed
    assert lt.acceptance_from_counts(0, 0, 0) is None  # no evidence
    with pytest.raises(ValueError, match="inconsistent"):
        lt.acceptance_from_counts(3, 3, 1)


def test_interpolation_between_and_beyond_measured_rows():
    table = {1: 1.0, 3: 2.0, 5: 2.5}
    assert lt.interp(table, 2) == 1.5 and lt.interp(table, 4) == 2.25
    assert lt.interp(table, 7) == pytest.approx(3.0)  # the last segment's slope
    assert lt.interp({1: 1.0, 2: 0.9}, 4) == 0.9  # never cheaper beyond the last row


def test_costs_are_made_nondecreasing_in_T():
    assert lt.nondecreasing({1: 1.0, 2: 3.0, 3: 2.0, 4: 4.0}) == {1: 1.0, 2: 2.5, 3: 2.5, 4: 4.0}
    assert lt.nondecreasing({1: 2.0, 2: 1.0, 3: 0.0}) == {1: 1.0, 2: 1.0, 3: 1.0}
    assert lt.nondecreasing({1: 1.0, 5: 2.0}) == {1: 1.0, 5: 2.0}


# ---------------------------------------------------------------------------------------------- the recursion
def test_two_level_time_per_token_matches_a_hand_computation():
    cal = synthetic()  # L=10, L2/L5, layer(T) = 1 + 0.2 (T-1), head_L2(T) = 0.3 + 0.05 (T-1), final = 2 + 0.1 (T-1)
    cal.acceptance["L2>full"] = 0.6
    draft = 2 * 1.0 + 0.3 + 0.1  # 2 layers + head at T=1 + overhead
    verify = 2 * 1.0 + 8 * 1.6 + 2.3  # newest token through L2's range, 8 layers over 4 rows, final over 4 rows
    E = (1 - 0.6 ** 4) / 0.4
    assert lt.time_per_token(["L2", "full"], [3], cal) == pytest.approx((3 * draft + verify + 0.1) / E)
    assert lt.time_per_token(["full"], [], cal) == pytest.approx(10 * 1.0 + 2.0 + 0.1)


def test_three_level_time_per_token_matches_a_hand_computation():
    cal = synthetic(acceptance={"L2>L5": 0.7, "L5>full": 0.8})
    t0 = 2 * 1.0 + 0.3 + 0.1
    v1 = 2 * 1.0 + 3 * 1.4 + 0.3  # L5 verifies 2 drafts: layers 2..5 over 3 rows, head_L5(3) = 0.2 + 0.1
    t1 = (2 * t0 + v1 + 0.1) / (1 + 0.7 + 0.49)
    v2 = 5 * 1.0 + 5 * 1.6 + 2.3  # the full model verifies 3 tokens: layers 5..10 over 4 rows
    t2 = (3 * t1 + v2 + 0.1) / (1 + 0.8 + 0.64 + 0.512)
    assert lt.time_per_token(["L2", "L5", "full"], [2, 3], cal) == pytest.approx(t2)
    # observed rates override the calibration's
    assert lt.time_per_token(["L2", "L5", "full"], [2, 3], synthetic(), acceptance={"L2>L5": 0.7, "L5>full": 0.8}
                             ) == pytest.approx(t2)


def test_ngram_level_matches_a_hand_computation():
    cal = synthetic(acceptance={"ngram>full": 0.6}, match=0.5, ngram=0.05)
    v5 = 10 * (1 + 0.2 * 4) + (2 + 0.1 * 4)  # all layers and the final projection over 4 proposals + 1
    v1 = 10 * 1.0 + 2.0
    E = (1 - 0.6 ** 5) / 0.4
    want = (0.05 + 0.1 + 0.5 * v5 + 0.5 * v1) / (1 + 0.5 * (E - 1))
    assert lt.time_per_token(["ngram", "full"], [4], cal) == pytest.approx(want)
    # never matching: every round is a plain step plus a wasted lookup
    assert lt.time_per_token(["ngram", "full"], [4], cal, ngram_match=0.0) == pytest.approx(0.05 + 0.1 + v1)


def test_lookup_first_level_matches_a_hand_computation():
    cal = dataclasses.replace(synthetic(acceptance={"L2>full": 0.6, "ngram>full": 0.7}, match=0.4, ngram=0.05),
                              ngram={"max_ngram": 3, "min_ngram": 1, "max_len": 4})
    draft = 2 * 1.0 + 0.3 + 0.1  # the exit's draft step
    E_n, E_g = (1 - 0.7 ** 5) / 0.3, (1 - 0.6 ** 3) / 0.4
    # three kinds of round: the lookup matches at once (0.4): its 4 tokens, every layer over 5 rows
    served = 0.05 + 0.1 + 10 * 1.8 + 2.4
    # it misses, the exit drafts one, the lookup matches after it (0.6 x 0.4): 1 + 4 tokens verified in one pass,
    # the exit's layers over the 4 looked-up tokens and the draft's newest input (5 rows), the rest over 6
    after_one = 2 * 0.05 + draft + (2 * 1.8 + 8 * 2.0 + 2.5) + 0.1
    E_after_one = 1 + 0.6 + 0.6 * (E_n - 1)  # the draft's accepted prefix, then (if it held) the lookup's
    # it never matches (0.6 x 0.6): two drafts, then the full model over 3 rows, two lookups tried
    drafted = 2 * 0.05 + 2 * draft + (2 * 1.0 + 8 * 1.4 + 2.2) + 0.1
    want = ((0.4 * served + 0.24 * after_one + 0.36 * drafted)
            / (0.4 * E_n + 0.24 * E_after_one + 0.36 * E_g))
    assert lt.time_per_token(["ngram|L2", "full"], [2], cal) == pytest.approx(want)
    assert [r[:3] for r in lt.lookup_first_rounds(2, 1.0, 0.4)] == [
        (0.4, 0, 0), (pytest.approx(0.24), 1, 1), (pytest.approx(0.36), 2, 2)]
    # limits: never matching, it is self-speculation plus the wasted lookups; always matching, the n-gram level
    assert lt.time_per_token(["ngram|L2", "full"], [2], cal, ngram_match=0.0) == pytest.approx(
        lt.time_per_token(["L2", "full"], [2], cal) + 2 * 0.05 / E_g)
    assert lt.time_per_token(["ngram|L2", "full"], [2], cal, ngram_match=1.0) == pytest.approx(
        lt.time_per_token(["ngram", "full"], [4], cal, ngram_match=1.0))
    # observed rates override the calibration's, one per drafter
    assert lt.time_per_token(["ngram|L2", "full"], [2], synthetic(match=0.4, ngram=0.05),
                             acceptance={"L2>full": 0.6, "ngram>full": 0.7}) == pytest.approx(
        lt.time_per_token(["ngram|L2", "full"], [2], dataclasses.replace(cal, ngram=None)))
    assert lt.level_pairs("ngram|L2", "L5") == ["L2>L5", "ngram>L5"] and lt.level_pairs("L2", "L5") == ["L2>L5"]
    assert lt.time_per_token(["ngram|L2", "L5", "full"], [2, 3], cal) > 0  # under a verifier
    with pytest.raises(ValueError, match="only be the bottom level"):
        lt.time_per_token(["L2", "ngram|L5", "full"], [1, 1], cal)
    with pytest.raises(ValueError, match="unknown level"):
        lt.time_per_token(["ngram|L2", "full"], [1], dataclasses.replace(
            cal, costs={**cal.costs, "ngram": None}))  # no n-gram measured: no lookup-first level either


def test_best_hierarchy_takes_the_lookup_first_exit_where_both_drafters_pay():
    fast = dict(L=30, exits=(2, 8), layer=(1.0, 0.01), heads=((0.1, 0.0), (0.1, 0.0)), final=(3.0, 0.01))
    both = synthetic(**fast, acceptance={"L2>full": 0.6, "L8>full": 0.3, "L2>L8": 0.3, "ngram>full": 0.9},
                     match=0.5)
    choice = lt.best_hierarchy(both)
    assert choice.levels == ("ngram|L2", "full")
    assert choice.seconds_per_token < min(lt.time_per_token(lv, [g], both) for lv in (["ngram", "full"], ["L2", "full"])
                                          for g in range(1, 9))
    assert lt.best_gammas(["ngram|L2", "full"], both, {}) >= [1]
    assert lt.best_gammas(["ngram|L2", "full"], both, {"L2>full": 0.0, "ngram>full": 0.0}) == [0]  # plain
    # an exit that is never right only costs: the n-gram alone is faster
    useless = synthetic(**fast, acceptance={"L2>full": 0.0, "L8>full": 0.0, "L2>L8": 0.0, "ngram>full": 0.9},
                        match=0.5)
    assert lt.best_hierarchy(useless).levels == ("ngram", "full")


def test_decoder_costs_split_into_a_per_layer_factor_and_a_per_pass_overhead():
    # L = 10 layers of 1 ms timed alone, final 2 ms, draft exit at layer 2 with a 0.5 ms head
    unit = dict(L=10, e=2, layer=1.0, final=2.0, head=0.5)
    # inside the decoder every layer takes 1.5 ms and a pass has 1 ms of bookkeeping: the fit recovers both
    scale, o = lt.fit_decoder_costs(10 * 1.5 + 2.0 + 1.0, 2 * 1.5 + 0.5 + 1.0, **unit)
    assert scale == pytest.approx(1.5) and o == pytest.approx(1.0)
    # all the extra time per pass (a small model's Python): no layer factor
    scale, o = lt.fit_decoder_costs(10 + 2.0 + 4.0, 2 + 0.5 + 4.0, **unit)
    assert scale == pytest.approx(1.0) and o == pytest.approx(4.0)
    # clamped: never a negative overhead; without a draft step, all per pass
    assert lt.fit_decoder_costs(10 + 2.0 + 3.0, 9.0, **unit) == (1.0, pytest.approx(3.0))
    # a plain step faster than the timed layers (they ran slow): scaled down so the model's step is the measured one
    assert lt.fit_decoder_costs(8 + 2.0, 2.5, **unit) == (pytest.approx(0.8), 0.0)
    assert lt.fit_decoder_costs(8 + 2.0, None, **unit) == (pytest.approx(0.8), 0.0)
    assert lt.fit_decoder_costs(10 * 2 + 2.0, 0.5, **unit) == (pytest.approx(2.0), pytest.approx(0.0))
    assert lt.fit_decoder_costs(15.0, None, **unit) == (1.0, pytest.approx(3.0))
    cal = synthetic()
    scaled = dataclasses.replace(cal, costs={**cal.costs, "layer_scale": 1.5})
    assert scaled.layer_cost(3) == pytest.approx(1.5 * cal.layer_cost(3))
    assert lt.Calibration.from_dict(scaled.to_dict()).layer_scale == 1.5
    assert lt.Calibration.from_dict(cal.to_dict()).layer_scale == 1.0  # older calibrations: 1


def test_a_zero_gamma_skips_the_level_and_everything_below_it():
    cal = synthetic()
    plain = lt.time_per_token(["full"], [], cal)
    assert lt.time_per_token(["L2", "L5", "full"], [3, 0], cal) == pytest.approx(plain)
    assert lt.time_per_token(["L2", "L5", "full"], [0, 3], cal) == pytest.approx(
        lt.time_per_token(["L5", "full"], [3], cal))
    with pytest.raises(ValueError, match="increasing depth"):
        lt.time_per_token(["L5", "L2", "full"], [1, 1], cal)
    with pytest.raises(ValueError, match="unknown level"):
        lt.time_per_token(["L3", "full"], [1], cal)
    with pytest.raises(ValueError, match="need 1 gammas"):
        lt.time_per_token(["L2", "full"], [1, 2], cal)


# ---------------------------------------------------------------------------------------------- the optimum
def test_best_hierarchy_is_plain_decoding_when_nothing_is_accepted():
    cal = synthetic(acceptance={k: 0.0 for k in synthetic().acceptance}, match=0.0)
    choice = lt.best_hierarchy(cal)
    assert choice.levels == ("full",) and choice.gammas == () and choice.speedup_vs_plain == pytest.approx(1.0)
    assert lt.best_gammas(["L2", "L5", "full"], cal, {}) == [0, 0]
    assert lt.best_gammas(["ngram", "L2", "full"], cal, {}, ngram_match=0.0) == [0, 0]
    spec = lt.best_hierarchy(cal, speculative_only=True)
    assert len(spec.levels) >= 2 and spec.speedup_vs_plain < 1


def test_best_hierarchy_speculates_when_drafts_are_cheap_and_accepted():
    cal = synthetic(L=30, exits=(2, 8), layer=(1.0, 0.01), heads=((0.1, 0.0), (0.1, 0.0)), final=(3.0, 0.01),
                    acceptance={"L2>L8": 0.9, "L2>full": 0.85, "L8>full": 0.95, "ngram>full": 0.0}, match=0.0)
    choice = lt.best_hierarchy(cal)
    assert choice.levels[0] == "L2" and choice.levels[-1] == "full" and min(choice.gammas) >= 1
    assert choice.speedup_vs_plain > 2
    assert lt.time_per_token(choice.levels, choice.gammas, cal) == pytest.approx(choice.seconds_per_token)
    assert lt.best_gammas(["L2", "L8", "full"], cal, {})[0] >= 1


def test_a_batch_prices_every_row_at_its_share_of_the_batch_pass():
    """`at_batch(B)`: a pass of T positions per row costs what one pass over B x T positions cost when timed, shared
    by the B rows; the per-pass overhead is shared too, the lookup is per row. Where that pass is compute-bound,
    speculation that pays for one row stops paying for a full batch, and the best hierarchy becomes plain."""
    flat_then_linear = {T: 1.0 * max(1.0, T / 4) for T in list(ROWS) + [16, 24, 32]}  # flat up to 4 positions
    acc = {"L2>L5": 0.7, "L2>full": 0.7, "L5>full": 0.8, "ngram>full": 0.3, "ngram>L2": 0.3, "ngram>L5": 0.3}
    cal = dataclasses.replace(synthetic(L=30, acceptance=acc, match=0.2), costs={
        "layer": flat_then_linear, "final": {T: 3 * c for T, c in flat_then_linear.items()},
        "head": {"L2": {T: 0.1 for T in ROWS}, "L5": {T: 0.1 for T in ROWS}}, "ngram": 0.05, "step_overhead": 0.4})
    assert cal.at_batch(1) is cal and cal.at_batch(0) is cal
    b4 = cal.at_batch(4)
    assert cal.at_batch(4) is b4  # memoised
    for T in (1, 2, 3, 8, 9):
        assert b4.layer_cost(T) == pytest.approx(lt.interp(flat_then_linear, 4 * T) / 4)
        assert b4.head_cost("full", T) == pytest.approx(3 * lt.interp(flat_then_linear, 4 * T) / 4)
        assert b4.head_cost("L2", T) == pytest.approx(0.1 / 4)
    assert b4.step_overhead == pytest.approx(0.1) and b4.ngram_cost == pytest.approx(0.05)
    # plain decoding per row: the batch's one-position step over 4 rows, divided among them
    assert lt.plain_seconds_per_token(b4) == pytest.approx((30 * 1.0 + 3.0 + 0.4) / 4)
    assert cal.costs["layer"] is flat_then_linear and cal.layer_cost(2) == 1.0  # the original is untouched
    alone, full = lt.best_hierarchy(cal), lt.best_hierarchy(cal.at_batch(32))
    assert alone.levels != ("full",) and alone.speedup_vs_plain > 1.3
    assert full.levels == ("full",) and full.speedup_vs_plain == pytest.approx(1.0)
    assert lt.auto_plan(cal.at_batch(32)).seconds_per_token >= lt.plain_seconds_per_token(cal.at_batch(32))
    speedups = [lt.best_hierarchy(cal.at_batch(B)).speedup_vs_plain for B in (1, 2, 4, 8, 16)]
    assert speedups == sorted(speedups, reverse=True)  # the fuller the batch, the less speculation buys


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_program_equals_brute_force_over_all_stacks_and_gammas(seed):
    rnd = random.Random(seed)
    cal = random_calibration(rnd)
    G = 4
    levels = cal.levels  # ngram, L_d, L_v, ngram|L_d, ngram|L_v, full
    assert levels[-3:-1] == [lt.LOOKUP + lv for lv in levels[1:3]]
    brute = []
    for r in range(len(levels)):
        for below in itertools.combinations(levels[:-1], r):
            stack = list(below) + ["full"]
            if any(s.startswith(lt.LOOKUP) for s in stack[1:]) or len({cal.depth(s) for s in stack}) < len(stack):
                continue  # (a lookup-first level only at the bottom; strictly deeper levels)
            stack.sort(key=cal.depth)
            for gs in itertools.product(range(1, G + 1), repeat=len(stack) - 1):
                brute.append((lt.time_per_token(stack, list(gs), cal), stack, gs))
    t, stack, gs = min(brute, key=lambda x: x[0])
    choice = lt.best_hierarchy(cal, max_gamma=G)
    assert choice.seconds_per_token == pytest.approx(t, rel=1e-12)
    assert lt.time_per_token(choice.levels, choice.gammas, cal) == pytest.approx(t, rel=1e-12)
    assert choice.seconds_per_token <= lt.time_per_token(["full"], [], cal)
    # best_gammas for a fixed list, with 0 = skip, against every gamma vector in 0..G
    fixed = [lv for lv in levels if not lv.startswith("ngram")]
    want = min(lt.time_per_token(fixed, list(gs), cal) for gs in itertools.product(range(G + 1), repeat=2))
    got = lt.best_gammas(fixed, cal, {}, max_gamma=G)
    assert lt.time_per_token(fixed, got, cal) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_best_gammas_margin_speculates_only_for_a_clear_predicted_gain(seed):
    cal = random_calibration(random.Random(seed))
    fixed = [lv for lv in cal.levels if not lv.startswith("ngram")]
    plain = lt.time_per_token(["full"], [], cal)
    free = lt.best_gammas(fixed, cal, {}, max_gamma=4)
    t = lt.time_per_token(fixed, free, cal)
    for margin in (0.0, 0.05, 0.3):
        got = lt.best_gammas(fixed, cal, {}, max_gamma=4, margin=margin)
        if t < plain * (1 - margin) * (1 - 1e-9):
            assert got == free  # a clear gain: the margin changes nothing
        else:
            assert got == [0, 0]  # plain decoding
    with pytest.raises(ValueError, match="margin"):
        lt.best_gammas(fixed, cal, {}, margin=1.0)


def test_best_gammas_is_memoised_on_rounded_acceptances():
    cal = synthetic()
    a = lt.best_gammas(["L2", "L5", "full"], cal, {"L2>L5": 0.801, "L5>full": 0.9})
    n = len(cal._memo["best_gammas"])
    assert lt.best_gammas(["L2", "L5", "full"], cal, {"L2>L5": 0.799, "L5>full": 0.9}) == a
    assert len(cal._memo["best_gammas"]) == n


# ---------------------------------------------------------------------------------------------- calibration
def test_ngram_rounds_follow_the_decoder_and_count_a_copied_span_once():
    from hispec.drafters.ngram import NgramConfig

    prompt, answer = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9, 9]
    tokens = torch.tensor(prompt + answer)
    # round 1 (after answer[0] = 1): "1" occurred at 0 -> proposes 2 3 4 5 6 1: five accepted, then 1 != 9 rejected;
    # round 2 (after ... 6 9): "9" never occurred -> no proposal, the verifier's own token; then the answer ends
    assert lt.ngram_rounds(tokens, 6, answer, answer[1:], NgramConfig()) == (5, 6, 1, 2, 1)
    # a verifier that disagrees from the start: every proposal is rejected at once, rounds advance one token each
    other = [0] * 7
    acc, proposed, rej, rounds, matched = lt.ngram_rounds(tokens, 6, answer, other, NgramConfig())
    assert acc == 0 and rej == matched and rounds == 7



@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 2, 4, "linear")
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 97, (6,), generator=g).tolist()
    prompts = [base * 3, torch.randint(3, 97, (14,), generator=g).tolist()]  # one repetitive: the n-gram matches
    # module-scoped, so it runs before conftest's per-test one-thread fixture: pin the threads here, as CI's
    # two idle cores would otherwise be recorded (cal.threads is what torch had while calibrating)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            cal = lt.calibrate(model, prompts, max_new_tokens=16, repeats=2)
    finally:
        torch.set_num_threads(threads)
    return model, cal


def test_calibrate_on_a_tiny_model_returns_sane_numbers(tiny):
    model, cal = tiny
    assert cal.levels == ["ngram", "L2", "L4", "ngram|L2", "ngram|L4", "full"]
    assert set(cal.acceptance) == {"ngram>L2", "ngram>L4", "ngram>full", "L2>L4", "L2>full", "L4>full"}
    assert all(0.0 <= a <= 1.0 for a in cal.acceptance.values())
    assert 0.0 <= cal.ngram_match <= 1.0 and cal.positions == 2 * 15
    assert all(t > 0 for t in cal.costs["layer"].values())
    assert set(cal.costs["layer"]) == set(range(1, 10)) | set(lt.TREE_ROWS)  # chains' pass sizes and the trees'
    for lv in ("L2", "L4"):  # top-k agreement for tree drafts: r(1) is the top-1 agreement, non-decreasing in k
        r = cal.topk[f"{lv}>full"]
        assert len(r) == lt.MAX_TREE_WIDTH and r[0] == pytest.approx(cal.acceptance[f"{lv}>full"])
        assert all(a <= b for a, b in zip(r, r[1:])) and 0.0 <= r[0] and r[-1] <= 1.0
    assert all(t > 0 for h in cal.costs["head"].values() for t in h.values())
    assert all(t > 0 for t in cal.costs["final"].values())
    assert cal.costs["ngram"] > 0 and cal.costs["step_overhead"] >= 0 and cal.costs["layer_scale"] > 0
    assert cal.costs["tree_overhead"] >= 0 and cal.costs["position_overhead"] >= 0
    assert cal.acceptance["ngram>full"] > 0 and cal.ngram_match > 0  # the repetitive prompt
    assert cal.measured["ar"] > 0 and cal.context > 0 and cal.threads == 1
    assert cal.model["exits"] == {"draft": 2, "verify": 4} and cal.dtype == "float32"
    choice = lt.best_hierarchy(cal)
    assert choice.speedup_vs_plain >= 1.0
    cal.check(model)  # its own model, this machine


def test_calibrate_keeps_the_ngram_config_auto_is_predicted_fastest_with(tiny):
    """Without a config, every candidate is measured on the same answers; the kept one is the argmin of auto's
    predicted time, and the calibration's n-gram figures are that config's own."""
    model, cal = tiny
    opts = cal.ngram_options
    assert [o["config"] for o in opts] == [dataclasses.asdict(c) for c in lt.NGRAM_CANDIDATES]
    for o in opts:  # each option's time is auto's plan under that option's figures
        alt = dataclasses.replace(cal, ngram=o["config"], ngram_match=o["match"],
                                  acceptance={**cal.acceptance, **o["acceptance"]}, ngram_options=None)
        assert lt.auto_plan(alt).seconds_per_token == pytest.approx(o["seconds_per_token"])
        assert set(o["acceptance"]) == {"ngram>L2", "ngram>L4", "ngram>full"}
    best = min(opts, key=lambda o: o["seconds_per_token"])
    assert cal.ngram == best["config"] and cal.ngram_match == best["match"]
    assert all(cal.acceptance[k] == v for k, v in best["acceptance"].items())
    assert len({o["match"] for o in opts}) > 1  # each was measured with its own config
    assert max(o["match"] for o in opts) > 0  # the repetitive prompt
    text = lt.format_predictions(cal, lt.predictions(cal))
    assert "chosen by auto's predicted speedup" in text


def test_calibrate_measures_only_a_given_or_checkpoint_ngram_config(tiny):
    model, _ = tiny
    given = hispec.NgramConfig(max_ngram=2, min_ngram=2, max_len=3)
    cal = lt.calibrate(model, [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=6, repeats=1, ngram=given)
    assert cal.ngram == dataclasses.asdict(given) and cal.ngram_options is None
    model.hispec_config.ngram = {"max_ngram": 4, "min_ngram": 2, "max_len": 5}
    try:
        cal = lt.calibrate(model, [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=6, repeats=1)
    finally:
        model.hispec_config.ngram = {}
    assert cal.ngram == {"max_ngram": 4, "min_ngram": 2, "max_len": 5} and cal.ngram_options is None


def test_decoding_runs_the_ngram_config_the_calibration_chose(tiny, monkeypatch):
    """An explicit config wins, then the checkpoint's `decoding.ngram`, then the calibration's, then defaults;
    `generate` proposes with it."""
    from hispec import decoding
    from hispec.decoding import rounds

    model, cal = tiny
    chosen = {"max_ngram": 3, "min_ngram": 2, "max_len": 4}
    seen = []
    propose = rounds.propose_batch
    monkeypatch.setattr(rounds, "propose_batch", lambda *a: seen.append(a[-1]) or propose(*a))
    old = model.hispec_config.calibration
    try:
        model.hispec_config.calibration = None
        assert decoding.ngram_config(model) == hispec.NgramConfig()
        model.hispec_config.calibration = dataclasses.replace(cal, ngram=chosen).to_dict()
        assert decoding.ngram_config(model) == hispec.NgramConfig(**chosen)
        ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]])
        out = model.generate(ids, max_new_tokens=12, strategy="ngram")
        assert seen and set(seen) == {hispec.NgramConfig(**chosen)}
        assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=12, strategy="ar").sequences)  # lossless
        assert decoding.ngram_config(model, {"min_ngram": 1}) == hispec.NgramConfig(min_ngram=1)
        model.hispec_config.ngram = {"max_ngram": 2}
        assert decoding.ngram_config(model) == hispec.NgramConfig(max_ngram=2)
    finally:
        model.hispec_config.calibration, model.hispec_config.ngram = old, {}


def test_calibration_round_trips_through_json_and_the_checkpoint(tiny, tmp_path):
    model, cal = tiny
    d = json.loads(json.dumps(cal.to_dict()))
    assert set(d["costs"]["layer"]) == {str(t) for t in (*range(1, 10), *lt.TREE_ROWS)}  # int keys became strings
    back = lt.Calibration.from_dict(d)
    assert back == cal
    assert lt.time_per_token(["L2", "L4", "full"], [2, 3], back) == lt.time_per_token(["L2", "L4", "full"], [2, 3], cal)
    assert lt.tree_time_per_token([4, 2, 1], back) == lt.tree_time_per_token([4, 2, 1], cal)
    folder = model.save(tmp_path / "ck")
    lt.write_calibration(folder, cal)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".config.json")]  # no temporary file left
    config = json.loads((folder / "config.json").read_text())
    assert config["hispec"]["calibration"]["acceptance"] == cal.acceptance
    assert lt.read_calibration(config) == cal and lt.read_calibration(folder) == cal
    assert lt.read_calibration(config["hispec"]) == cal
    lt.write_calibration(folder, None)
    assert lt.read_calibration(folder) is None
    with pytest.raises(lt.CalibrationError, match="malformed"):
        lt.Calibration.from_dict({"costs": {}})


def test_check_refuses_a_calibration_of_another_model(tiny):
    _, cal = tiny
    other = hispec.EarlyExitModel.from_base(tiny_model("llama"), 1, 3, "linear")  # the same base, other exits
    with pytest.raises(lt.CalibrationError, match=r"another model.*exits"):
        cal.check(other)
    import transformers
    from tiny import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = 8
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    eight = hispec.EarlyExitModel.from_base(base, 2, 4, "linear")
    with pytest.raises(lt.CalibrationError, match=r"another model.*num_layers: calibrated 6, model has 8"):
        cal.check(eight, machine=False)


def test_check_refuses_a_calibration_from_another_machine(tiny, monkeypatch):
    model, cal = tiny
    other = lt.Calibration.from_dict({**cal.to_dict(), "machine": {**cal.machine, "cpu": "Imaginary CPU 9000"}})
    with pytest.raises(lt.CalibrationError, match=r"another machine.*Imaginary CPU 9000"):
        other.check(model)
    other.check(model, machine=False)  # the model itself still fits
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NO_AVX")
    with pytest.raises(lt.CalibrationError, match="cpu_capability"):
        cal.check(model)


def test_predictions_table_names_every_candidate_hierarchy(tiny):
    _, cal = tiny
    rows = lt.predictions(cal, fixed={"hispec (checkpoint defaults)": (["L2", "L4", "full"], [2, 4])})
    names = [r["name"] for r in rows]
    assert names[:8] == ["ar", "self-spec", "hispec", "ngram", "ngram>L_d", "self-spec-lookup", "hispec-lookup",
                         "hispec (checkpoint defaults)"]
    assert names[8].startswith("tree ") and rows[8]["tree"] and names[9:] == ["best"]  # the best static tree
    assert rows[0]["speedup_vs_plain"] == pytest.approx(1.0) and rows[-1]["speedup_vs_plain"] >= 1.0
    text = lt.format_predictions(cal, rows)
    assert "L2>L4>full" in text and cal.machine["cpu"] in text


# ---------------------------------------------------------------------------------------------- tree drafts
def with_topk(cal: lt.Calibration, rates: dict) -> lt.Calibration:
    return lt.Calibration(**{**{f: getattr(cal, f) for f in ("machine", "dtype", "threads", "model", "costs",
                                                            "acceptance", "ngram_match")}, "topk": rates})


def test_tree_expected_tokens_matches_a_hand_computation():
    rates = [0.3, 0.5, 0.6]
    assert lt.tree_expected_tokens([2, 1], rates) == pytest.approx(1 + 0.5 + 0.5 * 0.3)
    assert lt.tree_expected_tokens([4, 3], rates) == pytest.approx(1 + 0.6 + 0.6 * 0.6)  # k > measured: r(3)
    assert lt.tree_expected_tokens([1, 1, 1], [0.5]) == pytest.approx(lt.expected_tokens(0.5, 3))


def test_tree_round_matches_a_hand_computation():
    # L=10, draft exit 2; layer(T) = 1 + 0.2 (T-1), head_L2(T) = 0.3 + 0.05 (T-1), final(T) = 2 + 0.1 (T-1), o = 0.1
    cal = with_topk(synthetic(), {"L2>full": [0.4, 0.6]})
    layer = lambda T: 1 + 0.2 * (T - 1)  # noqa: E731
    head = lambda T: 0.3 + 0.05 * (T - 1)  # noqa: E731
    final = lambda T: 2 + 0.1 * (T - 1)  # noqa: E731
    # tree [2, 2]: depth 1 from the pending position, depth 2 from 2 nodes, leaves (4 nodes), verify 1 + 6 positions
    R = (2 * layer(1) + head(1) + 0.1) + (2 * layer(2) + head(2) + 0.1) + 2 * layer(4) + 8 * layer(7) + final(7) + 0.1
    assert lt.tree_round_seconds([2, 2], cal, "L2") == pytest.approx(R)
    assert lt.tree_time_per_token([2, 2], cal) == pytest.approx(R / (1 + 0.6 + 0.36))
    # a real round's own extra (fitted by calibrate on real rounds of a probe tree), once per round
    over = dataclasses.replace(cal, costs={**cal.costs, "tree_overhead": 0.7})
    assert lt.tree_round_seconds([2, 2], over, "L2") == pytest.approx(R + 0.7)
    assert over.at_batch(2).tree_overhead == pytest.approx(0.35)
    assert lt.Calibration.from_dict(over.to_dict()).tree_overhead == 0.7
    from hispec.latency.measure import fit_tree_overhead
    # runs: (level-0 s/pass, entries/pass, verify s/pass, positions/verification, level-0 passes/verification,
    # new tokens/verification)
    runs = [(1.0, 1.0, 10.0, 5.0, 2.0, 2.0), (1.5, 1.0, 11.0, 5.0, 2.0, 3.0), (0.5, 1.0, 9.0, 5.0, 2.0, 1.0)]
    assert fit_tree_overhead(runs, rounds=11.0) == pytest.approx(1.0)  # median of 1, 3, 0 (clipped)
    assert fit_tree_overhead([], rounds=1.0) == 0.0
    # a drafter's tree: its first pass also took in the tokens verified the round before (here 0.25 each)
    assert fit_tree_overhead(runs, rounds=11.0, context=lambda tokens: 0.25 * (tokens - 1)) == pytest.approx(0.75)
    # every pass over T positions pays position_overhead T - 1 times (a tree's verification: N times)
    pos = dataclasses.replace(cal, costs={**cal.costs, "position_overhead": 0.25})
    assert lt.tree_round_seconds([2, 2], pos, "L2") == pytest.approx(R + 0.25 * 6)
    assert (lt.time_per_token(["L2", "full"], [3], pos) - lt.time_per_token(["L2", "full"], [3], cal)
            == pytest.approx(0.25 * 3 / lt.expected_tokens(cal.acceptance["L2>full"], 3)))
    assert lt.Calibration.from_dict(pos.to_dict()).position_overhead == 0.25
    from hispec.latency.measure import fit_position_overhead
    runs = [(0.1, 0.0, 14.0, 3.0, 1.0), (0.1, 0.0, 12.0, 2.0, 1.0), (0.1, 0.0, 11.0, 1.0, 1.0)]  # (p = 1: skipped)
    got = fit_position_overhead(runs, verify=lambda p: 10.0 + 0.5 * (p - 1), o=0.5)
    assert got == pytest.approx(min((14 - 11 - 0.5) / 2, (12 - 10.5 - 0.5) / 1))  # (noise only adds time)
    assert fit_position_overhead(runs[2:], verify=lambda p: 10.0, o=0.0) == 0.0
    # each run priced at its prompt's context: a prompt whose plain step is 1.2x the median one pays 1.2x the units
    long = [(0.1, 0.0, 13.5, 2.0, 1.0), (0.1, 0.0, 12.0, 2.0, 1.0)]
    assert fit_position_overhead(long, verify=lambda p: 10.0, o=0.0) == pytest.approx(2.0)
    assert fit_position_overhead(long, verify=lambda p: 10.0, o=0.0, scale=[1.3, 1.2]) == pytest.approx(0.0)


def test_lookup_first_tree_matches_a_hand_computation_the_chain_and_its_limits():
    cal = dataclasses.replace(
        with_topk(synthetic(acceptance={"L2>full": 0.4, "ngram>full": 0.7}, match=0.4, ngram=0.05),
                  {"L2>full": [0.4, 0.6]}),
        ngram={"max_ngram": 3, "min_ngram": 1, "max_len": 4})
    R = lt.tree_round_seconds([2, 2], cal, "L2")  # checked by hand above
    E_tree, E_n = 1 + 0.6 + 0.36, (1 - 0.7 ** 5) / 0.3
    served = 0.1 + 10 * 1.8 + 2.4  # the lookup's 4 tokens: every layer over 5 rows, then the final norm + lm_head
    want = (0.05 + 0.4 * served + 0.6 * R) / (0.4 * E_n + 0.6 * E_tree)  # one lookup per round
    assert lt.tree_time_per_token([2, 2], cal, lookup=True) == pytest.approx(want)
    # a one-node tree is the lookup-first chain of gamma 1
    assert lt.tree_time_per_token([1], cal, lookup=True) == pytest.approx(
        lt.time_per_token(["ngram|L2", "full"], [1], cal))
    # never matching: the tree plus the wasted lookup; always matching: the n-gram level
    assert lt.tree_time_per_token([2, 2], cal, match=0.0, lookup=True) == pytest.approx(
        lt.tree_time_per_token([2, 2], cal) + 0.05 / E_tree)
    assert lt.tree_time_per_token([2, 2], cal, match=1.0, lookup=True) == pytest.approx(
        lt.time_per_token(["ngram", "full"], [4], cal, ngram_match=1.0))
    assert lt.tree_time_per_token([2, 2], cal, acceptance={"ngram>full": 0.9}, lookup=True) < want


@pytest.mark.parametrize("seed", range(5))
def test_a_tree_of_width_one_is_the_chain(seed):
    rnd = random.Random(seed)
    base = random_calibration(rnd)
    d = f"L{base.model['exits']['draft']}"
    cal = with_topk(base, {f"{d}>full": [base.acceptance[f"{d}>full"], 0.9]})
    for g in range(1, 6):
        assert lt.tree_time_per_token([1] * g, cal) == pytest.approx(lt.time_per_token([d, "full"], [g], cal))


def test_best_tree_is_the_fastest_shape_within_its_budget():
    cal = with_topk(synthetic(), {"L2>full": [0.3, 0.45, 0.55, 0.6, 0.63, 0.65, 0.66, 0.67]})
    widths, t = lt.best_tree(cal, max_nodes=24)
    assert sum(math.prod(widths[:i + 1]) for i in range(len(widths))) <= 24
    assert all(a >= b for a, b in zip(widths, widths[1:]))
    assert t == pytest.approx(lt.tree_time_per_token(widths, cal))
    shapes = [list(w) for D in range(1, 5) for w in itertools.product(range(1, 9), repeat=D)
              if list(w) == sorted(w, reverse=True) and sum(math.prod(w[:i + 1]) for i in range(D)) <= 24]
    assert t <= min(lt.tree_time_per_token(w, cal) for w in shapes) + 1e-12  # brute force, same space
    assert lt.best_tree(cal, max_nodes=24) == (widths, t)  # memoised
    lw, lt_ = lt.best_tree(cal, max_nodes=24, lookup=True)  # the lookup-first exit drafting it: its own optimum
    assert lt_ == pytest.approx(min(lt.tree_time_per_token(w, cal, lookup=True) for w in shapes))
    assert lt_ == pytest.approx(lt.tree_time_per_token(lw, cal, lookup=True))


def test_scaled_topk_moves_the_rates_to_a_rows_top1():
    assert lt.scaled_topk([0.4, 0.6, 0.8], 0.2) == pytest.approx([0.2, 0.3, 0.4])
    assert lt.scaled_topk([0.4, 0.6, 0.8], 0.8) == pytest.approx([0.8, 1.0, 1.0])  # clipped
    assert lt.scaled_topk([0.4, 0.6], 0.0) == [0.0, 0.0]
    assert lt.scaled_topk([0.0, 0.5], 0.3) == [0.0, 0.5]  # no calibrated top-1: unchanged


def test_trees_need_a_calibration_with_topk_rates_and_valid_widths():
    cal = synthetic()
    with pytest.raises(lt.CalibrationError, match="recalibrate"):
        lt.tree_time_per_token([4, 2, 1], cal)
    cal = with_topk(cal, {"L2>full": [0.3]})
    for bad in ([], [0, 2], [2.5], [True]):
        with pytest.raises(ValueError, match="widths"):
            lt.tree_time_per_token(bad, cal)
    with pytest.raises(ValueError, match="exit level"):
        lt.tree_time_per_token([2], cal, level="full")
    rows = lt.predictions(cal)
    tree = [r for r in rows if r["name"].startswith("tree ")]
    assert len(tree) == 1 and tree[0]["levels"] == ["L2", "full"] and rows[-1]["name"] == "best"
