"""What runs when the caller does not say: the default strategy, the calibration `auto` plans with, `auto`'s plan
(levels, tree, predicted seconds per token) and the n-gram level's config.

Contract: `default_strategy(model)` is `auto` only where the checkpoint holds a calibration valid on this machine,
else `ar` (warned once per reason); `_calibration(model)` returns that calibration or raises `CalibrationError`;
`_auto_chain` / `_auto_plan` turn `latency.auto_plan` into this model's `Level`s (and a `TreeSpec`);
`ngram_config(model, ngram)` resolves the n-gram config: explicit, else the checkpoint's, else the calibration's,
else the defaults. `generate`, the server and the bench all plan through here.
"""

from __future__ import annotations

import warnings

from .. import latency
from ..latency import Calibration, CalibrationError
from ..drafters.ngram import NgramConfig
from .tree import TreeSpec
from .levels import Level, _plan_levels

_warned: set = set()


def default_strategy(model) -> str:
    """`auto` when the checkpoint holds a calibration made on this kind of machine, else plain decoding (`ar`),
    with a warning once: without measurements nothing says speculation pays here, and it must never be slower."""
    cal = getattr(model.hispec_config, "calibration", None)
    if cal:
        try:
            _calibration(model)
            return "auto"
        except CalibrationError as e:
            why = str(e)
    else:
        why = "the checkpoint holds no calibration"
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"hispec: {why}; decoding plainly (strategy='ar'). Measure this machine with "
                      "`hispec-export RUN --output-dir OUT --calibrate` or `hispec-bench --model CKPT --calibrate`, "
                      "or choose a strategy yourself.", stacklevel=3)
    return "ar"


def _calibration(model):
    cal = getattr(model.hispec_config, "calibration", None)
    if not cal:
        raise CalibrationError(
            "strategy='auto' needs a calibration of this checkpoint on this machine: run `hispec-export RUN "
            "--output-dir OUT --calibrate` or `hispec-bench --model CKPT --calibrate`, or pick a strategy")
    cal = cal if isinstance(cal, Calibration) else Calibration.from_dict(cal)
    cal.check(model)
    return cal.for_model(model)  # (a drafter's figures only for the drafter they were measured with)



def _auto_chain(model, cal, *, gamma, window, ngram) -> list[Level]:
    """The latency-optimal speculative chain hierarchy for the calibration (rows may still decode plainly)."""
    plan = latency.auto_plan(cal, trees=False)
    return _plan_levels(model, plan.levels, plan.gammas, gamma=gamma, window=window, ngram=ngram)


def _auto_trees(do_sample: bool, verification: str | None) -> bool:
    """Whether `auto` may draft trees: not when sampling verifies sequence-level (`verification="hsd"`), a rule
    for chains (a tree's children are verified token-wise, `hispec.sampling.recursive_accept`)."""
    return not do_sample or verification == "token"


def _auto_plan(model, cal, *, gamma, window, ngram, max_new_tokens: int | None = None, trees: bool = True):
    """`auto`'s plan: (levels, tree, predicted seconds per token), `latency.auto_plan` (the latency-optimal
    speculative chain, or a static tree with some width > 1 where predicted faster; `hispec.decoding.tree`) as the model's
    levels; trees never deeper than `max_new_tokens`. `generate` and the bench's prediction both plan through
    here."""
    plan = latency.auto_plan(cal, trees=trees, max_depth=5 if max_new_tokens is None else min(5, max_new_tokens))
    levels = _plan_levels(model, plan.levels, plan.gammas if plan.widths is None else (), gamma=gamma, window=window,
                          ngram=ngram)
    return levels, None if plan.widths is None else TreeSpec(plan.widths), plan.seconds_per_token


def ngram_config(model, ngram=None) -> NgramConfig:
    """The n-gram level's config: `ngram` (an `NgramConfig` or its fields) if given, else the checkpoint's
    `decoding.ngram` if it sets one, else the one its calibration measured (and chose: `latency.calibrate`), else
    the defaults. The calibration's acceptance figures hold for its own config, so `auto` plans with what it runs."""
    if isinstance(ngram, NgramConfig):
        return ngram
    if ngram:
        return NgramConfig(**ngram)
    cfg = model.hispec_config
    if getattr(cfg, "ngram", None):
        return NgramConfig(**cfg.ngram)
    cal = getattr(cfg, "calibration", None)
    measured = cal.ngram if isinstance(cal, Calibration) else (cal or {}).get("ngram")
    return NgramConfig(**measured) if measured else NgramConfig()

