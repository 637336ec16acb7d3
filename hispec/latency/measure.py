"""`calibrate`: measuring a `Calibration` of a model on this machine.

Contract: `calibrate(model, prompts)` times the model's greedy answers, counts acceptance rates teacher-forced
along them (top-1 agreement per pair of levels, top-k per exit for trees, the n-gram's decoder rounds by
`ngram_rounds`), times the unit costs (`hispec.latency.timing`), fits the decoder's own per-layer factor and
per-pass overhead (`fit_decoder_costs`) and, unless given a config, keeps the one of NGRAM_CANDIDATES that
`auto_plan` is predicted fastest with, and the drafter's confidence gate likewise; its docstring gives the steps.
Within a time budget (`max_seconds`, `hispec.latency.budget`) it answers fewer prompts, counts along fewer
answers, times fewer repeats and runs fewer (or no) draft-step runs rather than run past it, and records what it
left out (`Calibration.budget`). Every timer waits for the device's queued work (`hispec.timing`). It returns the
calibration; storing it in a checkpoint is `write_calibration`'s (`hispec.latency.calibration`).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from .. import timing
from ..drafters.ngram import NgramConfig, propose
from ..prompts import Prompt, render
from .budget import DEFAULT_MAX_SECONDS, Budget
from .calibration import Calibration, _dtype_name, machine_fingerprint, model_identity
from .levels import EAGLE, FULL, NGRAM, acceptance_from_counts, gate_key, level_name, pair_key
from .model import DEFAULT_MAX_GAMMA, _drafter_context, _pass_cost
from .plans import auto_plan
from .timing import measure_costs
from .trees import MAX_TREE_WIDTH, TREE_ROWS, tree_round_seconds

# the n-gram configs `calibrate` chooses from when none is given (the default first: it wins ties). Measured on
# Qwen2.5-Coder-1.5B (16 Spec-Bench answers x 96 tokens, bf16, 2-core EPYC): min_ngram 1 matches 49% of rounds at
# an acceptance of 0.39, min_ngram 2 15% at 0.61, and auto's predicted speedup goes 1.38x -> 1.45x (a one-token
# match is mostly noise, and under a lookup-first exit it takes the round from the exit's better draft)
NGRAM_CANDIDATES = tuple(NgramConfig(3, n, k) for k in (8, 4) for n in (1, 2, 3))
# the confidence gates on the drafter's chains `calibrate` measures and chooses from (0, full chains, besides)
DRAFT_GATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
GATE_MIN_GAIN = 0.01  # a gate is kept only when auto's plan is predicted >= 1% faster with it than with full chains


def _calibration_contexts(model, name: str, states: dict, T: int, gen: torch.Generator) -> dict:
    """Teacher-forced inputs of exit `name`'s context head, one per level that verifies it ({upper level: ctx}).

    The latency model takes one acceptance rate per pair of levels, while a context head's agreement falls with
    the distance d to the last position the full model verified. Each pair is measured under the distances its
    hierarchy produces at the checkpoint's gamma g and window N, drawn uniformly per position: the draft under
    the full model (self-spec) d in 1..g; under the verifier exit d in 1..N*g (reading the verifier's states of
    the last d' in 1..min(d, g) positions, if the head reads that exit); the verifier exit under the full model
    d in 1..N*g. The rate is then the mean over those distances, an approximation (per-position rates would need
    the latency model to take a rate per draft position)."""
    cfg = model.hispec_config
    g, N = max(1, int(cfg.gamma)), max(1, int(cfg.window))
    head = model.heads[name]
    v_layer = model.verify_layer

    def uniform(hi):
        return torch.randint(1, hi + 1, (1, T), generator=gen).to(model.device)

    if name == "verify":
        return {FULL: head.sequence_context(states, uniform(N * g))}
    out = {FULL: head.sequence_context(states, uniform(g))}
    d = uniform(N * g)
    mid = torch.minimum(uniform(g), d) if v_layer in head.context_layers else None
    out[level_name(v_layer)] = head.sequence_context(states, d, mid)
    return out


def _prompt_ids(model, prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        return [int(x) for x in prompt.flatten().tolist()]
    if isinstance(prompt, (list, tuple)):
        return [int(x) for x in prompt]
    text = prompt.text if isinstance(prompt, Prompt) else str(prompt)
    if model.tokenizer is None:
        raise ValueError("text prompts need the model's tokenizer, and this model has none; pass token id lists")
    return render(model.tokenizer, text, chat=True)


def ngram_rounds(tokens: torch.Tensor, P: int, answer: list[int], upper_argmax: list[int], ngram: NgramConfig,
                 lookup_times: list | None = None) -> tuple[int, int, int, int, int]:
    """The rounds an n-gram level runs under a verifier U along a known greedy answer, as the decoder would:
    lookup over the known prefix, the proposal walked against U's argmax until the first mismatch (one rejection),
    then U's own token; a round without a proposal is U's own token. `tokens` [P + N] = prompt + answer,
    `upper_argmax[q - 1]` = U's argmax for answer token q (teacher-forced); answer token 0 comes from prefill.
    Returns (accepted, proposed, rejections, rounds, rounds with a proposal); a walk that leaves the answer (U
    accepts a token the answer does not continue with) or runs past it is censored (no rejection)."""
    N = len(answer)
    acc = proposed = rej = rounds = matched = 0
    j = 1  # answer token j is next; known: prompt + answer[:j]
    while j < N:
        t0 = timing.now()  # (a lookup on the host: nothing to wait for)
        prop = propose(tokens[: P + j], ngram).tolist()
        if lookup_times is not None:
            lookup_times.append(timing.now() - t0)
        rounds += 1
        a = 0
        if prop:
            matched += 1
            proposed += len(prop)
            a, r = _walk(prop, j, answer, upper_argmax)
            acc, rej = acc + a, rej + r
        j += a + 1  # the accepted proposals, then U's own token
    return acc, proposed, rej, rounds, matched


def _walk(prop, j: int, answer: list[int], upper_argmax: list[int]) -> tuple[int, int]:
    """A proposal for answer tokens j, j+1, ... walked against U's argmax: (accepted, 1 if rejected else 0); a walk
    that leaves the answer or runs past it stops without a rejection (censored)."""
    a = 0
    for i, t in enumerate(prop):
        q = j + i
        if q >= len(answer):
            break
        if t != upper_argmax[q - 1]:
            return a, 1
        a += 1
        if t != answer[q]:
            break
    return a, 0


def drafter_rounds(pred: list[list[int]], P: int, answer: list[int], upper_argmax: list[int], gamma: int,
                   conf: list[list[float]] | None = None, gate: float = 0.0) -> tuple[int, int, int, int]:
    """The rounds an EAGLE-3 drafter runs under the full model along a known greedy answer, as the decoder would:
    `gamma` drafts from the verified prefix, walked against the model's argmax until the first mismatch (one
    rejection), then the model's own token. `pred[s][e]` is the drafter's step-s draft (a target id) from entry e
    of its training-time-test pass over its own drafts (`Eagle3Drafter.ttt_logits(own_drafts=True)` over prompt +
    answer: entry e reads the states of position e and predicts position e + 2 + s; each step reads the previous
    step's draft, as the decoder's chain does), so a round whose first draft is answer token j reads entry
    P + j - 2 (answer token 0 comes from prefill). `upper_argmax[q - 1]` is the model's argmax for answer token q.
    With a confidence `gate` > 0 (`conf[s][e]`: the largest probability of that draft's distribution) a chain stops
    at the first step below it, that pass spent and nothing proposed (the decoder's `draft_gate`).
    Returns (accepted, proposed, rejections, drafter passes); a walk that leaves the answer or runs past it is
    censored."""
    N, gamma = len(answer), min(gamma, len(pred))
    acc = proposed = rej = passes = 0
    j = 1
    while j < N:
        prop = []
        for s in range(min(gamma, N - j)):  # (drafts past the answer: never made)
            passes += 1
            if gate > 0 and conf[s][P + j - 2] < gate:
                break
            prop.append(pred[s][P + j - 2])
        a, r = _walk(prop, j, answer, upper_argmax)
        acc, proposed, rej = acc + a, proposed + len(prop), rej + r
        j += a + 1
    return acc, proposed, rej, passes


def fit_decoder_costs(step: float | None, draft: float | None, *, L: int, e: int, layer: float, final: float,
                      head: float) -> tuple[float, float]:
    """(layer_scale, step_overhead) from a measured plain decode step and draft step (see `calibrate`, step 4);
    without a draft step all the unexplained time is per-pass overhead, as before."""
    if not step:
        return 1.0, 0.0
    S = step - final
    if S < L * layer:  # the decoder's step is faster than the timed layers: they ran slow (a busy machine, the
        return max(S, 0.0) / (L * layer), 0.0  # fixed context); the plain step, measured directly, is the truth
    top = S / (L * layer)
    scale = 1.0 if draft is None or L <= e else min(max((S - (draft - head)) / ((L - e) * layer), 1.0), top)
    return scale, max(0.0, S - scale * L * layer)


def _draft_step_seconds(model, ids_list: list[list[int]], max_new_tokens: int, budget: Budget, step: float,
                        progress: bool = False) -> float | None:
    """The decoder's median seconds per draft step of the draft exit (level 0 of `self-spec`); None when none was
    timed (see `_decoder_runs`)."""
    runs = _decoder_runs(model, ids_list, max_new_tokens, budget, step, "self-spec", progress)
    return statistics.median(r[0] for r in runs) if runs else None


def _decoder_runs(model, ids_list: list[list[int]], max_new_tokens: int, budget: Budget, step: float,
                  strategy: str, progress: bool = False, indices: list | None = None,
                  **kw) -> list[tuple[float, ...]]:
    """Short real decoder runs of `strategy` (up to 32 tokens per prompt) after one untimed warm-up run -> per run
    (level 0's seconds per pass, its entries per pass (layer evaluations: a drafter's entries), the full model's
    seconds per verification, positions per verification, level 0's passes per verification, new tokens per
    verification); `indices`: appended the index in `ids_list` of each run's prompt; `kw`: more `generate` options
    (a `tree`). A run starts only while it fits the budget (first
    guess, before any was timed: every token costs gamma draft steps and a verification, each as dear as a plain
    step `step`)."""
    runs, spent = [], []
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    todo = ids_list[:1] + ids_list  # the first run warms up (kernels for new shapes), untimed
    worst = step * (int(model.hispec_config.gamma) + 1)  # seconds a token, before any run was timed
    bar = tqdm(total=len(todo), desc=f"calibration: {strategy} steps", disable=not progress, file=sys.stderr)
    for i, ids in enumerate(todo):
        n = min(max_new_tokens, 32, max_pos - len(ids) if max_pos else 32)
        if n < 2:
            continue
        if not budget.fits("decoder", n * (max(spent) if spent else worst)):
            what = f"{strategy}{'_tree' if kw.get('tree') else ''}_step_runs"  # (chain and tree runs apart)
            budget.skip(what, {"timed": len(runs), "of": len(todo) - 1})
            break
        t0 = timing.now(model.adapter.device)
        out = model.generate(torch.tensor([ids], device=model.adapter.device), strategy=strategy, max_new_tokens=n,
                             **kw)
        spent.append((timing.now(model.adapter.device) - t0) / n)
        low, top = out.stats.levels[0], out.stats.levels[-1]
        if low.passes and top.passes and i:
            runs.append((low.seconds / low.passes, low.layer_evals / low.passes, top.seconds / top.passes,
                         (top.proposed + top.row_passes) / top.passes, low.passes / top.passes,
                         len(out.new_tokens[0]) / top.passes))
            if indices is not None:
                indices.append(i - 1)
        bar.update()
    bar.close()
    return runs


def fit_position_overhead(runs, *, verify, o: float, scale=None) -> float:
    """`position_overhead`: what the decoder's verification costs per position past the first beyond the timed
    units (`verify(p) + o`), from real `ngram` runs (`_decoder_runs`: seconds and mean positions per verification);
    the least over the runs that verified more than one position on average (noise only adds time, and divided by
    p - 1 it adds a lot), >= 0. `scale`: per run, its prompt's plain
    decode step over the calibration's median one (step 1's answers): the units are timed at the typical context, a
    run's passes at its prompt's, so `verify(p) + o` is scaled by it. Why: the excess is divided by p - 1 (~0.3 on
    SmolLM2), so a long prompt's dearer attention read as a cost per position; unscaled, one bf16 SmolLM2
    calibration (one Zen 4 core) fitted 10.9 ms per position (a plain step is 43 ms) and predicted every
    drafter chain at <= 1.16x of `ar`, against 1.4-1.7x measured; the same machine's runs, with the other core's
    job taking memory bandwidth, read 0.6-1.6 ms per position in one repeat and 24-68 ms in the next."""
    scale = list(scale) if scale is not None else [1.0] * len(runs)
    per = [max(0.0, (v - c * (verify(p) + o)) / (p - 1)) for (_, _, v, p, *_), c in zip(runs, scale) if p > 1.05]
    return min(per) if per else 0.0


TREE_PROBE = [4, 2]  # the static tree whose real rounds `calibrate` times (12 nodes: the size `auto` plans here)


def fit_tree_overhead(runs, *, rounds: float, context=None) -> float:
    """`tree_overhead` (`drafter_tree_overhead`): what a real static tree round (`_decoder_runs` of `self-spec`, or
    `eagle`, with `TREE_PROBE`: level 0's passes, then one verification) costs beyond R(tree) = `rounds` (its masks,
    the nodes' gathers and compaction); `context(tokens)`: what else the round's first pass took in, by the run's new
    tokens per verification (a drafter's context, c(tokens - 1)); median over runs, >= 0."""
    if not runs:
        return 0.0
    return statistics.median(max(0.0, per * d + v - rounds - (context(tok) if context else 0.0))
                             for d, _, v, _, per, tok in runs)


def fit_drafter_costs(runs, *, drafter, verify, o: float) -> tuple[float, float]:
    """(drafter_overhead, drafter_verify_overhead) from real `eagle` runs (`_decoder_runs`): what the decoder's
    drafter pass costs beyond the timed one over as many entries (`drafter(entries) + o`: gathers of the aux states,
    masks, the drafted token's bookkeeping), and its verification beyond `verify(positions) + o` (the aux layers'
    capture and store); medians over runs, >= 0."""
    if not runs:
        return 0.0, 0.0
    pas = statistics.median(max(0.0, s - drafter(n) - o) for s, n, *_ in runs)
    ver = statistics.median(max(0.0, s - verify(p) - o) for _, _, s, p, *_ in runs)
    return pas, ver


def _fit_round_costs(model, ids_list, max_new_tokens: int, budget: Budget, step: float, progress: bool,
                     max_gamma: int, units, steps=None) -> None:
    """Step 4's fits on real rounds, into `units().costs`, each priced by the latency model's own terms under the
    unit costs fitted so far (`units()`: a fresh Calibration of them, so its memo never holds an earlier fit):
    `position_overhead` from `ngram` runs (first: the others' verifications pay it), the drafter's from `eagle`
    runs (with one attached), `drafter_tree_overhead` from `eagle` runs of `TREE_PROBE`, then `tree_overhead` from
    `self-spec` runs of it. The drafter's runs come before the exit's tree because, under a tight budget (each
    step's runs start only while they fit), they are what `auto` plans with where a drafter is attached: Qwen2.5-
    Coder-1.5B's calibration at the default 300 s (one Zen 4 core, the other core busy) had time for none of them, and
    priced the drafter's rounds without their overheads. `steps`: step 1's plain decode step per prompt of
    `ids_list` (None: not timed), which prices each n-gram run at its prompt's context (`fit_position_overhead`)."""
    costs = units().costs
    idx = []
    runs = _decoder_runs(model, ids_list, max_new_tokens, budget, step, "ngram", progress, indices=idx)
    own = [(steps[i] if steps and i < len(steps) and steps[i] else step) / step for i in idx]  # (untimed: 1)
    cal = units()
    costs["position_overhead"] = fit_position_overhead(runs, o=cal.step_overhead, scale=own,
                                                       verify=lambda p: _pass_cost(cal, None, FULL, p))
    trees = max_gamma >= len(TREE_PROBE)
    if costs.get("drafter"):
        runs = _decoder_runs(model, ids_list, max_new_tokens, budget, step, "eagle", progress)
        cal = units()
        costs["drafter_overhead"], costs["drafter_verify_overhead"] = fit_drafter_costs(
            runs, drafter=lambda n: cal.head_cost(EAGLE, n), o=cal.step_overhead,
            verify=lambda p: _pass_cost(cal, None, FULL, p))
        if trees:  # the drafter's trees: their own masks over its entries, its nodes' KV
            runs = _decoder_runs(model, ids_list, max_new_tokens, budget, step, "eagle", progress,
                                 tree=list(TREE_PROBE))
            cal = units()
            bare = tree_round_seconds(TREE_PROBE, cal, EAGLE) - cal.drafter_tree_overhead
            costs["drafter_tree_overhead"] = fit_tree_overhead(
                runs, rounds=bare, context=lambda tokens: _drafter_context(cal, tokens - 1))
    if trees:
        runs = _decoder_runs(model, ids_list, max_new_tokens, budget, step, "self-spec", progress,
                             tree=list(TREE_PROBE))
        costs["tree_overhead"] = fit_tree_overhead(runs, rounds=tree_round_seconds(
            TREE_PROBE, units(), level_name(model.draft_layer)))


def _greedy_answers(model, ids_list, max_new_tokens: int, budget: Budget, progress: bool):
    """Step 1: the model's greedy answers and the seconds of a decode step (prefill excluded) per answer (None for an
    answer under 2 tokens); after the first, an answer starts only while one more (the slowest so far) fits the
    budget's share."""
    dev = model.adapter.device
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    answers, steps, spent = [], [], []
    with tqdm(total=len(ids_list), desc="calibration: greedy answers", disable=not progress, file=sys.stderr) as bar:
        for ids in ids_list:
            if spent and not budget.fits("answers", max(spent)):
                budget.skip("prompts", {"answered": len(answers), "of": len(ids_list)})
                break
            n_new = max_new_tokens if not max_pos else max(0, min(max_new_tokens, max_pos - len(ids)))
            t0 = timing.now(dev)
            out = model.generate(torch.tensor([ids], device=dev), strategy="ar", max_new_tokens=n_new)
            spent.append(timing.now(dev) - t0)
            new = list(out.new_tokens[0])
            answers.append(new)
            steps.append((spent[-1] - out.stats.seconds.get("prefill", 0.0)) / (len(new) - 1) if len(new) >= 2
                         else None)
            bar.update()
    return answers, steps


@dataclass
class _Counts:
    """Step 2's tallies: top-1 agreement per pair of levels, the n-gram's rounds per config and level, top-k hits
    per exit, the lookups' times."""

    levels: list
    configs: list
    agree: dict = field(default_factory=dict)  # "lo>hi": [agreeing positions, positions]
    ngram: list = field(default_factory=list)  # per config {level: [accepted, proposed, rejections, rounds, matched]}
    topk_hits: dict = field(default_factory=dict)
    lookups: list = field(default_factory=list)
    positions: int = 0
    drafter: list = field(default_factory=lambda: [0, 0, 0])  # an EAGLE-3 drafter's [accepted, proposed, rejections]
    # its gated chains' per gate: [accepted, proposed, rejections, drafter passes]
    drafter_gates: dict = field(default_factory=lambda: {g: [0, 0, 0, 0] for g in DRAFT_GATES})

    def __post_init__(self):
        self.agree = {pair_key(a, b): [0, 0] for i, a in enumerate(self.levels) for b in self.levels[i + 1:]}
        self.ngram = [{lv: [0, 0, 0, 0, 0] for lv in self.levels} for _ in self.configs]

    def add(self, tokens: torch.Tensor, P: int, ans: list[int], arg: dict, top: dict) -> None:
        """One answer's argmaxes (`arg`: per level, and per (level, upper level) for context heads; under EAGLE, an
        EAGLE-3 drafter's drafts per step) and exits' top-k indices (`top`)."""
        N = len(ans)
        if EAGLE in arg:
            counts = drafter_rounds(arg[EAGLE], P, ans, arg[FULL], DEFAULT_MAX_GAMMA)
            self.drafter = [a + b for a, b in zip(self.drafter, counts[:3])]
            for g, tally in self.drafter_gates.items():
                counts = drafter_rounds(arg[EAGLE], P, ans, arg[FULL], DEFAULT_MAX_GAMMA, arg[EAGLE, "conf"], g)
                self.drafter_gates[g] = [a + b for a, b in zip(tally, counts)]
        for lv, idx in top.items():  # the model's argmax among the exit's top-k, k = 1..MAX_TREE_WIDTH
            full_arg = torch.tensor(arg[FULL], device=idx.device)[:, None]
            hit = (idx == full_arg).cumsum(-1).clamp(max=1).sum(0).tolist()
            self.topk_hits[lv] = [a + b for a, b in zip(self.topk_hits.setdefault(lv, [0] * len(hit)), hit)]
        for key, c in self.agree.items():
            lo, hi = key.split(">")
            c[0] += sum(x == y for x, y in zip(arg.get((lo, hi), arg[lo]), arg[hi]))
            c[1] += N - 1
        self.positions += N - 1
        for c, cfg in enumerate(self.configs):
            for lv in self.levels:
                counts = ngram_rounds(tokens, P, ans, arg[lv], cfg, self.lookups if c == 0 else None)
                self.ngram[c][lv] = [x + y for x, y in zip(self.ngram[c][lv], counts)]


def _teacher_forced(model, ids: list[int], ans: list[int], draw: torch.Generator):
    """Prompt + answer through the model once -> (the sequence [1, P + N]; per level the argmax at the positions
    predicting answer tokens 1..N-1, and per (level, upper level) for context heads; per exit its top-k indices)."""
    ad = model.adapter
    dev, L = ad.device, ad.num_layers
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    P, N = len(ids), len(ans)
    seq = torch.tensor([ids + ans], device=dev)
    pos = torch.arange(P + N, device=dev)[None]
    cache = ad.new_cache(1)
    arg, states, top = {}, {}, {}
    bounds = sorted({0, L, *exits.values()})
    drafter = getattr(model, "drafter", None)
    aux_ids = list(drafter.config.aux_layers) if drafter is not None else []
    aux = {}
    with torch.no_grad():
        h = ad.embed(seq, pos)
        for a, b in zip(bounds[:-1], bounds[1:]):
            capture = {i: None for i in aux_ids if a <= i <= b and i not in aux} or None
            h = ad.run_layers(h, a, b, position_ids=pos, cache=cache, capture=capture)
            aux.update(capture or {})
            states[b] = h
        arg[FULL] = ad.final_logits(h[:, P: P + N - 1])[0].argmax(-1).tolist()
        if drafter is not None and P + N >= 2:  # its drafts per step from every entry (training-time test)
            fused_in = torch.cat([aux[i] for i in aux_ids], -1)[:, :-1]
            embed = model.base.get_input_embeddings()
            logits = drafter.ttt_logits(fused_in, embed, seq[:, 1:], DEFAULT_MAX_GAMMA, own_drafts=True)
            arg[EAGLE] = [drafter.to_target(x[0].argmax(-1)).tolist() for x in logits]
            arg[EAGLE, "conf"] = [torch.softmax(x[0].float(), -1).amax(-1).tolist() for x in logits]  # (gates)
            # its step-0 top-k where the model's argmax is arg[FULL]: entry j predicts token j + 2 (trees' r(k))
            step0 = logits[0][0, P - 1: P + N - 2]
            top[EAGLE] = drafter.to_target(step0.topk(min(MAX_TREE_WIDTH, step0.shape[-1]), dim=-1).indices)
        for name, layer in exits.items():
            head, lv = model.heads[name], level_name(layer)
            if head.needs_context:  # its agreement under the frontier distances decoding gives it
                for below, ctx in _calibration_contexts(model, name, states, P + N, draw).items():
                    logits = model.project_exit(name, head(states[layer], context=ctx)[:, P: P + N - 1])[0]
                    arg[(lv, below)] = logits.argmax(-1).tolist()
                    if below == FULL:
                        top[lv] = logits.topk(min(MAX_TREE_WIDTH, logits.shape[-1]), dim=-1).indices
                arg[lv] = arg[(lv, FULL)]
                continue
            run_layer = head.run_layer_fresh(ad) if head.stateful else None
            feats = head(states[layer], run_layer)[:, P: P + N - 1]  # positions predicting answer tokens 1..N-1
            logits = model.project_exit(name, feats)[0]
            arg[lv] = logits.argmax(-1).tolist()
            top[lv] = logits.topk(min(MAX_TREE_WIDTH, logits.shape[-1]), dim=-1).indices
    return seq, arg, top


def _acceptance(model, ids_list, answers, configs, budget: Budget, progress: bool) -> _Counts:
    """Step 2: the tallies along every answer (of >= 2 tokens); after the first, an answer is counted only while one
    more (the slowest so far) fits the budget's share."""
    exits = sorted({model.draft_layer, model.verify_layer})
    counts = _Counts([level_name(layer) for layer in exits] + [FULL], configs)
    draw = torch.Generator().manual_seed(0)  # frontier distances of context heads (reproducible)
    spent, used = [], 0
    pairs = list(zip(ids_list, answers))
    with tqdm(total=len(pairs), desc="calibration: acceptance", disable=not progress, file=sys.stderr) as bar:
        for ids, ans in pairs:
            if spent and not budget.fits("acceptance", max(spent)):
                budget.skip("answers_counted", {"counted": used, "of": len(pairs)})
                break
            used += 1
            bar.update()
            if len(ans) < 2:
                continue
            t0 = timing.now(model.adapter.device)
            seq, arg, top = _teacher_forced(model, ids, ans, draw)
            counts.add(seq[0].cpu(), len(ids), ans, arg, top)
            spent.append(timing.now(model.adapter.device) - t0)
    return counts


def _unit_costs(model, ids_list, answers, configs, max_gamma: int, repeats: int, budget: Budget,
                progress: bool) -> tuple[dict, int]:
    """Step 3: unit costs behind the typical context (median prompt + half an answer) -> (costs, context)."""
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    context = int(statistics.median(len(ids) + len(ans) // 2 for ids, ans in zip(ids_list, answers)))
    chain = max(max_gamma, *(cfg.max_len for cfg in configs)) + 1
    rows = tuple(range(1, chain + 1)) + tuple(T for T in TREE_ROWS if T > chain)  # chains; passes over trees
    if max_pos:
        context = max(1, min(context, max_pos - 2 * max(rows) - 2))

    def fit(round_seconds: float) -> int:  # repeats of a round of every timed pass within the budget's share
        n = budget.units("costs", round_seconds, repeats)
        if n < repeats:
            budget.skip("repeats", {"timed": n, "of": repeats})
        return n

    label = f"calibration: timing ({context} KV slots, T = 1..{chain}, {', '.join(map(str, rows[chain:]))})"
    return measure_costs(model, rows, context, repeats, fit=fit, progress=label if progress else None), context


def calibrate(model, prompts, *, max_new_tokens: int = 64, ngram: NgramConfig | None = None,
              progress: bool = False, repeats: int = 10, max_gamma: int = DEFAULT_MAX_GAMMA,
              max_seconds: float | None = DEFAULT_MAX_SECONDS) -> Calibration:
    """Measure a `Calibration` of `model` (an `EarlyExitModel`) on this machine, in its dtype and thread count.

    `prompts`: texts (rendered with the chat template), `hispec.prompts.Prompt`s or token id lists. Steps:
    1. greedy answers (`strategy="ar"`, `max_new_tokens`), timed: the median decode step (prefill excluded);
    2. prompt + answer teacher-forced once: per answer position the argmax of every exit head and of the model;
       top-1 agreement per pair of levels over all answer positions (every position is a draft opportunity);
       for "ngram" under each level U the decoder's rounds along the answer: a lookup over the known prefix,
       the proposal walked against U's argmax until the first mismatch, then U's own token (so a copied span
       counts once, as in decoding, not once per position): per-token acceptance by `acceptance_from_counts`,
       `ngram_match` = the share of rounds (under "full") whose lookup proposes, the median lookup time; for
       every n-gram config measured (`ngram`; None: the checkpoint's `decoding.ngram` if it sets one, else each of
       NGRAM_CANDIDATES, and the one `auto_plan` predicts fastest is kept, the others listed in `ngram_options`);
    3. unit costs (`measure_costs`) behind a KV cache of the typical context (median prompt + half an answer),
       for T = 1..max(max_gamma, ngram.max_len) + 1 and the tree passes' TREE_ROWS; per exit, the share of answer
       positions where the model's argmax is among the exit's top-k (k = 1..MAX_TREE_WIDTH; tree drafts);
    4. the decoder's own costs beyond the timed units, fitted on two real decode steps: the plain step of 1. and a
       draft step of the draft exit (its level-0 seconds per pass in a short `self-spec` run on up to 3 of the
       prompts). With S = plain step - final(1) and D = draft step - head(1): a per-layer factor
       `layer_scale` = (S - D) / ((L - e) layer(1)) (clamped to [1, S / (L layer(1))]; S / (L layer(1)) < 1 when
       the plain step is faster than the timed layers, so the model's plain step is the measured one) and the per-pass
       `step_overhead` = S - layer_scale L layer(1) (>= 0). A layer can run slower inside the decoder than timed
       alone; charged per pass instead, that time priced every cheap draft step like a full step's extra (Qwen2.5-
       1.5B, bf16, 2-core EPYC: 71 ms of a 217 ms step; the fit gives x1.09 per layer and ~2 ms per pass). On a
       small model the extra time is Python per pass, and the fit says so (layer_scale ~1). With a drafter
       attached, short real `eagle` runs on up to 3 prompts give what its pass costs beyond the timed one over as
       many entries (`drafter_overhead`: the aux states' gathers, masks, bookkeeping) and what its verification
       costs beyond V_0k over as many positions (`drafter_verify_overhead`: the aux layers' capture), per pass
       (`fit_drafter_costs`; SmolLM2 fp32, 2-core EPYC: the timed pass was 2.15 ms, the decoder's 2.9 ms).
       Likewise real `self-spec` runs of the static tree `TREE_PROBE` give what a tree round costs beyond R(tree)
       (`tree_overhead`, per round: masks, gathers, compaction; `fit_tree_overhead`; the drafter's trees their
       own, `drafter_tree_overhead`, from `eagle` runs of it), and real `ngram` runs what a verification costs per
       position past the first beyond the timed units (`position_overhead`, fitted first: every pass over T
       positions pays it T - 1 times; `fit_position_overhead`). Order: n-gram, the drafter's chain and tree, the
       exit's tree (`_fit_round_costs`: a tight budget keeps the first).

    5. of the n-gram configs, the one `auto_plan` is predicted fastest with (`_choose_ngram`); 6. with a drafter,
    its chains gated at each of DRAFT_GATES counted along the same answers and the gate auto's plan is predicted
    fastest with kept (`_choose_gate`, `Calibration.drafter_gate`; 0 unless it gains >= GATE_MIN_GAIN).

    `max_seconds` (None: no limit) bounds the whole call: steps 1-4 get 45%, 60%, 90% and 100% of it by then
    (`hispec.latency.budget.STEPS`), and each takes on no unit of work (an answer, a counted answer, a round of
    repeats, a draft-step run) that would end past its share; the first answer, the first counted answer and one
    timed repeat always run, so the result is a complete calibration, noisier for what it skipped
    (`Calibration.budget`: the limit, the seconds spent, what was skipped). `progress`: tqdm bars on stderr."""
    ad = model.adapter
    budget = Budget(max_seconds, ad.device)
    ids_list = [_prompt_ids(model, p) for p in prompts]
    if not ids_list or any(not ids for ids in ids_list):
        raise ValueError("calibration needs at least one non-empty prompt")
    if ngram is None and getattr(model.hispec_config, "ngram", None):
        ngram = NgramConfig(**model.hispec_config.ngram)
    configs = [ngram] if ngram is not None else list(NGRAM_CANDIDATES)

    answers, steps = _greedy_answers(model, ids_list, max_new_tokens, budget, progress)
    counts = _acceptance(model, ids_list, answers, configs, budget, progress)
    if counts.positions == 0:
        raise ValueError(f"calibration needs answers of >= 2 tokens; got none (max_new_tokens={max_new_tokens})")
    costs, context = _unit_costs(model, ids_list, answers, configs, max_gamma, repeats, budget, progress)
    costs["ngram"] = statistics.median(counts.lookups)

    # 4. the decoder's own costs: a per-layer factor and a per-pass overhead, from a plain and a draft step
    timed = [t for t in steps if t is not None]
    step = statistics.median(timed) if timed else None
    draft = _draft_step_seconds(model, ids_list[:3], max_new_tokens, budget, step, progress) if step else None
    draft_layer = model.draft_layer
    costs["layer_scale"], costs["step_overhead"] = fit_decoder_costs(
        step, draft, L=ad.num_layers, e=draft_layer, layer=costs["layer"][1], final=costs["final"][1],
        head=costs["head"][level_name(draft_layer)][1])
    base = dict(machine=machine_fingerprint(ad.device, model), dtype=_dtype_name(ad.dtype),
                threads=torch.get_num_threads(), model=model_identity(model), costs=costs,
                measured={"ar": 1.0 / step} if step else None, context=context, positions=counts.positions,
                topk={pair_key(lv, FULL): [h / counts.positions for h in hits]
                      for lv, hits in counts.topk_hits.items()})
    if step:
        _fit_round_costs(model, ids_list[:3], max_new_tokens, budget, step, progress, max_gamma,
                         lambda: Calibration(**base, acceptance={}), steps=steps[:3])
    cal = _choose_ngram(base, counts, min(5, max_new_tokens), progress)
    cal = _choose_gate(cal, counts, min(5, max_new_tokens))
    cal.budget = budget.report()
    return cal


def _choose_ngram(base: dict, counts: _Counts, max_depth: int, progress: bool = False) -> Calibration:
    """Step 5: of the n-gram configs measured, the calibration with the one auto's plan is predicted fastest with
    (the first on a tie); the others are listed in `ngram_options` (None: one measured)."""
    acceptance = {k: c[0] / c[1] for k, c in counts.agree.items()}
    if counts.drafter[1]:  # an EAGLE-3 drafter's rate along its rounds (i.i.d. maximum likelihood)
        acceptance[pair_key(EAGLE, FULL)] = acceptance_from_counts(*counts.drafter) or 0.0
    ngram_acc = [{pair_key(NGRAM, lv): acceptance_from_counts(*per[lv][:3]) or 0.0 for lv in per}
                 for per in counts.ngram]
    # exact for ngram > full: teacher forcing follows the model's own greedy path
    ngram_match = [per[FULL][4] / max(per[FULL][3], 1) for per in counts.ngram]

    def with_config(c: int, options=None) -> Calibration:
        cfg = counts.configs[c]
        return Calibration(**base, acceptance={**acceptance, **ngram_acc[c]}, ngram_match=ngram_match[c],
                           ngram={"max_ngram": cfg.max_ngram, "min_ngram": cfg.min_ngram, "max_len": cfg.max_len},
                           ngram_options=options)

    if len(counts.configs) == 1:
        return with_config(0)
    options = []
    for c in tqdm(range(len(counts.configs)), desc="calibration: n-gram configs", disable=not progress,
                  file=sys.stderr):
        cal = with_config(c)
        options.append({"config": cal.ngram, "match": cal.ngram_match, "acceptance": ngram_acc[c],
                        "seconds_per_token": auto_plan(cal, max_depth=max_depth).seconds_per_token})
    best = min(range(len(counts.configs)), key=lambda c: options[c]["seconds_per_token"])
    return with_config(best, options)


def _choose_gate(cal: Calibration, counts: _Counts, max_depth: int) -> Calibration:
    """Step 6 (with a drafter): the gated chains' figures per gate measured (`Calibration.drafter_gates`: the
    acceptance of what they propose, the share of draft steps that pass, and auto's predicted time per token with
    that gate), and the gate auto's plan is predicted fastest with, if >= GATE_MIN_GAIN faster than full chains
    (else 0). Where a verification of several positions is expensive (fp32 on a CPU) stopping at an unlikely draft
    saves more than it loses; where it is nearly free, full chains win and the gate stays 0."""
    if not cal.has_drafter:
        return cal
    gates = {}
    for g, (acc, proposed, rej, passes) in sorted(counts.drafter_gates.items()):
        if passes:
            gates[gate_key(g)] = {"acceptance": acceptance_from_counts(acc, proposed, rej) or 0.0,
                                  "pass": proposed / passes, "proposed": proposed, "passes": passes}
    if not gates:
        return cal
    base = replace(cal, costs={**cal.costs, "drafter_gates": gates, "drafter_gate": 0.0})
    plain = auto_plan(base, max_depth=max_depth).seconds_per_token
    best, best_t = 0.0, plain * (1 - GATE_MIN_GAIN)
    for key, entry in gates.items():
        entry["seconds_per_token"] = auto_plan(base.with_gate(float(key)), max_depth=max_depth).seconds_per_token
        if entry["seconds_per_token"] < best_t:
            best, best_t = float(key), entry["seconds_per_token"]
    return base.with_gate(best)
