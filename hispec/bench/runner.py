"""The benchmark's runner: `BenchConfig`, the raw samples (`Counters`, `Sample`, `PromptRecord`, `BenchResult`), pass
counting through forward hooks (`PassCounter`), one strategy on one prompt (`Runner`), the fp32 re-check of greedy
divergences (`TieChecker`, `tie_tolerance`), `run_bench` and the latency model's `predict_speedups`.

Every timer waits for the device's queued work before reading the clock (`hispec.timing`). A peer strategy
(transformers' own, `HF_STRATEGIES`) that raises is recorded in `BenchResult.failed` and dropped, and the run goes
on with the others; whatever it changed in the base model's config is undone after each of its runs
(`restored_config`: transformers' `assistant_early_exit` sets `num_hidden_layers` to the exit layer and, when it
fails, leaves it there). hispec's own strategies are not caught: an error there is a bug.

Other engines (`hispec.bench.peers`: llama.cpp, vLLM) run after the interleaved loop, each on every prompt in turn
(an engine is started once, not per prompt), on the same prompt token ids; their rows join the same records, so
identity, the tie check and the ratios to `hf` treat them like every row. A peer that is not installed is listed in
`BenchResult.skipped`, one that fails in `BenchResult.failed`, with the reason, and the others run on."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .. import latency, packed, timing
from . import peers
from ..decoding import STRATEGIES as HISPEC_STRATEGIES
from ..decoding import _auto_plan, _auto_trees, build_levels, ngram_config, parse_hierarchy
from ..prompts import Prompt, cut_at_eos, encode_prompts, eos_ids
from ..decoding.tree import TreeSpec, parse_tree
from .env import hardware_info, model_info


# transformers' own decoding, run with stock linear kernels (as a user gets it) even on a packed model; "hf-packed"
# is transformers' greedy/sampling `generate` on the prepacked linears (`hispec.packed`), the kernel's gain alone
HF_STRATEGIES = ("hf", "hf-early-exit", "hf-prompt-lookup", "hf-packed")
STRATEGIES = HF_STRATEGIES + HISPEC_STRATEGIES
REFERENCE = "hf"
STAGES = ("prefill", "draft", "verify", "target", "other")
SWEEPABLE = ("self-spec", "hispec")
VERIFICATION_SUFFIXES = ("token", "hsd")  # hispec.sampling.VERIFICATIONS


def split_verification(strategy: str) -> tuple[str, str | None]:
    """`"hispec:hsd"` -> ("hispec", "hsd"); `"hispec"` -> ("hispec", None). Raises ValueError on a bad suffix."""
    if strategy.startswith(TREE_PREFIXES + GATE_PREFIXES) or peers.is_peer(strategy):
        return strategy, None
    name, sep, rule = strategy.partition(":")
    if not sep:
        return strategy, None
    if rule not in VERIFICATION_SUFFIXES:
        raise ValueError(f"strategy {strategy!r}: unknown verification {rule!r} after ':' (choose "
                         f"{', '.join(VERIFICATION_SUFFIXES)})")
    if name in HF_STRATEGIES or name == "ar":
        raise ValueError(f"strategy {strategy!r}: a verification rule applies to hispec's speculative strategies, "
                         f"not {name!r}")
    return name, rule


def with_both_verifications(strategies) -> tuple[str, ...]:
    """Each speculative hispec strategy s (no suffix) followed by `s:hsd`, for a side-by-side comparison; the
    plain name then runs token-wise (set `BenchConfig.verification="token"`)."""
    out = []
    for s in strategies:
        out.append(s)
        if s not in HF_STRATEGIES and s != "ar" and ":" not in s and not peers.is_peer(s):
            out.append(f"{s}:hsd")
    return tuple(dict.fromkeys(out))


TREE_PREFIX = "tree:"  # strategy "tree:4x2x1": self-spec drafting that static tree (hispec.decoding.tree)
LOOKUP_TREE_PREFIX = "lookup-tree:"  # "lookup-tree:4": self-spec-lookup, the exit drafting that tree
# prefix -> the strategy that drafts the tree ("eagle-tree:4x2": the EAGLE-3 drafter's tree, hispec.decoding.eagle_tree)
TREE_STRATEGIES = {TREE_PREFIX: "self-spec", LOOKUP_TREE_PREFIX: "self-spec-lookup", "eagle-tree:": "eagle",
                   "eagle-lookup-tree:": "eagle-lookup"}
TREE_PREFIXES = tuple(TREE_STRATEGIES)


def tree_of(strategy: str):
    """`"tree:4x2x1"` / `"lookup-tree:4"` / `"eagle-tree:4x2"` / `"eagle-lookup-tree:4x2"` -> its TreeSpec
    (ValueError when malformed); None for any other strategy."""
    for prefix in TREE_PREFIXES:
        if strategy.startswith(prefix):
            return parse_tree(strategy[len(prefix):])
    return None


def tree_strategy(strategy: str) -> str:
    """The hispec strategy a tree strategy decodes with (`TREE_STRATEGIES`)."""
    return next(name for prefix, name in TREE_STRATEGIES.items() if strategy.startswith(prefix))


# "eagle-gate:0.3": the EAGLE-3 drafter's chain with `generate(draft_gate=0.3)` (stops at a draft below 0.3)
GATE_STRATEGIES = {"eagle-gate:": "eagle", "eagle-lookup-gate:": "eagle-lookup"}
GATE_PREFIXES = tuple(GATE_STRATEGIES)


def gate_of(strategy: str) -> tuple[str, float] | None:
    """`"eagle-gate:0.3"` -> ("eagle", 0.3), `"eagle-lookup-gate:0.2"` -> ("eagle-lookup", 0.2) (ValueError when
    malformed); None for any other strategy."""
    for prefix, name in GATE_STRATEGIES.items():
        if strategy.startswith(prefix):
            try:
                gate = float(strategy[len(prefix):])
            except ValueError:
                raise ValueError(f"strategy {strategy!r}: the gate after '{prefix}' must be a number") from None
            if not 0.0 <= gate < 1.0:
                raise ValueError(f"strategy {strategy!r}: the gate must be in [0, 1)")
            return name, gate
    return None


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class BenchConfig:
    """What to run. `temperature` 0 = greedy (identity to `hf` is checked); > 0 samples (it is not)."""

    strategies: tuple[str, ...] = ("hf", "hf-early-exit", "self-spec", "hispec")
    max_new_tokens: int = 128
    temperature: float = 0.0
    gamma: int | None = None  # None: the checkpoint's decoding default
    window: int | None = None
    warmup: int = 1  # warm-up generations per strategy (first prompt, at most 32 tokens), not timed
    repeats: int = 1  # timed runs per prompt and strategy; a prompt's time is their median
    seed: int = 0
    chat: bool = True
    prompt_lookup_tokens: int = 10  # hf-prompt-lookup: prompt_lookup_num_tokens
    assistant_tokens: int | None = None  # hf-early-exit: num_assistant_tokens (None: transformers' default)
    tie_tolerance: float | None = None  # fp32 logit margin below which a divergence is a rounding tie (None: by dtype)
    tie_check: bool = True  # re-evaluate divergences in fp32 (costs one fp32 copy of the base when it is not fp32)
    ngram: dict | None = None  # hispec's n-gram level: NgramConfig fields (None: `decoding.ngram_config`'s)
    verification: str | None = None  # sampling acceptance rule of unsuffixed hispec strategies (None: checkpoint's)
    # other engines (hispec.bench.peers): the base model's local folder they load (None: the folder the model was
    # loaded from), the EAGLE-3 drafter of the vllm-eagle3 rows (a `speculators` folder, or a drafter run or
    # checkpoint holding one, exported on the fly; None: the model's folder when it holds one), vLLM's Python
    peer_model: str | None = None
    peer_drafter: str | None = None
    vllm_python: str | None = None

    def __post_init__(self):
        self.strategies = tuple(self.strategies)
        if self.verification is not None and self.verification not in VERIFICATION_SUFFIXES:
            raise ValueError(f"unknown verification {self.verification!r}: choose one of "
                             f"{', '.join(VERIFICATION_SUFFIXES)}")
        unknown = [s for s in self.strategies
                   if split_verification(s)[0] not in STRATEGIES and ">" not in s and tree_of(s) is None
                   and gate_of(s) is None and not peers.is_peer(s)]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)} or a hierarchy "
                             "such as ngram>L4>full")
        if not self.strategies:
            raise ValueError("no strategies to run")
        for s in self.strategies:
            if peers.is_peer(s):
                peers.parse(s)  # ValueError when malformed
                if not self.greedy:
                    raise ValueError(f"strategy {s!r}: other engines run greedy only (drop --temperature)")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies are listed twice: {list(self.strategies)}")
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        for name in ("gamma", "window"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---------------------------------------------------------------------------------------------------- samples
@dataclass
class Counters:
    """What one generation did, in the same terms for every strategy (None: not observable for it)."""

    new_tokens: int = 0
    target_passes: int | None = 0  # full-model passes that produced new tokens (prefill included for transformers)
    drafted: int | None = None
    accepted_at_verify: int | None = None
    proposed_to_verify: int | None = None
    accepted_at_target: int | None = None
    proposed_to_target: int | None = None
    layer_evals: int | None = 0  # decoder-layer evaluations beyond one pass over the prompt (None: not observed)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    hierarchy: str | None = None  # hispec: the levels it ran (auto: the chain it chose), e.g. "auto:ngram>L4>full"
    verification: str | None = None  # hispec: the sampling acceptance rule ("token" | "hsd")
    plain_share: float | None = None  # auto: share of row rounds decoded plainly
    levels: list | None = None  # hispec: per-level counters (hispec.decoding.LevelStats.as_dict())


@dataclass
class Sample:
    """One strategy on one prompt, one timed run."""

    seconds: float
    tokens: list[int]
    counters: Counters

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


@dataclass
class PromptRecord:
    index: int
    category: str
    text: str
    prompt_tokens: int
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # strategy -> one Sample per repeat
    # strategy -> fp32 logit margin (reference's token minus the strategy's) where it first left the reference
    margins: dict[str, float | None] = field(default_factory=dict)
    # strategy -> (the same margin in the dtype the model runs in, TieChecker.ULPS of that dtype at those logits)
    own_margins: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class BenchResult:
    config: BenchConfig
    records: list[PromptRecord]
    model_info: dict
    hardware: dict
    tie_tolerance: float = 0.0
    predictions: dict = field(default_factory=dict)  # strategy -> latency-model speedup vs ar (calibrated models)
    predictors: dict = field(default_factory=dict)  # strategy -> f(observed rates) -> predicted speedup vs ar
    failed: dict = field(default_factory=dict)  # peer strategy -> "ExceptionType: message" (it raised; no samples)
    skipped: dict = field(default_factory=dict)  # other engine -> why it did not run (not installed: how to install)
    engines: dict = field(default_factory=dict)  # other engine's row -> what ran (version, CPU features, files, ...)
    lossy: tuple = ()  # rows whose outputs are not expected to equal the reference's (quantised models)

    @property
    def strategies(self) -> tuple[str, ...]:
        """The configured strategies that ran (those that failed or were skipped are left out)."""
        return tuple(s for s in self.config.strategies if s not in self.failed and s not in self.skipped)


# ---------------------------------------------------------------------------------------------------- counting
class PassCounter:
    """Forward hooks on the base model: full vs early-exit passes, their time, decoder-layer evaluations of
    transformers' own strategies. Attached only while one runs (`with counter:`): a decoder layer with hooks is run
    through its own forward, so hooks left on would take hispec's strategies off their faster path (`hispec.fused`)
    and the benchmark would time something a user does not run."""

    def __init__(self, base: torch.nn.Module, layers, device=None):
        self.base, self.layers = base, list(layers)
        self.num_layers, self.device = len(self.layers), device
        self.handles = []
        self.reset()

    def __enter__(self):
        self.remove()
        self.handles = [
            self.base.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.base.register_forward_hook(self._post, with_kwargs=True),
        ] + [layer.register_forward_pre_hook(self._layer, with_kwargs=True) for layer in self.layers]
        return self

    def __exit__(self, *exc):
        self.remove()

    def reset(self):
        self.full_passes = self.draft_passes = self.layer_tokens = 0
        self.full_seconds = self.draft_seconds = self.prefill_seconds = 0.0
        self._layers_in_call = 0
        self._t0 = None

    def _pre(self, module, args, kwargs):
        self._layers_in_call, self._t0 = 0, timing.now(self.device)

    def _post(self, module, args, kwargs, output):
        if self._t0 is None:
            return
        dt = timing.now(self.device) - self._t0
        if self._layers_in_call >= self.num_layers:
            if self.full_passes == 0:
                self.prefill_seconds += dt
            else:
                self.full_seconds += dt
            self.full_passes += 1
        else:
            self.draft_passes += 1
            self.draft_seconds += dt
        self._t0 = None

    def _layer(self, module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            self.layer_tokens += hidden.shape[0] * hidden.shape[1]
        self._layers_in_call += 1

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


# ---------------------------------------------------------------------------------------------------- running
class Runner:
    """Runs one strategy on one prompt (`[1, P]` ids) and returns a `Sample`."""

    def __init__(self, model, config: BenchConfig):
        self.model, self.config = model, config
        self.counter = PassCounter(model.base, model.adapter.parts.layers, model.device)
        self.eos = eos_ids(generation_config=model.base.generation_config)
        gen = model.base.generation_config
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else (self.eos[0] if self.eos else 0)

    def close(self):
        self.counter.remove()

    def _hf_kwargs(self, strategy: str, max_new_tokens: int) -> dict:
        from transformers import GenerationConfig

        cfg = self.config
        gc = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1, do_sample=not cfg.greedy,
                  repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=self.eos or None,
                  pad_token_id=self.pad, bos_token_id=self.model.base.generation_config.bos_token_id)
        if not cfg.greedy:  # plain temperature sampling, as hispec's (no top-k/top-p warping)
            gc.update(temperature=cfg.temperature, top_k=0, top_p=1.0, typical_p=1.0)
        if strategy == "hf-early-exit":
            gc["assistant_early_exit"] = self.model.draft_layer
            if cfg.assistant_tokens is not None:
                gc["num_assistant_tokens"] = cfg.assistant_tokens
        elif strategy == "hf-prompt-lookup":
            gc["prompt_lookup_num_tokens"] = cfg.prompt_lookup_tokens
        return {"generation_config": GenerationConfig(**gc)}

    def run(self, strategy: str, ids: torch.Tensor, mask: torch.Tensor, seed: int,
            max_new_tokens: int | None = None, gamma: int | None = None, window: int | None = None,
            model=None) -> Sample:
        model = model or self.model
        cfg = self.config
        n = max_new_tokens or cfg.max_new_tokens
        P = int(mask.sum())
        L = model.num_layers
        self.counter.reset()
        if strategy in HF_STRATEGIES:
            kwargs = self._hf_kwargs(strategy, n)
            torch.manual_seed(seed)
            kernels = contextlib.nullcontext() if strategy == "hf-packed" else packed.stock()
            with self.counter:  # (attached outside the timed span)
                t0 = timing.now(model.device)
                with torch.no_grad(), kernels:
                    out = model.base.generate(ids, attention_mask=mask, **kwargs)
                secs = timing.now(model.device) - t0
            tokens, _ = cut_at_eos(out[0, ids.shape[1]:].tolist(), self.eos)
            c = self.counter
            counters = Counters(new_tokens=len(tokens), target_passes=c.full_passes,
                                layer_evals=c.layer_tokens - (P - 1) * L)
            if strategy == "hf-early-exit":
                # each draft pass proposes one token; each full pass adds one token of its own
                counters.drafted = counters.proposed_to_target = c.draft_passes
                counters.accepted_at_target = max(0, len(tokens) - c.full_passes)
            counters.seconds.update(prefill=c.prefill_seconds, draft=c.draft_seconds, target=c.full_seconds)
        else:
            gen = torch.Generator(device=model.device).manual_seed(seed) if not cfg.greedy else None
            t0 = timing.now(model.device)
            name, rule = split_verification(strategy)
            tree, gated = tree_of(name), gate_of(name)
            if gated is not None:
                name, gate = gated
            out = model.generate(ids, mask, max_new_tokens=n, strategy=tree_strategy(name) if tree else name,
                                 tree=tree, do_sample=not cfg.greedy, draft_gate=gate if gated else 0.0,
                                 verification=None if tree else rule or cfg.verification,
                                 temperature=cfg.temperature if not cfg.greedy else 1.0,
                                 gamma=gamma if gamma is not None else cfg.gamma,
                                 window=window if window is not None else cfg.window, ngram=cfg.ngram,
                                 eos_token_id=self.eos or None, pad_token_id=self.pad, generator=gen)
            secs = timing.now(model.device) - t0
            s = out.stats
            tokens = list(out.new_tokens[0])
            counters = Counters(new_tokens=len(tokens), target_passes=s.target_row_passes,
                                layer_evals=s.layer_evals - (P - 1) * L, hierarchy=s.strategy,
                                verification=s.verification)
            if len(s.levels) > 1:
                counters.drafted = s.drafted
                counters.accepted_at_target, counters.proposed_to_target = s.accepted_at_target, s.proposed_to_target
            if len(s.levels) > 2:
                counters.accepted_at_verify, counters.proposed_to_verify = s.accepted_at_verify, s.proposed_to_verify
            if s.row_rounds:
                counters.plain_share = s.plain_row_rounds / s.row_rounds
            counters.levels = [lv.as_dict() for lv in s.levels]
            counters.seconds.update({k: float(v) for k, v in s.seconds.items() if k in STAGES})
        counters.seconds["other"] = max(0.0, secs - sum(v for k, v in counters.seconds.items() if k != "other"))
        return Sample(seconds=secs, tokens=tokens, counters=counters)


def _progress(total: int, enabled: bool, desc: str):
    return tqdm(total=total, disable=not enabled, desc=desc, unit="run", dynamic_ncols=True)


def _rotated(items, k: int) -> list:
    items = list(items)
    k %= len(items)
    return items[k:] + items[:k]


def encode(model, prompts: list[Prompt], chat: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer; the benchmark renders text prompts and needs one")
    return [tuple(t.to(model.device) for t in encode_prompts(model.tokenizer, [p.text], chat=chat)) for p in prompts]


def check_fits(model, encoded, max_new_tokens: int) -> None:
    """Refuse before any work a prompt that does not fit the context with max_new_tokens."""
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    longest = max(int(ids.shape[1]) for ids, _ in encoded)
    if max_pos and longest + max_new_tokens > max_pos:
        raise ValueError(f"the longest prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's context of {max_pos}; lower --max-new-tokens or choose other prompts")


TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def tie_tolerance(config: BenchConfig, dtype: torch.dtype) -> float:
    """Largest fp32 logit margin still read as a rounding tie for a model run in `dtype`."""
    return config.tie_tolerance if config.tie_tolerance is not None else TIE_TOLERANCE.get(dtype, 0.5)


class TieChecker:
    """Why did a greedy run leave the reference? Re-evaluates the divergence point in fp32.

    In bf16/fp16 two correct computations of the same model (one pass over the prompt, or the prompt then one
    token; one token or eight at a time) round differently, and greedy decoding follows a different token
    wherever the top two logits are closer than that rounding. The margin (reference's token minus the
    strategy's, fp32 logits of the reference model given the common prefix) separates such near-ties (|margin|
    tiny) from real errors (the strategy chose a clearly worse token).

    `own_margin` asks the same in the dtype the model runs in (one pass over the common prefix, its own kernels): a
    bf16 logit near 11 is a multiple of 1/16, so two tokens within `ULPS` units in the last place of each other
    are tied at the model's own resolution, and another correct computation order can flip them even where the
    fp32 model separates them by more than the fp32 tolerance (measured on a Xeon with AMX, SmolLM2 bf16: fp32
    margin 0.63, bf16 margin 0.06 over the prefix and 0.125 over an 8-position pass). A wrong token is not within
    a couple of its own ulps of the top.
    """

    ULPS = 2

    def __init__(self, model):
        self.model = model
        self._fp32 = None

    def _base32(self):
        if self._fp32 is None:
            if self.model.dtype == torch.float32:
                self._fp32 = self.model.base
            else:

                self._fp32 = copy.deepcopy(self.model.base).float().eval()
        return self._fp32

    @staticmethod
    def _common_prefix(ids: torch.Tensor, mask: torch.Tensor, ref: list[int], other: list[int]):
        """(prompt + the tokens both runs share, the index of the first that differs), or None."""
        k = _first_mismatch(other, ref)
        if k is None or k >= min(len(ref), len(other)):
            return None
        prompt = ids[0][mask[0].bool()]
        return torch.cat([prompt, torch.tensor(ref[:k], dtype=prompt.dtype, device=prompt.device)])[None], k

    @torch.no_grad()
    def margin(self, ids: torch.Tensor, mask: torch.Tensor, ref: list[int], other: list[int]) -> float | None:
        found = self._common_prefix(ids, mask, ref, other)
        if found is None:
            return None
        seq, k = found
        with packed.stock():  # the reference's kernels (transformers' strategies run unpacked)
            logits = self._base32()(seq).logits[0, -1].float()
        return float(logits[ref[k]] - logits[other[k]])

    @torch.no_grad()
    def own_margin(self, ids: torch.Tensor, mask: torch.Tensor, ref: list[int], other: list[int]
                   ) -> tuple[float, float] | None:
        """(margin of the reference's token over the strategy's in the model's own dtype and kernels, `ULPS` units
        in the last place of that dtype at the larger of the two logits), or None."""
        found = self._common_prefix(ids, mask, ref, other)
        if found is None:
            return None
        seq, k = found
        logits = self.model.base(seq).logits[0, -1]
        a, b = float(logits[ref[k]]), float(logits[other[k]])
        top = max(abs(a), abs(b), torch.finfo(logits.dtype).tiny)
        ulp = 2.0 ** math.floor(math.log2(top)) * torch.finfo(logits.dtype).eps
        return a - b, self.ULPS * ulp

    def close(self):
        self._fp32 = None


@contextlib.contextmanager
def restored_config(base: torch.nn.Module):
    """Undo, when the block ends (raising or not), what it changed in `base`'s config (and text config) and
    generation config: attributes set, replaced or added (the values themselves are not copied)."""
    config = base.config
    objs = [config, getattr(base, "generation_config", None)]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    objs.append(text if text is not config else None)
    saved = [(vars(o), dict(vars(o))) for o in objs if o is not None]
    try:
        yield
    finally:
        for now, before in saved:
            for k in [k for k in now if k not in before]:
                del now[k]
            now.update(before)


class _Attempts:
    """Runs every strategy through `runner`; a peer strategy (transformers' own, `HF_STRATEGIES`) runs under
    `restored_config`, and when it raises it is recorded in `failed` ("ExceptionType: message"), its samples are
    dropped and it is not run again. hispec's own strategies are not caught."""

    def __init__(self, runner: Runner, records: list[PromptRecord]):
        self.runner, self.records, self.failed = runner, records, {}

    def run(self, strategy: str, ids, mask, seed: int, **kw) -> Sample | None:
        if strategy in self.failed:
            return None
        if strategy not in HF_STRATEGIES:
            return self.runner.run(strategy, ids, mask, seed, **kw)
        try:
            with restored_config(self.runner.model.base):
                return self.runner.run(strategy, ids, mask, seed, **kw)
        except Exception as e:  # noqa: BLE001 (a peer's own bug or missing feature: reported, not fatal)
            self.failed[strategy] = f"{type(e).__name__}: {e}"
            for rec in self.records:
                rec.samples.pop(strategy, None)
            return None


def run_bench(model, prompts: list[Prompt], config: BenchConfig, progress: bool = False) -> BenchResult:
    """Decode every prompt with every strategy, interleaved (see module docstring); a peer strategy that raises is
    reported in `BenchResult.failed` and the others go on."""
    if "hf-early-exit" in config.strategies and model.draft_layer >= model.num_layers:
        raise ValueError("hf-early-exit needs a draft layer below the model's depth")
    encoded = encode(model, prompts, config.chat)
    check_fits(model, encoded, config.max_new_tokens)
    runner = Runner(model, config)
    records = [PromptRecord(i, p.category, p.text, int(m.sum())) for i, (p, (_, m)) in enumerate(zip(prompts, encoded))]
    attempts = _Attempts(runner, records)
    own = tuple(s for s in config.strategies if not peers.is_peer(s))
    try:
        if own:
            _run_all(attempts, encoded, records, config, progress, own)
    finally:
        runner.close()
    result = BenchResult(config=config, records=records, model_info=model_info(model), hardware=hardware_info(),
                         tie_tolerance=tie_tolerance(config, model.dtype), failed=attempts.failed)
    if len(own) < len(config.strategies):
        _run_peers(model, encoded, result, runner.eos, progress)
    if not result.strategies:
        raise ValueError(f"every strategy failed: {dict(result.failed, **result.skipped)}")
    if config.greedy and config.tie_check:
        _tie_margins(model, encoded, records, [s for s in result.strategies if s not in result.lossy])
    result.predictions, result.predictors = predict_speedups(model, config)
    return result


def _run_all(attempts: _Attempts, encoded, records, config: BenchConfig, progress: bool, strategies) -> None:
    """The warm-up runs, then every prompt x repeat x strategy (rotated order), into `records`."""
    with _progress(config.warmup * len(strategies), progress and config.warmup > 0, "warm-up") as bar:
        for _ in range(config.warmup):
            for s in strategies:
                bar.set_postfix_str(s)
                attempts.run(s, *encoded[0], seed=config.seed, max_new_tokens=min(32, config.max_new_tokens))
                bar.update()
    with _progress(len(encoded) * config.repeats * len(strategies), progress, "bench") as bar:
        for i, (ids, mask) in enumerate(encoded):
            for r in range(config.repeats):
                seed = config.seed + 1000 * i + r
                for s in _rotated(strategies, i * config.repeats + r):
                    bar.set_postfix_str(f"prompt {i + 1}/{len(encoded)} {s}")
                    sample = attempts.run(s, ids, mask, seed)
                    if sample is not None:
                        records[i].samples.setdefault(s, []).append(sample)
                    bar.update()


def _run_peers(model, encoded, result: BenchResult, eos: list[int], progress: bool) -> None:
    """The other engines' rows (`hispec.bench.peers`) on the same prompt ids, into `result` (records, failed,
    skipped, engines, lossy)."""
    from .peers.job import peer_job

    config = result.config
    names = [s for s in config.strategies if peers.is_peer(s)]
    prompts = [ids[0][mask[0].bool()].tolist() for ids, mask in encoded]
    try:
        job = peer_job(model, prompts, config, eos, threads=torch.get_num_threads())
    except peers.PeerError as e:  # no usable base-model folder: every peer row fails with that reason
        result.failed.update({n: f"{type(e).__name__}: {e}" for n in names})
        return
    outcomes = peers.run_peers(names, job, progress=progress)
    L = model.num_layers
    for name, o in outcomes.items():
        if o.skipped:
            result.skipped[name] = o.skipped
            continue
        if o.failed:
            result.failed[name] = o.failed
            continue
        result.engines[name] = dict(o.info, lossy=o.spec.lossy)
        if o.spec.lossy:
            result.lossy += (name,)
        for rec, runs in zip(result.records, o.runs):
            rec.samples[name] = [Sample(seconds=r.seconds, tokens=r.tokens, counters=Counters(
                new_tokens=len(r.tokens), target_passes=r.passes,
                drafted=r.drafted, accepted_at_target=r.accepted, proposed_to_target=r.drafted,
                layer_evals=None if r.positions is None else r.positions * L,
                seconds={**dict.fromkeys(STAGES, 0.0), "other": r.seconds}, hierarchy=None)) for r in runs]


def _tie_margins(model, encoded, records, strategies) -> None:
    """The fp32 margin, and the margin in the model's own dtype, at each greedy run's first divergence from the
    reference (`TieChecker`), into `records`."""
    ref = next((r for r in (REFERENCE, "ar") if r in strategies), None)
    if ref is None:
        return
    checker = TieChecker(model)
    for rec, (ids, mask) in zip(records, encoded):
        for s in strategies:
            if s != ref:
                diverged = [x for x in rec.samples[s] if x.tokens != rec.samples[ref][0].tokens]
                if diverged:
                    rec.margins[s] = checker.margin(ids, mask, rec.samples[ref][0].tokens, diverged[0].tokens)
                    own = checker.own_margin(ids, mask, rec.samples[ref][0].tokens, diverged[0].tokens)
                    if own is not None:
                        rec.own_margins[s] = own
    checker.close()


def predict_speedups(model, config: BenchConfig) -> tuple[dict, dict]:
    """The latency model's speedup over plain decoding (`ar`) for each hispec strategy, from the checkpoint's
    calibration (acceptances measured on other text than the benchmark's), and per fixed hierarchy a function of
    observed rates ({"L4>full": a, ..., "ngram_match": m}) giving the same model's prediction with the run's own
    acceptance (which isolates the cost model's error); ({}, {}) without a usable calibration."""
    cal = model.hispec_config.calibration
    if not cal:
        return {}, {}
    try:
        cal = latency.Calibration.from_dict(cal)
        cal.check(model)
    except latency.CalibrationError:
        return {}, {}
    hc = model.hispec_config
    kw = dict(gamma=config.gamma or hc.gamma, window=config.window or hc.window,
              ngram=ngram_config(model, config.ngram))
    # a drafter's chains at its own default gamma unless the run sets one, as `generate` drafts them
    eagle_gamma = config.gamma or getattr(getattr(model, "drafter", None), "default_gamma", None)
    plain = latency.time_per_token(["full"], [], cal)
    out, fns = {}, {}
    for s in config.strategies:
        if s in HF_STRATEGIES or peers.is_peer(s):
            continue
        c, gated = cal.with_gate(0), gate_of(s)  # (fixed strategies run full chains; `auto` its calibration's gate)
        if gated is not None:  # a gated chain: priced where the calibration measured that gate
            try:
                c = cal.with_gate(gated[1])
            except latency.CalibrationError:
                continue
        tree = tree_of(s)
        if tree is not None:  # static trees from the calibration's top-k rates (dynamic trees are not modelled)
            drafter = tree_strategy(s).startswith("eagle")
            if isinstance(tree, TreeSpec) and cal.topk:
                try:
                    out[s] = plain / latency.tree_time_per_token(list(tree.widths), cal, "eagle3" if drafter else None,
                                                                 lookup=tree_strategy(s).endswith("lookup"))
                except latency.CalibrationError:  # e.g. a lookup tree, but no n-gram rate in the calibration
                    pass
            continue
        name, rule = split_verification(s)  # (the model's i.i.d. acceptance is token-wise; for hsd it is a fit)
        if name == "auto":  # planned as `generate` plans it; rows may also decode plainly: the better of the two
            _, _, t = _auto_plan(model, cal, max_new_tokens=config.max_new_tokens, **kw,
                                 trees=_auto_trees(not config.greedy, rule or config.verification or hc.verification))
            out[s] = plain / min(t, plain)
            continue
        levels = build_levels(model, parse_hierarchy(gated[0] if gated else name, model), **kw, eagle_gamma=eagle_gamma)
        names, gammas = [lv.name for lv in levels], [lv.threshold for lv in levels[:-1]]
        if not levels[0].lookup:  # (a lookup-first level's counters mix its two drafters: no observed rates)
            fns[s] = (lambda names, gs, c: lambda obs: plain / latency.time_per_token(
                names, gs, c, acceptance={k: v for k, v in obs.items() if k != "ngram_match" and v is not None},
                ngram_match=obs.get("ngram_match")))(names, gammas, c)
        out[s] = plain / latency.time_per_token(names, gammas, c)
    return out, fns


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
