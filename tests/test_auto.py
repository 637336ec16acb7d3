"""`strategy="auto"`: the latency-optimal hierarchy from the checkpoint's calibration, adapted per row while decoding.
Whatever it chooses, output is plain decoding's: greedy identical, sampling in distribution."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch
from test_decoding import _chi2_pvalue, _draw, _exact_joint, _hf_greedy, _oracle, _ragged, _tiny_vocab_model, _wrap
from tiny import FAMILIES, tiny_model

from hispec import NgramConfig, decoding, latency


def _calibrated(model, acceptance=None, match=None, prompts=([5, 6, 7, 8, 9, 5, 6],), realistic=False):
    cal = latency.calibrate(model, list(prompts), max_new_tokens=8, repeats=1, max_gamma=4, ngram=NgramConfig())
    if realistic:  # tiny models are all Python overhead; give them the cost shape of a real one (ms), one whose
        # batched passes stay nearly free far beyond the measured rows (as on a GPU), so that the big batches the
        # distribution tests decode in one call still speculate (`Calibration.at_batch`)
        Ts = list(cal.costs["layer"]) + [1 << 24]
        cal = dataclasses.replace(cal, costs={
            "layer": {T: 1e-3 * (1 + 0.02 * min(int(T), 32)) for T in Ts},
            "head": {lv: {T: 2e-4 for T in Ts} for lv in cal.costs["head"]},
            "final": {T: 2e-3 for T in Ts}, "ngram": 1e-7, "step_overhead": 2e-4})
    if acceptance is not None:
        cal = dataclasses.replace(cal, acceptance={k: acceptance(k) for k in cal.acceptance})
    if match is not None:
        cal = dataclasses.replace(cal, ngram_match=match)
    model.hispec_config.calibration = cal.to_dict()
    return cal


PRIORS = {"measured": (None, None), "all-accept": (lambda k: 0.95, 0.95), "none-accept": (lambda k: 0.0, 0.0)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_is_greedy_identical_for_every_family(family):
    model = _wrap(tiny_model(family), head_type="linear")
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    for name, (acc, match) in PRIORS.items():
        _calibrated(model, acc, match)
        out = model.generate(ids, am, max_new_tokens=17, strategy="auto")
        assert torch.equal(out.sequences, ref), name
        assert out.stats.strategy.startswith("auto:") and out.stats.row_rounds > 0
    for lookup in (False, True):  # priors under which auto drafts trees (the exit's own, or lookup-first)
        cal = _tree_priors(model, lookup)  # (auto plans at the batch's costs)
        levels, tree, _ = decoding._auto_plan(model, cal.at_batch(len(ids)), gamma=1, window=1, ngram=NgramConfig())
        assert tree is not None and max(tree.widths) > 1
        out = model.generate(ids, am, max_new_tokens=17, strategy="auto")
        assert torch.equal(out.sequences, ref), lookup
        want = ("auto:ngram|L2>full[tree " if lookup else "auto:L2>full[tree ") + str(tree)
        assert out.stats.strategy == want + "]" and out.stats.row_rounds > 0
        assert out.stats.levels[1].proposed > 0  # rows drafted trees


@pytest.mark.parametrize("priors", ["flat", "lookup-first"])
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "warped"])
def test_auto_sampling_matches_the_exact_distribution(warp, priors):
    model = _tiny_vocab_model()
    if priors == "flat":
        _calibrated(model, lambda k: 0.6, 0.6, prompts=([1, 3, 2],))
    else:  # priors under which auto runs the lookup-first exit (its two drafters' rows: point masses and q)
        cal = _calibrated(model, lambda k: {"L1>full": 0.9, "ngram>full": 0.7}.get(k, 0.0), 0.5, prompts=([1, 3, 2],),
                          realistic=True)
        chain = decoding._auto_chain(model, cal, gamma=1, window=1, ngram=NgramConfig())
        assert [lv.name for lv in chain] == ["ngram|L1", "full"]
    prompt, n = [1, 3, 2], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples = _draw(model, prompt, n, warp, "auto", draws=6000, seed=11)
    assert _chi2_pvalue(samples, outcomes, probs) > 1e-4


def _spy_choices(monkeypatch, current):
    """Record, per round, every row's draft gamma as auto set it ({original row: [gammas]}); `current["run"]` is
    the run in progress."""
    rounds: dict[int, list[int]] = {}
    choose = decoding._AutoPolicy.choose

    def spy(self, run):
        current["run"] = run
        choose(self, run)
        for b, row in enumerate(run.orig.tolist()):
            rounds.setdefault(row, []).append(int(run.gam[0][b]))

    monkeypatch.setattr(decoding._AutoPolicy, "choose", spy)
    return rounds


def _auto_greedy_with(monkeypatch, model, exit_logits, *, rows: int, new: int):
    """Greedy `auto` on `rows` ragged prompts with `exit_logits` in place of the model's: (output, per-row choices
    from `_spy_choices`), after checking the output equals plain greedy decoding."""
    model.exit_logits = exit_logits
    rounds = _spy_choices(monkeypatch, {})
    ids, am = _ragged(rows, 7)
    ref = _hf_greedy(model.base, ids, am, new)
    out = model.generate(ids, am, max_new_tokens=new, strategy="auto")
    assert torch.equal(out.sequences, ref)
    return out, rounds


def _flip_exit_logits(model, current, bad):
    """Exit heads that agree with the model (the model is an oracle from layer 2 on) except for original rows
    where `bad(row)` (the exit heads are always called on the run's whole batch)."""
    orig = model.exit_logits

    def patched(name, hidden, *a, **kw):
        out = orig(name, hidden, *a, **kw)
        rows = torch.tensor([bad(int(r)) for r in current["run"].orig])
        return torch.where(rows.view(-1, *[1] * (out.dim() - 1)), -out, out)

    model.exit_logits = patched


def _tree_priors(model, lookup: bool, top1=0.3, prompts=([5, 6, 7, 8, 9, 5, 6],)):
    """Priors under which a wide depth-1 tree beats every chain: the exit's top-1 rarely agrees, its top-4 nearly
    always; with `lookup` the n-gram pays too (the lookup-first exit drafts the tree)."""
    exit_level = f"L{model.hispec_config.layer_of('draft')}"
    rates = {f"{exit_level}>full": top1, "ngram>full": 0.6 if lookup else 0.0}
    cal = _calibrated(model, lambda k: rates.get(k, 0.0), 0.5 if lookup else 0.0, prompts=prompts, realistic=True)
    topk = {k: [top1, 0.7, 0.85, 0.95] + [0.95] * 4 if k == f"{exit_level}>full" else [0.0] * 8 for k in cal.topk}
    cal = dataclasses.replace(cal, topk=topk)
    model.hispec_config.calibration = cal.to_dict()
    return cal


def _self_spec_only(k):  # priors that make L2 > full the chosen chain (no n-gram, no intermediate exit)
    return 0.8 if k == "L2>full" else 0.0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_rows_with_wildly_different_acceptance_adapt_separately_in_one_batch(monkeypatch, tree):
    """Rows whose exit is always wrong go plain; rows whose exit is right speculate (chains: long gammas; trees: the
    tree, while a plain row gets the model's own token from the tree pass); output is plain decoding's either way.
    Rows priced as a server's (each returns when done): where the call waits for its slowest row (`generate`)
    the plain rows set its length, and one chain round for the batch is plain (the next test)."""
    monkeypatch.setattr(decoding._AutoPolicy, "together", False)
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    if tree:
        _tree_priors(model, lookup=False, top1=0.5)
    else:
        _calibrated(model, _self_spec_only, 0.0, realistic=True)
    good, bad = {0, 2}, {1, 3}
    current = {}
    rounds = _spy_choices(monkeypatch, current)
    _flip_exit_logits(model, current, lambda row: row in bad)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 40)
    out = model.generate(ids, am, max_new_tokens=40, strategy="auto")
    assert torch.equal(out.sequences, ref)
    assert out.stats.strategy.startswith("auto:L2>full[tree ") if tree else out.stats.strategy == "auto:L2>full"
    for b in good:
        late = rounds[b][1:] if tree else rounds[b][2:]
        assert all(g >= (1 if tree else 2) for g in late), f"row {b} (every draft right) should speculate: {rounds[b]}"
    for b in bad:
        late = rounds[b][len(rounds[b]) // 3:]
        assert late and all(g == 0 for g in late), f"row {b} (every draft wrong) should decode plainly: {rounds[b]}"
    assert len(rounds[1]) > 2 * len(rounds[0])  # plain rows need a round per token
    assert 0 < out.stats.plain_row_rounds < out.stats.row_rounds


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_full_batch_decodes_plainly_where_its_pass_is_compute_bound(tree):
    """Pass costs flat up to 8 positions, then linear (compute-bound beyond): drafts the model always accepts pay
    for one row, but in a batch of 8 every extra position costs its full share, so `auto` (which prices rows at
    the batch's costs, `Calibration.at_batch`) keeps all 8 rows plain, and the same prompts alone speculate.
    Output is plain decoding's either way."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    cal = _tree_priors(model, lookup=False, top1=0.5) if tree else _calibrated(model, _self_spec_only, 0.0,
                                                                              realistic=True)
    shape = {T: max(1.0, T / 8) for T in cal.costs["layer"]}
    cal = dataclasses.replace(cal, costs={**cal.costs, "layer": {T: 1e-3 * c for T, c in shape.items()},
                                          "final": {T: 2e-3 * c for T, c in shape.items()}})
    model.hispec_config.calibration = cal.to_dict()
    ids, am = _ragged(8, 9)
    ref = _hf_greedy(model.base, ids, am, 24)
    batch = model.generate(ids, am, max_new_tokens=24, strategy="auto")
    assert torch.equal(batch.sequences, ref)
    assert batch.stats.row_rounds > 0 and batch.stats.plain_row_rounds == batch.stats.row_rounds
    for b in (0, 5):
        keep = am[b].bool()
        alone = model.generate(ids[b : b + 1, keep], max_new_tokens=24, strategy="auto")
        assert alone.sequences[0, -24:].tolist() == ref[b, -24:].tolist()
        assert alone.stats.plain_row_rounds < alone.stats.row_rounds / 2, (b, alone.stats.strategy)
        assert alone.stats.tokens_per_target_pass > 1.5


def _lookup_batch_model(match=0.3, rate=0.9):
    """A model whose calibration plans `ngram>full` (the lookup's rate `rate`, its match rate `match`) on a
    machine whose passes are flat up to 8 positions, then compute-bound."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    cal = _calibrated(model, lambda k: rate if k == "ngram>full" else 0.0, match, realistic=True)
    shape = {T: max(1.0, T / 8) for T in cal.costs["layer"]}
    cal = dataclasses.replace(cal, costs={**cal.costs, "layer": {T: 1e-3 * c for T, c in shape.items()},
                                          "final": {T: 2e-3 * c for T, c in shape.items()},
                                          "position_overhead": 1e-5})
    model.hispec_config.calibration = cal.to_dict()
    return model, cal


def _lookup_batch_policy(rows, match=0.3, rate=0.9):
    """`auto`'s policy for `rows` rows of `_lookup_batch_model`, and a run holding only what `choose` reads."""
    model, cal = _lookup_batch_model(match, rate)
    levels, tree, policy = decoding.generation._auto_policy(model, cal, rows, "cpu", gamma=1, window=1,
                                                            ngram=NgramConfig(), max_new_tokens=64, trees=False)
    assert [lv.name for lv in levels] == ["ngram", "full"] and tree is None
    run = types.SimpleNamespace(gam=[torch.zeros(rows, dtype=torch.long)], lookup_only=torch.zeros(rows, dtype=bool),
                                stats=decoding.GenerationStats())
    return policy, run


def _batch_choice(rows, together, match=0.3, rate=0.9) -> list[int]:
    """The gammas `auto` chooses for one round of `_lookup_batch_policy`; `match` may be one per row (as if each
    row had measured it over many rounds)."""
    policy, run = _lookup_batch_policy(rows, match if isinstance(match, float) else 0.5, rate)
    if not isinstance(match, float):
        m = torch.tensor(match, dtype=torch.float64)
        policy.hit, policy.miss = 10 * m, 10 * (1 - m)
    policy.together = together
    policy.choose(run)
    return [int(g) for g in run.gam[0]]


def test_a_batch_whose_rows_each_pay_alone_goes_plain_where_its_widest_pass_does_not(monkeypatch):
    """Four rows whose lookups match 30% of the time and are then right 90% of the time: priced per row at its
    share of a batch pass as wide as its own proposal (`Calibration.at_batch`) each row pays, but one pass verifies
    every row at the widest proposal, paid by the batch whenever any row's lookup matched (76% of rounds), and
    that round costs more per token than a plain one: `auto` chooses a plain round for the batch (`_batch_pays`),
    whether its rows return together (`generate`) or each when done (a server). The per-row rule alone
    speculates."""
    for together in (True, False):
        gam = _batch_choice(4, together)
        assert not any(gam), together
    monkeypatch.setattr(decoding._AutoPolicy, "_batch_pays", lambda self, *a: True)  # the per-row rule alone
    assert all(_batch_choice(4, True))


def test_a_batch_that_returns_together_values_tokens_at_a_rows_share_and_its_slowest_row():
    """On this machine a pass costs the same for 1 to 8 positions: one row less saves nothing, so where the rows
    return together (`generate`) a round is worth as many tokens as its slowest row expects. Two rows whose lookups
    match 90% of the time (one token proposed: 1.81 expected) and two matching 50% (three proposed: 2.22) pay
    for their 4 x 4-position pass (2x a plain one) where each row returns when done (a server: 8.06 tokens, more
    than two plain rounds' 8), not where the call waits for its slowest row (1.81 rounds' worth); four rows that
    each expect 2.2 tokens from a 4 x 3-position pass (1.5x) pay in both."""
    rows = [0.9, 0.9, 0.5, 0.5]
    assert all(_batch_choice(4, False, match=rows)) and not any(_batch_choice(4, True, match=rows))
    assert all(_batch_choice(4, True, match=0.7)) and all(_batch_choice(4, False, match=0.7))


def test_a_batch_priced_by_its_round_decodes_identically_and_speculates_less_than_its_rows_alone(monkeypatch):
    """Decoding the batch above: output is plain decoding's, and the batch's rounds are plain more often than the
    per-row rule alone makes them (rows whose own text repeats may still make a wide pass pay)."""
    model, _ = _lookup_batch_model()
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 16)
    out = model.generate(ids, am, max_new_tokens=16, strategy="auto")
    assert torch.equal(out.sequences, ref)
    monkeypatch.setattr(decoding._AutoPolicy, "_batch_pays", lambda self, *a: True)  # the per-row rule alone
    alone = model.generate(ids, am, max_new_tokens=16, strategy="auto")
    assert torch.equal(alone.sequences, ref)
    share = [o.stats.plain_row_rounds / o.stats.row_rounds for o in (out, alone)]
    assert share[0] > share[1] + 0.2, share


def _cost_clock(monkeypatch, model, cost):
    """Time as a cost model: every decoder-layer call adds `cost(rows, positions)`; `auto`'s guard reads it as its
    clock. Returns the running total (a one-element list)."""
    spent = [0.0]

    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        spent[0] += cost(h.shape[0], h.shape[1])

    for layer in model.base.model.layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: spent[0]))
    return spent


def _cost_per_token(model, spent, ids, am, strategy, new):
    start = spent[0]
    out = model.generate(ids, am, max_new_tokens=new, strategy=strategy)
    return out, (spent[0] - start) / out.stats.new_tokens


def _guarded_model(tree):
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    if tree:
        _tree_priors(model, lookup=False, top1=0.5)
    else:
        _calibrated(model, _self_spec_only, 0.0, realistic=True)
    return model


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_guard_decodes_plainly_where_measured_speculation_loses(monkeypatch, tree, rows):
    """A machine where any pass over more than one position per row costs 4x a position of a one-position pass
    (what the calibration did not see): drafts the model always accepts, which the rule is sure pay, cost more
    per token than plain decoding. Timed by that cost model, the guard speculates only in its warm-up and its scheduled
    explorations, which keeps `auto` within 20% of `ar` over 96 tokens with chains (warm-up included) and well
    below the rule alone, which is over 1.5x dearer than `ar`; output is plain decoding's either way."""
    model = _guarded_model(tree)
    spent = _cost_clock(monkeypatch, model, lambda B, T: B * (1.0 if T == 1 else 4.0 * T))
    ids, am = _ragged(rows, 9)
    ref = _hf_greedy(model.base, ids, am, 96)
    _, ar = _cost_per_token(model, spent, ids, am, "ar", 96)
    out, guarded = _cost_per_token(model, spent, ids, am, "auto", 96)
    assert torch.equal(out.sequences, ref)
    assert out.stats.guarded_rounds > 0 and out.stats.plain_row_rounds > 0.8 * out.stats.row_rounds
    spec_rounds = (out.stats.row_rounds - out.stats.plain_row_rounds) / rows
    assert spec_rounds <= decoding._PlainGuard.WARM + 3, spec_rounds  # setup + warm-up, then exploration only
    monkeypatch.setattr(decoding._PlainGuard, "begin", lambda self, run: None)  # the rule alone
    alone, unguarded = _cost_per_token(model, spent, ids, am, "auto", 96)
    assert torch.equal(alone.sequences, ref)
    assert alone.stats.guarded_rounds == 0 and alone.stats.plain_row_rounds < alone.stats.row_rounds / 2
    assert unguarded > 1.5 * ar, (unguarded, ar)
    # a 17-node tree round costs ~20 plain rounds here, so the warm-up weighs on 96 tokens; a chain's does not
    assert guarded < (1.2 * ar if not tree else 0.25 * unguarded), (guarded, ar, unguarded)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_guard_keeps_speculating_where_it_pays(monkeypatch, tree):
    """Passes cost the same at any width (weight-bound, like a GPU): the same drafts pay, the guard measures plain
    rounds only on schedule (once after its warm-up, then one per EXPLORE plain rounds' time) and `auto` stays well
    below `ar`'s cost per token."""
    model = _guarded_model(tree)
    spent = _cost_clock(monkeypatch, model, lambda B, T: 1.0)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 48)
    _, ar = _cost_per_token(model, spent, ids, am, "ar", 48)
    out, cost = _cost_per_token(model, spent, ids, am, "auto", 48)
    assert torch.equal(out.sequences, ref)
    assert out.stats.guarded_rounds >= 1 and out.stats.plain_row_rounds < 0.4 * out.stats.row_rounds
    assert cost < 0.7 * ar, (cost, ar)


def test_a_batch_chosen_plain_chooses_again_every_few_rounds(monkeypatch):
    """A compute-bound batch (passes cost their positions past 4) under drafts the model always accepts: every
    row of 4 is chosen plain at the batch's prices, so the policy chooses again only every REDECIDE_PLAIN-th
    round (the choice per row is most of its own cost there); one row alone speculates and chooses every round.
    Output is plain decoding's either way."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    cal = _calibrated(model, _self_spec_only, 0.0, realistic=True)
    shape = {T: max(1.0, T / 4) for T in cal.costs["layer"]}
    cal = dataclasses.replace(cal, costs={**cal.costs, "layer": {T: 1e-3 * c for T, c in shape.items()},
                                          "final": {T: 2e-3 * c for T, c in shape.items()}})
    model.hispec_config.calibration = cal.to_dict()
    calls = []
    chain = decoding._AutoPolicy._choose_chain
    monkeypatch.setattr(decoding._AutoPolicy, "_choose_chain", lambda self, *a: calls.append(1) or chain(self, *a))
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 30)
    out = model.generate(ids, am, max_new_tokens=30, strategy="auto")
    assert torch.equal(out.sequences, ref)
    rounds = out.stats.row_rounds // 4
    assert out.stats.plain_row_rounds == out.stats.row_rounds and rounds >= 20
    assert len(calls) == -(-rounds // decoding._AutoPolicy.REDECIDE_PLAIN), (len(calls), rounds)
    calls.clear()
    alone = model.generate(ids[:1], am[:1], max_new_tokens=30, strategy="auto")
    assert torch.equal(alone.sequences, _hf_greedy(model.base, ids[:1], am[:1], 30))
    assert alone.stats.plain_row_rounds < alone.stats.row_rounds and len(calls) == alone.stats.row_rounds


def _guard_rounds(guard, run, rounds: int, setup: list, clock: list, spec_cost: float = 1.2) -> list[str]:
    """Drive `guard` through `rounds` rounds in which the rule always speculates: a speculative round costs
    `spec_cost` and commits 2 tokens (1.2: 0.6 per token), plus 5 for a pending setup (`setup[0]`, then cleared), a
    plain one costs 1 and commits 1. Returns the arms the guard ran."""
    arms = []
    for _ in range(rounds):
        run.gam = [torch.tensor([2])]
        guard.begin(run)
        arm = "plain" if int(run.gam[0][0]) == 0 else "spec"
        clock[0] += 1.0 if arm == "plain" else spec_cost + 5.0 * setup[0]
        setup[0] = setup[0] and arm == "plain"
        run.committed_tokens += 2 if arm == "spec" else 1
        guard.end(run)
        arms.append(arm)
    return arms


@pytest.mark.parametrize("joins", [False, True], ids=["run-start", "rows-join"])
def test_the_guard_does_not_measure_the_setup_of_new_rows(monkeypatch, joins):
    """The first speculative round after rows start pays their one-time setup (an EAGLE-3 drafter's pass over the
    prompt): here 6.2 plain rounds' time for 2 tokens, later rounds 1.2 for 2 (0.6 per token against plain's 1.0).
    Not measured, the guard speculates but for its scheduled plain measurements; measured, that round sends it plain
    after its warm-up for most of the run. Rows joining a running batch (`_AutoPolicy.extend` -> `joined`) bring a
    setup again."""
    from hispec.decoding.stats import GenerationStats

    clock = [0.0]
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: clock[0]))

    def fresh_run():
        return types.SimpleNamespace(gam=[torch.tensor([2])], seq=torch.tensor([5]), committed_tokens=0,
                                     lookup_only=torch.zeros(1, dtype=torch.bool), stats=GenerationStats(),
                                     device=torch.device("cpu"))

    run, guard = fresh_run(), decoding._PlainGuard()
    if joins:  # a steady batch first, then rows join: their setup falls in the next speculative round
        assert _guard_rounds(guard, run, 30, [True], clock).count("plain") <= 3
        guard.joined()
    arms = _guard_rounds(guard, run, 40, [True], clock)
    assert arms.count("plain") <= 3, arms  # its scheduled measurements of plain rounds, no more
    naive = decoding._PlainGuard()
    naive.setup = False  # the setup round measured like any other
    arms = _guard_rounds(naive, fresh_run(), 40, [True], clock)
    assert arms.count("plain") > 20, arms


def test_the_guard_explores_plain_rounds_only_while_they_could_win(monkeypatch):
    """Speculation at 0.6 per token against plain's 1.0 (`_guard_rounds`): after its one measurement of a plain
    round the guard never explores again (plain would have to get 1 / NEAR times cheaper); at 0.9 per token
    (speculative rounds of 1.8 for 2 tokens), within NEAR of plain, it explores on schedule."""
    from hispec.decoding.stats import GenerationStats

    clock = [0.0]
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: clock[0]))
    run = types.SimpleNamespace(gam=[torch.tensor([2])], seq=torch.tensor([5]), committed_tokens=0,
                                lookup_only=torch.zeros(1, dtype=torch.bool), stats=GenerationStats(),
                                device=torch.device("cpu"))
    arms = _guard_rounds(decoding._PlainGuard(), run, 200, [False], clock)
    assert arms.count("plain") == 1 and arms.index("plain") == 1 + decoding._PlainGuard.WARM, arms  # (setup, warm)
    monkeypatch.setattr(decoding._PlainGuard, "NEAR", 0.0)  # (the schedule alone, as before NEAR)
    assert _guard_rounds(decoding._PlainGuard(), run, 200, [False], clock).count("plain") > 5
    monkeypatch.setattr(decoding._PlainGuard, "NEAR", 0.8)
    slow = _guard_rounds(decoding._PlainGuard(), run, 200, [False], clock, spec_cost=1.8)
    assert 5 < slow.count("plain") < 200 / decoding._PlainGuard.EXPLORE * 2, slow


def test_one_unlucky_round_does_not_send_the_batch_plain(monkeypatch):
    """Speculative rounds cost 1.3 plain rounds and could commit 4 tokens; the first measured one commits 1 (1.3
    per token, dearer than plain by more than MARGIN), the later ones 3 (0.43 per token). Judged on that one round
    the guard would decode ~EXPLORE rounds plainly before looking again (measured on the fp32 demo: 21 plain rounds
    in a row after such a round); until EVIDENCE speculative rounds are measured it judges them by their capacity
    (1.3 / 4 per token) and speculates on. Rounds that could not pay even had every draft been accepted (2 plain
    rounds' time for at most 1.5 tokens a round) send it plain at once."""
    from hispec.decoding.stats import GenerationStats

    clock = [0.0]
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: clock[0]))

    def arms_of(guard, cost, yields, capacity, rounds=40):
        run = types.SimpleNamespace(gam=[], seq=torch.tensor([5]), committed_tokens=0,
                                    lookup_only=torch.zeros(1, dtype=torch.bool), stats=GenerationStats(),
                                    device=torch.device("cpu"))
        arms, spec_rounds = [], 0
        for _ in range(rounds):
            run.gam = [torch.tensor([3])]
            guard.begin(run)
            spec = int(run.gam[0][0]) > 0
            clock[0] += cost if spec else 1.0
            run.committed_tokens += yields[min(spec_rounds, len(yields) - 1)] if spec else 1
            run.stats.top.proposed += capacity - 1 if spec else 0
            spec_rounds += spec
            guard.end(run)
            arms.append("spec" if spec else "plain")
        return arms

    unlucky = [2, 1, 3]  # (the setup round's, unmeasured), then one token, then three a round
    arms = arms_of(decoding._PlainGuard(), 1.3, unlucky, capacity=4)
    assert arms.count("plain") == 1 and arms[:3] == ["spec", "spec", "plain"], arms  # (the schedule's one)
    monkeypatch.setattr(decoding._PlainGuard, "EVIDENCE", 0)  # judged on the one round
    arms = arms_of(decoding._PlainGuard(), 1.3, unlucky, capacity=4)
    assert arms[2:12] == ["plain"] * 10, arms
    monkeypatch.setattr(decoding._PlainGuard, "EVIDENCE", 4)
    hopeless = arms_of(decoding._PlainGuard(), 3.0, [1], capacity=2)
    assert hopeless[:2] == ["spec", "spec"] and hopeless[2:].count("spec") <= 3, hopeless


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_row_that_went_plain_climbs_back_when_its_drafts_would_pay_again(monkeypatch, tree):
    model = _wrap(_oracle(tiny_model("qwen2"), 2), head_type="shared", draft=2, verify=4)
    if tree:  # auto drafts trees (`_tree_priors`): a row's choice is the tree (gam 1) or plain (gam 0)
        _tree_priors(model, lookup=False, top1=0.5)
    else:
        _calibrated(model, _self_spec_only, 0.0, realistic=True)
    calls = {"n": 0}
    orig = model.exit_logits

    def bad_at_first(name, hidden, *a, **kw):  # the heads are wrong for a while, then right
        calls["n"] += 1
        out = orig(name, hidden, *a, **kw)
        return -out if calls["n"] <= 12 else out

    out, rounds = _auto_greedy_with(monkeypatch, model, bad_at_first, rows=1, new=60)
    assert ("[tree " in out.stats.strategy) == tree
    g = rounds[0]
    assert 0 in g, f"never went plain: {g}"
    assert any(x >= (1 if tree else 2) for x in g[g.index(0):]), f"never climbed back: {g}"


def test_a_tree_row_keeps_its_own_top_k_counts_and_stays_on_the_tree_its_second_choices_pay_for(monkeypatch):
    """Greedy trees count each row's own top-k hits: an exit whose top-1 never agrees with the model but whose 2nd
    choice always does (r(1) = 0, r(2) = 1) keeps drafting the tree, where scaling the calibration's top-k rates
    to the row's top-1 rate (`latency.scaled_topk`, all sampling can observe) would have sent it plain."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    cal = _tree_priors(model, lookup=False, top1=0.5)
    plan = latency.auto_plan(cal)
    assert plan.widths is not None and plan.widths[0] >= 2, plan
    key = "L2>full"
    scaled = latency.tree_time_per_token(list(plan.widths), cal, "L2", {key: latency.scaled_topk(cal.topk[key], 0.0)})
    assert scaled > latency.plain_seconds_per_token(cal)  # the scaled estimate alone predicts plain decoding faster
    orig = model.exit_logits

    def second(name, hidden, *a, **kw):  # the model's token (the oracle exit's top-1) becomes the exit's 2nd choice
        out = orig(name, hidden, *a, **kw)
        top2 = out.topk(2, dim=-1).indices
        swapped = out.scatter(-1, top2[..., :1], out.gather(-1, top2[..., 1:]))
        return swapped.scatter(-1, top2[..., 1:], out.gather(-1, top2[..., :1]))

    out, rounds = _auto_greedy_with(monkeypatch, model, second, rows=2, new=48)
    assert "[tree " in out.stats.strategy
    for b, g in rounds.items():
        assert g and all(x == 1 for x in g), f"row {b} (every 2nd choice right) should keep its tree: {g}"
    assert out.stats.plain_row_rounds == 2 * out.stats.guarded_rounds  # only the guard's scheduled measurements
    assert out.stats.tokens_per_target_pass > 1.5


def test_auto_takes_the_lookup_first_exit_and_counts_its_two_drafters_apart(monkeypatch):
    """Priors under which the n-gram lookup first, the exit where it misses, is the fastest chain: auto runs it,
    output stays plain decoding's, and each row's estimates of the exit's and the n-gram's rates move apart."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)  # the exit is always right
    _calibrated(model, lambda k: {"L2>full": 0.9, "ngram>full": 0.7}.get(k, 0.0), 0.5, realistic=True)
    seen = []
    choose = decoding._AutoPolicy.choose

    def spy(self, run):
        choose(self, run)
        seen.append((self.acc[:, 0] / (self.acc[:, 0] + self.rej[:, 0]), self.lacc + self.lrej, self.hit + self.miss))

    monkeypatch.setattr(decoding._AutoPolicy, "choose", spy)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 40)
    out = model.generate(ids, am, max_new_tokens=40, strategy="auto")
    assert torch.equal(out.sequences, ref)
    assert out.stats.strategy == "auto:ngram|L2>full"
    lv0 = out.stats.levels[0]
    assert 0 < lv0.lookups < lv0.proposals  # both drafters proposed
    exit_rate, lookup_weight, match_weight = seen[-1]
    assert bool((exit_rate > 0.9).all())  # up from the 0.9 prior: the exit was right every time
    assert bool((lookup_weight != 2 * decoding._AutoPolicy.PRIOR / 2).any())  # the n-gram's own count moved
    assert bool((match_weight > decoding._AutoPolicy.PRIOR).all())  # every round tried the lookup


# ---------------------------------------------------------------------------------------------- trees
def test_auto_lookup_tree_counts_the_exit_and_the_ngram_apart_per_row(monkeypatch):
    """Under the lookup-first exit with a tree, each row's exit estimate follows its own tree rounds (right rows up,
    wrong rows down) while the n-gram serves rounds of both; output is plain decoding's."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)
    _tree_priors(model, lookup=True, top1=0.5)
    current, seen, matches = {}, {}, []
    choose, match = decoding._AutoPolicy.choose, decoding._AutoPolicy._match

    def spy(self, run):
        current["run"] = run
        choose(self, run)
        for b, row in enumerate(run.orig.tolist()):
            seen[row] = float(self.acc[b, 0] / (self.acc[b, 0] + self.rej[b, 0]))
        matches.append([])  # this round's match observations, by original row

    def spy_match(self, rows, hit):
        match(self, rows, hit)
        if matches:
            matches[-1].extend(int(current["run"].orig[int(r)]) for r in rows)

    monkeypatch.setattr(decoding._AutoPolicy, "choose", spy)
    monkeypatch.setattr(decoding._AutoPolicy, "_match", spy_match)
    bad = {1, 3}
    _flip_exit_logits(model, current, lambda row: row in bad)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 40)
    out = model.generate(ids, am, max_new_tokens=40, strategy="auto")
    assert torch.equal(out.sequences, ref)
    assert out.stats.strategy.startswith("auto:ngram|L2>full[tree ")
    assert out.stats.levels[0].lookups > 0
    assert all(seen[b] < 0.3 for b in bad) and all(seen[b] > 0.7 for b in (0, 2)), seen
    # every row that tried the lookup counts once per round, whether it was served (chain) or missed (tree)
    assert all(len(r) == len(set(r)) for r in matches) and sum(map(len, matches)) > 0


@pytest.mark.parametrize("lookup", [False, True], ids=["tree", "lookup-tree"])
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "warped"])
def test_auto_tree_sampling_matches_the_exact_distribution(warp, lookup):
    model = _tiny_vocab_model()
    _tree_priors(model, lookup, prompts=([1, 3, 2],))
    prompt, n = [1, 3, 2], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    g = torch.Generator().manual_seed(11)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="auto", do_sample=True,
                         generator=g, **warp)
    s = out.stats
    assert s.strategy.startswith("auto:ngram|L1>full[tree " if lookup else "auto:L1>full[tree "), s.strategy
    assert s.levels[1].proposed > 0 and s.plain_row_rounds < s.row_rounds  # rows drafted trees
    assert (s.levels[0].lookups > 0) == lookup  # and the lookup served rounds of its own
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) > 1e-4


def test_auto_plans_no_tree_without_topk_rates_or_room():
    model = _wrap(tiny_model("llama"), head_type="linear")
    cal = _tree_priors(model, lookup=True)
    kw = dict(gamma=1, window=1, ngram=NgramConfig())
    assert decoding._auto_plan(model, cal, **kw)[1] is not None
    assert decoding._auto_plan(model, dataclasses.replace(cal, topk=None), **kw)[1] is None  # an older calibration
    assert decoding._auto_plan(model, cal, max_new_tokens=0, **kw)[1] is None
    flat = dataclasses.replace(cal, topk={k: [v[0]] * 8 for k, v in cal.topk.items()})  # width buys nothing
    assert decoding._auto_plan(model, flat, **kw)[1] is None
    # the predicted time is the plan's own (the bench reports it), and a chain plan is never predicted faster
    levels, tree, t = decoding._auto_plan(model, cal, **kw)
    exit_level = levels[0].name.removeprefix(latency.LOOKUP)
    assert levels[0].lookup and t == pytest.approx(latency.tree_time_per_token(list(tree.widths), cal, exit_level,
                                                                               lookup=True))
    chain, no_tree, t_chain = decoding._auto_plan(model, cal, trees=False, **kw)
    assert no_tree is None and t < t_chain
    assert t_chain == pytest.approx(latency.time_per_token([lv.name for lv in chain],
                                                           [lv.threshold for lv in chain[:-1]], cal))


def test_auto_keeps_chains_when_sampling_verifies_sequence_level():
    """`verification="hsd"` verifies chains only: under priors that make `auto` draft trees, sampling with it
    plans the chain (greedy decoding and token-wise sampling keep the tree)."""
    model = _wrap(tiny_model("llama"), head_type="linear")
    _tree_priors(model, lookup=True)
    assert decoding._auto_trees(False, "hsd") and decoding._auto_trees(True, "token")
    assert not decoding._auto_trees(True, "hsd")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    for kw, tree in ((dict(do_sample=True, verification="hsd"), False), (dict(do_sample=True), True), ({}, True)):
        out = model.generate(ids, max_new_tokens=6, strategy="auto", **kw)
        assert ("[tree " in out.stats.strategy) == tree, (kw, out.stats.strategy)


# ---------------------------------------------------------------------------------------------- defaults, bad input
def test_without_a_calibration_the_default_is_plain_decoding_with_a_warning():
    model = _wrap(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.warns(UserWarning, match="no calibration; decoding plainly"):
        decoding._warned.clear()
        out = model.generate(ids, max_new_tokens=5)
    assert out.stats.strategy == "full"
    with pytest.raises(latency.CalibrationError, match="needs a calibration"):
        model.generate(ids, max_new_tokens=5, strategy="auto")


def test_a_calibration_for_this_machine_makes_auto_the_default():
    model = _wrap(tiny_model("llama"))
    _calibrated(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5)
    assert out.stats.strategy.startswith("auto:")


def test_a_calibration_from_another_machine_or_model_is_refused_clearly(monkeypatch):
    model = _wrap(tiny_model("llama"))
    cal = _calibrated(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    other = dict(cal.to_dict(), machine={**cal.machine, "cpu": "Some Other CPU", "cpu_capability": "NEON"})
    model.hispec_config.calibration = other
    with pytest.raises(latency.CalibrationError, match="another machine"):
        model.generate(ids, max_new_tokens=5, strategy="auto")
    decoding._warned.clear()
    with pytest.warns(UserWarning, match="another machine"):
        assert model.generate(ids, max_new_tokens=5).stats.strategy == "full"  # default: plain, never slower
    model.hispec_config.calibration = dict(cal.to_dict(), model={**cal.model, "num_layers": 12})
    with pytest.raises(latency.CalibrationError, match="another model"):
        model.generate(ids, max_new_tokens=5, strategy="auto")


# ---------------------------------------------------------------------------------------------- the lookup alone
def _force_lookup_alone(monkeypatch, pick) -> dict:
    """After auto's rule, rows whose original index satisfies `pick` draft by the lookup alone (exit / drafter off).
    Returns counters: "forced" row rounds, and "plain_tree" tree rounds replaced by one plain verification."""
    from hispec.decoding.rounds import _Run

    choose, plain_if_idle = decoding._AutoPolicy.choose, _Run.verify_plainly_if_none_drafts
    seen = {"forced": 0, "plain_tree": 0}

    def forced(self, run):
        choose(self, run)
        rows = torch.tensor([bool(pick(int(r))) for r in run.orig.tolist()], device=run.seq.device)
        run.gam[0] = torch.where(rows, torch.clamp(run.gam[0], min=1), run.gam[0])
        run.lookup_only = run.lookup_only | rows
        seen["forced"] += int(rows.sum())

    def spy(run):
        ran = plain_if_idle(run)
        seen["plain_tree"] += ran
        return ran

    monkeypatch.setattr(decoding._AutoPolicy, "choose", forced)
    monkeypatch.setattr(_Run, "verify_plainly_if_none_drafts", spy)
    return seen


def _lookup_priors(model, tree: bool, prompts=([5, 6, 7, 8, 9, 5, 6],)):
    """Priors under which auto runs the lookup-first exit: as a chain, or (`tree`) drafting trees where it misses."""
    if tree:
        return _tree_priors(model, lookup=True, prompts=prompts)
    cal = _calibrated(model, lambda k: {"L2>full": 0.9, "ngram>full": 0.7, "L1>full": 0.9}.get(k, 0.0), 0.5,
                      prompts=prompts, realistic=True)
    cal = dataclasses.replace(cal, topk=None)  # (no top-k rates: no tree is planned)
    model.hispec_config.calibration = cal.to_dict()
    return cal


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_rows_drafting_by_the_lookup_alone_stay_greedy_identical(monkeypatch, family, tree):
    """Some rows (then every row) of a lookup-first `auto` run draft by the lookup alone: output is plain
    decoding's, and with every row so the exit drafts nothing (every proposal is the lookup's)."""
    model = _wrap(tiny_model(family), head_type="linear", draft=2, verify=4)
    _lookup_priors(model, tree)
    _greedy_with_the_lookup_alone(monkeypatch, model, "auto:ngram|L2>full" + ("[tree" if tree else ""), tree)


def _greedy_with_the_lookup_alone(monkeypatch, model, want: str, tree: bool):
    """Greedy `auto` with half the rows, then every row, forced to the lookup alone: plain decoding's output; with
    every row so, every proposal is the lookup's and (trees) idle tree rounds are one plain verification."""
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 24)
    for pick in (lambda r: r % 2, lambda r: True):
        seen = _force_lookup_alone(monkeypatch, pick)
        out = model.generate(ids, am, max_new_tokens=24, strategy="auto")
        assert torch.equal(out.sequences, ref)
        assert out.stats.strategy.startswith(want) and seen["forced"] > 0
    lv0 = out.stats.levels[0]
    assert 0 < lv0.lookups == lv0.proposals  # (every row alone: no exit / drafter proposal, no tree drafted)
    if tree:
        assert seen["plain_tree"] > 0


def test_the_rule_drafts_by_the_lookup_alone_where_the_exit_loses_and_the_lookup_pays():
    """Three rows of one lookup-first `auto` batch, speculating: the exit agrees, the lookup rarely matches -> the
    exit with the lookup first; the exit never agrees but the lookup does -> the lookup alone; neither -> plain
    decoding. The same three choices under the lookup-first tree. (Priced as a server's rows, each returning when
    done: in `generate` the plain row sets the batch's length, and the chain round is plain for all.)"""
    from types import SimpleNamespace

    model = _wrap(tiny_model("llama"), head_type="linear", draft=2, verify=4)
    for tree in (False, True):
        cal = _lookup_priors(model, tree)
        levels, spec, pol = decoding.generation._auto_policy(model, cal, 3, "cpu", gamma=1, window=1,
                                                             ngram=NgramConfig(), max_new_tokens=64, trees=tree)
        assert [lv.name for lv in levels] == ["ngram|L2", "full"] and (spec is not None) == tree
        w = pol.PRIOR * 5
        for agreed, disagreed, rates in ((pol.acc[:, 0], pol.rej[:, 0], [0.95, 0.0, 0.0]),
                                         (pol.lacc, pol.lrej, [0.3, 0.95, 0.0]), (pol.hit, pol.miss, [0.3, 0.95, 0.0])):
            agreed.copy_(torch.tensor(rates) * w)
            disagreed.copy_((1 - torch.tensor(rates)) * w)
        if tree:
            pol.khit.copy_(torch.tensor([[0.95] * len(pol.kwidths), [0.0] * len(pol.kwidths), [0.0] * len(pol.kwidths)]))
            pol.kseen.fill_(1.0)
        pol.lowest.zero_()  # all three speculated last round (no hysteresis)
        pol.together = False
        run = SimpleNamespace(gam=[torch.ones(3, dtype=torch.long)], do_sample=False, ngram=NgramConfig(),
                              lookup_only=torch.zeros(3, dtype=torch.bool),
                              stats=SimpleNamespace(row_rounds=0, plain_row_rounds=0, lookup_only_row_rounds=0))
        pol.choose(run)
        assert run.lookup_only.tolist() == [False, True, False], tree
        assert run.gam[0][0] > 0 and run.gam[0][1] > 0 and run.gam[0][2] == 0, tree
        assert (run.stats.lookup_only_row_rounds, run.stats.plain_row_rounds) == (1, 1)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_row_drafting_by_the_lookup_alone_measures_its_exit_in_the_shadow_and_takes_it_back(monkeypatch, tree):
    """Every row starts sure its exit never agrees (the lookup alone is chosen) while the exit is in fact always
    right: where the lookup misses, the exit is shadowed, and every row takes its exit back."""
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", draft=2, verify=4)  # the exit is always right
    _lookup_priors(model, tree)
    init = decoding._AutoPolicy.__init__

    def exit_never_agrees(self, *a, **kw):
        init(self, *a, **kw)
        self.acc.zero_()
        self.rej.fill_(self.PRIOR)
        self.khit.zero_()

    monkeypatch.setattr(decoding._AutoPolicy, "__init__", exit_never_agrees)
    monkeypatch.setattr(decoding._AutoPolicy, "SHADOW_EVERY", 1)
    alone = []
    choose = decoding._AutoPolicy.choose

    def spy(self, run):
        choose(self, run)
        alone.append(run.lookup_only.tolist())

    monkeypatch.setattr(decoding._AutoPolicy, "choose", spy)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 40)
    out = model.generate(ids, am, max_new_tokens=40, strategy="auto")
    assert torch.equal(out.sequences, ref)
    assert all(alone[0]), alone  # the lookup alone first, every row ...
    assert any(not any(r) for r in alone[1:]), alone  # ... then every row with its exit back
    assert out.stats.levels[0].proposals > out.stats.levels[0].lookups  # (the exit proposed)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "warped"])
def test_rows_drafting_by_the_lookup_alone_keep_the_exact_distribution(monkeypatch, warp, tree):
    model = _tiny_vocab_model()
    _lookup_priors(model, tree, prompts=([1, 3, 2],))
    seen = _force_lookup_alone(monkeypatch, lambda r: r % 2)  # half the rows by the lookup alone, half as auto chose
    prompt, n = [1, 3, 2, 1, 3], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="auto", do_sample=True,
                         generator=torch.Generator().manual_seed(3), **warp)
    s = out.stats
    assert s.strategy.startswith("auto:ngram|L1>full" + ("[tree" if tree else "")), s.strategy
    assert seen["forced"] > 0 and s.levels[0].lookups > 0 and s.levels[0].proposals > s.levels[0].lookups
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) > 1e-4
