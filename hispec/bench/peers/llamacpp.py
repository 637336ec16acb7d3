"""llama.cpp as a peer in hispec-bench, through the llama-cpp-python bindings (`pip install 'hispec[peers]'`).

Contract:
- `run(specs, job, progress)` -> {name: PeerOutcome} for the `llama.cpp` / `llama.cpp:QUANT` rows (hispec.bench.peers).
  The model is a GGUF made by llama.cpp's own `convert_hf_to_gguf.py` from the base-model folder (`job.model_dir`)
  with `--outtype` f32 / bf16 / f16 for the bench dtype fp32 / bf16 / fp16 (or the row's quantised type, e.g.
  q8_0), cached under `folders.cache_root()/gguf/` keyed by the folder's fingerprint, the type and the converter's
  version; a later run reuses it.
- Decoding: `Llama.generate` on the prompt's token ids (no BOS, no template added), greedy (`temp=0`: llama.cpp's
  greedy sampler; repeat penalty 1), after `Llama.reset()` so that no KV-cache prefix of an earlier run is reused;
  it stops at the first EOS id (kept) or after `max_new_tokens`. `n_threads` and `n_threads_batch` are the bench's
  threads. Timed per prompt with `time.perf_counter`, the prompt's evaluation included, as for transformers.
- The converter: `$HISPEC_LLAMA_CPP_CONVERTER` (a path to `convert_hf_to_gguf.py` inside a llama.cpp source tree,
  whose `gguf-py/` it imports), else `folders.cache_root()/llama.cpp/<llama-cpp-python version>/`, which
  `tools/get_llama_cpp_converter.py` (run by `make peers`) fills from the llama-cpp-python sdist of the installed
  version: the converter of the same llama.cpp the bindings were built from. It runs in this interpreter (it needs
  torch, numpy, transformers and sentencepiece-free tokenizers, which hispec has).
- `info`: llama-cpp-python's version, llama.cpp's CPU features as the library reports them
  (`llama_print_system_info`), the GGUF file and type, conversion and load seconds.
A missing `llama_cpp` module or converter is `PeerMissing` (a skipped row saying how to install them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .spec import PeerJob, PeerMissing, PeerError, PeerOutcome, PeerRun, PeerSpec, cut
from .folders import cache_root, fingerprint

OUTTYPES = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
CONVERTER_ENV = "HISPEC_LLAMA_CPP_CONVERTER"
INSTALL = "pip install 'hispec[peers]' (or `make peers`, which also fetches llama.cpp's converter)"


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise PeerMissing(f"llama-cpp-python is not installed ({e}); {INSTALL}") from e
    return llama_cpp


def converter_dir(version: str) -> Path:
    return cache_root() / "llama.cpp" / version


def find_converter(version: str) -> Path:
    """`convert_hf_to_gguf.py` of llama.cpp (module docstring); PeerMissing when there is none."""
    given = os.environ.get(CONVERTER_ENV)
    path = Path(given) if given else converter_dir(version) / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise PeerMissing(f"llama.cpp's converter is not at {path}: run `make peers` or `python "
                          "tools/get_llama_cpp_converter.py` (it takes convert_hf_to_gguf.py from the "
                          f"llama-cpp-python {version} sdist), or set ${CONVERTER_ENV} to a llama.cpp checkout's "
                          "convert_hf_to_gguf.py")
    return path


def gguf_file(folder: str, outtype: str, converter: Path, progress: bool = False) -> tuple[Path, float]:
    """The cached GGUF of `folder` at `outtype` (converting it when absent); (path, seconds spent converting)."""
    key = fingerprint(folder, outtype, str(converter.resolve()))
    out = cache_root() / "gguf" / f"{Path(folder).name}-{outtype}-{key}.gguf"
    if out.is_file():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    print(f"[hispec-bench] llama.cpp: converting {folder} to GGUF {outtype} with {converter}", file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile", str(tmp)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise PeerError(f"convert_hf_to_gguf.py --outtype {outtype} failed (exit {proc.returncode}): "
                        f"{proc.stdout[-1500:].strip()}")
    os.replace(tmp, out)
    return out, time.perf_counter() - t0


def cpu_features(llama_cpp) -> str:
    """The features llama.cpp's CPU backend was built with and uses, e.g. "AVX2 F16C FMA OPENMP" (from
    `llama_print_system_info`: "CPU : SSE3 = 1 | AVX2 = 1 | ...")."""
    text = llama_cpp.llama_print_system_info()
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    feats = []
    for part in text.replace("CPU :", "|").split("|"):
        name, eq, val = part.partition("=")
        if eq and val.strip() == "1" and name.strip() not in feats:
            feats.append(name.strip())
    return " ".join(feats) or text.strip()


def load(llama_cpp, path: Path, job: PeerJob):
    n_ctx = max(len(p) for p in job.prompts) + job.max_new_tokens + 8
    threads = job.threads or os.cpu_count() or 1
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, seed=0, verbose=False)


def generate(llm, ids: list[int], max_new_tokens: int, eos) -> tuple[list[int], float]:
    """Greedy new tokens (cut after the first EOS) and the seconds they took, prompt evaluation included."""
    eos = set(eos)
    llm.reset()  # n_tokens = 0: generate() then reuses no cached prefix and evaluates the whole prompt
    tokens: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if tok in eos or len(tokens) >= max_new_tokens:
            break
    return tokens, time.perf_counter() - t0


def run(specs: list[PeerSpec], job: PeerJob, progress: bool = False) -> dict[str, PeerOutcome]:
    llama_cpp = import_llama_cpp()
    version = getattr(llama_cpp, "__version__", "?")
    converter = find_converter(version)
    out = {}
    for spec in specs:
        try:
            out[spec.name] = _run_one(llama_cpp, version, converter, spec, job, progress)
        except PeerMissing as e:
            out[spec.name] = PeerOutcome(spec, skipped=str(e))
        except Exception as e:  # noqa: BLE001 (reported as a FAILED row)
            out[spec.name] = PeerOutcome(spec, failed=f"{type(e).__name__}: {e}")
    return out


def _run_one(llama_cpp, version: str, converter: Path, spec: PeerSpec, job: PeerJob, progress: bool) -> PeerOutcome:
    if job.dtype not in OUTTYPES:
        raise PeerError(f"no GGUF type for dtype {job.dtype!r} (known: {', '.join(OUTTYPES)})")
    outtype = spec.quant or OUTTYPES[job.dtype]
    path, convert_s = gguf_file(job.model_dir, outtype, converter, progress)
    t0 = time.perf_counter()
    llm = load(llama_cpp, path, job)
    load_s = time.perf_counter() - t0
    try:
        for _ in range(job.warmup):
            generate(llm, job.prompts[0], min(32, job.max_new_tokens), job.eos)
        runs = []
        for i, ids in enumerate(job.prompts):
            per = []
            for _ in range(job.repeats):
                tokens, secs = generate(llm, ids, job.max_new_tokens, job.eos)
                tokens = cut(tokens, job.eos)
                per.append(PeerRun(tokens, secs, passes=len(tokens), positions=len(tokens)))
            runs.append(per)
            if progress:
                print(f"[hispec-bench] {spec.name}: prompt {i + 1}/{len(job.prompts)} "
                      f"{sum(len(r.tokens) for r in per) / max(sum(r.seconds for r in per), 1e-9):.1f} tok/s",
                      file=sys.stderr, flush=True)
    finally:
        llm.close() if hasattr(llm, "close") else None
    info = {"engine": "llama.cpp", "version": f"llama-cpp-python {version}", "cpu_features": cpu_features(llama_cpp),
            "gguf": str(path), "gguf_type": outtype, "threads": job.threads, "convert_seconds": round(convert_s, 1),
            "start_seconds": round(load_s, 2), "converter": str(converter)}
    return PeerOutcome(spec, runs=runs, info=info)
