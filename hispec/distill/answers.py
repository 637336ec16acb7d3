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

`gen_dtype` (auto, fp32, bf16, fp16) runs generation in another dtype than the backbone was loaded in (bf16
decoding is ~2x faster than fp32 on this CPU and standard on GPUs) while training keeps the backbone's dtype:
`generation_dtype(model, dtype)` casts the parameters for the duration of a `with` block and then puts the very
same original tensors back (bit-identical; peak memory = original + cast copy). Buffers are left as they are.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hispec.distill.args import DataArguments, GenerationArguments, ModelArguments
from hispec.distill.data import DataError, expand_path, load_examples, prompt_id, prompt_of, render_chat
from hispec.distill.generate import generate_rows
from hispec.io import parse_dtype
from hispec.model import load_base_model, load_tokenizer
from hispec.prompts import eos_ids


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
    todo.sort(key=lambda p: -len(prompt_ids[p["id"]]))  # similar lengths share a batch: little padding
    eos = eos_ids(tokenizer, model.generation_config)
    sample = (gen.gen_temperature, gen.gen_top_p) if gen.gen_do_sample else None
    bar = tqdm(total=len(todo), desc=f"self-distill answers (rank {rank})", disable=not show_progress)
    written, new_tokens, t0 = 0, 0, time.time()
    with generation_dtype(model, gen.gen_dtype), \
            open_for_append(out_dir / f"part-rank{rank}.jsonl") as f:
        for a in range(0, len(todo), gen.gen_batch_size):
            batch = todo[a : a + gen.gen_batch_size]
            seed_b = seed * 1_000_003 + int(batch[0]["id"][:8], 16) if sample else None
            rows = generate_rows(model, [prompt_ids[p["id"]] for p in batch], pad_id=tokenizer.pad_token_id,
                                 eos=eos, max_new_tokens=gen.gen_max_new_tokens, sample=sample, seed=seed_b,
                                 keep_eos=False)
            for p, (keep, finished) in zip(batch, rows):
                answer = tokenizer.decode(keep, skip_special_tokens=True)
                rec = {"id": p["id"], "messages": p["messages"] + [{"role": "assistant", "content": answer}],
                       "response_tokens": len(keep), "finished": finished}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                new_tokens += len(keep)
            f.flush()
            os.fsync(f.fileno())
            written += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
    return written


def prompts_from(ds) -> list[dict]:
    """A {messages, text} Dataset -> [{"id", "messages"}] prompts (hispec.distill.data.prompt_of)."""
    out = []
    for row in ds:
        msgs = prompt_of(row)
        if msgs:
            out.append({"id": prompt_id(msgs), "messages": msgs})
    return out


def main(argv=None) -> int:
    from transformers import HfArgumentParser

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
