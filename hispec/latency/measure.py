"""`calibrate`: measuring a `Calibration` of a model on this machine.

Contract: `calibrate(model, prompts)` times the model's greedy answers, counts acceptance rates teacher-forced
along them (top-1 agreement per pair of levels, top-k per exit for trees, the n-gram's decoder rounds by
`ngram_rounds`), times the unit costs (`hispec.latency.timing`), fits the decoder's own per-layer factor and
per-pass overhead (`fit_decoder_costs`) and, unless given a config, keeps the one of NGRAM_CANDIDATES that
`auto_plan` is predicted fastest with; its docstring gives the steps. It returns the calibration; storing it in a
checkpoint is `write_calibration`'s (`hispec.latency.calibration`).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

from ..ngram import NgramConfig, propose
from ..prompts import Prompt, render
from .calibration import Calibration, _dtype_name, machine_fingerprint, model_identity
from .model import DEFAULT_MAX_GAMMA, FULL, NGRAM, acceptance_from_counts, level_name, pair_key
from .plans import auto_plan
from .timing import measure_costs
from .trees import MAX_TREE_WIDTH, TREE_ROWS

# the n-gram configs `calibrate` chooses from when none is given (the default first: it wins ties). Measured on
# Qwen2.5-Coder-1.5B (16 Spec-Bench answers x 96 tokens, bf16, 2-core EPYC): min_ngram 1 matches 49% of rounds at
# an acceptance of 0.39, min_ngram 2 15% at 0.61, and auto's predicted speedup goes 1.38x -> 1.45x (a one-token
# match is mostly noise, and under a lookup-first exit it takes the round from the exit's better draft)
NGRAM_CANDIDATES = tuple(NgramConfig(3, n, k) for k in (8, 4) for n in (1, 2, 3))


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
        t0 = time.perf_counter()
        prop = propose(tokens[: P + j], ngram).tolist()
        if lookup_times is not None:
            lookup_times.append(time.perf_counter() - t0)
        rounds += 1
        a = 0
        if prop:
            matched += 1
            proposed += len(prop)
            for i, t in enumerate(prop):
                q = j + i
                if q >= N:
                    break
                if t != upper_argmax[q - 1]:
                    rej += 1
                    break
                a += 1
                if t != answer[q]:
                    break
            acc += a
        j += a + 1  # the accepted proposals, then U's own token
    return acc, proposed, rej, rounds, matched


def fit_decoder_costs(step: float | None, draft: float | None, *, L: int, e: int, layer: float, final: float,
                      head: float) -> tuple[float, float]:
    """(layer_scale, step_overhead) from a measured plain decode step and draft step (see `calibrate`, step 4);
    without a draft step all the unexplained time is per-pass overhead, as before."""
    if not step:
        return 1.0, 0.0
    S = step - final
    top = max(1.0, S / (L * layer))
    scale = 1.0 if draft is None or L <= e else min(max((S - (draft - head)) / ((L - e) * layer), 1.0), top)
    return scale, max(0.0, S - scale * L * layer)


def _draft_step_seconds(model, ids_list: list[list[int]], max_new_tokens: int) -> float | None:
    """The decoder's median seconds per draft step of the draft exit (level 0 of `self-spec`), over short runs after
    one untimed warm-up run."""
    per = []
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    for i, ids in enumerate(ids_list[:1] + ids_list):  # the first run warms up (kernels for new shapes), untimed
        n = min(max_new_tokens, 32, max_pos - len(ids) if max_pos else 32)
        if n < 2:
            continue
        out = model.generate(torch.tensor([ids], device=model.adapter.device), strategy="self-spec", max_new_tokens=n)
        st = out.stats.levels[0]
        if st.passes and i:
            per.append(st.seconds / st.passes)
    return statistics.median(per) if per else None


def calibrate(model, prompts, *, max_new_tokens: int = 64, ngram: NgramConfig | None = None,
              progress: bool = False, repeats: int = 10, max_gamma: int = DEFAULT_MAX_GAMMA) -> Calibration:
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
       `layer_scale` = (S - D) / ((L - e) layer(1)) (clamped to [1, S / (L layer(1))]) and the per-pass
       `step_overhead` = S - layer_scale L layer(1) (>= 0). A layer can run slower inside the decoder than timed
       alone; charged per pass instead, that time priced every cheap draft step like a full step's extra (Qwen2.5-
       1.5B, bf16, 2-core EPYC: 71 ms of a 217 ms step; the fit gives x1.09 per layer and ~2 ms per pass). On a
       small model the extra time is Python per pass, and the fit says so (layer_scale ~1)."""
    ad = model.adapter
    L, dev = ad.num_layers, ad.device
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    ids_list = [_prompt_ids(model, p) for p in prompts]
    if not ids_list or any(not ids for ids in ids_list):
        raise ValueError("calibration needs at least one non-empty prompt")
    max_pos = getattr(ad.config, "max_position_embeddings", None)
    if ngram is None and getattr(model.hispec_config, "ngram", None):
        ngram = NgramConfig(**model.hispec_config.ngram)
    configs = [ngram] if ngram is not None else list(NGRAM_CANDIDATES)

    # 1. the model's own greedy answers, timed
    answers, steps = [], []
    for ids in tqdm(ids_list, desc="calibration: greedy answers", disable=not progress, file=sys.stderr):
        n_new = max_new_tokens if not max_pos else max(0, min(max_new_tokens, max_pos - len(ids)))
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([ids], device=dev), strategy="ar", max_new_tokens=n_new)
        wall = time.perf_counter() - t0
        new = list(out.new_tokens[0])
        answers.append(new)
        if len(new) >= 2:
            steps.append((wall - out.stats.seconds.get("prefill", 0.0)) / (len(new) - 1))

    # 2. acceptances, teacher-forced along those answers
    levels = [level_name(layer) for layer in sorted(exits.values())] + [FULL]
    agree = {pair_key(a, b): [0, 0] for i, a in enumerate(levels) for b in levels[i + 1:]}
    # per n-gram config and level: accepted, proposed, rejections, rounds, rounds with a proposal
    ng = [{lv: [0, 0, 0, 0, 0] for lv in levels} for _ in configs]
    positions = 0
    lookups = []
    topk_hits: dict[str, list[int]] = {}
    bounds = sorted({0, L, *exits.values()})
    draw = torch.Generator().manual_seed(0)  # frontier distances of context heads (reproducible)
    for ids, ans in tqdm(list(zip(ids_list, answers)), desc="calibration: acceptance", disable=not progress,
                         file=sys.stderr):
        P, N = len(ids), len(ans)
        if N < 2:
            continue
        seq = torch.tensor([ids + ans], device=dev)
        pos = torch.arange(P + N, device=dev)[None]
        cache = ad.new_cache(1)
        arg, states, top = {}, {}, {}
        with torch.no_grad():
            h = ad.embed(seq, pos)
            for a, b in zip(bounds[:-1], bounds[1:]):
                h = ad.run_layers(h, a, b, position_ids=pos, cache=cache)
                states[b] = h
            arg[FULL] = ad.final_logits(h[:, P: P + N - 1])[0].argmax(-1).tolist()
            for name, layer in exits.items():
                head = model.heads[name]
                lv = level_name(layer)
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
        full_arg = torch.tensor(arg[FULL], device=dev)[:, None]
        for lv, idx in top.items():  # the model's argmax among the exit's top-k, k = 1..MAX_TREE_WIDTH
            hit = (idx == full_arg).cumsum(-1).clamp(max=1).sum(0).tolist()
            topk_hits[lv] = [a + b for a, b in zip(topk_hits.setdefault(lv, [0] * len(hit)), hit)]
        for key, c in agree.items():
            lo, hi = key.split(">")
            c[0] += sum(x == y for x, y in zip(arg.get((lo, hi), arg[lo]), arg[hi]))
            c[1] += N - 1
        positions += N - 1
        for c, cfg in enumerate(configs):
            for lv in levels:
                counts = ngram_rounds(seq[0].cpu(), P, ans, arg[lv], cfg, lookups if c == 0 else None)
                ng[c][lv] = [x + y for x, y in zip(ng[c][lv], counts)]
    if positions == 0:
        raise ValueError(f"calibration needs answers of >= 2 tokens; got none (max_new_tokens={max_new_tokens})")
    acceptance = {k: c[0] / c[1] for k, c in agree.items()}
    ngram_acc = [{pair_key(NGRAM, lv): acceptance_from_counts(*counts[:3]) or 0.0 for lv, counts in per.items()}
                 for per in ng]
    # exact for ngram > full: teacher forcing follows the model's own greedy path
    ngram_match = [per[FULL][4] / max(per[FULL][3], 1) for per in ng]

    # 3. unit costs, behind the typical context
    context = int(statistics.median(len(ids) + len(ans) // 2 for ids, ans in zip(ids_list, answers)))
    chain = max(max_gamma, *(cfg.max_len for cfg in configs)) + 1
    rows = tuple(range(1, chain + 1)) + tuple(T for T in TREE_ROWS if T > chain)  # chains; passes over trees
    if max_pos:
        context = max(1, min(context, max_pos - 2 * max(rows) - 2))
    if progress:
        print(f"calibration: timing layers and heads ({context} KV slots, T = 1..{chain}, "
              f"{', '.join(map(str, rows[chain:]))})", file=sys.stderr)
    costs = measure_costs(model, rows, context, repeats)
    costs["ngram"] = statistics.median(lookups)

    # 4. the decoder's own costs: a per-layer factor and a per-pass overhead, from a plain and a draft step
    step = statistics.median(steps) if steps else None
    draft = _draft_step_seconds(model, ids_list[:3], max_new_tokens) if step else None
    costs["layer_scale"], costs["step_overhead"] = fit_decoder_costs(
        step, draft, L=L, e=exits["draft"], layer=costs["layer"][1], final=costs["final"][1],
        head=costs["head"][level_name(exits["draft"])][1])
    measured = {"ar": 1.0 / step} if step else None

    # 5. the n-gram config: of those measured, the one auto's plan is predicted fastest with (the first on a tie)
    def with_config(c: int, options=None) -> Calibration:
        cfg = configs[c]
        return Calibration(machine=machine_fingerprint(dev, model), dtype=_dtype_name(ad.dtype),
                           threads=torch.get_num_threads(), model=model_identity(model), costs=costs,
                           acceptance={**acceptance, **ngram_acc[c]}, ngram_match=ngram_match[c], measured=measured,
                           context=context, positions=positions,
                           ngram={"max_ngram": cfg.max_ngram, "min_ngram": cfg.min_ngram, "max_len": cfg.max_len},
                           topk={pair_key(lv, FULL): [h / positions for h in hits] for lv, hits in topk_hits.items()},
                           ngram_options=options)

    if len(configs) == 1:
        return with_config(0)
    options = []
    for c in range(len(configs)):
        cal = with_config(c)
        options.append({"config": cal.ngram, "match": cal.ngram_match, "acceptance": ngram_acc[c],
                        "seconds_per_token": auto_plan(cal, max_depth=min(5, max_new_tokens)).seconds_per_token})
    best = min(range(len(configs)), key=lambda c: options[c]["seconds_per_token"])
    return with_config(best, options)
