"""The latency model of hierarchical speculative decoding and the latency-optimal hierarchy (design.md §3.3).

Contract:
- A *hierarchy* is a list of level names ordered by depth, bottom-up, ending with "full": "ngram" (prompt-lookup
  drafting, `hispec.drafters.ngram`; only as the bottom level), "eagle3" (an EAGLE-3 drafter, `hispec.drafters.eagle3`; only as the
  bottom level, directly under "full"; "ngram|eagle3" tries the lookup first), "L<k>" (the exit after decoder
  layer k with its trained head) and "full" (the model). Level i < top has a gamma `g_i`: how many tokens it gathers before level i+1
  verifies them in one pass (for "ngram": its longest proposal). `gammas[i] == 0` means level i is *skipped*:
  level i+1 produces its tokens itself (it becomes the bottom; the levels below i are idle). So
  `(["L4", "L8", "full"], [0, 3])` is self-speculation at L8 and `[0, 0]` is plain decoding.
- `time_per_token(levels, gammas, cal)` predicts seconds per generated token; `best_hierarchy(cal)` the fastest
  hierarchy (plain decoding is always a candidate, so the choice is never predicted slower than plain);
  `best_gammas(levels, cal, acceptance)` the best gammas for a fixed level list given (e.g. per-row, observed)
  acceptance rates, allowing 0 = skip; memoised, cheap enough to call every few decoding rounds.
- `calibrate(model, prompts)` measures a `Calibration` on this machine: unit costs (timed) and acceptance rates
  (counted on the model's own greedy answers), and keeps the n-gram config (of NGRAM_CANDIDATES) that `auto_plan`,
  `auto`'s plan, is predicted fastest with; the decoder then runs that config. It lives in the checkpoint as
  `config.json["hispec"]["calibration"]` (`write_calibration` / `read_calibration`); `Calibration.check(model)`
  refuses one made for another model or on another kind of machine (`CalibrationError`).

The package re-exports its modules' names (`from hispec.latency import X` and `hispec.latency.X` reach them all);
each module imports only those listed before it:
- `levels`: level names and the closed forms (`expected_tokens`, `interp`, ...), `CalibrationError`;
- `calibration`: the `Calibration` record (costs, acceptances, batch scaling, JSON, the model / machine check) and
  its storage in a checkpoint (`write_calibration`, `read_calibration`);
- `model`: the formulas (in its docstring), `time_per_token` and the dynamic programmes over hierarchies and
  gammas (`best_hierarchy`, `best_gammas`);
- `trees`: static tree drafts priced (`tree_time_per_token`) and the best tree;
- `plans`: `auto_plan`, the plan `auto` decodes with, and the prediction tables the tools print;
- `timing`: unit costs timed behind a KV cache (`KVBench`, `measure_costs`);
- `budget`: a calibration's time budget (`Budget`, `DEFAULT_MAX_SECONDS`);
- `measure`: `calibrate`, which measures a `Calibration` on this machine within a time budget.
"""

from .budget import DEFAULT_MAX_SECONDS, Budget
from .calibration import (CALIBRATION_VERSION, Calibration, cpu_model, drafter_identity, machine_fingerprint,
                          model_identity, read_calibration, write_calibration)
from .measure import NGRAM_CANDIDATES, calibrate, drafter_rounds, fit_decoder_costs, ngram_rounds
from .levels import (EAGLE, FULL, LOOKUP, NGRAM, CalibrationError, acceptance_from_counts, expected_tokens, interp,
                     is_drafter, level_name, level_pairs, lookup_exit, pair_key)
from .model import (DEFAULT_MAX_GAMMA, Choice, batch_pass_seconds, best_gammas, best_hierarchy, lookup_alone_seconds,
                    lookup_first_rounds, plain_seconds_per_token, time_per_token)
from .plans import AutoPlan, auto_plan, format_predictions, named_hierarchies, predictions
from .timing import KVBench, measure_costs, measure_layer_costs, median_times, nondecreasing
from .trees import (MAX_TREE_WIDTH, TREE_ROWS, best_tree, scaled_topk, tree_expected_tokens, tree_round_seconds,
                    tree_shapes, tree_time_per_token)

__all__ = [
    "Budget",
    "DEFAULT_MAX_SECONDS",
    "Calibration",
    "CalibrationError",
    "Choice",
    "LOOKUP",
    "KVBench",
    "acceptance_from_counts",
    "batch_pass_seconds",
    "best_gammas",
    "best_hierarchy",
    "calibrate",
    "drafter_identity",
    "drafter_rounds",
    "expected_tokens",
    "fit_decoder_costs",
    "format_predictions",
    "interp",
    "level_pairs",
    "lookup_alone_seconds",
    "lookup_exit",
    "lookup_first_rounds",
    "machine_fingerprint",
    "measure_costs",
    "measure_layer_costs",
    "median_times",
    "model_identity",
    "ngram_rounds",
    "nondecreasing",
    "named_hierarchies",
    "predictions",
    "read_calibration",
    "plain_seconds_per_token",
    "time_per_token",
    "write_calibration",
]
