"""Decoding strategies on one machinery: a *hierarchy* of levels, each proposing to or verifying the one below.

Level 0 drafts (an n-gram lookup, an exit head, or both: `ngram|EXIT`); each level k >= 1 verifies, in one pass,
what level k-1 gathered; the top level is the full model. Every strategy is a hierarchy (`ar` = full, `self-spec` =
draft>full, `hispec` = draft>verify>full, `ngram>L8>full`, ...), and `auto` picks one from the checkpoint's
calibration and adapts it per row while decoding. Decoding is lossless: greedy output equals the model's greedy
output, sampled output keeps the model's distribution.

The package, in the order a call goes through it:
- `levels`: level kinds, named strategies, `parse_hierarchy` / `build_levels`;
- `plan`: the default strategy, the calibration, `auto`'s plan, the n-gram config;
- `generation`: `generate`, from its arguments to its output;
- `rounds`: `_Run`, the round machinery (prefill, draft, verify, commit; KV and hidden-state reuse; the losslessness
  argument), with `batching` (`_RowSet`: rows leaving and joining a running batch) and `handover` (`_Handover`:
  `commit`, the round's tokens and counters read from the device in one copy);
- `auto`: `_AutoPolicy`, `auto`'s per-row choice of levels and gammas; `guard`: `_PlainGuard`, its measured floor;
- `stats`: `GenerationOutput`, `GenerationStats`, `LevelStats`.

Everything the rest of hispec, its tools and tests import from `hispec.decoding` is re-exported here.
"""

from .auto import _AutoPolicy
from .batching import _RowSet
from .generation import _as_list, _stop_checker, generate
from .guard import _PlainGuard
from .levels import NAMED, STRATEGIES, Level, _plan_levels, build_levels, parse_hierarchy
from .plan import _auto_chain, _auto_plan, _auto_trees, _calibration, _warned, default_strategy, ngram_config
from .rounds import _Run
from .stats import GenerationOutput, GenerationStats, LevelStats
