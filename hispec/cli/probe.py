"""hispec-probe: held-out top-1 agreement with the final layer's argmax, by exit layer and head type.

    hispec-probe --model ~/.cache/hispec/models/SmolLM2-135M-Instruct \\
        --data data/train/gsm8k_train_2000.jsonl \\
        --max-prompts 120 --eval-data data/eval/spec_bench_question.jsonl --max-eval-prompts 24 \\
        --max-new-tokens 96 --layers 2-28:2 --head-types shared,norm,linear --steps 150 \\
        --plot probe.png --json-out probe.json
    hispec-probe --model M --data chats.jsonl --eval-fraction 0.1 --draft-vocab-sizes 8192,16384
    hispec-probe --model M --data prompts.jsonl --layers 4,8 --head-types linear --train-sizes 5000,20000,80000
    hispec-probe --model runs/ckpt --eval-heads --eval-data data/eval/spec_bench_question.jsonl \\
        --max-eval-prompts 48 --max-new-tokens 96 --json-out heads.json

Data (--data, --eval-data): any prompt file hispec understands (Spec-Bench / MT-Bench question.jsonl, ShareGPT
json, jsonl/json with a prompt / text / instruction / question field, .txt one prompt a line); jsonl/json records
with {"prompt", "response"} or {"messages": [...]} are teacher-forced as they are (over the assistant turns);
--raw-text makes .txt files and {"text"} records documents scored on every token. Prompts alone are answered by the
model itself, greedily, and the answers cached on disk (model + prompt hash) so a rerun generates nothing.
Held-out data: --eval-data, or a --eval-fraction of --data's prompts. Spec-Bench / MT-Bench files are refused as
training data (use them as --eval-data) unless --allow-eval-sets-for-training.

The frozen model runs once over all sequences; at each probed layer a head of each type is evaluated on the held-out
answers (`shared` = the model's own final norm + lm_head, zero-shot; norm / linear / lowrank trained for --steps
steps by forward KL against the final layer's top-64 + rest bucket): top-1 agreement, top-5 agreement and expected
tokens per full-model pass of greedy self-speculation with --gamma drafts (from the measured agree/disagree runs).
Prints a table, then one JSON line (the results) as the last line of stdout; progress goes to stderr.
Exit status: 0; 2 on bad input (checked before any model work).

--eval-heads: --model is a hispec checkpoint (hispec.load: a folder saved by EarlyExitModel.save / hispec-export);
instead of training probe heads, its own two heads are evaluated at their own exits (draft at draft_layer, verifier
at verify_layer; any head type, `layer` heads included; a reduced head vocabulary is honoured) on the --eval-data
prompts answered greedily by the checkpoint's base model (cached like the probe's answers, shared with a probe of the
plain base): top-1 / top-5 agreement with the final layer's argmax, tokens per full pass for --gamma (default: the
checkpoint's own gamma), the share of draft tokens the verifier exit agrees with (draft argmax == verifier argmax),
overall and per category. Prints a table (rows draft, verify), a per-category table and the JSON line ("mode":
"eval-heads"). Training options (--data, --layers, --head-types, --steps, ...) are refused in this mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_CACHE = "~/.cache/hispec/probe"


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def build_parser() -> argparse.ArgumentParser:
    from ..probe import DEFAULT_HEAD_TYPES

    p = argparse.ArgumentParser(prog="hispec-probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True, help="base model: local HF folder, Hub id or .gguf file")
    m.add_argument("--revision", help="Hub revision")
    m.add_argument("--dtype", default="fp32", help="dtype of the probe pass and head training (default fp32)")
    m.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    m.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    m.add_argument("--eval-heads", action="store_true", help="--model is a hispec checkpoint: evaluate its own draft "
                   "and verifier heads on --eval-data instead of training probe heads (see below)")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", metavar="FILE", help="training (and, without --eval-data, held-out) data "
                   "files (required unless --eval-heads)")
    d.add_argument("--eval-data", nargs="+", metavar="FILE", help="held-out data files (e.g. Spec-Bench questions)")
    d.add_argument("--eval-fraction", type=float, default=0.2,
                   help="without --eval-data: share of --data's prompts held out (default 0.2)")
    d.add_argument("--max-prompts", type=int, help="use at most this many --data items, spread round-robin over "
                   "files and categories (default all)")
    d.add_argument("--max-eval-prompts", type=int, help="at most this many held-out items, spread likewise")
    d.add_argument("--allow-eval-sets-for-training", action="store_true",
                   help="allow --data files named like spec_bench / mt_bench (evaluation sets)")
    d.add_argument("--raw-text", action="store_true",
                   help=".txt files and {'text'} records are documents scored on every token, not prompts")
    d.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    d.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip prompts longer than this many tokens (default 512)")
    d.add_argument("--max-seq-len", type=int, default=1024, help="truncate sequences to this many tokens "
                   "(default 1024)")
    g = p.add_argument_group("self-generated answers")
    g.add_argument("--max-new-tokens", type=int, default=128, help="answer length for prompts (default 128)")
    g.add_argument("--gen-dtype", help="dtype for generating answers, e.g. bf16 (default: --dtype)")
    g.add_argument("--gen-batch-size", type=int, default=16, help="prompts per generate call (default 16)")
    g.add_argument("--cache-dir", default=DEFAULT_CACHE, help=f"answer cache folder (default {DEFAULT_CACHE})")
    g.add_argument("--no-cache", action="store_true", help="neither read nor write the answer cache")
    r = p.add_argument_group("probe")
    r.add_argument("--layers", help="exit layers: list and/or ranges, e.g. 2,4,6 or 2-28:2 "
                   "(default every 2nd layer below the depth)")
    r.add_argument("--head-types", default=",".join(DEFAULT_HEAD_TYPES),
                   help="comma-separated from shared, norm, linear, lowrank (default shared,norm,linear)")
    r.add_argument("--rank", type=int, default=64, help="lowrank head rank (default 64)")
    r.add_argument("--steps", type=int, default=200, help="AdamW steps per trained head (default 200)")
    r.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    r.add_argument("--batch-tokens", type=int, default=512, help="positions per training step (default 512)")
    r.add_argument("--top-k", type=int, default=64, help="teacher tokens kept per position (default 64)")
    r.add_argument("--gamma", type=int, default=4, help="drafts per round for tokens per full pass (default 4; with "
                   "--eval-heads the checkpoint's gamma)")
    r.add_argument("--draft-vocab-sizes", type=_ints, help="also report agreement with the draft argmax restricted "
                   "to the K most frequent tokens, e.g. 8192,16384")
    r.add_argument("--train-sizes", type=_ints, help="agreement-vs-training-tokens curve, e.g. 5000,20000,80000")
    r.add_argument("--train-size-layers", help="layers for the curve (default: all --layers)")
    r.add_argument("--feature-dtype", default="bf16", help="storage dtype of exit hidden states (default bf16)")
    r.add_argument("--feature-batch-tokens", type=int, default=4096,
                   help="padded tokens per frozen forward batch, also with --eval-heads (default 4096)")
    r.add_argument("--seed", type=int, default=0, help="seed for the split, batches and head init (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--json-out", help="write the full results (with loss curves) to this JSON file")
    o.add_argument("--plot", help="write a PNG: agreement vs layer per head type, and per category / vs data size")
    o.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def _check_args(args) -> str | None:
    positive = {"--max-new-tokens": args.max_new_tokens, "--gen-batch-size": args.gen_batch_size,
                "--max-prompt-tokens": args.max_prompt_tokens, "--max-seq-len": args.max_seq_len,
                "--batch-tokens": args.batch_tokens, "--top-k": args.top_k, "--gamma": args.gamma,
                "--rank": args.rank, "--feature-batch-tokens": args.feature_batch_tokens}
    for name, v in positive.items():
        if v < 1:
            return f"{name} must be >= 1"
    for name, v in (("--max-prompts", args.max_prompts), ("--max-eval-prompts", args.max_eval_prompts)):
        if v is not None and v < 1:
            return f"{name} must be >= 1"
    if args.steps < 0:
        return "--steps must be >= 0"
    if not args.lr > 0:
        return "--lr must be > 0"
    if args.eval_data is None and not 0.0 < args.eval_fraction < 1.0:
        return "--eval-fraction must be between 0 and 1 (exclusive)"
    if args.train_sizes and min(args.train_sizes) < 1:
        return "--train-sizes must be positive token counts"
    if args.draft_vocab_sizes and min(args.draft_vocab_sizes) < 1:
        return "--draft-vocab-sizes must be positive"
    if args.train_size_layers and not args.train_sizes:
        return "--train-size-layers needs --train-sizes"
    return None



def _read_config(model: str) -> dict | None:
    """The text config of a local folder's config.json (None when it cannot be read without loading)."""
    cfg = Path(model).expanduser() / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text(encoding="utf-8"))
    return data if "num_hidden_layers" in data else data.get("text_config", data)


def _check_against(args, num_layers: int, hidden: int | None, vocab: int | None) -> None:
    from ..probe import parse_layers

    parse_layers(args.layers, num_layers)
    if args.train_size_layers:
        parse_layers(args.train_size_layers, num_layers)
    if hidden and "lowrank" in args.head_types and args.rank > hidden:
        raise ValueError(f"--rank {args.rank} exceeds the hidden size ({hidden}); lowrank heads need 1..{hidden}")
    for k in args.draft_vocab_sizes or []:
        if vocab and k > vocab:
            raise ValueError(f"draft vocabulary size {k} exceeds the model's vocabulary ({vocab})")


def _check_inputs(model: str, files) -> None:
    """The model source and the data files exist: checked before anything is loaded."""
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") > 1
    if looks_local and not path.exists():
        raise ValueError(f"model {model} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"model folder {model} has no config.json")
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"data file {f} does not exist")


def _log(msg: str) -> None:
    print(f"[hispec-probe] {msg}", file=sys.stderr, flush=True)


def _fail(msg: str) -> int:
    print(f"hispec-probe: error: {msg}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------- --eval-heads
_UNSET = object()
# options that only shape probe-head training / the probe's own outputs: meaningless when a checkpoint's heads are
# evaluated, so refused rather than silently ignored
EVAL_HEADS_REFUSED = ("data", "eval_fraction", "max_prompts", "allow_eval_sets_for_training", "layers", "head_types",
                      "rank", "steps", "lr", "batch_tokens", "top_k", "draft_vocab_sizes", "train_sizes",
                      "train_size_layers", "feature_dtype", "seed", "plot")


def _explicit_options(argv, dests) -> set[str]:
    """The dests of the options given on the command line (a second parse with every default unset)."""
    p = build_parser()
    p.set_defaults(**{k: _UNSET for k in dests})
    return {k for k, v in vars(p.parse_args(argv)).items() if v is not _UNSET}


def _eval_heads_problem(args, explicit: set[str]) -> str | None:
    given = [f"--{k.replace('_', '-')}" for k in EVAL_HEADS_REFUSED if k in explicit]
    if given:
        return (f"--eval-heads evaluates the checkpoint's own heads at its own exits and trains nothing: "
                f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply; drop "
                f"{'it' if len(given) == 1 else 'them'} (held-out data goes in --eval-data)")
    if not args.eval_data:
        return "--eval-heads needs held-out data: pass --eval-data FILE..."
    return None


def _checkpoint_entry(model: str) -> dict | None:
    """The 'hispec' entry of a local checkpoint folder's config.json, checked without loading anything; None for a
    Hub id (checked when it is loaded). Raises ValueError for anything that is no checkpoint."""
    from ..model import HEADS_FILE, HispecConfig, validate_exits  # torch-heavy: imported when a run starts

    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        raise ValueError(f"{model} is a GGUF base model, not a hispec checkpoint; --eval-heads needs a checkpoint "
                         "folder (EarlyExitModel.save / hispec-export); to probe the plain model drop --eval-heads")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{model} is a file, not a hispec checkpoint folder")
    if not path.is_dir():
        return None
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or "hispec" not in data:
        raise ValueError(f"{model} is not a hispec checkpoint: its config.json has no 'hispec' entry (a plain model). "
                         "--eval-heads evaluates the heads of a checkpoint saved by EarlyExitModel.save or "
                         "hispec-export; to probe a plain model drop --eval-heads and pass --data")
    hconf = HispecConfig.from_dict(data["hispec"])
    if not (path / HEADS_FILE).is_file():
        raise ValueError(f"{model} has no {HEADS_FILE}: not a complete hispec checkpoint")
    text = data if "num_hidden_layers" in data else data.get("text_config", data)
    if text.get("num_hidden_layers"):
        validate_exits(hconf.draft_layer, hconf.verify_layer, int(text["num_hidden_layers"]))
    return data["hispec"]


# ---------------------------------------------------------------------------------------------------- run
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = _explicit_options(argv, vars(args)) if args.eval_heads else set()
    if not args.eval_heads and not args.data:
        parser.error("the following arguments are required: --data (or --eval-heads to evaluate a checkpoint's "
                     "own heads on --eval-data)")
    problem = (_eval_heads_problem(args, explicit) if args.eval_heads else None) or _check_args(args)
    if problem:
        return _fail(problem)
    try:
        return _run(args, explicit, time.perf_counter())
    except (ValueError, OSError) as e:  # bad input (ProbeError, DataError, ConfigError are ValueErrors)
        return _fail(str(e))


def _run(args, explicit: set[str], t_start: float) -> int:
    # torch-heavy: imported once a run starts, so --help and argument errors stay fast
    import torch
    import transformers

    from .. import probe
    from ..distill.answers import answer_prompts
    from ..distill.data import check_training_files
    from ..distill.features import scored_features
    from ..distill.items import Acceptor, read_items, select_items, split_items
    from ..io import dtype_name, parse_dtype, write_json
    from ..layers import DecoderAdapter
    from ..model import load, load_base_model, load_tokenizer

    # ---- everything that can be checked without the model
    dtype = parse_dtype(args.dtype)
    gen_dtype = parse_dtype(args.gen_dtype) if args.gen_dtype else dtype
    _check_inputs(args.model, [*(args.data or []), *(args.eval_data or [])])
    if args.eval_heads:
        entry = _checkpoint_entry(args.model)
    else:
        head_types, feature_dtype = probe.parse_head_types(args.head_types), parse_dtype(args.feature_dtype)
        check_training_files(args.data, args.allow_eval_sets_for_training, advice="use them as --eval-data, or "
                             "pass --allow-eval-sets-for-training if you really mean it")
        cfg = _read_config(args.model)
        if cfg and cfg.get("num_hidden_layers"):
            _check_against(args, int(cfg["num_hidden_layers"]), cfg.get("hidden_size"), cfg.get("vocab_size"))
    train_all = [it for f in args.data or [] for it in read_items(f, args.raw_text)]
    eval_all = [it for f in args.eval_data or [] for it in read_items(f, args.raw_text)]

    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    progress, device = not args.no_progress, args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seconds = {}
    tokenizer = load_tokenizer(args.model, revision=args.revision)
    if tokenizer is None and args.eval_heads and entry and entry.get("heads_only"):
        base = entry.get("base", {})
        tokenizer = load_tokenizer(base["name_or_path"], base.get("revision")) if base.get("name_or_path") else None
    if tokenizer is None:
        raise probe.ProbeError(f"no tokenizer could be loaded for {args.model} (no tokenizer files, or not "
                               "reachable); the probe tokenizes text data and needs one")

    # ---- items: chosen round-robin, tokenized once, split by prompt
    accept = Acceptor(tokenizer, max_prompt_tokens=args.max_prompt_tokens, max_seq_len=args.max_seq_len,
                      chat=not args.no_chat)
    overlap, train_items = 0, []
    if eval_all:
        eval_keys = {it.key for it in eval_all}
        overlap = sum(it.key in eval_keys for it in train_all)
        train_items = select_items([it for it in train_all if it.key not in eval_keys], args.max_prompts, accept)
        eval_items = select_items(eval_all, args.max_eval_prompts, accept)
    else:
        train_items, eval_items = split_items(select_items(train_all, args.max_prompts, accept), args.eval_fraction,
                                              args.seed)
        if args.max_eval_prompts:
            eval_items = select_items(eval_items, args.max_eval_prompts)
    if not eval_items:
        raise probe.ProbeError("no usable held-out items (all too long or empty?); add --eval-data or more data")
    if not args.eval_heads and not train_items and (any(h != "shared" for h in head_types)
                                                    or args.draft_vocab_sizes or args.train_sizes):
        raise probe.ProbeError("no usable training items (all too long or empty?); trainable head types, "
                               "--draft-vocab-sizes and --train-sizes need training data")
    preps = accept.take(train_items, False) + accept.take(eval_items, True)
    _log(f"{len(train_items)} training items, {len(eval_items)} held-out items ({accept.rejected} skipped as too "
         f"long or empty, {overlap} training items dropped as also held out)")

    # ---- the model, its answers to the prompt items
    _log(f"loading {args.model} ({args.dtype}, {device})")
    if args.eval_heads:
        model = load(args.model, dtype=dtype, device=device, revision=args.revision)
        base, adapter, hc = model.base, model.adapter, model.hispec_config
    else:
        base = load_base_model(args.model, dtype=dtype, device=device, revision=args.revision)
        adapter = DecoderAdapter(base)
        _check_against(args, adapter.num_layers, adapter.hidden_size, adapter.vocab_size)
        layers = probe.parse_layers(args.layers, adapter.num_layers)
        size_layers = probe.parse_layers(args.train_size_layers, adapter.num_layers) if args.train_size_layers \
            else None
    t0 = time.perf_counter()
    answered = answer_prompts(preps, base, tokenizer, max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
                              cache_dir=None if args.no_cache else args.cache_dir, gen_dtype=gen_dtype,
                              batch_size=args.gen_batch_size, show_progress=progress)
    seconds["generate"] = round(time.perf_counter() - t0, 2)
    _log(f"answers: {answered['generated']} generated, {answered['cached']} from cache"
         + (f" ({answered['cache']})" if answered["cache"] else ""))
    sequences = [s for p in preps for s in p.sequences]
    if not any(s.held_out for s in sequences):
        raise probe.ProbeError("no held-out sequence has anything to score")
    held = [s for s in sequences if s.held_out]
    sizes = {"train_items": len(train_items), "eval_items": len(eval_items),
             "train_sequences": len(sequences) - len(held), "eval_sequences": len(held),
             "train_tokens": sum(s.n_scored for s in sequences) - sum(s.n_scored for s in held),
             "eval_tokens": sum(s.n_scored for s in held), "generated": answered["generated"],
             "cached": answered["cached"], "skipped": accept.rejected, "overlap_dropped": overlap,
             "categories": len({s.category for s in held if s.n_scored})}
    model_info = {"name": Path(str(args.model)).name or str(args.model), "path": str(args.model),
                  "num_layers": adapter.num_layers, "hidden_size": adapter.hidden_size,
                  "vocab_size": adapter.vocab_size, "dtype": dtype_name(base.dtype), "gen_dtype": answered["gen_dtype"],
                  "device": device, "fingerprint": answered["fingerprint"][:16]}

    if args.eval_heads:  # ---- the checkpoint's own heads
        for k in ("train_items", "train_sequences", "train_tokens", "overlap_dropped"):
            sizes.pop(k)
        gamma = args.gamma if "gamma" in explicit else hc.gamma
        _log(f"{sizes['eval_tokens']:,} held-out positions; evaluating the {hc.head_type} heads at layers "
             f"{hc.draft_layer} (draft) and {hc.verify_layer} (verify)")
        model_info.update(checkpoint=True, base=hc.base.get("name_or_path"), draft_layer=hc.draft_layer,
                          verify_layer=hc.verify_layer, head_type=hc.head_type, checkpoint_gamma=hc.gamma)
        config = {"gamma_from": "--gamma" if "gamma" in explicit else "checkpoint",
                  "max_new_tokens": args.max_new_tokens, "max_seq_len": args.max_seq_len, "chat": not args.no_chat,
                  "batch_tokens": args.feature_batch_tokens}
        result = probe.evaluate_exit_heads(model, held, gamma=gamma, batch_tokens=args.feature_batch_tokens,
                                           model_info=model_info, sizes=sizes, seconds=seconds, config=config)
        result["seconds"]["total"] = round(time.perf_counter() - t_start, 2)
        print(probe.format_eval_table(result), flush=True)
        out = full = probe.rounded(result)
    else:  # ---- the probe: features once, then heads of every type at every layer
        t0 = time.perf_counter()
        feats = scored_features(adapter, sequences, sorted(set(layers) | set(size_layers or [])), k=args.top_k,
                                batch_tokens=args.feature_batch_tokens,
                                feature_dtype=feature_dtype or torch.bfloat16, progress=progress)
        seconds["features"] = round(time.perf_counter() - t0, 2)
        _log(f"{sizes['train_tokens']:,} training and {sizes['eval_tokens']:,} held-out positions; "
             f"probing layers {layers} with {', '.join(head_types)}")
        config = probe.ProbeConfig(layers=layers, head_types=head_types, steps=args.steps, lr=args.lr,
                                   batch_tokens=args.batch_tokens, rank=args.rank, top_k=args.top_k,
                                   gamma=args.gamma, draft_vocab_sizes=list(args.draft_vocab_sizes or []),
                                   train_sizes=list(args.train_sizes or []), train_size_layers=size_layers,
                                   seed=args.seed, feature_dtype=feature_dtype or torch.bfloat16)
        torch.manual_seed(args.seed)
        result = probe.run_probe(adapter, feats, config, model_info=model_info, sizes=sizes, seconds=seconds,
                                 progress=progress)
        result.seconds["total"] = round(time.perf_counter() - t_start, 2)
        print(probe.format_table(result), flush=True)
        if args.plot:
            _log(f"wrote {probe.plot(result, args.plot)}")
        out, full = result.as_dict(), result.as_dict(full=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json_out, full)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
