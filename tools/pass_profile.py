"""Where one decoding pass spends its time, and how far it is from the floor of streaming the weights once.

    python tools/pass_profile.py --model ~/.cache/hispec/models/SmolLM2-135M-Instruct --dtype fp32 --threads 1
    taskset -c 0 python tools/pass_profile.py --model CKPT --dtype fp32,bf16 --positions 1,2,4,8,16 --json-out p.json

A pass is what `ar` runs per token and a verification runs per round: embeddings, every decoder layer over T new
positions behind a KV cache of `--context` positions (`hispec.latency.KVBench`, rolled back after each pass), the
final norm and the lm_head. For each dtype and T it reports
- `wall`: the median time of the pass (`--repeats` runs, after a warm-up), as decoding runs it;
- the time of the operators inside it, from `torch.profiler` (their self time, summed by kind): GEMMs (the linear
  layers' weight-streaming products), attention (sdpa), lm_head (the final norm + output projection), cache (the
  KV writes and reads of `hispec.cache.KVCache.update`), masks + rotary (`DecoderAdapter._prepare`), and the
  rest (norms, rotary application, activations, residual adds, copies: `other ops`);
- `python + dispatch`: the wall time no operator accounts for (the interpreter, module calls, torch's dispatcher);
- `floor`: the bytes of weights one pass must read (every linear layer and the lm_head; an embedding lookup reads
  one row) over the weight-read bandwidth measured on this core (a matrix-vector product over a matrix far larger
  than the caches, best of `--repeats`), i.e. what a pass costs if it does nothing but stream its weights once.
The operators' times come from a profiled run, which is slower than an unprofiled one; they are scaled to the
unprofiled wall time only in the sense that `python + dispatch` is wall minus their sum (so it can read a little
low). `hispec.matvec`'s products are C calls no torch operator sees; the tool names them as a profiler scope, so
they count as GEMMs (or lm_head).

`--kernel-rows 1,2,4,8,16,64` adds a second table: every linear layer of the model run once over that many rows
through each kernel `hispec.packed` offers on this CPU (`packed.time_kernels`: the kernels in turn, every weight
streamed), median ms and the weight bytes per second, i.e. the products alone, without the rest of the pass.
Prints the table(s) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::mv", "aten::matmul", "aten::linear", "aten::baddbmm",
            "mkldnn::_linear_pointwise", "mkldnn::_linear_pointwise.binary", "aten::_addmm_activation",
            "aten::mkldnn_linear", "hispec::")
ATTN_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_attention_math", "aten::_safe_softmax", "aten::softmax", "aten::_softmax")
SCOPES = {"hispec.cache": "cache", "hispec.prepare": "masks + rotary", "hispec.lm_head": "lm_head"}
KINDS = ("gemm", "attention", "lm_head", "cache", "masks + rotary", "other ops")


def weight_bytes(model) -> int:
    """Bytes a pass reads from weights: every 2-D linear weight of the decoder layers and the output projection
    (the embedding matrix counts once, through the lm_head, whether tied or not)."""
    ad = model.adapter
    seen, total = set(), 0
    modules = list(ad.parts.layers) + [ad.parts.final_norm]
    head = model.base.get_output_embeddings()
    if head is not None:
        modules.append(head)
    for m in modules:
        for p in m.parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def read_bandwidth(dtype, repeats: int = 10, mbytes: int = 256) -> float:
    """Bytes per second a matrix-vector product streams a `mbytes` MB matrix of `dtype` at (best of `repeats`)."""
    import torch

    el = torch.empty((), dtype=dtype).element_size()
    cols = 4096
    rows = mbytes * 2**20 // (el * cols)
    w = torch.randn(rows, cols).to(dtype)
    x = torch.randn(cols).to(dtype)
    torch.mv(w, x)
    best = min(_timed(lambda: torch.mv(w, x)) for _ in range(repeats))
    return rows * cols * el / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _scopes(model):
    """Context manager: name the cache's updates, the masks + rotary and the lm_head as profiler scopes."""
    import torch

    from hispec import matvec
    from hispec.cache import KVCache

    ad = model.adapter
    update, prepare, final = KVCache.update, type(ad)._prepare, type(ad).final_logits
    product = matvec.matvec  # (a C call through ctypes: no operator of torch's profiler sees it)

    def scoped(fn, name):
        def run(*a, **k):
            with torch.profiler.record_function(name):
                return fn(*a, **k)
        return run

    @contextlib.contextmanager
    def cm():
        KVCache.update = scoped(update, "hispec.cache")
        type(ad)._prepare = scoped(prepare, "hispec.prepare")
        type(ad).final_logits = scoped(final, "hispec.lm_head")
        matvec.matvec = scoped(product, "hispec::matvec")
        try:
            yield
        finally:
            KVCache.update, type(ad)._prepare, type(ad).final_logits = update, prepare, final
            matvec.matvec = product

    return cm()


def _kind(event, scope_of) -> str:
    scope = scope_of(event)
    if scope is not None:
        return scope
    name = event.name
    if any(name.startswith(g) for g in GEMM_OPS):
        return "gemm"
    if name in ATTN_OPS:
        return "attention"
    return "other ops"


def breakdown(pass_fn, repeats: int) -> dict:
    """Self time (seconds per pass) of the operators in `pass_fn` by kind, from `torch.profiler`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            pass_fn()
    events = prof.events()

    def scope_of(e):
        p = e.cpu_parent
        while p is not None:
            if p.name in SCOPES:
                return SCOPES[p.name]
            p = p.cpu_parent
        return None

    out = dict.fromkeys(KINDS, 0.0)
    for e in events:
        if e.name in SCOPES or e.name.startswith("hispec.") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        out[_kind(e, scope_of)] += e.self_cpu_time_total * 1e-6
    return {k: v / repeats for k, v in out.items()}


def kernel_table(model, dtype: str, rows, repeats: int) -> list[dict]:
    """The base model's linear layers alone through every kernel (`hispec.packed.time_kernels`), per row count:
    median ms per kernel and the bytes of weight they read. Leaves the base packed with oneDNN's kernel."""
    from hispec import packed

    nbytes = packed.packed_bytes(model.base)
    took = packed.time_kernels(model.base, rows, repeats)
    model.adapter.refresh_modules()
    return [{"dtype": dtype, "rows": t, "bytes": nbytes,
             "ms": {k: statistics.median(v) * 1e3 for k, v in per.items() if v}} for t, per in took.items()]


def profile_model(model, positions, context: int, repeats: int) -> list[dict]:
    import torch

    from hispec.latency import KVBench

    ad = model.adapter
    bench = KVBench(model, context)
    rows = []
    for T in positions:
        ids = torch.randint(0, ad.vocab_size, (1, T), generator=bench.gen).to(ad.device)
        pos, valid = bench._pos(T)

        def one_pass():
            with torch.no_grad():
                h = ad.embed(ids, pos)
                h = ad.run_layers(h, 0, ad.num_layers, position_ids=pos, cache=bench.cache, valid=valid)
                ad.final_logits(h[:, -T:])
            bench.cache.truncate(0, ad.num_layers, bench.keep)

        for _ in range(3):
            one_pass()
        wall = statistics.median(_timed(one_pass) for _ in range(repeats))
        with _scopes(model):
            ops = breakdown(one_pass, max(3, repeats // 2))
        rows.append({"T": T, "wall": wall, **ops, "python + dispatch": max(0.0, wall - sum(ops.values()))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pass_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a base model folder (or .gguf) or a hispec checkpoint")
    p.add_argument("--dtype", default="fp32", help="comma-separated dtypes to profile (fp32, bf16, fp16)")
    p.add_argument("--positions", default="1,2,4,8,16", help="new positions per pass, comma-separated")
    p.add_argument("--context", type=int, default=256, help="positions already in the KV cache (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=20, help="timed passes per setting (default 20)")
    p.add_argument("--bandwidth-mb", type=int, default=256,
                   help="size of the matrix the weight-read bandwidth is measured on, in MB (default 256: far "
                        "beyond the caches)")
    p.add_argument("--kernels", choices=("auto", "packed", "stock"), default="auto",
                   help="linear kernels: as hispec.load chooses them on this CPU (auto, hispec.packed's measured "
                        "choice), oneDNN-prepacked, or stock")
    p.add_argument("--wrapped", action="store_true",
                   help="call standard decoder layers through transformers' own forward (hispec.fused off)")
    p.add_argument("--separate", action="store_true",
                   help="multiply Q, K, V and gate, up one by one (hispec.merged off; its merged products are the "
                        "default)")
    p.add_argument("--kernel-rows", default=None,
                   help="also time the linear layers alone through every kernel over these row counts, "
                        "comma-separated (e.g. 1,2,4,8,16,64)")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    import torch

    import hispec
    from hispec import packed
    from hispec.io import cpu_model, emit_result, parse_dtype

    torch.set_num_threads(args.threads)
    positions = [int(t) for t in args.positions.split(",")]
    pack = {"auto": None, "packed": True, "stock": False}[args.kernels]
    results, kernel_rows = [], []
    for name in args.dtype.split(","):
        dtype = parse_dtype(name)
        cfg = Path(args.model) / "config.json"
        if cfg.is_file() and "hispec" in json.loads(cfg.read_text()):
            model = hispec.load(args.model, dtype=name, pack=pack)
        else:
            model = hispec.EarlyExitModel.from_base(args.model, 1, 2, "shared", dtype=name)
            packed.apply(model, pack)
        if args.wrapped:
            model.adapter.standard = None
        elif args.separate and model.adapter.standard is not None:
            model.adapter.standard.merge = False
        fused = model.adapter.standard
        kernels = packed.kind(model.base) + ("" if fused is None else ", standard layers unwrapped"
                                             + (", QKV and gate/up merged" if fused.merge and packed.kind(model.base) != packed.STOCK
                                                else ""))
        nbytes = weight_bytes(model)
        bw = read_bandwidth(dtype, mbytes=args.bandwidth_mb)
        floor = nbytes / bw
        for row in profile_model(model, positions, args.context, args.repeats):
            results.append({"dtype": name, "linear": kernels, **row, "floor": floor,
                            "wall_over_floor": row["wall"] / floor})
        print(f"# {name}: {nbytes / 2**20:.0f} MiB of weights per pass, read at {bw / 1e9:.1f} GB/s "
              f"(matrix-vector product) -> floor {floor * 1e3:.2f} ms; linear kernels: {kernels}", file=sys.stderr)
        if args.kernel_rows:
            kernel_rows += kernel_table(model, name, [int(t) for t in args.kernel_rows.split(",")], args.repeats)
        del model

    cols = ["wall", "gemm", "attention", "lm_head", "cache", "masks + rotary", "other ops", "python + dispatch",
            "floor"]
    print(f"pass profile: {args.model}, {cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s), context {args.context}, ms per pass (median of {args.repeats})")
    print("| dtype | T | " + " | ".join(cols) + " | wall / floor |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for r in results:
        print(f"| {r['dtype']} | {r['T']} | " + " | ".join(f"{r[c] * 1e3:.2f}" for c in cols)
              + f" | {r['wall_over_floor']:.2f} |")
    if kernel_rows:
        names = list(dict.fromkeys(k for r in kernel_rows for k in r["ms"]))
        print(f"\nthe linear layers alone, once over each row count, median ms of {args.repeats} rounds in turn "
              "(weight GB/s)")
        print("| dtype | rows | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in kernel_rows:
            print(f"| {r['dtype']} | {r['rows']} | " + " | ".join(
                f"{r['ms'][k]:.1f} ({r['bytes'] / r['ms'][k] / 1e6:.1f})" if k in r["ms"] else "-" for k in names)
                + " |")
    summary = {"tool": "pass_profile", "model": args.model, "cpu": cpu_model(),
               "capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
               "context": args.context, "rows": results, "kernels": kernel_rows}
    return emit_result(summary, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
