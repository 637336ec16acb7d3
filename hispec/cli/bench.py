"""hispec-bench: latency and fidelity of hispec against transformers' own decoding, in one process.

    hispec-bench --model ./smollm2-hispec --prompts spec_bench_question.jsonl --num-prompts 40 \\
        --max-new-tokens 128 --dtype bf16 --threads 2 --plot speedup.png
    hispec-bench --model ./smollm2-hispec --prompts spec_bench_question.jsonl --num-prompts 4 \\
        --sweep --sweep-gammas 2,3,4,6 --sweep-windows 2,4,8 --write-defaults
    hispec-bench --model HuggingFaceTB/SmolLM2-135M-Instruct --head-type shared --prompts q.jsonl \\
        --sweep --sweep-draft-layers 2,4,6 --sweep-verify-layers 8,10 --sweep-gammas 3,4
    hispec-bench --model ./smollm2-hispec --prompts spec_bench_question.jsonl --temperature 0.7 \\
        --strategies ar,self-spec,hispec --verification both
    hispec-bench --model ./smollm2-hispec --prompts spec_bench_question.jsonl --dtype fp32 --threads 1 \\
        --strategies hf,ar,auto,llama.cpp,vllm,vllm-eagle3,vllm-batch --peer-drafter DRAFTER

Every prompt (batch size 1, chat template applied) is decoded by every strategy, interleaved with a rotating order
so machine drift hits all alike. Prints a fixed-width table to stdout and ends with one JSON line (the summary);
progress goes to stderr. When sampling, `--verification both` runs every speculative hispec strategy twice, token-
wise (its plain name) and sequence-level (`NAME:hsd`), side by side on the same prompts, and adds a table of
HSD's gain; a single strategy can also be named with its rule (`--strategies hispec:token,hispec:hsd`). `hf`
(transformers greedy `generate`) is the reference: a lossless strategy must
reproduce its new tokens exactly. In bf16/fp16 two correct computations round differently and may part at a
near-tie of the top two logits; every divergence is therefore re-evaluated in fp32 and its margin reported
("lossless_up_to_ties"). A strategy of transformers' own (hf, hf-early-exit, hf-prompt-lookup, hf-packed) that
raises is reported as FAILED in the table, under "failed" in the JSON line and on stderr, and the others run on.
Other engines join the same table (hispec.bench.peers; greedy, the same prompt token ids and EOS): `llama.cpp`
(llama-cpp-python, `make peers`; a GGUF made by llama.cpp's converter at --dtype, cached; `llama.cpp:q8_0` a
quantised one, never counted as identical) and `vllm`, `vllm-batch`, `vllm-eagle3[:K]`, `vllm-eagle3-batch[:K]`
(vLLM's CPU build in .venv-vllm, `make vllm`; one prompt at a time, or all at once). One that is not installed is
"skipped", one that fails "FAILED", each with the reason, and the others run on.
Exit status: 0; 1 when a greedy run left hf beyond a rounding tie; 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import packed

DEFAULT_STRATEGIES = ("hf", "hf-early-exit", "hf-prompt-lookup", "ar", "self-spec", "hispec", "ngram")
DEFAULT_CALIBRATION_SECONDS = 300.0  # hispec.latency.DEFAULT_MAX_SECONDS (not imported: --help stays light)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from ..bench import STRATEGIES

    p = argparse.ArgumentParser(prog="hispec-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True,
                   help="hispec checkpoint folder or Hub id; or a base model (folder, Hub id, .gguf) together with "
                   "--draft-layer / --verify-layer / --head-type (untrained heads)")
    m.add_argument("--draft-layer", type=int, help="treat --model as a base model; draft exit (default depth/8)")
    m.add_argument("--verify-layer", type=int, help="treat --model as a base model; verifier exit (default depth/4)")
    m.add_argument("--head-type", help="treat --model as a base model with heads of this type (default shared)")
    m.add_argument("--draft-vocab-size", type=int, metavar="K",
                   help="draft head proposes only the K lowest-id (most frequent BPE) tokens, e.g. 8192; 0 = full "
                        "(default: the checkpoint's)")
    m.add_argument("--verify-vocab-size", type=int, metavar="K", help="the same for the verifier head")
    m.add_argument("--dtype", default="bf16", help="fp32, bf16 or fp16 (default bf16)")
    m.add_argument("--device", default=None, help="torch device (default cpu)")
    m.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    packed.add_argument(m)
    d = p.add_argument_group("prompts")
    d.add_argument("--prompts", required=True,
                   help="Spec-Bench/MT-Bench question.jsonl, ShareGPT json, jsonl with a 'prompt' field, or text")
    d.add_argument("--num-prompts", type=int, default=10,
                   help="prompts to run, spread round-robin over categories (default 10; 0 = all)")
    d.add_argument("--categories", type=_names, help="comma-separated categories to keep (e.g. writing,math)")
    d.add_argument("--no-chat", action="store_true", help="feed the raw text, without the chat template")
    r = p.add_argument_group("decoding")
    r.add_argument("--strategies", type=_names, default=None,
                   help=f"comma-separated, from {', '.join(STRATEGIES)}, hierarchies such as ngram>L8>full, or "
                   "tree:4x2x1 (self-spec drafting that static tree: children per node at each depth), "
                   "lookup-tree:4 (self-spec-lookup, its exit drafting that tree where the lookup finds nothing), "
                   "eagle-tree:4x2 / eagle-lookup-tree:4x2 (the EAGLE-3 drafter drafting that static tree), "
                   "eagle-gate:0.3 / eagle-lookup-gate:0.3 (its chain stopping at a draft it gives less than 0.3), "
                   "other engines llama.cpp, llama.cpp:q8_0, vllm, vllm-batch, vllm-eagle3[:K], vllm-eagle3-batch[:K] "
                   "(default: hf, hf-early-exit, hf-prompt-lookup, ar, self-spec, hispec, ngram, and auto when the "
                   "checkpoint holds a calibration). "
                   "With --sweep: which of self-spec, hispec to tune (default hispec)")
    r.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    r.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, identity to hf checked (default); > 0 samples, identity not checked")
    r.add_argument("--gamma", type=int, help="drafts per round (default: the checkpoint's)")
    r.add_argument("--window", type=int, help="tokens gathered before full verification (default: the checkpoint's)")
    r.add_argument("--ngram-max", type=int, help="n-gram level: longest suffix matched (default 3)")
    r.add_argument("--ngram-min", type=int, help="n-gram level: shortest suffix tried (default 1)")
    r.add_argument("--ngram-tokens", type=int, help="n-gram level: most tokens proposed per round (default 8)")
    r.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="hf-prompt-lookup: prompt_lookup_num_tokens (default 10)")
    r.add_argument("--assistant-tokens", type=int,
                   help="hf-early-exit: num_assistant_tokens (default: transformers' own, 20 with confidence stop)")
    r.add_argument("--verification", choices=("token", "hsd", "both"), default=None,
                   help="acceptance rule of hispec's strategies when sampling: token (per-token), hsd "
                        "(sequence-level), or both (each speculative strategy twice, NAME and NAME:hsd, side by "
                        "side); a strategy may also carry its own as NAME:token / NAME:hsd (default: the "
                        "checkpoint's, else token; greedy runs are identical under both)")
    r.add_argument("--seed", type=int, default=0, help="seed for sampling runs (default 0)")
    r.add_argument("--tie-tolerance", type=float,
                   help="fp32 logit margin up to which a divergence from hf counts as a rounding tie "
                   "(default: 0.5 for bf16, 0.1 for fp16, 0.001 for fp32)")
    r.add_argument("--no-tie-check", action="store_true",
                   help="do not re-evaluate divergences in fp32 (that check holds one fp32 copy of the base model)")
    e = p.add_argument_group("other engines (strategies llama.cpp*, vllm*)")
    e.add_argument("--peer-model", metavar="FOLDER",
                   help="the base model's local Hugging Face folder the engines load (default: --model; a hispec "
                        "checkpoint's own files are left out)")
    e.add_argument("--peer-drafter", metavar="FOLDER",
                   help="EAGLE-3 drafter of the vllm-eagle3 rows: a speculators folder (hispec-export --format "
                        "speculators), or a drafter run / checkpoint with one, exported on the fly (default: --model "
                        "when it holds a drafter)")
    e.add_argument("--vllm-python", metavar="PYTHON",
                   help="Python of vLLM's environment (default: $HISPEC_VLLM_PYTHON, else .venv-vllm/bin/python)")
    t = p.add_argument_group("timing and output")
    t.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per strategy (default 1)")
    t.add_argument("--repeats", type=int, default=1,
                   help="timed runs per prompt and strategy; a prompt's time is their median (default 1)")
    t.add_argument("--json-out", help="write the full results (with per-prompt figures) to this JSON file")
    t.add_argument("--plot", help="write a PNG of speedup vs hf by category and strategy")
    t.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    c = p.add_argument_group("latency calibration (what strategy 'auto' and the predictions use)")
    c.add_argument("--calibrate", action="store_true",
                   help="before benchmarking, calibrate the latency model on this machine (timed unit costs, "
                        "acceptance on the model's own answers to --calibration-prompts) and store it in the "
                        "checkpoint's config.json (also done by --write-defaults)")
    c.add_argument("--calibration-prompts", metavar="FILE",
                   help="prompts to calibrate on (default: prompts of --prompts that the benchmark does not run, "
                        "spread over categories)")
    c.add_argument("--calibration-num-prompts", type=int, default=8, help="prompts to calibrate on (default 8)")
    c.add_argument("--calibration-max-seconds", type=float, default=DEFAULT_CALIBRATION_SECONDS, metavar="S",
                   help="time budget of the calibration: past it, fewer prompts, repeats and decoder runs are "
                        "measured (stated in the calibration and on stderr) rather than the calibration running on; "
                        f"0 = no limit (default {DEFAULT_CALIBRATION_SECONDS:g})")
    s = p.add_argument_group("sweep (greedy; picks the fastest setting whose outputs all equal hf's)")
    s.add_argument("--sweep", action="store_true", help="sweep settings instead of comparing strategies")
    s.add_argument("--sweep-draft-layers", type=_ints, help="draft exits to try, e.g. 2,4 (base models, shared heads)")
    s.add_argument("--sweep-verify-layers", type=_ints, help="verifier exits to try, e.g. 8,10")
    s.add_argument("--sweep-gammas", type=_ints, help="gammas to try, e.g. 2,3,4 (default: the checkpoint's)")
    s.add_argument("--sweep-windows", type=_ints, help="windows to try, e.g. 2,4 (default: the checkpoint's)")
    s.add_argument("--write-defaults", action="store_true",
                   help="store the best gamma/window (and exits, for shared heads) and a latency calibration of this "
                        "machine in the checkpoint's config.json")
    return p


def load_model(args):
    from hispec.vocab import apply_vocab_sizes

    model, from_base = _load_model(args)
    apply_vocab_sizes(model, args.draft_vocab_size, args.verify_vocab_size)
    return model, from_base


def _load_model(args):
    import hispec

    pack = packed.pack_arg(args)

    if args.draft_layer is not None or args.verify_layer is not None or args.head_type is not None:
        return packed.apply(hispec.EarlyExitModel.from_base(
            args.model, draft_layer=args.draft_layer, verify_layer=args.verify_layer,
            head_type=args.head_type or "shared", dtype=args.dtype, device=args.device), pack), True
    try:
        return hispec.load(args.model, dtype=args.dtype, device=args.device, pack=pack), False
    except hispec.CheckpointError as e:
        if "no 'hispec' entry" in str(e):
            raise hispec.CheckpointError(f"{e} (or benchmark it with untrained heads: add --head-type shared)") from e
        raise


def _check_args(args) -> str | None:
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be >= 1"
    if args.num_prompts < 0:
        return "--num-prompts must be >= 0"
    if args.write_defaults and not args.sweep:
        return "--write-defaults only works with --sweep (to store only a calibration: --calibrate)"
    if args.calibration_num_prompts < 1:
        return "--calibration-num-prompts must be >= 1"
    if args.calibration_max_seconds < 0:
        return "--calibration-max-seconds must be >= 0 (0 = no limit)"
    if args.sweep and args.temperature != 0:
        return "--sweep checks identical outputs and runs greedy only; drop --temperature"
    if args.sweep and args.verification is not None:
        return "--sweep runs greedy, where both verification rules give the same output; drop --verification"
    if args.plot and args.sweep:
        return "--plot is for the strategy comparison, not --sweep"
    if not args.sweep and any(v is not None for v in (args.sweep_draft_layers, args.sweep_verify_layers,
                                                      args.sweep_gammas, args.sweep_windows)):
        return "--sweep-* values need --sweep"
    return None


def _sweep(args, model, from_base: bool, prompts, config, progress: bool) -> int:
    from .. import bench

    h = model.hispec_config
    layers_free = from_base or h.head_type == "shared"
    strategies = args.strategies or ["hispec"]
    draft = args.sweep_draft_layers or [h.draft_layer]
    verify = args.sweep_verify_layers or [h.verify_layer]
    if not layers_free and (set(draft) != {h.draft_layer} or set(verify) != {h.verify_layer}):
        raise ValueError(
            f"the heads in {args.model} were trained for draft layer {h.draft_layer} and verify layer "
            f"{h.verify_layer}: on a trained checkpoint sweep only --sweep-gammas/--sweep-windows; layer sweeps "
            "need a base model with --head-type shared (or norm)"
        )
    settings = bench.sweep_settings(strategies, draft, verify, args.sweep_gammas or [h.gamma],
                                    args.sweep_windows or [h.window], model.num_layers)
    if args.write_defaults and from_base:
        raise ValueError("--write-defaults needs a hispec checkpoint folder as --model, not a base model")
    result = bench.run_sweep(model, prompts, settings, config, layers_free=layers_free, progress=progress)
    print(bench.format_sweep_table(result), flush=True)
    out = result.as_dict()
    best = result.best
    out["written"] = None
    if args.write_defaults:
        if best is None:
            print("not writing defaults: no setting was lossless", file=sys.stderr)
        else:
            write_exits = h.head_type == "shared"
            moved = (best.setting.draft_layer, best.setting.verify_layer or h.verify_layer) != (
                h.draft_layer, h.verify_layer)
            if moved and not write_exits:  # cannot happen for checkpoints (checked above); kept as a guard
                raise ValueError("the best setting moves the exits, but the heads exist only at the trained ones")
            bench.write_decoding_defaults(args.model, best.setting, write_exits=write_exits and moved)
            out["written"] = {"path": f"{args.model}/config.json", "gamma": best.setting.gamma,
                              "window": best.setting.window,
                              "exits": [best.setting.draft_layer, best.setting.verify_layer] if write_exits and moved
                              else None}
            print(f"wrote {best.setting.label} into {args.model}/config.json", file=sys.stderr)
    if args.json_out:
        _write_json(args.json_out, out)
    print(json.dumps(out), flush=True)
    return 0 if best is not None else 1


def _calibrate(args, model, prompts, progress: bool) -> None:
    """Calibrate the latency model on prompts the benchmark does not run (when the file has enough), store it."""
    from .. import latency
    from ..drafters.ngram import NgramConfig
    from ..prompts import load_prompts, spread_over_categories

    if not Path(args.model, "config.json").is_file():
        raise ValueError(f"--calibrate / --write-defaults need a local checkpoint folder, not {args.model!r}")
    if args.calibration_prompts:
        cal_prompts = load_prompts(args.calibration_prompts, num=args.calibration_num_prompts)
    else:
        every = load_prompts(args.prompts)
        used = {p.text for p in prompts}
        rest = [p for p in every if p.text not in used]
        cal_prompts = spread_over_categories(rest or every, args.calibration_num_prompts)
    print(f"[hispec-bench] calibrating on {len(cal_prompts)} prompts", file=sys.stderr, flush=True)
    flags = _ngram(args)  # given: measure that config; else the checkpoint's, else calibrate chooses one
    cal = latency.calibrate(model, cal_prompts, ngram=NgramConfig(**flags) if flags else None, progress=progress,
                            max_seconds=args.calibration_max_seconds or None)
    report_budget(cal, "hispec-bench")
    latency.write_calibration(args.model, cal)
    model.hispec_config.calibration = cal.to_dict()
    print(latency.format_predictions(cal, latency.predictions(cal)), file=sys.stderr, flush=True)


def report_budget(cal, prog: str) -> None:
    """Say on stderr what a calibration's time budget left out (nothing when it fitted)."""
    b = cal.budget or {}
    if b.get("skipped"):
        print(f"[{prog}] the calibration took {b['seconds']:.0f} s of its {b['max_seconds']:g} s budget and left out "
              f"{b['skipped']} (raise --calibration-max-seconds for more)", file=sys.stderr, flush=True)


def _ngram(args) -> dict | None:
    d = {k: v for k, v in (("max_ngram", args.ngram_max), ("min_ngram", args.ngram_min),
                           ("max_len", args.ngram_tokens)) if v is not None}
    if not d:
        return None
    from ..drafters.ngram import NgramConfig

    NgramConfig(**d)  # validate before any work
    return d


def _write_json(path: str, data: dict) -> None:
    from ..io import write_json  # torch-heavy: imported when used, so --help stays fast

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _check_args(args)
    if problem:
        parser.error(problem)

    import torch
    import transformers

    from .. import bench
    from ..model import CheckpointError
    from ..prompts import load_prompts

    transformers.utils.logging.set_verbosity_error()  # generation-config chatter would drown the table
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    try:
        config = bench.BenchConfig(
            strategies=("hf",) if args.sweep else tuple(args.strategies or DEFAULT_STRATEGIES),
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, gamma=args.gamma,
            window=args.window, warmup=args.warmup, repeats=args.repeats, seed=args.seed, chat=not args.no_chat,
            prompt_lookup_tokens=args.prompt_lookup_tokens, assistant_tokens=args.assistant_tokens,
            tie_tolerance=args.tie_tolerance, tie_check=not args.no_tie_check, ngram=_ngram(args),
            verification="token" if args.verification == "both" else args.verification,
            peer_model=args.peer_model, peer_drafter=args.peer_drafter, vllm_python=args.vllm_python,
        )
        prompts = load_prompts(args.prompts, num=args.num_prompts or None, categories=args.categories)
        print(f"[hispec-bench] loading {args.model}", file=sys.stderr, flush=True)
        model, from_base = load_model(args)
        if model.tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer files; the benchmark renders text prompts and needs one")
        print(f"[hispec-bench] {len(prompts)} prompts, {model.num_layers} layers, exits "
              f"{model.draft_layer}/{model.verify_layer}, {model.dtype}, {torch.get_num_threads()} threads",
              file=sys.stderr, flush=True)
        if args.calibrate or args.write_defaults:
            if from_base:
                raise ValueError("--calibrate / --write-defaults need a hispec checkpoint folder as --model")
            _calibrate(args, model, prompts, progress)
        if args.sweep:
            return _sweep(args, model, from_base, prompts, config, progress)
        if not args.strategies and not args.sweep and model.hispec_config.calibration:
            config.strategies = config.strategies + ("auto",)
        if args.verification == "both":
            config.strategies = bench.with_both_verifications(config.strategies)
        result = bench.run_bench(model, prompts, config, progress=progress)
    except (CheckpointError, ValueError, FileNotFoundError, OSError) as e:
        print(f"hispec-bench: error: {e}", file=sys.stderr)
        return 2
    summary = bench.summarize(result)
    for name, why in summary.failed.items():
        print(f"hispec-bench: warning: {name} failed and was left out: {why}", file=sys.stderr)
    for name, why in summary.skipped.items():
        print(f"hispec-bench: warning: {name} was skipped: {why}", file=sys.stderr)
    print(bench.format_table(summary), flush=True)
    if args.plot:
        try:
            print(f"[hispec-bench] wrote {bench.plot(summary, args.plot)}", file=sys.stderr)
        except ValueError as e:
            print(f"hispec-bench: error: {e}", file=sys.stderr)
            return 2
    if args.json_out:
        _write_json(args.json_out, summary.as_dict(per_prompt=True))
    print(json.dumps(summary.as_dict()), flush=True)
    return 1 if summary.lossless_up_to_ties is False else 0


if __name__ == "__main__":
    sys.exit(main())
