"""Other engines in hispec-bench: llama.cpp and vLLM decode the same prompt token ids as transformers, one table.

Contract:
- Peer strategy names (`parse` reads them; `is_peer` says whether a name is one):
  `llama.cpp` (a GGUF converted by llama.cpp's own converter from the base model at the bench dtype),
  `llama.cpp:q8_0` (a quantised GGUF, e.g. q8_0: a labelled, lossy row that is never counted as identical),
  `vllm` (vLLM's CPU build, prompts one at a time), `vllm-eagle3` / `vllm-eagle3:K` (the same with an EAGLE-3
  drafter in the `speculators` format proposing K tokens per step, default 3), and `vllm-batch` /
  `vllm-eagle3-batch[:K]` (every prompt at once: tok/s is the batch's throughput).
- `run_peers(names, job, progress)` decodes every prompt of `job` (a `PeerJob`: prompt token ids, new tokens, end-of-
  sequence ids, dtype, threads, repeats, the local base-model folder, the drafter) with each named peer and returns
  per name a `PeerOutcome`: the runs (per prompt, one `PeerRun` per repeat: new token ids cut at the first EOS,
  seconds, and what the engine counted), what ran (`info`: version, CPU features, file, start-up time, acceptance),
  or why it did not: `skipped` (the engine is not installed: the reason says how to install it) or `failed` (it
  raised, or its subprocess failed: the reason carries the error). It never raises for an engine's own failure.
- Greedy only; every engine gets the prompt ids hispec-bench feeds transformers (no BOS or chat template added by
  the engine) and stops at the same EOS ids (kept in the output, as transformers keeps it) or after
  `max_new_tokens`. Engines that share a configuration share one start-up (`vllm` and `vllm-batch` one vLLM
  engine; `vllm-eagle3:K` and `vllm-eagle3-batch:K` another).

Modules: `spec` (the names, job, results and errors above, shared by all), one per engine: `llamacpp` (llama-cpp-python in this process), `vllm_peer` (vLLM in its own virtual
environment, `.venv-vllm`, run as a subprocess of `vllm_worker.py`: JSON in, JSON out; the worker's name keeps it
from shadowing the `vllm` package), `folders` (the base-model folder an engine loads, the cache of converted
files). Nothing here imports torch-heavy parts of hispec.
"""

from __future__ import annotations

import sys

from .spec import (DEFAULT_SPEC_TOKENS, ENGINES, LLAMA_CPP_QUANTS, PeerError, PeerJob, PeerMissing,  # noqa: F401
                   PeerOutcome, PeerRun, PeerSpec, cut, is_peer, parse)


def run_peers(names, job: PeerJob, progress: bool = False) -> dict[str, PeerOutcome]:
    """Every named peer on every prompt of `job` (module docstring); engine failures become `failed` / `skipped`."""
    specs = [parse(n) for n in names]
    out: dict[str, PeerOutcome] = {}
    for engine in ENGINES:
        group = [s for s in specs if s.engine == engine]
        if not group:
            continue
        if engine == "llama.cpp":
            from . import llamacpp as module
        else:
            from . import vllm_peer as module
        try:
            out.update(module.run(group, job, progress=progress))
        except PeerMissing as e:
            out.update({s.name: PeerOutcome(s, skipped=str(e)) for s in group})
        except Exception as e:  # noqa: BLE001 (an engine's own failure is a FAILED row, never a crash of the bench)
            out.update({s.name: PeerOutcome(s, failed=f"{type(e).__name__}: {e}") for s in group})
    for name, o in out.items():
        if o.failed or o.skipped:
            print(f"[hispec-bench] {name}: {'FAILED' if o.failed else 'skipped'}: {o.failed or o.skipped}",
                  file=sys.stderr, flush=True)
    return {s.name: out[s.name] for s in specs}
