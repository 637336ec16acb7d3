"""vLLM as a peer in hispec-bench: its CPU build, in its own virtual environment, run as a subprocess.

Contract:
- `run(specs, job, progress)` -> {name: PeerOutcome} for the `vllm`, `vllm-batch`, `vllm-eagle3[:K]` and
  `vllm-eagle3-batch[:K]` rows (hispec.bench.peers). Rows with the same drafter setting share one engine: one
  subprocess `PYTHON vllm_worker.py REQUEST.json RESULT.json` (its protocol: that file's docstring), which decodes
  the prompts one at a time when a latency row is asked for and all at once when a batch row is.
- PYTHON is `job.vllm_python`, else `$HISPEC_VLLM_PYTHON`, else `.venv-vllm/bin/python` of the source checkout
  (`make vllm` builds it: vLLM's CPU wheel pins its own transformers and torch, so it cannot share hispec's
  environment). None there is `PeerMissing` (a skipped row saying `make vllm`).
- The subprocess runs with `OMP_NUM_THREADS` = the bench's threads, `VLLM_CPU_OMP_THREADS_BIND` = that many of the
  CPUs this process may run on (vLLM's own "auto" binding would choose cores from the whole NUMA node, outside a
  `taskset`), `VLLM_CPU_KVCACHE_SPACE` = `$HISPEC_VLLM_KV_GB` or 2 GiB, Hub access off (`HF_HUB_OFFLINE=1`), usage
  statistics off (`VLLM_NO_USAGE_STATS=1`, `DO_NOT_TRACK=1`), and its own compile cache per setting
  (`VLLM_CACHE_ROOT` = vLLM's cache root + `/hispec-plain` or `/hispec-eagle3-kK`): vLLM 0.32's CPU build, started
  with k=2 after a k=3 run had filled the shared cache, failed to load the cached graph ("Compiling model again due
  to a load failure"), recompiled and died of a stack overflow in torch's tensor printing ("Fatal Python error:
  _Py_CheckRecursiveCall"). Its whole output goes to a log file under
  `folders.cache_root()/logs/` (named in the row's info and in errors); lines of the worker itself go to stderr.
- Speculative rows need `job.drafter`, a `speculators` folder (`hispec-export RUN --format speculators`); without
  one they fail saying what to pass. Counters: a row's passes are 1 + vLLM's drafts (the prefill's token, then one
  verification step per draft), positions 1 + drafts + draft tokens; `info` has vLLM's acceptance by position
  (accepted at position i / drafts), the mean acceptance length (1 + accepted / drafts) and the share of draft
  tokens accepted, from vLLM's own metrics.
- A batch row's wall time is shared among its prompts in proportion to their new tokens, so that each prompt's
  tokens/s, and so the row's median, is the batch's throughput (total new tokens / wall time).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .spec import PeerError, PeerJob, PeerMissing, PeerOutcome, PeerRun, PeerSpec, cut
from .folders import cache_root

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO = Path(__file__).resolve().parents[3]
DEFAULT_TIMEOUT = 3600.0
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def default_python() -> Path | None:
    given = os.environ.get("HISPEC_VLLM_PYTHON")
    if given:
        return Path(given)
    for root in (REPO, Path.cwd()):
        p = root / ".venv-vllm" / "bin" / "python"
        if p.exists():
            return p
    return None


def parse_cpus(text: str) -> list[int]:
    """A CPU list as taskset and vLLM write it ("1", "0,2", "4-7,9") -> the CPU ids."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def bind_cpus(threads: int | None) -> str:
    """The CPUs vLLM's OpenMP threads are bound to: the first `threads` of those this process may use."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[: threads or len(cpus)])


def worker_env(threads: int | None, cache_tag: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the worker imports vLLM's environment only
    bound = bind_cpus(threads)
    env.update(OMP_NUM_THREADS=str(len(bound.split(","))), VLLM_CPU_OMP_THREADS_BIND=bound,
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("HISPEC_VLLM_KV_GB", "2"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    if cache_tag:  # one compile cache per engine setting (module docstring)
        root = os.environ.get("VLLM_CACHE_ROOT") or str(Path.home() / ".cache" / "vllm")
        env["VLLM_CACHE_ROOT"] = str(Path(root) / f"hispec-{cache_tag}")
    return env


def model_len(needed: int) -> int:
    """vLLM's max_model_len: 2048, or the next multiple of 1024 that holds `needed` tokens. A fixed value keeps the
    engine's configuration, and so the key of vLLM's compilation cache (~/.cache/vllm/torch_compile_cache), the same
    from run to run: a hit skips minutes of compiling at start-up."""
    return max(2048, -(-(needed + 16) // 1024) * 1024)


def request(job: PeerJob, spec_tokens: int | None, modes: list[str]) -> dict:
    req = {"model": str(job.model_dir), "dtype": DTYPES[job.dtype], "prompts": job.prompts,
           "max_new_tokens": job.max_new_tokens, "eos": list(job.eos), "modes": modes, "repeats": job.repeats,
           "warmup": job.warmup, "seed": 0, "speculative": None,
           "max_model_len": model_len(max(len(p) for p in job.prompts) + job.max_new_tokens + (spec_tokens or 0))}
    if spec_tokens is not None:
        req["speculative"] = {"method": "eagle3", "model": str(job.drafter), "num_speculative_tokens": spec_tokens}
    return req


def cache_tag(req: dict) -> str:
    """The compile-cache tag of an engine setting: "plain" or "eagle3-kK" (module docstring)."""
    spec = req.get("speculative")
    return "plain" if not spec else f"{spec['method']}-k{spec['num_speculative_tokens']}"


def call_worker(python: Path, req: dict, threads: int | None, timeout: float, progress: bool = False,
                label: str = "vllm") -> tuple[dict, Path]:
    """Run the worker on `req`; (its result, its log file). PeerError with the log's tail when it fails."""
    logs = cache_root() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    tail: collections.deque = collections.deque(maxlen=40)
    with tempfile.TemporaryDirectory(prefix="hispec-vllm-") as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(req))
        env = worker_env(threads, cache_tag(req))
        proc = subprocess.Popen([str(python), str(WORKER), str(req_path), str(res_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        deadline = time.monotonic() + timeout
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                tail.append(line.rstrip())
                if progress and line.startswith("[vllm-worker]"):
                    print(f"[hispec-bench] {label}: {line[len('[vllm-worker] '):].rstrip()}", file=sys.stderr,
                          flush=True)
                if time.monotonic() > deadline:
                    proc.kill()
                    break
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if time.monotonic() > deadline:
            raise PeerError(f"vLLM did not finish within {timeout:.0f} s (log: {log})")
        result = json.loads(res_path.read_text()) if res_path.is_file() else None
    if result is None or not result.get("ok"):
        why = (result or {}).get("error") or f"exit status {rc}, no result"
        last = next((t for t in reversed(tail) if "Error" in t or "error" in t), tail[-1] if tail else "")
        raise PeerError(f"{why}" + (f" | last error line: {last.strip()[:300]}" if last and last not in why else "")
                        + f" (log: {log})")
    return result, log


def _run(r: dict, eos, spec_tokens: int | None, seconds: float | None = None) -> PeerRun:
    tokens = list(r["tokens"])
    stop = r.get("stop_reason")
    if r.get("finish") == "stop" and isinstance(stop, int) and (not tokens or tokens[-1] != stop):
        tokens.append(stop)  # an engine that leaves the EOS id out: transformers' rows keep it
    tokens = cut(tokens, eos)
    n = len(tokens)
    if spec_tokens is None:
        return PeerRun(tokens, r["seconds"] if seconds is None else seconds, passes=n, positions=n)
    drafts, drafted, accepted = r.get("drafts"), r.get("draft_tokens"), r.get("accepted")
    if drafts is None:
        return PeerRun(tokens, r["seconds"] if seconds is None else seconds)
    return PeerRun(tokens, r["seconds"] if seconds is None else seconds, passes=1 + drafts, drafted=drafted,
                   accepted=accepted, positions=1 + drafts + drafted)


def acceptance(totals: dict) -> dict:
    drafts = totals.get("drafts") or 0
    if not drafts:
        return {}
    return {"drafts": drafts, "draft_tokens": totals.get("draft_tokens"), "accepted": totals.get("accepted"),
            "acceptance_by_position": [round(a / drafts, 4) for a in totals.get("accepted_per_pos") or []],
            "mean_acceptance_length": round(1 + (totals.get("accepted") or 0) / drafts, 4),
            "draft_acceptance": round((totals.get("accepted") or 0) / max(totals.get("draft_tokens") or 0, 1), 4)}


def run(specs: list[PeerSpec], job: PeerJob, progress: bool = False) -> dict[str, PeerOutcome]:
    python = Path(job.vllm_python) if job.vllm_python else default_python()
    if python is None or not python.exists():
        raise PeerMissing(f"no Python of vLLM's environment ({python or REPO / '.venv-vllm/bin/python'}): run `make "
                          "vllm` (it builds .venv-vllm with vLLM's CPU build) or set $HISPEC_VLLM_PYTHON")
    if job.dtype not in DTYPES:
        raise PeerError(f"vLLM rows run fp32, bf16 or fp16, not {job.dtype!r}")
    out: dict[str, PeerOutcome] = {}
    groups: dict[int | None, list[PeerSpec]] = {}
    for s in specs:
        groups.setdefault(s.spec_tokens, []).append(s)
    for k, group in groups.items():
        if k is not None and not job.drafter:
            why = job.drafter_error or (
                "no EAGLE-3 drafter: pass a `speculators` folder with --peer-drafter (hispec-export RUN --format "
                "speculators), or benchmark a checkpoint exported with --drafter")
            out.update({s.name: PeerOutcome(s, failed=f"PeerError: {why}") for s in group})
            continue
        modes = [m for m, want in (("single", any(not s.batch for s in group)), ("batch", any(s.batch for s in group)))
                 if want]
        label = "vllm" if k is None else f"vllm-eagle3-k{k}"
        try:
            result, log = call_worker(python, request(job, k, modes), job.threads, job.timeout or DEFAULT_TIMEOUT,
                                      progress, label)
        except PeerError as e:
            out.update({s.name: PeerOutcome(s, failed=f"PeerError: {e}") for s in group})
            continue
        for s in group:
            out[s.name] = _outcome(s, result, job, log)
    return out


def _outcome(spec: PeerSpec, result: dict, job: PeerJob, log: Path) -> PeerOutcome:
    k = spec.spec_tokens
    info = {"engine": "vllm", "version": f"vLLM {result.get('vllm')} (CPU build)", "torch": result.get("torch"),
            "cpu_features": result.get("cpu_capability"), "start_seconds": round(result.get("start_seconds", 0), 1),
            "dtype": DTYPES[job.dtype], "threads": job.threads, "log": str(log),
            "mode": f"batch of {len(job.prompts)}" if spec.batch else "one prompt at a time"}
    if k is not None:
        info["speculative"] = {"method": "eagle3", "model": str(job.drafter), "num_speculative_tokens": k}
        info.update(acceptance(result["batch_totals"] if spec.batch else result["totals"]))
    if not spec.batch:
        runs = [[_run(r, job.eos, k) for r in per] for per in result["single"]]
        return PeerOutcome(spec, runs=runs, info=info)
    runs = [[] for _ in job.prompts]
    for b in result["batch"]:
        cut_runs = [_run({**o, "seconds": 0.0}, job.eos, None) for o in b["outputs"]]
        total = sum(len(r.tokens) for r in cut_runs) or 1
        for i, r in enumerate(cut_runs):  # the batch's wall time shared by new tokens (module docstring)
            r.seconds = b["seconds"] * len(r.tokens) / total
            if k is not None:
                r.passes = r.positions = None  # per-row speculative counters: only the batch's totals exist
            runs[i].append(r)
    return PeerOutcome(spec, runs=runs, info=info)
