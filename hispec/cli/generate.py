"""hispec-generate: decode prompts with an early-exit checkpoint (or a base model plus untrained heads).

    hispec-generate --model ./smollm2-hispec --prompt "What is the capital of France?" --chat --stream
    hispec-generate --model HuggingFaceTB/SmolLM2-135M-Instruct --draft-layer 4 --verify-layer 8 \\
        --head-type shared --prompts-file prompts.jsonl --strategy self-spec --max-new-tokens 64

Prints each completion, then the decoding statistics; `--json` prints one JSON line per prompt instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import packed, timing
from ..decoding import STRATEGIES
from ..sampling import VERIFICATIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="hispec checkpoint folder or Hub id; or a base model (folder, Hub id, .gguf) with --draft-layer")
    p.add_argument("--draft-layer", type=int, help="treat --model as a base model and put the draft exit here")
    p.add_argument("--verify-layer", type=int, help="intermediate-verifier exit for a base model (default depth/4)")
    p.add_argument("--head-type", default="shared", help="head type for a base model (default: shared)")
    p.add_argument("--draft-vocab-size", type=int, metavar="K",
                   help="draft head proposes only the K lowest-id (most frequent BPE) tokens, e.g. 8192; 0 = full "
                        "(default: the checkpoint's)")
    p.add_argument("--verify-vocab-size", type=int, metavar="K", help="the same for the verifier head")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", help="jsonl/json/txt prompts (Spec-Bench, MT-Bench, ShareGPT, {'prompt': ..})")
    p.add_argument("--num-prompts", type=int, help="take only this many prompts from --prompts-file")
    p.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--strategy", default=None,
                   help=f"one of {', '.join(STRATEGIES)}, or a hierarchy such as ngram>L8>full (default: auto when "
                        "the checkpoint holds a calibration for this machine, else ar)")
    p.add_argument("--gamma", type=int, help="drafts of the lowest exit per round (default: checkpoint's)")
    p.add_argument("--window", type=int, help="tokens a higher exit gathers before the next level verifies "
                                              "(default: checkpoint's)")
    p.add_argument("--tree", metavar="WIDTHS",
                   help="draft a static tree instead of a chain, children per node at each depth, e.g. 4x2x1 "
                        "(self-spec / draft>full, or self-spec-lookup: the n-gram lookup first; verified in one full pass; "
                        "see hispec.decoding.tree), or a dynamic tree "
                        "dyn-DEPTH-TOPK-BEAM-NODES, e.g. dyn-5-4-4-16 (greedy only)")
    p.add_argument("--ngram-max", type=int, help="n-gram level: longest suffix matched (default 3)")
    p.add_argument("--ngram-min", type=int, help="n-gram level: shortest suffix tried (default 1)")
    p.add_argument("--ngram-tokens", type=int, help="n-gram level: most tokens proposed per round (default 8)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass")
    p.add_argument("--verification", choices=VERIFICATIONS, default=None,
                   help="acceptance rule when sampling, at every level: token (per-token speculative sampling) or "
                        "hsd (sequence-level, same output distribution, more tokens accepted); greedy decoding is "
                        "identical under both (default: the checkpoint's, else token)")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    packed.add_argument(p)
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed (batch size 1)")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt with text and stats")
    return p


def load_model(args):
    import hispec
    from hispec.vocab import apply_vocab_sizes

    pack = packed.pack_arg(args)

    if args.draft_layer is not None:
        model = packed.apply(hispec.EarlyExitModel.from_base(
            args.model, draft_layer=args.draft_layer, verify_layer=args.verify_layer, head_type=args.head_type,
            dtype=args.dtype, device=args.device), pack)
    else:
        model = hispec.load(args.model, dtype=args.dtype, device=args.device, pack=pack)
    apply_vocab_sizes(model, args.draft_vocab_size, args.verify_vocab_size)
    return model


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 0:
        print("error: --max-new-tokens must be >= 0", file=sys.stderr)
        return 2
    if args.stream and args.batch_size != 1:
        print("error: --stream needs --batch-size 1", file=sys.stderr)
        return 2
    from ..decoding.tree import parse_tree

    try:
        parse_tree(args.tree)
    except ValueError as e:
        print(f"error: --tree: {e}", file=sys.stderr)
        return 2
    import torch

    from ..prompts import encode_prompts, load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt is not None:
        texts = list(args.prompt)
        if any(not t.strip() for t in texts):
            print("error: a --prompt is empty", file=sys.stderr)
            return 2
    else:
        texts = [p.text for p in load_prompts(args.prompts_file, num=args.num_prompts, spread=False)]
    try:
        model = load_model(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = model.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer files", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    ngram = {k: v for k, v in (("max_ngram", args.ngram_max), ("min_ngram", args.ngram_min),
                               ("max_len", args.ngram_tokens)) if v is not None} or None
    for start in range(0, len(texts), args.batch_size):
        batch = texts[start : start + args.batch_size]
        ids, mask = encode_prompts(tok, batch, chat=args.chat)
        streamer = None
        if args.stream:
            from transformers import TextStreamer

            streamer = TextStreamer(tok, skip_prompt=True)
        t0 = timing.now(model.device)
        try:
            out = model.generate(ids, mask, max_new_tokens=args.max_new_tokens, strategy=args.strategy,
                                 do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, gamma=args.gamma, window=args.window, ngram=ngram,
                                 streamer=streamer, generator=generator, tree=args.tree,
                                 verification=args.verification)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        secs = timing.now(model.device) - t0
        s = out.stats
        for text, new in zip(batch, out.new_tokens):
            completion = tok.decode(new, skip_special_tokens=True)
            if args.json:
                print(json.dumps({"prompt": text, "completion": completion, "new_tokens": len(new),
                                  "seconds": secs, "stats": s.as_dict()}))
            elif not args.stream:
                print(f"### {text}\n{completion}\n")
        if not args.json:
            levels = ", ".join(f"{lv.name} {lv.accepted}/{lv.proposed}" for lv in s.levels[1:])
            plain = f"; plain rounds {s.plain_row_rounds}/{s.row_rounds}" if s.row_rounds else ""
            rule = ", hsd" if args.do_sample and s.verification == "hsd" else ""
            print(
                f"[{s.strategy}{rule}] {s.new_tokens} tokens in {secs:.2f} s ({s.new_tokens / max(secs, 1e-9):.1f} tok/s); "
                f"tokens/full pass {s.tokens_per_target_pass:.2f}; accepted/proposed {levels or '-'}{plain}; "
                f"layer evals/token {s.layer_evals / max(s.new_tokens, 1):.1f}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
