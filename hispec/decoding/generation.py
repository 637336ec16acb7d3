"""`generate`: one batched generation call with an `EarlyExitModel`, from its arguments to its output.

Contract: checks every argument before any work (ValueError / CalibrationError naming the bad one), resolves the
defaults (the checkpoint's gamma, window, verification and n-gram config; the default strategy; eos and pad from the
base model's generation config), builds the hierarchy (or, for `auto`, plans it at this batch's costs and adds the
`_AutoPolicy`), runs the rounds (`hispec.decoding.rounds._Run`) and returns the prompt plus new tokens, padded, with
the call's counters (`GenerationOutput`). Lossless: the tokens do not depend on the strategy (greedy) or keep the
model's distribution (sampling). `_as_list` and `_stop_checker` are shared with the server (`hispec.serve`).
"""

from __future__ import annotations

import torch

from ..drafters.ngram import NgramConfig
from ..sampling import check_verification
from .tree import check_tree, parse_tree
from .auto import _AutoPolicy
from .levels import build_levels, parse_hierarchy
from .plan import _auto_plan, _auto_trees, _calibration, default_strategy, ngram_config
from .rounds import _Run
from .stats import GenerationOutput


@torch.no_grad()
def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int = 128,
    strategy: str | list | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    gamma: int | None = None,
    window: int | None = None,
    gammas: list[int] | None = None,
    ngram: NgramConfig | dict | None = None,
    eos_token_id=None,
    pad_token_id: int | None = None,
    stop_strings=None,
    streamer=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    policy=None,
    tree=None,
    verification: str | None = None,
    draft_gate: float = 0.0,
) -> GenerationOutput:
    """Generate with an `EarlyExitModel`. `input_ids` `[B, P]` may be left-padded (give `attention_mask`).

    `strategy`: `auto` (the default when the checkpoint holds a calibration for this machine, else `ar`), a named
    hierarchy (`ar`, `self-spec`, `hispec`, `ngram`, `ngram-self-spec`, `ngram-hispec`) or a spec such as
    `"ngram>L8>full"`. `gamma` sets the lowest exit's draft count, `window` the higher exits', `gammas` every
    level's (one per level below the full model); `ngram` configures the n-gram level (`NgramConfig` or its fields:
    max_ngram, min_ngram, max_len — max_len is that level's gamma). Defaults come from the checkpoint's config;
    eos/pad from the base model's generation config. Strategies ignore what they do not use.

    `tree`: draft a static tree at level 0 instead of a chain and verify it in one full pass (`hispec.decoding.tree`):
    widths per depth, `[4, 2, 1]` or `"4x2x1"` (the root's top-4, each one's top-2, then top-1: 4 + 8 + 8 nodes;
    sampling draws the children without replacement), or `"dyn-D-K-B-N"`, a dynamic EAGLE-2-style tree (depth D,
    top-K per expanded node, B nodes expanded per depth, the N best verified; greedy only). Needs a hierarchy of one
    draft exit under the full model (`self-spec`, `draft>full`, `L4>full`), the lookup-first exit
    (`self-spec-lookup`: the n-gram lookup first, the tree where it misses), or the EAGLE-3 drafter (`eagle`,
    `eagle-lookup`; static trees, `hispec.decoding.eagle_tree`); `gamma` is then unused. Default None: chains
    (`auto` may still plan a tree itself, `_auto_plan`).
    `verification`: the acceptance rule when sampling, at every level of the hierarchy: `"token"` (speculative
    sampling, token by token) or `"hsd"` (sequence-level, `hispec.sampling.hsd_accept`: the same output
    distribution, at least as many accepted tokens); default: the checkpoint's `decoding.verification`, else
    "token". Greedy decoding (`do_sample=False`) matches exact prefixes and is identical under both.

    `draft_gate`: an EAGLE-3 chain (`eagle`, `eagle-lookup`) stops drafting at the first draft the drafter itself
    gives a probability below it, and the full model verifies the drafts before it (EAGLE-2's and transformers'
    `assistant_confidence_threshold` idea for a chain; on a CPU every proposed draft costs verification work).
    Default 0: the full chain. Trees ignore it; `auto` ignores it too and runs the gate its calibration chose
    (`Calibration.drafter_gate`: the one its latency model predicts fastest, often 0).

    `policy` (advanced): an object with `choose(run)`, `observe(run, k, part, m, a, new, probs)` and
    `keep_rows(idx)` that sets the per-row gammas `run.gam` (and, under a lookup-first level 0, `run.lookup_only`)
    between rounds (see `_AutoPolicy`, which `auto` uses).
    """
    explicit_verification = verification
    eagle_gamma = gamma if gamma is not None else getattr(getattr(model, "drafter", None), "default_gamma", None)
    verification, gamma, window, ngram = _settings(model, verification, gamma, window, ngram)
    _check_sampling(max_new_tokens, do_sample, temperature, top_k, top_p)
    tree = parse_tree(tree)
    if not 0.0 <= draft_gate < 1.0:
        raise ValueError(f"draft_gate must be in [0, 1), got {draft_gate!r}")
    if strategy is None:
        strategy = "self-spec" if tree is not None else default_strategy(model)
    policy_cal, levels = _hierarchy(model, strategy, tree, gammas, gamma=gamma, window=window, ngram=ngram,
                                    eagle_gamma=eagle_gamma)
    if tree is not None:
        _check_tree_options(tree, levels, max_new_tokens, policy, do_sample, explicit_verification)
    if policy_cal is not None or tree is not None or levels[0].kind != "eagle3":
        draft_gate = 0.0  # chains of the drafter only; `auto` runs its calibration's gate (`_AutoPolicy.draft_gate`)
    dev = model.device
    input_ids, prompts = _prompts(model, input_ids, attention_mask, max_new_tokens)
    eos, pad_token_id = _eos_and_pad(model, eos_token_id, pad_token_id)
    if streamer is not None and len(prompts) != 1:
        raise ValueError("streaming supports batch size 1 only")

    if policy_cal is not None:
        levels, tree, policy = _auto_policy(model, policy_cal, len(prompts), dev, gamma=gamma, window=window,
                                            ngram=ngram, max_new_tokens=max_new_tokens,
                                            trees=_auto_trees(do_sample, verification))
    run = _Run(model, levels, prompts, [len(p) + max_new_tokens for p in prompts], do_sample=do_sample,
               warp=dict(temperature=temperature, top_k=top_k, top_p=top_p), eos=eos, generator=generator,
               stop_check=_stop_checker(stop_strings, tokenizer if tokenizer is not None else model.tokenizer),
               streamer=streamer, ngram=ngram, policy=policy, tree=tree, verification=verification,
               draft_gate=draft_gate)
    run.stats.strategy = ("auto:" if policy_cal is not None else "") + ">".join(lv.name for lv in levels)
    if tree is not None:
        run.stats.strategy += f"[tree {tree}]"
    return _output(run, input_ids, len(prompts), max_new_tokens, streamer, pad_token_id)


def _settings(model, verification, gamma, window, ngram):
    """The call's verification, gamma, window and n-gram config: given, else the checkpoint's (checked)."""
    cfg = model.hispec_config
    verification = check_verification(getattr(cfg, "verification", "token") if verification is None
                                      else verification)
    gamma = cfg.gamma if gamma is None else gamma
    window = cfg.window if window is None else window
    for name, v in (("gamma", gamma), ("window", window)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return verification, gamma, window, ngram_config(model, ngram)


def _check_sampling(max_new_tokens, do_sample, temperature, top_k, top_p):
    """ValueError on a bad length or sampling setting."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _hierarchy(model, strategy, tree, gammas, *, gamma, window, ngram, eagle_gamma=None):
    """-> (the calibration, None) for `auto` (planned once the batch size is known), else (None, the levels).
    An `eagle3` level drafts `eagle_gamma` tokens (default: the drafter's own, the draft steps it trained for)."""
    if tree is not None and strategy == "auto":
        raise ValueError("tree drafts need a fixed hierarchy of one draft exit under the full model (e.g. "
                         "strategy='self-spec'), not 'auto'")
    if strategy == "auto":
        return _calibration(model), None
    return None, build_levels(model, parse_hierarchy(strategy, model), gammas, gamma=gamma, window=window,
                              ngram=ngram, eagle_gamma=eagle_gamma)


def _check_tree_options(tree, levels, max_new_tokens, policy, do_sample, explicit_verification):
    """ValueError where `tree=` does not fit the hierarchy or the other options."""
    check_tree(tree, levels, max_new_tokens=max_new_tokens, policy=policy, do_sample=do_sample)
    if do_sample and explicit_verification == "hsd":
        raise ValueError("verification='hsd' verifies chains; a tree's children are verified by recursive "
                         "rejection sampling (hispec.sampling.recursive_accept): drop tree= or verification=")


def _prompts(model, input_ids, attention_mask, max_new_tokens):
    """-> (input_ids `[B, P]` on the model's device, each row's prompt without its padding), checked."""
    dev = model.device
    input_ids = torch.as_tensor(input_ids, device=dev)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, length] tensor of token ids (the prompt is empty)")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask, device=dev)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    vocab = model.adapter.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids contain ids outside the vocabulary 0..{vocab - 1}")
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {b} is empty (its attention_mask has no 1s)")
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if max_pos and longest + max_new_tokens > max_pos:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{max_pos} positions; shorten the prompt or lower max_new_tokens"
        )
    return input_ids, prompts


def _eos_and_pad(model, eos_token_id, pad_token_id):
    """-> (EOS ids as a LongTensor, possibly empty; the pad id): given, else the base model's generation config's
    (pad: else the first EOS, else 0)."""
    gen_cfg = getattr(model.base, "generation_config", None)
    if eos_token_id is None and gen_cfg is not None:
        eos_token_id = gen_cfg.eos_token_id
    eos = torch.tensor(_as_list(eos_token_id), dtype=torch.long, device=model.device)
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None) if gen_cfg is not None else None
        if pad_token_id is None:
            pad_token_id = int(eos[0]) if eos.numel() else 0
    return eos, pad_token_id


def _auto_policy(model, cal, rows: int, dev, *, gamma, window, ngram, max_new_tokens, trees):
    """`auto`'s levels, tree and `_AutoPolicy` for a batch of `rows`, planned at this batch's costs
    (`Calibration.at_batch`): a full batch is compute-bound, where fewer extra positions pay."""
    levels, tree, _ = _auto_plan(model, cal.at_batch(rows), gamma=gamma, window=window, ngram=ngram,
                                 max_new_tokens=max_new_tokens, trees=trees)
    return levels, tree, _AutoPolicy(levels, cal, rows, dev, tree=tree)


def _output(run: _Run, input_ids, rows: int, max_new_tokens: int, streamer, pad_token_id) -> GenerationOutput:
    """Run the rounds (streaming if asked) and return the prompts followed by their new tokens, padded."""
    dev = run.model.device
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if max_new_tokens == 0:
        results = {b: [] for b in range(rows)}
    else:
        results = run.run()
    if streamer is not None:
        streamer.end()
    new = [results[b] for b in range(rows)]
    width = max((len(t) for t in new), default=0)
    tail = torch.full((len(new), width), pad_token_id, dtype=torch.long, device=dev)
    for b, t in enumerate(new):
        if t:
            tail[b, : len(t)] = torch.tensor(t, device=dev)
    return GenerationOutput(sequences=torch.cat([input_ids, tail], 1), stats=run.stats, new_tokens=new)


def _as_list(x) -> list[int]:
    """Token ids given as None, an int, a sequence or a tensor -> a list of ints."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, (list, tuple, set)):
        return [int(v) for v in x]
    return [int(x)]


def _stop_checker(stop_strings, tokenizer):
    """`stop_strings` -> a checker `check(toks, new_from)` for `_Run.commit` (None without stop strings)."""
    if not stop_strings:
        return None
    if tokenizer is None:
        raise ValueError("stop_strings need a tokenizer: pass tokenizer=... or load the model with one")
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    # A stop string of c characters spans at most c tokens that decode to text (plus a few for tokens that decode
    # to nothing, e.g. parts of a multi-byte character): decoding that far back before the new tokens suffices.
    back = 2 * max(len(s) for s in stops) + 8

    def check(toks: list[int], new_from: int = 0):
        """The length to cut `toks` to (just after the first token that completes a stop string), or None; tokens
        before `new_from` were checked already."""
        lo = max(0, new_from - back)
        decode = lambda i: tokenizer.decode(toks[lo:i], skip_special_tokens=False)  # noqa: E731
        if not any(s in decode(len(toks)) for s in stops):
            return None
        for i in range(max(new_from, lo) + 1, len(toks) + 1):  # the first token that completes a stop string
            if any(s in decode(i) for s in stops):
                return i
        return len(toks)

    return check
