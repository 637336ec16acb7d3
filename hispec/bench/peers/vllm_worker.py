"""Runs vLLM for hispec: `PYTHON vllm_worker.py REQUEST.json RESULT.json`, PYTHON being vLLM's own environment's.

This file imports nothing of hispec (vLLM's environment, `.venv-vllm`, does not have it): only the standard library
and vLLM. hispec.bench.peers.vllm_peer writes the request, starts this script, and reads the result.

Request (JSON): {"model": folder, "dtype": "float32" | "bfloat16" | "float16", "prompts": [[token ids]],
"max_new_tokens": N, "eos": [ids], "modes": ["single", "batch"], "repeats": R, "warmup": W, "seed": S,
"speculative": null | {"method": "eagle3", "model": folder, "num_speculative_tokens": K}, "max_model_len": M,
"engine": {extra keyword arguments of vllm.LLM}}.

What it does: one `vllm.LLM` engine (prefix caching off, so that repeats and the warm-up never skip a prompt's
prefill; statistics on, for the speculative counters), W untimed warm-up generations of the first prompt (at most
32 tokens), then for "single" every prompt alone, R times, each timed around `LLM.generate`, and for "batch" all
prompts in one `LLM.generate` call, R times. Sampling: `SamplingParams(temperature=0, max_tokens=N,
stop_token_ids=eos, ignore_eos=False, seed=S, detokenize=False)` (token ids are compared, so no text is made,
as transformers' `generate` makes none), prompts given as `TokensPrompt(prompt_token_ids=...)` (vLLM adds
nothing to them). Speculative counters per run are the differences of vLLM's own metrics
(`LLM.get_metrics()`: vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
_num_accepted_tokens_per_pos) before and after it.

Result (JSON, written atomically): {"ok": true, "vllm": version, "torch": version, "cpu_capability": the vector
ISA torch's CPU kernels use, "start_seconds": s, "single": [[run per repeat] per prompt] | null, "batch": [run per
repeat] | null, "totals": counters over "single", "batch_totals": counters over "batch"}; a single run is
{"tokens": [...], "seconds": s, "finish": reason, "stop_reason": the stop token id or null, "drafts": n,
"draft_tokens": n, "accepted": n, "accepted_per_pos": [...]}; a batch run is {"seconds": s, "outputs": [{"tokens":
[...], "finish": reason, "stop_reason": ...}], counters}. On any error: {"ok": false, "error": "Type: message",
"traceback": "..."} and exit status 1. Progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# This file's folder holds hispec's own `vllm_peer.py` and friends; Python puts a script's folder first on sys.path,
# where no module of it may shadow vLLM's packages: take it off before anything is imported.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _log(msg: str) -> None:
    print(f"[vllm-worker] {msg}", file=sys.stderr, flush=True)


def counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters ({} when the engine keeps none)."""
    out = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 (an engine without statistics: no counters)
        return out
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] = out.get(SPEC_COUNTERS[m.name], 0) + int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            prev = out.get("accepted_per_pos") or [0] * len(vals)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, vals)]
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            b = before.get(k) or [0] * len(v)
            out[k] = [x - y for x, y in zip(v, b)]
        else:
            out[k] = v - before.get(k, 0)
    return out


def add(total: dict, d: dict) -> None:
    for k, v in d.items():
        if isinstance(v, list):
            prev = total.get(k) or [0] * len(v)
            total[k] = [a + b for a, b in zip(prev, v)]
        else:
            total[k] = total.get(k, 0) + v


def _tokens(completion) -> dict:
    return {"tokens": [int(t) for t in completion.token_ids], "finish": completion.finish_reason,
            "stop_reason": completion.stop_reason if isinstance(completion.stop_reason, int) else None}


def run(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = dict(model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"], seed=req.get("seed", 0),
              enable_prefix_caching=False, disable_log_stats=False)
    if req.get("speculative"):
        kw["speculative_config"] = dict(req["speculative"])
    kw.update(req.get("engine") or {})
    _log(f"starting vLLM {vllm.__version__} on {req['model']} ({req['dtype']}"
         + (f", speculative {req['speculative']}" if req.get("speculative") else "") + ")")
    llm = LLM(**kw)
    start = time.perf_counter() - t0
    _log(f"engine up in {start:.1f} s")
    n, eos = req["max_new_tokens"], [int(t) for t in req["eos"]]
    params = lambda m: SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=eos or None,  # noqa: E731
                                      ignore_eos=False, seed=req.get("seed", 0), detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in req["prompts"]]
    for _ in range(req.get("warmup", 1)):
        llm.generate([prompts[0]], params(min(32, n)), use_tqdm=False)
    out = {"ok": True, "vllm": vllm.__version__, "torch": _torch_version(), "cpu_capability": _cpu_capability(),
           "start_seconds": start,
           "single": None, "batch": None, "totals": {}, "batch_totals": {}}
    modes, repeats = req.get("modes", ["single"]), req.get("repeats", 1)
    if "single" in modes:
        out["single"] = []
        for i, p in enumerate(prompts):
            per = []
            for _ in range(repeats):
                before = counters(llm)
                t = time.perf_counter()
                res = llm.generate([p], params(n), use_tqdm=False)
                secs = time.perf_counter() - t
                d = delta(counters(llm), before)
                add(out["totals"], d)
                per.append({**_tokens(res[0].outputs[0]), "seconds": secs, **d})
            out["single"].append(per)
            toks = sum(len(r["tokens"]) for r in per)
            _log(f"prompt {i + 1}/{len(prompts)}: {toks / max(sum(r['seconds'] for r in per), 1e-9):.1f} tok/s")
    if "batch" in modes:
        out["batch"] = []
        for _ in range(repeats):
            before = counters(llm)
            t = time.perf_counter()
            res = llm.generate(prompts, params(n), use_tqdm=False)
            secs = time.perf_counter() - t
            d = delta(counters(llm), before)
            add(out["batch_totals"], d)
            outputs = [_tokens(r.outputs[0]) for r in res]
            out["batch"].append({"seconds": secs, "outputs": outputs, **d})
            _log(f"batch of {len(prompts)}: {sum(len(o['tokens']) for o in outputs) / max(secs, 1e-9):.1f} tok/s")
    _shutdown(llm)
    return out


def _shutdown(llm) -> None:
    """Stop the engine's core process (vLLM's `EngineCoreClient.shutdown`) before this process exits."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 (the result is already complete; the exit below ends the rest)
        _log(f"engine shutdown: {type(e).__name__}: {e}")


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


def _cpu_capability() -> str | None:
    """The vector ISA torch's CPU kernels use here (torch.backends.cpu.get_cpu_capability: e.g. "AVX2")."""
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        return None


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        req = json.load(f)
    try:
        result = run(req)
    except BaseException as e:  # noqa: BLE001 (the parent reads the error from the result file)
        _write(argv[1], {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    _write(argv[1], result)
    sys.stderr.flush()
    os._exit(0)  # the engine is shut down; vLLM's remaining threads would otherwise hold the interpreter at exit


if __name__ == "__main__":
    sys.exit(main())
