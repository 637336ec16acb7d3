"""Self-distillation data: the target model answers prompts itself; exit heads then learn on its own outputs.

Launch (standalone; `train/heads.py --self_distill true` calls the same code before training):

    python train/generate_data.py --model_name_or_path ~/.cache/hispec/models/SmolLM2-135M-Instruct \
        --train_file data/train/gsm8k_train_2000.jsonl --text_column question --max_train_samples 256 \
        --output_dir runs/self_distill --gen_max_new_tokens 192

Contract: `generate_responses(model, tokenizer, prompts, out_dir, gen, rank=0, world_size=1)` takes prompts
`[{"id", "messages"}]`, skips those whose id is already in any `out_dir/*.jsonl`, splits the rest over
`world_size` processes (this one takes every `world_size`-th, from `rank`), drops prompts longer than
`gen_max_prompt_tokens` and answers them in length-sorted batches with left padding through plain
`model.generate` (greedy, or sampled with temperature / top-p), showing a progress bar. Every finished batch
is appended to `out_dir/part-rank{rank}.jsonl` and flushed, so a killed run resumes where it stopped.
`read_responses(out_dir)` -> `{id: row}`; a row is `{"id", "messages": prompt + [answer], "response_tokens",
"finished"}`. Prompts with the same id are answered once. Not deterministic across different batchings when
sampling (each batch draws from a generator seeded by the batch's first prompt id and `seed`).

Token answers (`hispec-probe`, evaluations): `answer_prompts(prepared, model, tokenizer, ...)` answers the prompt
items of `hispec.distill.items` greedily as token ids (no decode / re-tokenize round trip), through the same
batching loop (`hispec.distill.generate.answer_batches`); `AnswerCache` keeps them on disk keyed by
`model_fingerprint(model)` + generation dtype + the prompt's token ids, so reruns generate nothing.

`gen_dtype` (auto, fp32, bf16, fp16) runs generation in another dtype than the backbone was loaded in (bf16
decoding is ~2x faster than fp32 on this CPU and standard on GPUs) while training keeps the backbone's dtype:
`generation_dtype(model, dtype)` casts the parameters for the duration of a `with` block and then puts the very
same original tensors back (bit-identical; peak memory = original + cast copy). Buffers are left as they are.
`generating(model, dtype)` is that plus prepacked linears for the block (`hispec.packed.for_generation`): how every
generation of the core (self-written prompts, answers) runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hispec.distill.args import DataArguments, GenerationArguments, ModelArguments
from hispec.distill.data import DataError, expand_path, load_examples, prompt_id, prompt_of, render_chat
from hispec.distill.generate import answer_batches
from hispec import packed
from hispec.distill.items import Prepared, Sequence
from hispec.io import dtype_name, parse_dtype
from hispec.model import load_base_model, load_tokenizer
from hispec.prompts import eos_ids, pad_id_of


@contextmanager
def generation_dtype(model, dtype):
    """Within the block the model's floating-point parameters are `dtype` (a torch dtype, a name, or None = no
    change); afterwards the original parameter tensors are restored as they were (not re-cast)."""
    dtype = parse_dtype(dtype)
    params = [] if dtype is None else [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    if not params:
        yield model
        return
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.to(dtype)
        yield model
    finally:
        for p, data in zip(params, saved):
            p.data = data


@contextmanager
def generating(model, dtype):
    """How the core's generator runs the model: `generation_dtype(model, dtype)` with its linears prepacked for the
    block (`hispec.packed.for_generation`: 1.3x on batches of 16; tokens as with stock kernels except at logit
    near-ties, ~1e-4; nothing changes outside the block)."""
    with generation_dtype(model, dtype), packed.for_generation(model):
        yield model


def read_responses(out_dir: str | os.PathLike) -> dict[str, dict]:
    """All rows written so far in `out_dir/*.jsonl`, by prompt id (a torn last line of a killed run is skipped)."""
    rows = {}
    for path in sorted(Path(out_dir).glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                rows[row["id"]] = row
    return rows


def open_for_append(path: Path):
    """Open a jsonl file for appending, first ending a torn last line (a killed writer) with a newline, so the
    next record starts on a line of its own instead of being glued to the fragment."""
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return open(path, "a", encoding="utf-8")


def _padded(tokenizer):
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@torch.no_grad()
def generate_responses(model, tokenizer, prompts: list[dict], out_dir, gen: GenerationArguments, *, rank: int = 0,
                       world_size: int = 1, seed: int = 0, show_progress: bool = True) -> int:
    """Answer the prompts not yet in `out_dir` (this process's share); returns how many it answered."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_responses(out_dir)
    todo = [p for p in prompts if p["id"] not in done]
    todo = sorted({p["id"]: p for p in todo}.values(), key=lambda p: p["id"])[rank::world_size]
    if not todo:
        return 0
    tokenizer = _padded(tokenizer)
    texts = {p["id"]: render_chat(tokenizer, p["messages"], add_generation_prompt=True) for p in todo}
    prompt_ids = {i: list(tokenizer(t, add_special_tokens=False)["input_ids"]) for i, t in texts.items()}
    todo = [p for p in todo if len(prompt_ids[p["id"]]) <= gen.gen_max_prompt_tokens]
    sample = (gen.gen_temperature, gen.gen_top_p) if gen.gen_do_sample else None
    written = 0
    with generating(model, gen.gen_dtype), \
            open_for_append(out_dir / f"part-rank{rank}.jsonl") as f:
        batches = answer_batches(
            model, [prompt_ids[p["id"]] for p in todo], batch_size=gen.gen_batch_size, pad_id=tokenizer.pad_token_id,
            eos=eos_ids(tokenizer, model.generation_config), max_new_tokens=gen.gen_max_new_tokens, sample=sample,
            seed=(lambda i: seed * 1_000_003 + int(todo[i]["id"][:8], 16)) if sample else None, keep_eos=False,
            desc=f"self-distill answers (rank {rank})", show_progress=show_progress)
        for idx, rows in batches:
            for i, (keep, finished) in zip(idx, rows):
                p = todo[i]
                answer = tokenizer.decode(keep, skip_special_tokens=True)
                rec = {"id": p["id"], "messages": p["messages"] + [{"role": "assistant", "content": answer}],
                       "response_tokens": len(keep), "finished": finished}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            written += len(idx)
    return written


# ---------------------------------------------------------------------------------------------------- token answers
def model_fingerprint(model) -> str:
    """A hash of the config and a sample of every weight (bf16-rounded, so fp32 and bf16 loads agree). A hispec
    checkpoint's base (whose config.json carries the "hispec" entry) hashes like the plain base model, so both
    share cached answers."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "hispec", "torch_dtype", "dtype", "transformers_version",
              "_attn_implementation_autoset", "use_cache"):
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            if not t.is_floating_point():
                continue
            h.update(f"{name}:{tuple(t.shape)}".encode())
            flat = t.detach().reshape(-1)
            sample = torch.cat([flat[:128], flat[-128:]]).to(torch.bfloat16).float().cpu()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


class AnswerCache:
    """Greedy answers as token ids on disk: `<dir>/<model fingerprint[:16]>-<gen dtype>.jsonl`, one JSON line per
    answer `{"prompt": sha256 of the prompt ids, "max_new_tokens", "finished", "tokens"}`, appended batch by batch.
    An answer cached for a larger `max_new_tokens` (or one that ended at EOS) serves any smaller request."""

    def __init__(self, cache_dir: str | os.PathLike | None, model_key: str, gen_dtype: str):
        self.path = None if cache_dir is None else Path(cache_dir).expanduser() / f"{model_key[:16]}-{gen_dtype}.jsonl"
        self.rows: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a torn last line of a killed run
                    old = self.rows.get(row["prompt"])
                    if old is None or row["finished"] or row["max_new_tokens"] > old["max_new_tokens"]:
                        self.rows[row["prompt"]] = row

    @staticmethod
    def key(prompt_ids: list[int]) -> str:
        return hashlib.sha256(json.dumps(list(map(int, prompt_ids))).encode("utf-8")).hexdigest()

    def get(self, prompt_ids: list[int], max_new_tokens: int) -> list[int] | None:
        row = self.rows.get(self.key(prompt_ids))
        if row is None or not (row["finished"] or row["max_new_tokens"] >= max_new_tokens):
            return None
        return row["tokens"][:max_new_tokens]

    def put_many(self, entries: list[tuple[list[int], list[int], bool, int]]) -> None:
        rows = [{"prompt": self.key(p), "max_new_tokens": m, "finished": fin, "tokens": list(map(int, t))}
                for p, t, fin, m in entries]
        for r in rows:
            self.rows[r["prompt"]] = r
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open_for_append(self.path) as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())


def answer_prompts(prepared: list[Prepared], model, tokenizer, *, max_new_tokens: int, max_seq_len: int,
                   cache_dir=None, gen_dtype=None, batch_size: int = 16, show_progress: bool = False) -> dict:
    """Fill `sequences` of the prompt items (`hispec.distill.items.Prepared`) with greedy answers as token ids: from
    the `AnswerCache` in `cache_dir` (None: no cache) first, the rest generated by `model` (in `gen_dtype`,
    `generation_dtype`) and cached batch by batch. Returns counts (generated, cached, empty), the generation dtype's
    name, the model's fingerprint and the cache file."""
    gen_name = dtype_name(parse_dtype(gen_dtype) or model.dtype)
    fingerprint = model_fingerprint(model)
    cache = AnswerCache(cache_dir, fingerprint, gen_name)
    todo = [p for p in prepared if p.answer_needed and cache.get(p.prompt_ids, max_new_tokens) is None]
    todo_prompts = list({tuple(p.prompt_ids): p.prompt_ids for p in todo}.values())
    if todo_prompts:
        with generating(model, gen_dtype):
            for idx, rows in answer_batches(model, todo_prompts, batch_size=batch_size, pad_id=pad_id_of(tokenizer),
                                            eos=eos_ids(tokenizer, model.generation_config),
                                            max_new_tokens=max_new_tokens, show_progress=show_progress):
                cache.put_many([(todo_prompts[i], toks, fin, max_new_tokens) for i, (toks, fin) in zip(idx, rows)])
    empty = 0
    for p in prepared:
        if not p.answer_needed:
            continue
        answer = cache.get(p.prompt_ids, max_new_tokens)[: max(0, max_seq_len - len(p.prompt_ids))]
        if not answer:
            empty += 1
            continue
        n = len(p.prompt_ids)
        p.sequences = [Sequence(p.prompt_ids + list(answer), [(n, n + len(answer))], p.item.category, p.held_out)]
    return {"generated": len(todo_prompts), "cached": sum(p.answer_needed for p in prepared) - len(todo),
            "empty": empty, "gen_dtype": gen_name, "fingerprint": fingerprint, "cache": cache.path}


def prompts_from(ds) -> list[dict]:
    """A {messages, text} Dataset -> [{"id", "messages"}] prompts (hispec.distill.data.prompt_of)."""
    out = []
    for row in ds:
        msgs = prompt_of(row)
        if msgs:
            out.append({"id": prompt_id(msgs), "messages": msgs})
    return out


def main(argv=None) -> int:
    @dataclass
    class Out:
        output_dir: str = field(default="runs/self_distill", metadata={"help": "Folder of the answer jsonl files."})
        seed: int = field(default=42, metadata={"help": "Data shuffling / sampling seed."})

    parser = HfArgumentParser((ModelArguments, DataArguments, GenerationArguments, Out))
    margs, dargs, gargs, oargs = parser.parse_args_into_dataclasses(args=argv)
    dargs.eval_fraction = 0.0
    try:
        train, _ = load_examples(dargs, oargs.seed)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = expand_path(margs.model_name_or_path)
    model = load_base_model(path, dtype=margs.dtype)
    tokenizer = load_tokenizer(path)
    n = generate_responses(model, tokenizer, prompts_from(train), expand_path(oargs.output_dir), gargs,
                           seed=oargs.seed)
    rows = read_responses(expand_path(oargs.output_dir))
    print(json.dumps({"answered_now": n, "total_rows": len(rows), "output_dir": oargs.output_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
