"""hispec-serve: an OpenAI-compatible server (continuous batching, speculative decoding) for a hispec checkpoint.

    hispec-serve ./smollm2-hispec --port 8000 --strategy hispec
    hispec-serve HuggingFaceTB/SmolLM2-135M-Instruct --draft-layer 4 --verify-layer 8 --head-type shared

Endpoints: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health, /metrics. Requests may
choose their own strategy with the openai client's `extra_body={"strategy": "self-spec"}`. See hispec/serve/server.py.
"""

from __future__ import annotations

import argparse
import os

from .. import packed
from ..decoding import STRATEGIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="hispec checkpoint folder or Hub id; or a base model with --draft-layer")
    p.add_argument("--draft-layer", type=int, help="treat MODEL as a base model and put the draft exit here")
    p.add_argument("--verify-layer", type=int, help="intermediate-verifier exit for a base model (default depth/4)")
    p.add_argument("--head-type", default="shared", help="head type for a base model (default: shared)")
    p.add_argument("--served-model-name", help="the model id clients use (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16, fp16")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    packed.add_argument(p)
    p.add_argument("--strategy", default=None,
                   help=f"default strategy for requests that give none: {', '.join(STRATEGIES)} or a hierarchy "
                        "(default: auto when the checkpoint holds a calibration for this machine, else ar)")
    p.add_argument("--kv-blocks", type=int, help="KV pool size in blocks (default: from --kv-memory-mb)")
    p.add_argument("--kv-memory-mb", type=float, default=1024, help="KV pool size in MiB (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block (default 16)")
    p.add_argument("--contiguous", action="store_true",
                   help="contiguous per-batch KV caches instead of the paged pool (kv-blocks is then a budget)")
    p.add_argument("--max-batch", type=int, default=64, help="rows decoded together at most (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt positions per row per step (default 512)")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may still finish (default 30)")
    p.add_argument("--log-level", default="info")
    return p


def load_model(args):
    import hispec

    pack = packed.pack_arg(args)

    if args.draft_layer is not None:
        return packed.apply(hispec.EarlyExitModel.from_base(
            args.model, draft_layer=args.draft_layer, verify_layer=args.verify_layer, head_type=args.head_type,
            dtype=args.dtype, device=args.device), pack)
    return hispec.load(args.model, dtype=args.dtype, device=args.device, pack=pack)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from ..serve.server import serve
    except ImportError as e:
        raise SystemExit(f"hispec-serve needs the serve extra: pip install 'hispec[serve]' ({e})") from None
    import torch

    from ..serve import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; the server needs one to read prompts")
    engine = Engine(model, paged=not args.contiguous, kv_blocks=args.kv_blocks, kv_memory_mb=args.kv_memory_mb,
                    block_size=args.block_size, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                    strategy=args.strategy)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    print(f"hispec-serve: {name} on http://{args.host}:{args.port}/v1 (strategy {engine.default_strategy}, "
          f"{f'{engine.num_blocks} KV blocks of {args.block_size}' if engine.paged else 'contiguous KV caches'})",
          flush=True)
    serve(engine, name, host=args.host, port=args.port, max_tokens=args.max_tokens,
          default_max_tokens=args.default_max_tokens, drain_timeout=args.drain_timeout, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
