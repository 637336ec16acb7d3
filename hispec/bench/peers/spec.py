"""The peer engines' shared vocabulary: strategy names (`parse`, `is_peer`), the job every engine decodes
(`PeerJob`), its results (`PeerRun`, `PeerOutcome`) and errors (`PeerError`, `PeerMissing`); the lowest module of
`hispec.bench.peers` (the engines import it, it imports none of them)."""


from __future__ import annotations

import re
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
