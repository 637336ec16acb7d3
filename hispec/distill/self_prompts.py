"""Self-written prompts: the target model writes the user instructions it will then answer (no Hub, no dataset).

Launch (standalone; `train/heads.py --self_prompts N` calls the same code before self-distillation):

    python train/self_prompts.py --model_name_or_path ~/.cache/hispec/models/SmolLM2-135M-Instruct \
        --self_prompts 500 --output_dir runs/self_prompts --gen_dtype bf16 --seed 42

How: the chat template is rendered up to the start of the user turn's content (for SmolLM2
`<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`); with probability `self_prompt_cue_fraction` a task cue
from `TASK_CUES` ("Translate", "Write a Python function", a passage to answer questions on, ...) follows, and the
model samples the rest of the instruction (temperature / top-p, at most `self_prompt_max_new_tokens`, stopping at
its end-of-turn token). The instruction is cue + continuation.

Contract:
- `generate_self_prompts(model, tokenizer, n, out_dir, args, *, seed, gen_dtype, show_progress)` samples batches
  of `self_prompt_batch_size` until `n` prompts pass the filters, appending every candidate (kept or not, with
  the reason) to `out_dir/candidates.jsonl`; a batch is written in one go and flushed, so a killed run resumes:
  complete batches are skipped, a torn one is redone. Batch `b` draws its cues from `Random(f"{seed}-{b}")` and
  samples with `torch.manual_seed(seed * 1_000_003 + b)`, so the result depends on (model, seed, settings) and the
  kernels only (generation runs prepacked where it can, `hispec.distill.answers.generating`: a draw can differ from
  stock kernels' where two logits are within ~1e-4), not on interruptions. `out_dir/settings.json` records what batches depend on; resuming with other settings
  raises `SelfPromptError` (delete the folder or choose another), and so does an acceptance rate below ~1 in 10
  (it stops after `8 + 10 * ceil(n / batch)` batches). Returns the number of new candidates.
- `read_self_prompts(out_dir, n=None)` -> the first `n` accepted prompts `[{"id", "messages": [{"role": "user",
  "content"}], "cue"}]`, ids as `hispec.distill.data.prompt_id` (the answer step dedups on them). Filtering and
  deduplication happen here, over the candidates in (batch, index) order, so they are deterministic:
  `reject_reason` drops unfinished (no end-of-turn), too short, repetitive (a word 3-gram 3+ times, or few
  distinct words), non-text and special-token candidates; `DedupIndex` drops exact duplicates (hash of the
  lower-cased, punctuation-free, whitespace-collapsed text) and near-duplicates (word 5-gram Jaccard >= 0.5 with
  a kept prompt, through an inverted index of 5-grams: cheap at tens of thousands of prompts).
Nothing here reads benchmark files: Spec-Bench / MT-Bench are evaluation data only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm
from transformers import HfArgumentParser

from hispec.distill.answers import generating, open_for_append
from hispec.distill.args import SelfPromptArguments
from hispec.distill.data import expand_path, prompt_id, render_chat
from hispec.distill.generate import generate_rows
from hispec.io import parse_dtype, write_json
from hispec.model import load_base_model, load_tokenizer
from hispec.prompts import eos_ids


CANDIDATES = "candidates.jsonl"
SETTINGS = "settings.json"
SENTINEL = "\x00HISPEC_USER_CONTENT\x00"

# Openings of user instructions, broad on purpose: translation, summarisation, QA, RAG, math, code, writing,
# reasoning, data, advice, multi-step tasks. A cue ending in a space or a newline is continued in place.
TASK_CUES: tuple[str, ...] = (
    "Translate the following sentence into French:",
    "Translate this paragraph from German to English:",
    "Translate",
    "Summarize the following",
    "Summarize the main points of",
    "Write a short summary of this news article:\n\n",
    "Write a Python function",
    "Write a JavaScript function that",
    "Write a SQL query that",
    "Fix the bug in this code:\n\n",
    "Explain what this code does:\n\n",
    "Explain",
    "Explain to a ten-year-old",
    "Explain the difference between",
    "What is",
    "What are the main causes of",
    "Why do",
    "How does",
    "How can I",
    "How do I",
    "Is it true that",
    "Give three",
    "List five",
    "Give me some tips for",
    "Give an example of",
    "Solve",
    "Solve for x:",
    "A store sells",
    "If a train travels",
    "Calculate",
    "Rewrite the following sentence",
    "Rewrite this email to sound more professional:\n\n",
    "Paraphrase",
    "Correct the grammar in this text:",
    "Compare",
    "What are the pros and cons of",
    "Write a short story about",
    "Write a poem about",
    "Write an email to",
    "Write a blog post about",
    "Write a product description for",
    "Draft a cover letter for",
    "Create a lesson plan for",
    "Create a workout plan for",
    "Plan a three-day trip to",
    "Suggest a name for",
    "Generate a list of interview questions for",
    "Classify the following",
    "Extract the names and dates from this text:",
    "Answer the question based on the passage below.\n\nPassage:",
    "Read the text and answer the question.\n\nText:",
    "Based on the following context, answer the question.\n\nContext:",
    "Here is a paragraph:",
    "I have a dataset of",
    "I am a student and",
    "My friend told me that",
    "Can you help me",
    "Describe",
    "Describe the process of",
    "Outline the steps to",
    "Analyze",
    "Evaluate the argument that",
    "Convert",
    "Find the error in the following reasoning:",
    "Define",
    "Who was",
    "When did",
    "Recommend",
    "Brainstorm",
    "Continue the story:",
    "Format the following data as a table:",
    "Write a regular expression that",
    "Write a unit test for",
    "What would happen if",
    "Imagine",
)


class SelfPromptError(ValueError):
    """Self-written prompts cannot be produced or resumed; the message says what to change."""


# Settings a batch's content depends on: resuming with different values would mix two schemes.
_SCHEME = ("seed", "self_prompt_batch_size", "self_prompt_cue_fraction", "self_prompt_max_new_tokens",
           "self_prompt_temperature", "self_prompt_top_p", "self_prompt_system", "cues")


def load_cues(path: str | None) -> tuple[str, ...]:
    """The cues of `self_prompt_cues` (TASK_CUES when None); SelfPromptError for a missing, empty or bad file."""
    if path is None:
        return TASK_CUES
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise SelfPromptError(f"self_prompt_cues: {path} does not exist")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        try:
            cues = json.loads(text)
        except json.JSONDecodeError as e:
            raise SelfPromptError(f"self_prompt_cues: {path} is not valid JSON ({e})") from e
        if not isinstance(cues, list) or not all(isinstance(c, str) for c in cues):
            raise SelfPromptError(f"self_prompt_cues: {path} must hold a JSON list of strings")
    else:
        cues = [ln.rstrip("\r").replace("\\n", "\n") for ln in text.split("\n")
                if ln.strip() and not ln.lstrip().startswith("#")]
    cues = [c for c in cues if c.strip()]
    if not cues:
        raise SelfPromptError(f"self_prompt_cues: {path} holds no cues")
    return tuple(cues)


def validate_args(args) -> None:
    """SelfPromptError for settings that cannot work (checked before any model is loaded)."""
    if getattr(args, "self_prompt_cues", None) is not None:
        load_cues(args.self_prompt_cues)
    if args.self_prompts < 0:
        raise SelfPromptError(f"self_prompts must be >= 0, got {args.self_prompts}")
    if not 0.0 <= args.self_prompt_cue_fraction <= 1.0:
        raise SelfPromptError(f"self_prompt_cue_fraction must be in [0, 1], got {args.self_prompt_cue_fraction}")
    if args.self_prompt_temperature <= 0:
        raise SelfPromptError(f"self_prompt_temperature must be > 0, got {args.self_prompt_temperature}")
    if not 0.0 < args.self_prompt_top_p <= 1.0:
        raise SelfPromptError(f"self_prompt_top_p must be in (0, 1], got {args.self_prompt_top_p}")
    for name in ("self_prompt_max_new_tokens", "self_prompt_batch_size"):
        if getattr(args, name) < 1:
            raise SelfPromptError(f"{name} must be >= 1, got {getattr(args, name)}")


# ---------------------------------------------------------------------------------------------------- template
def chat_prefix(tokenizer, system: str | None = None) -> str:
    """The chat rendered up to where the first user turn's content starts (a plain "user: " without a template)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = render_chat(tokenizer, msgs)
    if SENTINEL not in text:
        raise SelfPromptError("the chat template does not copy the user's content verbatim; cannot write prompts")
    return text[: text.index(SENTINEL)]


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """End-of-turn ids: the tokenizer's EOS, the model's generation EOS ids, and the special token that the chat
    template puts right after a user turn's content (e.g. `<|im_end|>`, `<|eot_id|>`), when it is one token."""
    ids = set(eos_ids(tokenizer, getattr(model, "generation_config", None)))
    text = render_chat(tokenizer, [{"role": "user", "content": SENTINEL}])
    after = text[text.index(SENTINEL) + len(SENTINEL):] if SENTINEL in text else ""
    specials = sorted((t for t in getattr(tokenizer, "all_special_tokens", []) if t), key=len, reverse=True)
    added = sorted((t for t in getattr(tokenizer, "get_added_vocab", dict)() if t), key=len, reverse=True)
    for tok in specials + added:
        if after.lstrip().startswith(tok):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                ids.add(tid)
            break
    return sorted(t for t in ids if t is not None)


def draw_cues(n: int, rng: random.Random, cue_fraction: float, cues=TASK_CUES) -> list[str]:
    """n cues: each a random entry of `cues` with probability `cue_fraction`, else "" (the model chooses)."""
    return [rng.choice(cues) if rng.random() < cue_fraction else "" for _ in range(n)]


# ---------------------------------------------------------------------------------------------------- filters
_WORD = re.compile(r"[\w']+", re.UNICODE)


def normalize_text(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed: the key of exact deduplication."""
    return " ".join(_WORD.findall(text.lower()))


def reject_reason(text: str, finished: bool, generated_words: int, special: bool = False) -> str | None:
    """Why a candidate instruction is dropped, or None to keep it (see the module docstring)."""
    if special:
        return "special token"
    if not finished:
        return "unfinished"
    words = normalize_text(text).split()
    if len(words) < 4 or generated_words < 2 or len(text.strip()) < 12:
        return "too short"
    letters = sum(c.isalpha() for c in text)
    if letters < 0.3 * len(text.strip()):
        return "not text"
    tri = Counter(zip(words, words[1:], words[2:]))
    if tri and max(tri.values()) >= 3:
        return "repetition"
    if len(words) >= 12 and len(set(words)) < 0.4 * len(words):
        return "repetition"
    return None


class DedupIndex:
    """Exact (normalised-text hash) and near (word 5-gram Jaccard) duplicate detection over kept texts."""

    def __init__(self, n: int = 5, threshold: float = 0.5):
        self.n, self.threshold = n, threshold
        self.exact: set[str] = set()
        self.index: dict[str, list[int]] = {}
        self.sizes: list[int] = []

    def _shingles(self, norm: str) -> set[str]:
        words = norm.split()
        if len(words) < self.n:
            return {norm}
        return {" ".join(words[i : i + self.n]) for i in range(len(words) - self.n + 1)}

    def check_and_add(self, text: str) -> str | None:
        """None (and remember the text) if new; else "duplicate" or "near duplicate"."""
        norm = normalize_text(text)
        key = hashlib.sha1(norm.encode()).hexdigest()
        if key in self.exact:
            return "duplicate"
        sh = self._shingles(norm)
        shared: Counter = Counter()
        for s in sh:
            shared.update(self.index.get(s, ()))
        for j, c in shared.items():
            if c / (len(sh) + self.sizes[j] - c) >= self.threshold:
                return "near duplicate"
        self.exact.add(key)
        j = len(self.sizes)
        self.sizes.append(len(sh))
        for s in sh:
            self.index.setdefault(s, []).append(j)
        return None


# ---------------------------------------------------------------------------------------------------- files
def _read_candidates(out_dir: Path) -> dict[int, list[dict]]:
    """Complete batches only: {batch: rows in index order}; torn lines and half-written batches are ignored."""
    batches: dict[int, dict[int, dict]] = {}
    sizes: dict[int, int] = {}
    path = out_dir / CANDIDATES
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                b, i, n = int(row["batch"]), int(row["index"]), int(row["batch_rows"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            batches.setdefault(b, {}).setdefault(i, row)
            sizes[b] = n
    return {b: [rows[i] for i in range(sizes[b])] for b, rows in sorted(batches.items()) if len(rows) == sizes[b]}


def _accepted(batches: dict[int, list[dict]], n: int | None = None) -> list[dict]:
    dedup, kept = DedupIndex(), []
    for b in sorted(batches):
        for row in batches[b]:
            if row.get("reject"):
                continue
            if dedup.check_and_add(row["text"]) is None:
                kept.append(row)
                if n is not None and len(kept) >= n:
                    return kept
    return kept


def read_self_prompts(out_dir, n: int | None = None) -> list[dict]:
    """The first n accepted, deduplicated prompts written so far (all when n is None); see the module docstring."""
    out = []
    for row in _accepted(_read_candidates(Path(out_dir)), n):
        msgs = [{"role": "user", "content": row["text"]}]
        out.append({"id": prompt_id(msgs), "messages": msgs, "cue": row["cue"]})
    return out


def _settings(args, seed: int, cues: tuple[str, ...]) -> dict:
    d = {k: v for k, v in asdict(SelfPromptArguments(**{f: getattr(args, f) for f in
                                                          SelfPromptArguments.__dataclass_fields__})).items()}
    d["seed"] = seed
    d["cues"] = hashlib.sha1("\n".join(cues).encode()).hexdigest()[:12]
    return {k: d[k] for k in _SCHEME}


def _check_settings(out_dir: Path, settings: dict) -> None:
    path = out_dir / SETTINGS
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            raise SelfPromptError(
                f"{out_dir} holds self-written prompts made with other settings {diff} (old, new); delete it or "
                "set another self_prompts_dir"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, settings)


# ---------------------------------------------------------------------------------------------------- generation
def generate_self_prompts(model, tokenizer, n: int, out_dir, args, *, seed: int = 0, gen_dtype=None,
                          show_progress: bool = True) -> int:
    """Sample until `n` prompts are accepted (see the module docstring); returns how many candidates it wrote."""
    validate_args(args)
    out_dir = Path(out_dir)
    cue_set = load_cues(getattr(args, "self_prompt_cues", None))
    _check_settings(out_dir, _settings(args, seed, cue_set))
    batches = _read_candidates(out_dir)
    dedup, kept = DedupIndex(), 0
    for b in sorted(batches):  # replay the filter over what exists, in order
        for row in batches[b]:
            if not row.get("reject") and dedup.check_and_add(row["text"]) is None:
                kept += 1
    if kept >= n:
        return 0
    prefix = chat_prefix(tokenizer, args.self_prompt_system)
    stops = stop_token_ids(tokenizer, model)
    if not stops:
        raise SelfPromptError("the tokenizer has no end-of-turn / EOS token: self-written prompts cannot stop")
    specials = set(getattr(tokenizer, "all_special_ids", [])) - set(stops)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    bs = args.self_prompt_batch_size
    max_batches = 8 + 10 * -(-n // bs)  # fewer than ~1 in 10 accepted: something is wrong, stop
    bar = tqdm(total=n, initial=min(kept, n), desc="self-written prompts", disable=not show_progress)
    written, b, t0, tried = 0, 0, time.time(), 0
    try:
        with generating(model, gen_dtype), open_for_append(out_dir / CANDIDATES) as f:
            while kept < n:
                if b in batches:
                    b += 1
                    continue
                if b >= max_batches:
                    raise SelfPromptError(
                        f"only {kept} of {n} self-written prompts passed the filters after {b} batches of {bs}; "
                        f"see the 'reject' reasons in {out_dir / CANDIDATES} (a model that cannot follow its chat "
                        "template, or settings such as a too small self_prompt_max_new_tokens)"
                    )
                cues = draw_cues(bs, random.Random(f"{seed}-{b}"), args.self_prompt_cue_fraction, cue_set)
                rows = [list(tokenizer(prefix + c, add_special_tokens=False)["input_ids"]) for c in cues]
                out = generate_rows(model, rows, pad_id=tokenizer.pad_token_id, eos=stops,
                                    max_new_tokens=args.self_prompt_max_new_tokens,
                                    sample=(args.self_prompt_temperature, args.self_prompt_top_p),
                                    seed=seed * 1_000_003 + b, keep_eos=False)
                lines = []
                for i, (cue, (ids, finished)) in enumerate(zip(cues, out)):
                    gen_text = tokenizer.decode(ids, skip_special_tokens=True)
                    text = (cue + gen_text).strip()
                    reason = reject_reason(text, finished, len(normalize_text(gen_text).split()),
                                           special=any(t in specials for t in ids))
                    if reason is None:
                        dup = dedup.check_and_add(text)
                        kept += dup is None
                    lines.append(json.dumps({"batch": b, "index": i, "batch_rows": len(cues), "cue": cue,
                                             "text": text, "tokens": len(ids), "finished": finished,
                                             "reject": reason}, ensure_ascii=False))
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
                written += len(lines)
                tried += len(lines)
                bar.n = min(kept, n)
                bar.set_postfix(kept=f"{kept}/{tried}", per_min=f"{written / max(time.time() - t0, 1e-9) * 60:.0f}")
                bar.refresh()
                b += 1
    finally:
        tokenizer.padding_side = side
        bar.close()
    return written


def ensure_self_prompts(model, tokenizer, n: int, out_dir, args, *, seed: int = 0, gen_dtype=None,
                        show_progress: bool = True) -> list[dict]:
    """`generate_self_prompts` then `read_self_prompts(out_dir, n)`: exactly n prompts (fewer never happens: the
    generation loop runs until n are accepted)."""
    generate_self_prompts(model, tokenizer, n, out_dir, args, seed=seed, gen_dtype=gen_dtype,
                          show_progress=show_progress)
    return read_self_prompts(out_dir, n)


def main(argv=None) -> int:
    @dataclass
    class Run:
        model_name_or_path: str = field(default=None, metadata={"help": "Base model: Hub id, folder or .gguf."})
        dtype: str = field(default="fp32", metadata={"help": "Dtype the model is loaded in."})
        gen_dtype: str = field(default="auto", metadata={"help": "Dtype it samples in (auto, fp32, bf16, fp16)."})
        output_dir: str = field(default="runs/self_prompts", metadata={"help": "Folder of candidates.jsonl."})
        seed: int = field(default=42, metadata={"help": "Seed of cues and sampling."})
        show: int = field(default=10, metadata={"help": "Print this many accepted prompts at the end."})

    parser = HfArgumentParser((Run, SelfPromptArguments))
    run, args = parser.parse_args_into_dataclasses(args=argv)
    try:
        if not run.model_name_or_path:
            raise SelfPromptError("--model_name_or_path is required")
        validate_args(args)
        parse_dtype(run.gen_dtype)
        if args.self_prompts < 1:
            raise SelfPromptError("--self_prompts N (>= 1) says how many prompts to write")
        path = expand_path(run.model_name_or_path)
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise SelfPromptError(f"no tokenizer found for {run.model_name_or_path}")
        model = load_base_model(path, dtype=run.dtype)
        t0 = time.time()
        n_new = generate_self_prompts(model, tokenizer, args.self_prompts, expand_path(run.output_dir), args,
                                      seed=run.seed, gen_dtype=run.gen_dtype)
    except (SelfPromptError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.time() - t0
    prompts = read_self_prompts(expand_path(run.output_dir), args.self_prompts)
    for p in prompts[: run.show]:
        print(json.dumps(p["messages"][0]["content"], ensure_ascii=False))
    print(json.dumps({"prompts": len(prompts), "candidates_now": n_new, "seconds": round(seconds, 1),
                      "output_dir": run.output_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
