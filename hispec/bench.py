"""Latency benchmark and parameter sweep: hispec's strategies against transformers' own, side by side.

Contract:
- `run_bench(model, prompts, config)` decodes every prompt (batch size 1) with every strategy in one process,
  interleaved per prompt with a rotating order, so machine drift hits all strategies alike. Strategies:
  `hf` (transformers `generate`, the reference), `hf-early-exit` (`generate(assistant_early_exit=L_d)`: the base
  model's own final norm + lm_head at L_d), `hf-prompt-lookup` (`prompt_lookup_num_tokens`), and hispec's `ar`,
  `self-spec`, `hispec` (`hispec.decoding.generate`). It returns the raw samples (`BenchResult`). A hispec
  strategy may carry the sampling acceptance rule as a suffix, `hispec:hsd` / `hispec:token` (`split_verification`),
  so both rules run side by side on the same prompts; without one it uses `BenchConfig.verification` (None: the
  checkpoint's default). Greedy runs are identical under both rules.
- `summarize(result)` turns samples into figures per strategy and per prompt category (`Summary`): tokens/s (median
  over prompts; a prompt's figure is the median over repeats), speedup vs `hf` and vs `self-spec` (median of
  per-prompt ratios, each measured side by side), tokens per full-model pass, acceptance per stage, decoder-layer
  evaluations per generated token, time share per stage, and the share of prompts whose new tokens equal the
  reference's (greedy only). In bf16/fp16 two correct computations of one model round differently, so greedy runs
  may part at a near-tie of the top two logits: `run_bench` re-evaluates each first divergence in fp32
  (`TieChecker`) and `identical_up_to_ties` counts those within `tie_tolerance` as identical.
- `format_table(summary)` is fixed-width text; `summary.as_dict()` is the machine-readable summary; `plot(summary,
  path)` writes a PNG of speedup by category and strategy (matplotlib, Agg canvas, no global backend change).
- `run_sweep(model, prompts, settings, config)` times `hf` and every setting (draft layer, verify layer, gamma,
  window) on the same prompts, interleaved, and `SweepResult.best` is the fastest setting whose outputs are all
  identical to `hf` (up to rounding ties). `write_decoding_defaults(folder, setting)` stores it in the
  checkpoint's config.json (temporary file + os.replace).

Counting for transformers' strategies uses forward hooks (installed for every strategy alike, so all pay their
small cost): a top-level model call that runs every decoder layer is a full-model pass, one that runs fewer is an
early-exit draft pass. Layer evaluations exclude one pass over the prompt (all strategies prefill it alike).
Nothing here prints; progress goes through tqdm on stderr when asked.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .decoding import STRATEGIES as HISPEC_STRATEGIES
from .io import write_json
from .prompts import Prompt, encode_prompts

HF_STRATEGIES = ("hf", "hf-early-exit", "hf-prompt-lookup")
STRATEGIES = HF_STRATEGIES + HISPEC_STRATEGIES
REFERENCE = "hf"
STAGES = ("prefill", "draft", "verify", "target", "other")
SWEEPABLE = ("self-spec", "hispec")
VERIFICATION_SUFFIXES = ("token", "hsd")  # hispec.sampling.VERIFICATIONS


def split_verification(strategy: str) -> tuple[str, str | None]:
    """`"hispec:hsd"` -> ("hispec", "hsd"); `"hispec"` -> ("hispec", None). Raises ValueError on a bad suffix."""
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
        if s not in HF_STRATEGIES and s != "ar" and ":" not in s:
            out.append(f"{s}:hsd")
    return tuple(dict.fromkeys(out))


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
    ngram: dict | None = None  # hispec's n-gram level: NgramConfig fields (None: the checkpoint's / defaults)
    verification: str | None = None  # sampling acceptance rule of unsuffixed hispec strategies (None: checkpoint's)

    def __post_init__(self):
        self.strategies = tuple(self.strategies)
        if self.verification is not None and self.verification not in VERIFICATION_SUFFIXES:
            raise ValueError(f"unknown verification {self.verification!r}: choose one of "
                             f"{', '.join(VERIFICATION_SUFFIXES)}")
        unknown = [s for s in self.strategies if split_verification(s)[0] not in STRATEGIES and ">" not in s]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)} or a hierarchy "
                             "such as ngram>L4>full")
        if not self.strategies:
            raise ValueError("no strategies to run")
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
    target_passes: int = 0  # full-model passes that produced new tokens (prefill included for transformers)
    drafted: int | None = None
    accepted_at_verify: int | None = None
    proposed_to_verify: int | None = None
    accepted_at_target: int | None = None
    proposed_to_target: int | None = None
    layer_evals: int = 0  # decoder-layer evaluations beyond one pass over the prompt
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


@dataclass
class BenchResult:
    config: BenchConfig
    records: list[PromptRecord]
    model_info: dict
    hardware: dict
    tie_tolerance: float = 0.0
    predictions: dict = field(default_factory=dict)  # strategy -> latency-model speedup vs ar (calibrated models)
    predictors: dict = field(default_factory=dict)  # strategy -> f(observed rates) -> predicted speedup vs ar


# ---------------------------------------------------------------------------------------------------- counting
class PassCounter:
    """Forward hooks on the base model: full vs early-exit passes, their time, decoder-layer evaluations."""

    def __init__(self, base: torch.nn.Module, layers):
        self.num_layers = len(layers)
        self.handles = [
            base.register_forward_pre_hook(self._pre, with_kwargs=True),
            base.register_forward_hook(self._post, with_kwargs=True),
        ] + [layer.register_forward_pre_hook(self._layer, with_kwargs=True) for layer in layers]
        self.reset()

    def reset(self):
        self.full_passes = self.draft_passes = self.layer_tokens = 0
        self.full_seconds = self.draft_seconds = self.prefill_seconds = 0.0
        self._layers_in_call = 0
        self._t0 = None

    def _pre(self, module, args, kwargs):
        self._layers_in_call, self._t0 = 0, time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
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


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _eos_ids(model) -> list[int]:
    eos = getattr(model.base.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


# ---------------------------------------------------------------------------------------------------- running
class Runner:
    """Runs one strategy on one prompt (`[1, P]` ids) and returns a `Sample`."""

    def __init__(self, model, config: BenchConfig):
        self.model, self.config = model, config
        self.counter = PassCounter(model.base, model.adapter.parts.layers)
        self.eos = _eos_ids(model)
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
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.base.generate(ids, attention_mask=mask, **kwargs)
            secs = time.perf_counter() - t0
            tokens = _cut_at_eos(out[0, ids.shape[1]:].tolist(), set(self.eos))
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
            name, rule = split_verification(strategy)
            t0 = time.perf_counter()
            out = model.generate(ids, mask, max_new_tokens=n, strategy=name, do_sample=not cfg.greedy,
                                 verification=rule or cfg.verification,
                                 temperature=cfg.temperature if not cfg.greedy else 1.0,
                                 gamma=gamma if gamma is not None else cfg.gamma,
                                 window=window if window is not None else cfg.window, ngram=cfg.ngram,
                                 eos_token_id=self.eos or None, pad_token_id=self.pad, generator=gen)
            secs = time.perf_counter() - t0
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
    from tqdm.auto import tqdm

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
    """

    def __init__(self, model):
        self.model = model
        self._fp32 = None

    def _base32(self):
        if self._fp32 is None:
            if self.model.dtype == torch.float32:
                self._fp32 = self.model.base
            else:
                import copy

                self._fp32 = copy.deepcopy(self.model.base).float().eval()
        return self._fp32

    @torch.no_grad()
    def margin(self, ids: torch.Tensor, mask: torch.Tensor, ref: list[int], other: list[int]) -> float | None:
        k = _first_mismatch(other, ref)
        if k is None or k >= min(len(ref), len(other)):
            return None
        prompt = ids[0][mask[0].bool()]
        seq = torch.cat([prompt, torch.tensor(ref[:k], dtype=prompt.dtype, device=prompt.device)])[None]
        logits = self._base32()(seq).logits[0, -1].float()
        return float(logits[ref[k]] - logits[other[k]])

    def close(self):
        self._fp32 = None


def run_bench(model, prompts: list[Prompt], config: BenchConfig, progress: bool = False) -> BenchResult:
    """Decode every prompt with every strategy, interleaved (see module docstring)."""
    if "hf-early-exit" in config.strategies and model.draft_layer >= model.num_layers:
        raise ValueError("hf-early-exit needs a draft layer below the model's depth")
    encoded = encode(model, prompts, config.chat)
    check_fits(model, encoded, config.max_new_tokens)
    runner = Runner(model, config)
    records = [PromptRecord(i, p.category, p.text, int(m.sum())) for i, (p, (_, m)) in enumerate(zip(prompts, encoded))]
    strategies = config.strategies
    try:
        with _progress(config.warmup * len(strategies), progress and config.warmup > 0, "warm-up") as bar:
            for w in range(config.warmup):
                for s in strategies:
                    bar.set_postfix_str(s)
                    runner.run(s, *encoded[0], seed=config.seed, max_new_tokens=min(32, config.max_new_tokens))
                    bar.update()
        with _progress(len(prompts) * config.repeats * len(strategies), progress, "bench") as bar:
            for i, (ids, mask) in enumerate(encoded):
                for r in range(config.repeats):
                    seed = config.seed + 1000 * i + r
                    for s in _rotated(strategies, i * config.repeats + r):
                        bar.set_postfix_str(f"prompt {i + 1}/{len(encoded)} {s}")
                        records[i].samples.setdefault(s, []).append(runner.run(s, ids, mask, seed))
                        bar.update()
    finally:
        runner.close()
    if config.greedy and config.tie_check:
        ref = next((r for r in (REFERENCE, "ar") if r in strategies), None)
        checker = TieChecker(model)
        for rec, (ids, mask) in zip(records, encoded):
            for s in strategies:
                if ref is not None and s != ref:
                    diverged = [x for x in rec.samples[s] if x.tokens != rec.samples[ref][0].tokens]
                    if diverged:
                        rec.margins[s] = checker.margin(ids, mask, rec.samples[ref][0].tokens, diverged[0].tokens)
        checker.close()
    predictions, predictors = predict_speedups(model, config)
    return BenchResult(config=config, records=records, model_info=model_info(model), hardware=hardware_info(),
                       tie_tolerance=tie_tolerance(config, model.dtype), predictions=predictions,
                       predictors=predictors)


def predict_speedups(model, config: BenchConfig) -> tuple[dict, dict]:
    """The latency model's speedup over plain decoding (`ar`) for each hispec strategy, from the checkpoint's
    calibration (acceptances measured on other text than the benchmark's), and per fixed hierarchy a function of
    observed rates ({"L4>full": a, ..., "ngram_match": m}) giving the same model's prediction with the run's own
    acceptance (which isolates the cost model's error); ({}, {}) without a usable calibration."""
    from . import latency
    from .decoding import _auto_chain, build_levels, parse_hierarchy
    from .ngram import NgramConfig

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
              ngram=NgramConfig(**(config.ngram or hc.ngram or {})))
    plain = latency.time_per_token(["full"], [], cal)
    out, fns = {}, {}
    for s in config.strategies:
        if s in HF_STRATEGIES:
            continue
        name = split_verification(s)[0]  # (the model's i.i.d. acceptance is token-wise; for hsd it is a fit)
        levels = _auto_chain(model, cal, **kw) if name == "auto" else build_levels(
            model, parse_hierarchy(name, model), **kw)
        names = [lv.name for lv in levels]
        t = latency.time_per_token(names, [lv.threshold for lv in levels[:-1]], cal)
        if name == "auto":  # rows may also decode plainly: the better of the two
            t = min(t, plain)
        else:
            fns[s] = (lambda names, gs: lambda obs: plain / latency.time_per_token(
                names, gs, cal, acceptance={k: v for k, v in obs.items() if k != "ngram_match" and v is not None},
                ngram_match=obs.get("ngram_match")))(names, [lv.threshold for lv in levels[:-1]])
        out[s] = plain / t
    return out, fns


# ---------------------------------------------------------------------------------------------------- environment
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info() -> dict:
    import transformers

    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def model_info(model) -> dict:
    h = model.hispec_config
    return {"name_or_path": h.base.get("name_or_path") or getattr(model.base.config, "_name_or_path", ""),
            "num_layers": model.num_layers, "draft_layer": h.draft_layer, "verify_layer": h.verify_layer,
            "head_type": h.head_type, "gamma": h.gamma, "window": h.window,
            "draft_vocab_size": h.draft_vocab_size, "verify_vocab_size": h.verify_vocab_size,
            "dtype": str(model.dtype).replace("torch.", "")}


# ---------------------------------------------------------------------------------------------------- summary
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(num, den):
    return None if num is None or not den else num / den


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class StrategySummary:
    strategy: str
    prompts: int
    tokens_per_s: float
    speedup_vs_hf: float | None
    speedup_vs_self_spec: float | None
    tokens_per_target_pass: float
    verify_acceptance: float | None
    target_acceptance: float | None
    layer_evals_per_token: float
    time_share: dict
    identical: float | None  # share of prompts whose new tokens equal the reference's (greedy only)
    identical_up_to_ties: float | None  # the same, counting a divergence at an fp32 near-tie as identical
    new_tokens: int
    speedup_vs_ar: float | None = None  # vs hispec's own plain decoding (what the latency model predicts against)
    predicted_speedup_vs_ar: float | None = None  # the latency model's prediction from the checkpoint's calibration
    prediction_error: float | None = None  # predicted / measured - 1
    # the same model fed this run's own observed acceptance (and n-gram match) rates: the cost model's error alone
    predicted_speedup_observed: float | None = None
    prediction_error_observed: float | None = None
    observed_acceptance: dict | None = None
    plain_share: float | None = None  # auto: share of row rounds decoded plainly
    hierarchy: str | None = None
    verification: str | None = None  # hispec: the sampling acceptance rule it ran with
    # `s:hsd` next to `s`: median per-prompt tokens/s ratio and tokens-per-full-pass ratio, HSD over token-wise
    speedup_vs_token: float | None = None
    tokens_per_target_pass_vs_token: float | None = None


@dataclass
class Summary:
    config: BenchConfig
    reference: str | None
    strategies: dict[str, StrategySummary]
    categories: dict[str, dict]  # category -> {"prompts": n, "strategies": {s: {tokens_per_s, speedup_vs_hf, ..}}}
    per_prompt: list[dict]
    model_info: dict
    hardware: dict
    tie_tolerance: float = 0.0

    def _all(self, attr: str) -> bool | None:
        if not self.config.greedy or self.reference is None:
            return None
        return all(getattr(s, attr) == 1.0 for name, s in self.strategies.items() if name != self.reference)

    @property
    def lossless(self) -> bool | None:
        """All strategies reproduced the reference on every prompt (None: sampling, or no reference)."""
        return self._all("identical")

    @property
    def lossless_up_to_ties(self) -> bool | None:
        """As `lossless`, but a run that first left the reference at an fp32 near-tie counts as identical."""
        return self._all("identical_up_to_ties")

    @property
    def headline_strategy(self) -> str | None:
        """What the headline figures describe: `auto` (the default decoding) when it ran, else `hispec`."""
        return next((s for s in ("auto", "hispec") if s in self.strategies), None)

    def headline(self, name: str) -> float | None:
        s = self.strategies.get(self.headline_strategy)
        return None if s is None else getattr(s, name)

    def as_dict(self, per_prompt: bool = False) -> dict:
        d = {
            "lossless": self.lossless,
            "lossless_up_to_ties": self.lossless_up_to_ties,
            "tie_tolerance": self.tie_tolerance,
            "headline": self.headline_strategy,
            "speedup_vs_hf": self.headline("speedup_vs_hf"),
            "speedup_vs_self_spec": self.headline("speedup_vs_self_spec"),
            "reference": self.reference,
            "strategies": {k: asdict(v) for k, v in self.strategies.items()},
            "categories": self.categories,
            "config": {**asdict(self.config), "strategies": list(self.config.strategies),
                       "prompts": len(self.per_prompt)},
            "model": self.model_info,
            "hardware": self.hardware,
        }
        if per_prompt:
            d["per_prompt"] = self.per_prompt
        return d


def _prompt_figures(rec: PromptRecord, ref: str | None, tol: float) -> dict[str, dict]:
    """Per strategy on one prompt: tokens/s (median over repeats), tokens, identity to the reference."""
    out = {}
    ref_tokens = rec.samples[ref][0].tokens if ref in rec.samples else None
    for s, samples in rec.samples.items():
        fig = {"tokens_per_s": _median([x.tokens_per_s for x in samples]),
               "seconds": _median([x.seconds for x in samples]), "new_tokens": len(samples[0].tokens)}
        if ref_tokens is not None:
            mism = [_first_mismatch(x.tokens, ref_tokens) for x in samples]
            fig["identical"] = all(m is None for m in mism)
            fig["first_mismatch"] = next((m for m in mism if m is not None), None)
            margin = rec.margins.get(s)
            fig["mismatch_margin"] = margin
            fig["identical_up_to_ties"] = fig["identical"] or (margin is not None and abs(margin) <= tol)
        out[s] = fig
    return out


def _mean_opt(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _observed_rates(cs) -> dict | None:
    """Per adjacent pair of levels the i.i.d. acceptance a run observed ("L4>full": acc / (acc + rejections)), and
    "ngram_match" (share of n-gram lookups that proposed anything); None for runs without per-level counters."""
    runs = [c.levels for c in cs if c.levels]
    if not runs or len(runs[0]) < 2:
        return None
    out = {}
    for k in range(1, len(runs[0])):
        acc = sum(r[k]["accepted"] for r in runs)
        n = acc + sum(r[k]["rejections"] for r in runs)
        out[f"{runs[0][k - 1]['name']}>{runs[0][k]['name']}"] = acc / n if n else None
    if runs[0][0]["name"] == "ngram":
        looks = sum(r[0]["row_passes"] for r in runs)
        out["ngram_match"] = sum(r[0]["proposals"] for r in runs) / looks if looks else None
    return out


def _pass_ratio(records, s, idx) -> float:
    cs = [x.counters for i in idx for x in records[i].samples[s]]
    return sum(c.new_tokens for c in cs) / max(sum(c.target_passes for c in cs), 1)


def summarize(result: BenchResult) -> Summary:
    cfg = result.config
    strategies = cfg.strategies
    ref = next((r for r in (REFERENCE, "ar") if r in strategies), None) if cfg.greedy else None
    figs = [_prompt_figures(rec, ref, result.tie_tolerance) for rec in result.records]

    def ratios(s, base, idx):
        if base not in strategies:
            return None
        return _median([_ratio(figs[i][s]["tokens_per_s"], figs[i][base]["tokens_per_s"]) for i in idx])

    def identity(s, idx, key="identical"):
        if ref is None:
            return None
        return sum(figs[i][s][key] for i in idx) / max(len(idx), 1)

    every = list(range(len(result.records)))
    summaries = {}
    for s in strategies:
        cs = [x.counters for rec in result.records for x in rec.samples[s]]
        total = lambda k: sum(getattr(c, k) for c in cs)  # noqa: E731
        opt = lambda k: None if any(getattr(c, k) is None for c in cs) else total(k)  # noqa: E731
        secs = {k: sum(c.seconds.get(k, 0.0) for c in cs) for k in STAGES}
        all_secs = sum(secs.values())
        summaries[s] = StrategySummary(
            strategy=s,
            prompts=len(every),
            tokens_per_s=_median([figs[i][s]["tokens_per_s"] for i in every]),
            speedup_vs_hf=ratios(s, "hf", every),
            speedup_vs_self_spec=ratios(s, "self-spec", every),
            tokens_per_target_pass=total("new_tokens") / max(total("target_passes"), 1),
            verify_acceptance=_ratio(opt("accepted_at_verify"), opt("proposed_to_verify")),
            target_acceptance=_ratio(opt("accepted_at_target"), opt("proposed_to_target")),
            layer_evals_per_token=total("layer_evals") / max(total("new_tokens"), 1),
            time_share={k: v / all_secs if all_secs else 0.0 for k, v in secs.items()},
            identical=identity(s, every),
            identical_up_to_ties=identity(s, every, "identical_up_to_ties"),
            new_tokens=total("new_tokens") // max(cfg.repeats, 1),
            speedup_vs_ar=ratios(s, "ar", every),
            plain_share=_mean_opt([c.plain_share for c in cs]),
            hierarchy=next((c.hierarchy for c in cs if c.hierarchy), None),
            verification=next((c.verification for c in cs if c.verification), None),
        )
        pred = result.predictions.get(s)
        measured = summaries[s].speedup_vs_ar
        if pred is not None:
            summaries[s].predicted_speedup_vs_ar = pred
            summaries[s].prediction_error = None if not measured else pred / measured - 1
        observed = _observed_rates(cs)
        summaries[s].observed_acceptance = observed
        fn = result.predictors.get(s)
        if fn is not None and observed is not None:
            pred = fn(observed)
            summaries[s].predicted_speedup_observed = pred
            summaries[s].prediction_error_observed = None if not measured else pred / measured - 1
    for s in strategies:  # HSD next to the same strategy token-wise
        name, _ = split_verification(s)
        if summaries[s].verification != "hsd":
            continue
        twin = next((t for t in (f"{name}:token", name) if t in summaries and summaries[t].verification == "token"),
                    None)
        if twin is not None:
            summaries[s].speedup_vs_token = ratios(s, twin, every)
            summaries[s].tokens_per_target_pass_vs_token = _ratio(summaries[s].tokens_per_target_pass,
                                                                  summaries[twin].tokens_per_target_pass)
    cats: dict[str, list[int]] = {}
    for i, rec in enumerate(result.records):
        cats.setdefault(rec.category, []).append(i)
    categories = {
        c: {"prompts": len(idx),
            "strategies": {s: {"tokens_per_s": _median([figs[i][s]["tokens_per_s"] for i in idx]),
                               "speedup_vs_hf": ratios(s, "hf", idx),
                               "tokens_per_target_pass": _pass_ratio(result.records, s, idx),
                               "identical": identity(s, idx),
                               "identical_up_to_ties": identity(s, idx, "identical_up_to_ties")}
                           for s in strategies}}
        for c, idx in cats.items()
    }
    per_prompt = [{"index": rec.index, "category": rec.category, "prompt_tokens": rec.prompt_tokens,
                   "text": rec.text[:200], "strategies": figs[i]} for i, rec in enumerate(result.records)]
    return Summary(cfg, ref, summaries, categories, per_prompt, result.model_info, result.hardware,
                   result.tie_tolerance)


# ---------------------------------------------------------------------------------------------------- output
def _f(v, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def format_table(summary: Summary) -> str:
    """Fixed-width text: one row per strategy, then speedup vs hf and identity per category."""
    m, hw = summary.model_info, summary.hardware
    cfg = summary.config
    lines = [
        f"model {m['name_or_path']} ({m['num_layers']} layers, exits {m['draft_layer']}/{m['verify_layer']}, "
        f"{m['head_type']} heads, {m['dtype']}); {len(summary.per_prompt)} prompts x {cfg.max_new_tokens} new tokens, "
        f"{'greedy' if cfg.greedy else f'temperature {cfg.temperature}'}, repeats {cfg.repeats}",
        f"{hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}, transformers {hw['transformers']}",
        "",
        f"{'strategy':<17}{'tok/s':>8}{'vs hf':>8}{'vs s-s':>8}{'tok/pass':>9}{'acc L_i':>8}{'acc L':>7}"
        f"{'layers/tok':>11}  {'time % pre/draft/verify/target/other':<37}{'identical':>10}{'~ties':>7}",
    ]
    for s in summary.strategies.values():
        share = "/".join(f"{100 * s.time_share[k]:.0f}" for k in STAGES)
        lines.append(
            f"{s.strategy:<17}{_f(s.tokens_per_s, '{:.1f}'):>8}{_f(s.speedup_vs_hf, '{:.2f}x'):>8}"
            f"{_f(s.speedup_vs_self_spec, '{:.2f}x'):>8}{_f(s.tokens_per_target_pass):>9}"
            f"{_f(s.verify_acceptance):>8}{_f(s.target_acceptance):>7}{_f(s.layer_evals_per_token, '{:.1f}'):>11}"
            f"  {share:<37}{_f(s.identical):>10}{_f(s.identical_up_to_ties):>7}"
        )
    names = list(summary.strategies)
    preds = [s for s in summary.strategies.values() if s.predicted_speedup_vs_ar is not None]
    if preds:
        lines += ["", "latency model vs measured, speedup over ar: predicted from the checkpoint's calibration, and "
                  "from this run's own acceptance rates (the cost model alone)",
                  f"{'strategy':<17}{'hierarchy':<26}{'measured':>9}{'pred cal':>9}{'error':>8}{'pred obs':>9}"
                  f"{'error':>8}{'plain %':>8}  observed acceptance"]
        for s in preds:
            obs = ", ".join(f"{k} {v:.2f}" for k, v in (s.observed_acceptance or {}).items() if v is not None)
            lines.append(f"{s.strategy:<17}{(s.hierarchy or '-')[:25]:<26}{_f(s.speedup_vs_ar, '{:.2f}x'):>9}"
                         f"{_f(s.predicted_speedup_vs_ar, '{:.2f}x'):>9}{_f(s.prediction_error, '{:+.0%}'):>8}"
                         f"{_f(s.predicted_speedup_observed, '{:.2f}x'):>9}{_f(s.prediction_error_observed, '{:+.0%}'):>8}"
                         f"{_f(None if s.plain_share is None else 100 * s.plain_share, '{:.0f}'):>8}  {obs}")
    pairs = [s for s in summary.strategies.values() if s.speedup_vs_token is not None]
    if pairs:
        lines += ["", "sequence-level (hsd) vs token-wise verification of the same strategy",
                  f"{'strategy':<17}{'tok/pass':>9}{'vs token':>9}{'tok/s':>8}{'vs token':>9}"]
        for s in pairs:
            lines.append(f"{s.strategy:<17}{_f(s.tokens_per_target_pass):>9}"
                         f"{_f(s.tokens_per_target_pass_vs_token, '{:.3f}x'):>9}{_f(s.tokens_per_s, '{:.1f}'):>8}"
                         f"{_f(s.speedup_vs_token, '{:.3f}x'):>9}")
    width = max(12, *(len(n) + 2 for n in names))
    lines += ["", "speedup vs hf (identical share) by category", f"{'category':<16}{'n':>3}  "
              + "".join(f"{n:>{width}}" for n in names)]
    for c, d in sorted(summary.categories.items()):
        cells = []
        for n in names:
            x = d["strategies"][n]
            ident = "" if x["identical"] is None else f" ({x['identical']:.1f})"
            cells.append(f"{_f(x['speedup_vs_hf'], '{:.2f}x') + ident:>{width}}")
        lines.append(f"{c[:15]:<16}{d['prompts']:>3}  " + "".join(cells))
    lines.append("")
    if summary.lossless is None:
        lines.append("lossless: n/a (sampling: outputs are compared in distribution by the tests, not here)")
    else:
        lines.append(f"lossless (every strategy's new tokens identical to {summary.reference}'s): "
                     + ("yes" if summary.lossless else "NO"))
        lines.append(f"lossless up to rounding ties (first divergence at an fp32 logit margin <= "
                     f"{summary.tie_tolerance:g}): " + ("yes" if summary.lossless_up_to_ties else "NO"))
        diverged = [(p["index"], n, f["first_mismatch"], f["mismatch_margin"]) for p in summary.per_prompt
                    for n, f in p["strategies"].items() if not f.get("identical", True)]
        for i, n, k, margin in diverged[:12]:
            lines.append(f"  prompt {i}: {n} left {summary.reference} at new token {k}, fp32 margin "
                         f"{_f(margin, '{:+.3f}')}")
        if len(diverged) > 12:
            lines.append(f"  ... and {len(diverged) - 12} more (see --json-out)")
    return "\n".join(lines)


def plot(summary: Summary, path: str | os.PathLike) -> Path:
    """Grouped bars: speedup vs hf per category (and overall) for every strategy but hf."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [s for s in summary.strategies if s != "hf"]
    if "hf" not in summary.strategies or not names:
        raise ValueError("--plot needs 'hf' and at least one other strategy (it plots speedup vs hf)")
    cats = sorted(summary.categories) + ["all"]
    fig = Figure(figsize=(max(6.0, 0.6 * len(cats) + 0.08 * len(cats) * len(names) + 2), 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        vals = [summary.categories[c]["strategies"][n]["speedup_vs_hf"] for c in cats[:-1]]
        vals.append(summary.strategies[n].speedup_vs_hf)
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cats))]
        ax.bar(xs, [v or 0.0 for v in vals], width=width, label=n)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs hf (median of per-prompt ratios)")
    m = summary.model_info
    ax.set_title(f"{Path(str(m['name_or_path'])).name}, {m['dtype']}, {summary.config.max_new_tokens} tokens, "
                 f"{summary.hardware['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# ---------------------------------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class Setting:
    strategy: str
    draft_layer: int
    verify_layer: int | None  # None for self-spec
    gamma: int
    window: int | None  # None for self-spec

    @property
    def label(self) -> str:
        if self.strategy == "self-spec":
            return f"self-spec d{self.draft_layer} g{self.gamma}"
        return f"hispec d{self.draft_layer} v{self.verify_layer} g{self.gamma} w{self.window}"


def sweep_settings(strategies, draft_layers, verify_layers, gammas, windows, num_layers: int) -> list[Setting]:
    """The grid, without invalid (1 <= L_d < L_i < L) or duplicate settings."""
    out: list[Setting] = []
    for s in strategies:
        if s not in SWEEPABLE:
            raise ValueError(f"sweeps tune {' and '.join(SWEEPABLE)}, not '{s}'")
        for d, v, g, w in itertools.product(draft_layers, verify_layers, gammas, windows):
            if not 1 <= d < num_layers or g < 1 or w < 1:
                raise ValueError(f"invalid sweep values: draft layer {d} (1..{num_layers - 1}), gamma {g}, window {w}")
            if s == "self-spec":
                st = Setting(s, d, None, g, None)
            elif d < v < num_layers:
                st = Setting(s, d, v, g, w)
            else:
                continue
            if st not in out:
                out.append(st)
    if not out:
        raise ValueError(f"no valid setting in the sweep grid: need draft layer < verify layer < {num_layers}")
    return out


def model_for_exits(model, draft_layer: int, verify_layer: int, layers_free: bool):
    """`model` itself if its exits match, else (when `layers_free`) a sibling sharing the base with fresh heads."""
    from .model import EarlyExitModel, HispecConfig

    if (draft_layer, verify_layer) == (model.draft_layer, model.verify_layer):
        return model
    if not layers_free:
        raise ValueError(
            f"the heads were trained for exits {model.draft_layer}/{model.verify_layer} and cannot move to "
            f"{draft_layer}/{verify_layer}; sweep only gamma and window on a trained checkpoint, or sweep layers on "
            "a base model with --head-type shared (or norm)"
        )
    h = model.hispec_config
    cfg = HispecConfig(draft_layer=draft_layer, verify_layer=verify_layer, head_type=h.head_type,
                       head_rank=h.head_rank, gamma=h.gamma, window=h.window, base=dict(h.base))
    sibling = EarlyExitModel(model.base, cfg, tokenizer=model.tokenizer)
    for name in ("draft", "verify"):  # the same output vocabularies as the model's heads
        sibling.set_exit_vocab(name, model.heads[name].vocab)
    return sibling


@dataclass
class SettingResult:
    setting: Setting
    tokens_per_s: float
    speedup_vs_hf: float
    tokens_per_target_pass: float
    identical: float
    identical_up_to_ties: float


@dataclass
class SweepResult:
    results: list[SettingResult]
    hf_tokens_per_s: float
    model_info: dict
    hardware: dict
    config: BenchConfig
    tie_tolerance: float = 0.0

    @property
    def best(self) -> SettingResult | None:
        """The fastest setting that reproduced hf on every prompt (up to rounding ties)."""
        ok = [r for r in self.results if r.identical_up_to_ties == 1.0]
        return max(ok, key=lambda r: r.speedup_vs_hf) if ok else None

    def best_of(self, strategy: str) -> SettingResult | None:
        ok = [r for r in self.results if r.identical_up_to_ties == 1.0 and r.setting.strategy == strategy]
        return max(ok, key=lambda r: r.speedup_vs_hf) if ok else None

    def as_dict(self) -> dict:
        row = lambda r: None if r is None else {**asdict(r.setting), "label": r.setting.label,  # noqa: E731
                                                **{k: v for k, v in asdict(r).items() if k != "setting"}}
        best = self.best
        best_ss = self.best_of("self-spec")
        return {
            "best": row(best),
            "best_per_strategy": {s: row(self.best_of(s)) for s in SWEEPABLE
                                  if any(r.setting.strategy == s for r in self.results)},
            "speedup_best_vs_best_self_spec": (best.speedup_vs_hf / best_ss.speedup_vs_hf
                                               if best and best_ss and best.setting.strategy == "hispec" else None),
            "hf_tokens_per_s": self.hf_tokens_per_s,
            "tie_tolerance": self.tie_tolerance,
            "results": [row(r) for r in self.results],
            "config": {**asdict(self.config), "strategies": list(self.config.strategies)},
            "model": self.model_info,
            "hardware": self.hardware,
        }


def run_sweep(model, prompts: list[Prompt], settings: list[Setting], config: BenchConfig, *,
              layers_free: bool, progress: bool = False) -> SweepResult:
    """Time `hf` and every setting on each prompt, interleaved with a rotating order; greedy only."""
    if not config.greedy:
        raise ValueError("a sweep checks identical outputs and runs greedy only (temperature 0)")
    models: dict = {}
    for s in settings:
        if s.strategy == "self-spec" and s.draft_layer == model.draft_layer:
            models[s] = model  # the verify exit is unused by self-spec
            continue
        v = s.verify_layer if s.verify_layer is not None else max(model.verify_layer, s.draft_layer + 1)
        key = (s.draft_layer, v)
        if key not in models:
            models[key] = model_for_exits(model, s.draft_layer, v, layers_free)
        models[s] = models[key]
    encoded = encode(model, prompts, config.chat)
    check_fits(model, encoded, config.max_new_tokens)
    runner = Runner(model, config)
    jobs = ["hf"] + list(settings)
    times: dict[object, list[float]] = {j: [] for j in jobs}
    ident: dict[object, list[bool]] = {j: [] for j in jobs}
    diverged: dict[object, list[tuple[int, list[int], list[int]]]] = {j: [] for j in jobs}
    passes: dict[object, list[tuple[int, int]]] = {j: [] for j in jobs}

    def run(job, ids, mask, n=None) -> Sample:
        if job == "hf":
            return runner.run("hf", ids, mask, config.seed, max_new_tokens=n)
        return runner.run(job.strategy, ids, mask, config.seed, max_new_tokens=n, gamma=job.gamma,
                          window=job.window or 1, model=models[job])

    try:
        with _progress(config.warmup * len(jobs), progress and config.warmup > 0, "warm-up") as bar:
            for _ in range(config.warmup):
                for j in jobs:
                    run(j, *encoded[0], n=min(32, config.max_new_tokens))
                    bar.update()
        with _progress(len(encoded) * config.repeats * len(jobs), progress, "sweep") as bar:
            for i, (ids, mask) in enumerate(encoded):
                samples: dict[object, list[Sample]] = {j: [] for j in jobs}
                for r in range(config.repeats):
                    for j in _rotated(jobs, i * config.repeats + r):
                        bar.set_postfix_str(f"prompt {i + 1}/{len(encoded)} {j if j == 'hf' else j.label}")
                        samples[j].append(run(j, ids, mask))
                        bar.update()
                ref = samples["hf"][0].tokens
                for j in jobs:
                    times[j].append(_median([x.tokens_per_s for x in samples[j]]))
                    ident[j].append(all(x.tokens == ref for x in samples[j]))
                    if not ident[j][-1]:
                        other = next(x.tokens for x in samples[j] if x.tokens != ref)
                        diverged[j].append((i, ref, other))
                    c = samples[j][0].counters
                    passes[j].append((c.new_tokens, c.target_passes))
    finally:
        runner.close()
    tol = tie_tolerance(config, model.dtype)
    checker = TieChecker(model)
    ties = dict.fromkeys(jobs, 0)  # divergences at an fp32 near-tie, per job
    for j in jobs:
        for i, ref, other in diverged[j] if config.tie_check else []:
            margin = checker.margin(*encoded[i], ref, other)
            ties[j] += margin is not None and abs(margin) <= tol
    checker.close()
    results = []
    for s in settings:
        results.append(SettingResult(
            setting=s,
            tokens_per_s=_median(times[s]),
            speedup_vs_hf=_median([a / b for a, b in zip(times[s], times["hf"])]),
            tokens_per_target_pass=sum(n for n, _ in passes[s]) / max(sum(p for _, p in passes[s]), 1),
            identical=sum(ident[s]) / len(ident[s]),
            identical_up_to_ties=(sum(ident[s]) + ties[s]) / len(ident[s]),
        ))
    return SweepResult(results, _median(times["hf"]), model_info(model), hardware_info(), config, tol)


def format_sweep_table(sweep: SweepResult) -> str:
    lines = [f"hf: {sweep.hf_tokens_per_s:.1f} tok/s; {sweep.hardware['cpu']}, {sweep.hardware['threads']} threads",
             "", f"{'setting':<30}{'tok/s':>8}{'vs hf':>8}{'tok/pass':>9}{'identical':>10}{'~ties':>7}"]
    best = sweep.best
    for r in sorted(sweep.results, key=lambda r: -r.speedup_vs_hf):
        mark = "  <- best" if best is not None and r is best else ""
        lines.append(f"{r.setting.label:<30}{r.tokens_per_s:>8.1f}{r.speedup_vs_hf:>7.2f}x"
                     f"{r.tokens_per_target_pass:>9.2f}{r.identical:>10.2f}{r.identical_up_to_ties:>7.2f}{mark}")
    lines.append("")
    lines.append(f"fastest lossless setting (identical up to rounding ties, fp32 margin <= {sweep.tie_tolerance:g}): "
                 f"{best.setting.label}" if best else "no setting reproduced hf on every prompt")
    return "\n".join(lines)


def write_decoding_defaults(folder: str | os.PathLike, setting: Setting, *, write_exits: bool = False) -> dict:
    """Store gamma/window (and, when `write_exits`, the exits) in config.json's hispec entry, atomically."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --write-defaults needs a local hispec checkpoint folder")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if "hispec" not in cfg:
        raise ValueError(f"{path} has no 'hispec' entry: --write-defaults needs a hispec checkpoint, not a base model")
    from .model import HispecConfig

    hc = HispecConfig.from_dict(cfg["hispec"])  # read any format, write the current one (other keys kept)
    hc.gamma = setting.gamma
    if setting.window is not None:
        hc.window = setting.window
    if write_exits:
        hc.draft_layer, hc.verify_layer = setting.draft_layer, setting.verify_layer or hc.verify_layer
    h = {**cfg["hispec"], **hc.to_dict()}
    cfg["hispec"] = h
    write_json(path, cfg)
    return h
