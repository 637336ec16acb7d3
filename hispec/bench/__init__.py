"""Latency benchmark and parameter sweep: hispec's strategies against transformers' own, side by side.

Contract:
- `run_bench(model, prompts, config)` decodes every prompt (batch size 1) with every strategy in one process,
  interleaved per prompt with a rotating order, so machine drift hits all strategies alike. Strategies:
  `hf` (transformers `generate`, the reference), `hf-early-exit` (`generate(assistant_early_exit=L_d)`: the base
  model's own final norm + lm_head at L_d), `hf-prompt-lookup` (`prompt_lookup_num_tokens`), and hispec's `ar`,
  `self-spec`, `hispec` (`hispec.decoding.generate`). It returns the raw samples (`BenchResult`); a strategy of
  transformers' own that raises is listed in `BenchResult.failed` (and the summary's "failed") and the others run
  on, its changes to the base model's config undone (`restored_config`). A hispec
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
  identical to `hf` (up to rounding ties). `hispec.export.write_decoding_defaults(folder, setting)` stores it in the
  checkpoint's config.json (temporary file + os.replace).

Counting for transformers' strategies uses forward hooks (installed for every strategy alike, so all pay their
small cost): a top-level model call that runs every decoder layer is a full-model pass, one that runs fewer is an
early-exit draft pass. Layer evaluations exclude one pass over the prompt (all strategies prefill it alike).
Nothing here prints; progress goes through tqdm on stderr when asked.

Other engines (`peers`: llama.cpp through llama-cpp-python, vLLM's CPU build in its own environment) are rows of the
same table: strategies `llama.cpp`, `llama.cpp:q8_0`, `vllm`, `vllm-batch`, `vllm-eagle3[:K]`,
`vllm-eagle3-batch[:K]`; they decode the same prompt token ids greedily after the interleaved loop, and one that is
not installed (`BenchResult.skipped`) or fails (`BenchResult.failed`) is reported with its reason while the others
run on (hispec.bench.peers).

Layout, by concern: `runner` (config, samples, counting, `run_bench`, `predict_speedups`), `env` (hardware and
model info), `summary` (`summarize`), `report` (`format_table`, `plot`), `sweep` (`run_sweep`), `peers` (other
engines). Everything is
re-exported here, so `from hispec import bench; bench.run_bench(...)` reads as before.
"""

from __future__ import annotations

from .runner import (  # noqa: F401
    HF_STRATEGIES, STRATEGIES, REFERENCE, STAGES, SWEEPABLE, BenchConfig, Counters, Sample, PromptRecord,
    BenchResult, PassCounter, Runner, encode, check_fits, TIE_TOLERANCE, tie_tolerance, TieChecker, run_bench,
    predict_speedups, split_verification, with_both_verifications, tree_of, VERIFICATION_SUFFIXES, TREE_PREFIX,
    restored_config,
)
from .env import (  # noqa: F401
    hardware_info, model_info,
)
from .summary import (  # noqa: F401
    StrategySummary, Summary, summarize,
)
from .report import (  # noqa: F401
    format_table, plot,
)
from .sweep import (  # noqa: F401
    Setting, sweep_settings, model_for_exits, SettingResult, SweepResult, run_sweep, format_sweep_table,
)
from ..export import write_decoding_defaults  # noqa: F401  (the checkpoint writer owns it; kept here for callers)
