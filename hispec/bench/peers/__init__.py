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

Modules, one engine each: `llamacpp` (llama-cpp-python in this process), `vllm_peer` (vLLM in its own virtual
environment, `.venv-vllm`, run as a subprocess of `vllm_worker.py`: JSON in, JSON out; the worker's name keeps it
from shadowing the `vllm` package), `folders` (the base-model folder an engine loads, the cache of converted
files). Nothing here imports torch-heavy parts of hispec.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

ENGINES = ("llama.cpp", "vllm")
LLAMA_CPP_QUANTS = ("q8_0", "tq1_0", "tq2_0")  # convert_hf_to_gguf.py --outtype (its quantised types)
DEFAULT_SPEC_TOKENS = 3
_VLLM = re.compile(r"^vllm(?P<eagle>-eagle3)?(?P<batch>-batch)?(?::(?P<k>\d+))?$")


class PeerError(RuntimeError):
    """A peer engine could not run; the message says what failed and what to do."""


class PeerMissing(PeerError):
    """A peer engine is not installed (its row is `skipped`); the message says how to install it."""


@dataclass(frozen=True)
class PeerSpec:
    """One peer strategy: `engine` ("llama.cpp" | "vllm"), `quant` (llama.cpp: a quantised GGUF type, else None),
    `spec_tokens` (vLLM: EAGLE-3 tokens per step, None = plain), `batch` (vLLM: all prompts at once)."""

    name: str
    engine: str
    quant: str | None = None
    spec_tokens: int | None = None
    batch: bool = False

    @property
    def lossy(self) -> bool:
        """Its outputs are not expected to equal the reference's (a quantised model): identity is not claimed."""
        return self.quant is not None


def is_peer(name: str) -> bool:
    return name == "llama.cpp" or name.startswith(("llama.cpp:", "vllm"))


def parse(name: str) -> PeerSpec:
    """The peer strategy `name` as a `PeerSpec`; ValueError when malformed."""
    if name == "llama.cpp":
        return PeerSpec(name, "llama.cpp")
    if name.startswith("llama.cpp:"):
        quant = name.split(":", 1)[1]
        if quant not in LLAMA_CPP_QUANTS:
            raise ValueError(f"strategy {name!r}: llama.cpp's quantised GGUF types are {', '.join(LLAMA_CPP_QUANTS)} "
                             "(the unquantised GGUF at the bench dtype is plain 'llama.cpp')")
        return PeerSpec(name, "llama.cpp", quant=quant)
    m = _VLLM.match(name)
    if m is None or (m["k"] is not None and not m["eagle"]):
        raise ValueError(f"strategy {name!r}: vLLM rows are vllm, vllm-batch, vllm-eagle3[:K] and "
                         "vllm-eagle3-batch[:K] (K = drafted tokens per step)")
    k = None
    if m["eagle"]:
        k = int(m["k"]) if m["k"] is not None else DEFAULT_SPEC_TOKENS
        if k < 1:
            raise ValueError(f"strategy {name!r}: K must be >= 1")
    return PeerSpec(name, "vllm", spec_tokens=k, batch=bool(m["batch"]))


@dataclass
class PeerJob:
    """What every peer decodes: `prompts` (token ids, chat template applied, as transformers gets them), greedy."""

    prompts: list[list[int]]
    max_new_tokens: int
    eos: list[int]
    dtype: str  # "fp32" | "bf16" | "fp16"
    model_dir: str  # a local Hugging Face folder of the base model (folders.base_folder)
    num_layers: int
    threads: int | None = None  # None: the engine's default
    repeats: int = 1
    warmup: int = 1  # untimed runs on the first prompt (at most 32 tokens) after the engine starts
    drafter: str | None = None  # a `speculators` folder (vllm-eagle3); None: those rows fail saying what to pass
    drafter_error: str | None = None  # why a drafter that was named could not be used (the rows' reason)
    vllm_python: str | None = None  # the interpreter of vLLM's environment (None: vllm.default_python())
    timeout: float | None = None  # seconds per engine subprocess (None: vllm.DEFAULT_TIMEOUT)


@dataclass
class PeerRun:
    """One generation by a peer: the new tokens (cut after the first EOS), its wall time, and what the engine counted
    (None: not observable). `passes`: full-model passes that produced the tokens; `drafted` / `accepted`: draft
    tokens proposed and accepted (speculative rows); `positions`: positions the full model evaluated beyond the
    prompt (the decoder-layer evaluations are that times the depth)."""

    tokens: list[int]
    seconds: float
    passes: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    positions: int | None = None


@dataclass
class PeerOutcome:
    spec: PeerSpec
    runs: list[list[PeerRun]] | None = None  # per prompt, one per repeat (None: it did not run)
    info: dict = field(default_factory=dict)
    failed: str | None = None
    skipped: str | None = None


def cut(tokens: list[int], eos) -> list[int]:
    """`tokens` up to and including the first EOS id (hispec.prompts.cut_at_eos, without importing torch)."""
    eos = set(eos)
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


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
