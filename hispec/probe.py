"""Choosing exits from evidence: held-out agreement of exit heads with the final layer, by layer and head type.

Contract:
- Data. `read_items(path)` reads one file into `Item`s: any prompt format of `hispec.prompts` (Spec-Bench /
  MT-Bench question.jsonl, ShareGPT json, jsonl/json with a prompt/text/instruction/question field, text one prompt
  a line), plus full sequences: records with `{"prompt", "response"}` (or "completion") and chats `{"messages":
  [...]}` (or ShareGPT "conversations" holding an assistant turn), teacher-forced over the assistant turns; with
  `raw_text=True` a .txt file is one document (cut into blocks) and records with only a "text" field are documents
  scored on every token. A record's category (Spec-Bench's "category") is kept; records without one are named
  after their file. Files whose name says spec_bench / mt_bench are evaluation sets: `check_training_files`
  refuses them as training data unless explicitly allowed.
- `select_items(items, n)` takes n items round-robin over (file, category), lazily skipping those a predicate
  rejects (prompts too long); `split_items(items, fraction, seed)` splits by prompt text (every item with the same
  prompt lands on one side), deterministically from the seed.
- Answers. Prompt-only items are answered by the model itself, greedily (`generate_answers`: batched, left-padded,
  plain `generate`); `AnswerCache` keeps the answers on disk keyed by `model_fingerprint(model)` + generation
  dtype + the prompt's token ids, so reruns generate nothing. An answer cached for a larger `max_new_tokens` (or one
  that ended at EOS) serves any smaller request.
- Features. `extract_features(adapter, sequences, layers)` runs the frozen backbone once over every sequence
  (batches by token budget, right-padded, through `DecoderAdapter`) and keeps, for the scored positions only
  (positions whose next token belongs to an answer), the residual stream after each probed layer (bf16 by
  default), the teacher's top-k token ids and log-probabilities (k=64) and its argmax — never full logits.
- Heads. `shared` is the model's own final norm + lm_head, untrained. Other `hispec.heads.ExitHead` types are
  trained by `train_head` (AdamW, warmup + cosine, `batch_tokens` positions a step) on forward
  KL(teacher || head) where the teacher keeps its top-k and one bucket for the remaining mass (`topk_kl`: student
  log-softmax over the full vocabulary through `DecoderAdapter.project`).
- Metrics on held-out positions (`evaluate_head`): top-1 agreement (head argmax == teacher argmax), top-5 agreement
  (teacher argmax within the head's top-5), the bucketed KL, the expected tokens per full-model pass of greedy
  self-speculation with gamma drafts (`simulate_rounds` on each answer's agree/disagree sequence), and with
  reduced draft vocabularies (`top_vocab`: the K most frequent answer tokens of the training sequences, ties and
  fill by lowest token id) the restricted top-1 agreement and the set's `coverage` of teacher argmaxes.
- `run_probe(model, tokenizer, config)` does all of that (plus an optional agreement-vs-training-size curve) and
  returns a `ProbeResult`; `format_table(result)` and `plot(result, path)` present it. Deterministic given the
  seed. Nothing here prints; progress bars go to stderr through tqdm when asked.
- Checkpoint heads (`hispec-probe --eval-heads`): `evaluate_exit_heads(model, sequences, gamma=...)` evaluates an
  `EarlyExitModel`'s own draft and verifier heads (any head type; a `layer` head runs over whole sequences with a
  fresh cache; a reduced head vocabulary is honoured through `project_exit`) on the same self-generated held-out
  answers: top-1 / top-5 agreement with the final layer's argmax, tokens per full pass, and the hierarchy figures
  (`verify_agrees_draft`: share of positions where the verifier exit's argmax equals the draft's, and its two
  conditional companions), overall and per category; `format_eval_table` presents it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .distill.data import ROLES
from .distill.generate import generate_rows
from .distill.losses import TopkBucketKL, bucket_log_mass, exit_states, teacher_topk
from .distill.losses import expected_tokens_per_round as iid_tokens_per_pass
from .heads import STATELESS_HEAD_TYPES as HEAD_TYPES
from .heads import ExitHead
from .prompts import _from_record
from .prompts import eos_ids as _eos_ids

DEFAULT_HEAD_TYPES = ("shared", "norm", "linear")
DEFAULT_TOP_K = 64
EVAL_SET_MARKERS = ("spec_bench", "spec-bench", "specbench", "mt_bench", "mt-bench", "mtbench")


class ProbeError(ValueError):
    """Bad input for the probe (layers, head types, data); the message says what and how to fix it."""


# ---------------------------------------------------------------------------------------------------- layers
def default_layers(depth: int) -> list[int]:
    """Every second layer 2, 4, ... below the depth (layer 1 for a 2-layer model)."""
    return list(range(2, depth, 2)) or [1]


def parse_layers(spec: str | None, depth: int) -> list[int]:
    """'2,4,6', '2-28:2', '2-8' or a mix ('1,4-12:4') -> sorted unique layers, each in 1..depth-1."""
    if spec is None or not str(spec).strip():
        return default_layers(depth)
    layers: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+)(?::(\d+))?)?", part)
        if not m:
            raise ProbeError(f"cannot read layer spec {part!r}; use e.g. '2,4,6' or '2-28:2'")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        step = int(m.group(3)) if m.group(3) is not None else 1
        if step < 1 or b < a:
            raise ProbeError(f"layer range {part!r} is empty; use start-end[:step] with start <= end, step >= 1")
        layers.update(range(a, b + 1, step))
    if not layers:
        raise ProbeError("no layers given")
    bad = sorted(x for x in layers if not 1 <= x < depth)
    if bad:
        raise ProbeError(f"layers {bad} are out of range for a {depth}-layer model; choose exits in 1..{depth - 1} "
                         "(the final layer is the teacher)")
    return sorted(layers)


def parse_head_types(spec: str | list[str]) -> list[str]:
    names = [x.strip() for x in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [x for x in names if x]
    if not names:
        raise ProbeError("no head types given")
    if "layer" in names:
        raise ProbeError("'layer' heads attend over whole sequences and are not probed layer by layer; train them "
                         "with train/heads.py --head_type layer (from a feature cache) and measure the checkpoint "
                         "with hispec-probe --eval-heads")
    unknown = [x for x in names if x not in HEAD_TYPES]
    if unknown:
        raise ProbeError(f"unknown head type(s) {unknown}; choose from {', '.join(HEAD_TYPES)}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class Item:
    """One unit of data before tokenization. kind: 'prompt' (the model answers it), 'chat' (teacher forcing over
    the assistant turns of `messages`), 'text' (a document, every token scored)."""

    kind: str
    category: str
    source: str
    prompt: str | None = None
    messages: list[dict] | None = None
    text: str | None = None

    @property
    def key(self) -> str:
        """What the train / held-out split groups by: the prompt (first user turn) or the document."""
        if self.kind == "prompt":
            return self.prompt
        if self.kind == "chat":
            first = next((m["content"] for m in self.messages if m["role"] == "user"), None)
            return first if first is not None else json.dumps(self.messages, sort_keys=True)
        return self.text


def is_eval_set_file(path: str | os.PathLike) -> bool:
    name = Path(path).name.lower()
    return any(m in name for m in EVAL_SET_MARKERS)


def check_training_files(paths, allow_eval_sets: bool = False) -> None:
    """Refuse training on Spec-Bench / MT-Bench files (they are evaluation sets) unless explicitly allowed."""
    bad = [str(p) for p in paths if is_eval_set_file(p)]
    if bad and not allow_eval_sets:
        raise ProbeError(f"{', '.join(bad)} look like evaluation sets (Spec-Bench / MT-Bench); training heads on "
                         "them would leak the benchmark. Use them as --eval-data, or pass "
                         "--allow-eval-sets-for-training if you really mean it")


def _normalize_messages(turns) -> list[dict] | None:
    out = []
    for t in turns:
        if isinstance(t, dict):
            role = ROLES.get(str(t.get("role", t.get("from", ""))).lower())
            content = t.get("content", t.get("value"))
        else:
            return None
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out


def _record_item(rec, source: str, raw_text: bool) -> Item | None:
    if not isinstance(rec, dict):
        return None
    default_cat = Path(source).stem
    for key in ("messages", "conversations"):
        turns = rec.get(key)
        if isinstance(turns, list) and turns:
            msgs = _normalize_messages(turns)
            if msgs and any(m["role"] == "assistant" and m["content"].strip() for m in msgs) and any(
                    m["role"] == "user" for m in msgs):
                return Item("chat", str(rec.get("category", default_cat)), source, messages=msgs)
            if msgs and key == "messages":
                first = next((m["content"] for m in msgs if m["role"] == "user" and m["content"].strip()), None)
                if first:
                    return Item("prompt", str(rec.get("category", default_cat)), source, prompt=first)
    prompt = rec.get("prompt")
    response = rec.get("response", rec.get("completion"))
    if isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and response.strip():
        return Item("chat", str(rec.get("category", default_cat)), source,
                    messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
    if raw_text and isinstance(rec.get("text"), str) and rec["text"].strip() and not any(
            isinstance(rec.get(k), str) for k in ("prompt", "instruction", "question")):
        return Item("text", str(rec.get("category", default_cat)), source, text=rec["text"])
    p = _from_record(rec, 0)
    if p is None:
        return None
    cat = default_cat if p.category == "default" else str(p.category)
    return Item("prompt", cat, source, prompt=p.text)


def read_items(path: str | os.PathLike, raw_text: bool = False) -> list[Item]:
    """All usable items of one data file (see module docstring); a clear error if there are none."""
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    source = str(path)
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif path.suffix == ".json":
            data = json.loads(text)
            records = data if isinstance(data, list) else data.get("data", [])
        elif raw_text:
            return [Item("text", path.stem, source, text=text)] if text.strip() else _empty(path)
        else:
            records = [{"prompt": line} for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ProbeError(f"cannot read {path}: not valid JSON ({e})") from None
    items = [it for rec in records if (it := _record_item(rec, source, raw_text)) is not None]
    return items or _empty(path)


def _empty(path: Path):
    raise ProbeError(f"no usable prompts, chats or texts found in {path}")


def select_items(items: list[Item], n: int | None, accept=None) -> list[Item]:
    """Up to n items, round-robin over (file, category) groups in file order; `accept(item)` (evaluated lazily,
    only on candidates) may reject one, and the next of its group is tried instead."""
    accept = accept or (lambda it: True)
    if n is None:
        return [it for it in items if accept(it)]
    groups: dict[tuple[str, str], list[Item]] = {}
    for it in items:
        groups.setdefault((it.source, it.category), []).append(it)
    lists = [list(reversed(v)) for v in groups.values()]
    picked: list[Item] = []
    while len(picked) < n and any(lists):
        for lst in lists:
            while lst and len(picked) < n:
                it = lst.pop()
                if accept(it):
                    picked.append(it)
                    break
    return picked


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_items(items: list[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """(train, held_out) by prompt: keys ordered by a seeded hash, the first ~fraction of them held out
    (at least one key on each side when there are two or more)."""
    keys = sorted({it.key for it in items}, key=lambda k: _hash(f"{seed}:{k}"))
    n_eval = min(max(1, round(fraction * len(keys))), max(1, len(keys) - 1)) if keys else 0
    held = set(keys[:n_eval])
    return [it for it in items if it.key not in held], [it for it in items if it.key in held]


# ---------------------------------------------------------------------------------------------------- tokens
def _as_ids(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return list(out)


def render_messages(tokenizer, messages: list[dict], add_generation_prompt: bool, chat: bool = True) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template ('role: content' lines when it has none)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return _as_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if add_generation_prompt:
        text += "assistant: "
    return list(tokenizer(text)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Sequence:
    """Token ids and the spans `[a, b)` of tokens to predict (each span one answer; position p predicts p+1)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    category: str
    held_out: bool = False

    @property
    def n_scored(self) -> int:
        return sum(b - a for a, b in self.spans)


def chat_sequence(tokenizer, messages: list[dict], max_len: int, chat: bool = True) -> tuple[list[int], list]:
    """Full chat ids (truncated to max_len) and the spans of its assistant turns."""
    full = render_messages(tokenizer, messages, False, chat)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k == 0:
            continue
        a = _common_prefix(render_messages(tokenizer, messages[:k], True, chat), full)
        b = _common_prefix(render_messages(tokenizer, messages[: k + 1], False, chat), full)
        a, b = max(a, 1), min(b, max_len)
        if b > a:
            spans.append((a, b))
    return full[:max_len], spans


def text_sequences(tokenizer, text: str, max_len: int) -> list[list[int]]:
    ids = list(tokenizer(text)["input_ids"])
    return [ids[i : i + max_len] for i in range(0, len(ids), max_len) if len(ids[i : i + max_len]) >= 2]


# ---------------------------------------------------------------------------------------------------- answers
def model_fingerprint(model) -> str:
    """A hash of the config and a sample of every weight (bf16-rounded, so fp32 and bf16 loads agree). A hispec
    checkpoint's base (whose config.json carries the "hispec" entry) hashes like the plain base model, so both
    share cached answers."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    cfg.pop("_name_or_path", None)
    cfg.pop("hispec", None)
    for k in ("torch_dtype", "dtype", "transformers_version", "_attn_implementation_autoset", "use_cache"):
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
    """Greedy answers on disk: `<dir>/<model fingerprint[:16]>-<gen dtype>.jsonl`, one JSON line per answer
    `{"prompt": sha256 of the prompt ids, "max_new_tokens", "finished", "tokens"}`; appended batch by batch."""

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
        return _hash(json.dumps(list(map(int, prompt_ids))))

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
        with open(self.path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())


def eos_ids(model, tokenizer) -> list[int]:
    return sorted(_eos_ids(tokenizer, model.generation_config))


def generate_answers(model, prompts: list[list[int]], max_new_tokens: int, *, eos: list[int], pad_id: int,
                     batch_size: int = 16, progress: bool = False, on_batch=None) -> list[tuple[list[int], bool]]:
    """Greedy answers (new tokens up to and including the first EOS, and whether one came) for token-id prompts,
    in length-sorted left-padded batches through the distillation core's batched generator."""
    from tqdm.auto import tqdm

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="answering prompts", unit="prompt", disable=not progress, dynamic_ncols=True)
    for a in range(0, len(order), batch_size):
        idx = order[a : a + batch_size]
        rows = generate_rows(model, [prompts[i] for i in idx], pad_id=pad_id, eos=eos, max_new_tokens=max_new_tokens)
        for i, res in zip(idx, rows):
            out[i] = res
        if on_batch is not None:
            on_batch([(i, *res) for i, res in zip(idx, rows)])
        bar.update(len(idx))
    bar.close()
    return out


@dataclass
class Prepared:
    """A tokenized item: a prompt still to be answered (`answer_needed`) or finished sequences."""

    item: Item
    prompt_ids: list[int] | None = None
    sequences: list[Sequence] = field(default_factory=list)
    held_out: bool = False

    @property
    def answer_needed(self) -> bool:
        return self.prompt_ids is not None


def prepare_item(tokenizer, item: Item, *, max_prompt_tokens: int, max_seq_len: int, chat: bool = True,
                 held_out: bool = False) -> Prepared | None:
    """Tokenize one item; None when it cannot be used (prompt longer than `max_prompt_tokens`, nothing to score)."""
    if item.kind == "prompt":
        ids = render_messages(tokenizer, [{"role": "user", "content": item.prompt}], True, chat)
        if not ids or len(ids) > max_prompt_tokens or len(ids) >= max_seq_len:
            return None
        return Prepared(item, prompt_ids=ids, held_out=held_out)
    if item.kind == "chat":
        ids, spans = chat_sequence(tokenizer, item.messages, max_seq_len, chat)
        seqs = [Sequence(ids, spans, item.category, held_out)] if spans else []
    else:
        seqs = [Sequence(b, [(1, len(b))], item.category, held_out)
                for b in text_sequences(tokenizer, item.text, max_seq_len)]
    return Prepared(item, sequences=seqs, held_out=held_out) if seqs else None


def answer_prompts(prepared: list[Prepared], cache: AnswerCache, get_model, *, max_new_tokens: int,
                   max_seq_len: int, eos: list[int], pad_id: int, batch_size: int = 16,
                   progress: bool = False) -> dict:
    """Fill `sequences` of the prompt items: cached answers first, the rest generated greedily by `get_model()`
    (called only when something is missing) and cached batch by batch. Returns counts."""
    todo = [p for p in prepared if p.answer_needed and cache.get(p.prompt_ids, max_new_tokens) is None]
    todo_prompts = list({tuple(p.prompt_ids): p.prompt_ids for p in todo}.values())
    generated = 0
    if todo_prompts:
        model = get_model()

        def save(done):
            cache.put_many([(todo_prompts[i], toks, fin, max_new_tokens) for i, toks, fin in done])

        generate_answers(model, todo_prompts, max_new_tokens, eos=eos, pad_id=pad_id, batch_size=batch_size,
                         progress=progress, on_batch=save)
        generated = len(todo_prompts)
    empty = 0
    for p in prepared:
        if not p.answer_needed:
            continue
        answer = cache.get(p.prompt_ids, max_new_tokens)[: max(0, max_seq_len - len(p.prompt_ids))]
        if not answer:
            empty += 1
            continue
        n = len(p.prompt_ids)
        p.sequences = [Sequence(p.prompt_ids + list(answer), [(n, n + len(answer))], p.item.category,
                                p.held_out)]
    return {"generated": generated, "cached": sum(p.answer_needed for p in prepared) - len(todo), "empty": empty}


# ---------------------------------------------------------------------------------------------------- features
@dataclass
class Features:
    """Per scored position (N of them): exit hidden states and the teacher's targets."""

    hidden: dict[int, torch.Tensor]  # layer -> [N, H] (feature dtype, CPU)
    t_ids: torch.Tensor  # [N, k] long: the teacher's top-k token ids
    t_logp: torch.Tensor  # [N, k] float32: their log-probabilities
    t_top: torch.Tensor  # [N] long: the teacher's argmax
    next_token: torch.Tensor  # [N] long: the token that actually follows
    segment: torch.Tensor  # [N] long: answer (span) id, contiguous
    sequence: torch.Tensor  # [N] long: sequence index
    category: torch.Tensor  # [N] long: index into `categories`
    held_out: torch.Tensor  # [N] bool
    categories: list[str]

    @property
    def n(self) -> int:
        return int(self.t_top.numel())


def teacher_targets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits `[n, V]` -> (top-k ids `[n, k]`, their log-probabilities `[n, k]` fp32, argmax `[n]`)."""
    ids, vals = teacher_topk(logits, k)
    return ids, vals, logits.float().argmax(-1)


@dataclass
class _Layout:
    """Where each sequence's scored positions go in the flat `[N]` arrays (sequence order, answers contiguous)."""

    offsets: list[int]
    n: int
    categories: list[str]
    next_token: torch.Tensor
    segment: torch.Tensor
    sequence: torch.Tensor
    category: torch.Tensor
    held_out: torch.Tensor


def _layout(sequences: list[Sequence]) -> _Layout:
    cats = sorted({s.category for s in sequences})
    cat_index = {c: i for i, c in enumerate(cats)}
    offsets, n = [], 0
    for s in sequences:
        offsets.append(n)
        n += s.n_scored
    next_token = torch.empty(n, dtype=torch.long)
    segment = torch.empty(n, dtype=torch.long)
    seq_idx = torch.empty(n, dtype=torch.long)
    category = torch.empty(n, dtype=torch.long)
    held_out = torch.empty(n, dtype=torch.bool)
    seg = 0
    for i, s in enumerate(sequences):
        o = offsets[i]
        for a, b in s.spans:
            m = b - a
            next_token[o : o + m] = torch.tensor(s.ids[a:b])
            segment[o : o + m] = seg
            o, seg = o + m, seg + 1
        seq_idx[offsets[i] : o] = i
        category[offsets[i] : o] = cat_index[s.category]
        held_out[offsets[i] : o] = s.held_out
    return _Layout(offsets, n, cats, next_token, segment, seq_idx, category, held_out)


def _length_batches(sequences: list[Sequence], batch_tokens: int) -> list[list[int]]:
    """Sequence indices in length order, cut into batches of at most `batch_tokens` padded tokens (or one)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    batches, cur = [], []
    for i in order:
        width = len(sequences[i].ids)
        if cur and (len(cur) + 1) * width > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _padded_batch(sequences: list[Sequence], batch: list[int], offsets: list[int], device):
    """Right-padded ids and validity `[B, T]` (on device), and for the scored positions (position p - 1 predicts
    token p of a span): row and column indices (on device) and destination indices into the flat arrays (CPU);
    None when the batch scores nothing."""
    T = max(len(sequences[i].ids) for i in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    valid = torch.zeros(len(batch), T, dtype=torch.bool)
    rows, cols, dest = [], [], []
    for r, i in enumerate(batch):
        s = sequences[i]
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        valid[r, : len(s.ids)] = True
        pos = [p - 1 for a, b in s.spans for p in range(a, b)]
        rows += [r] * len(pos)
        cols += pos
        dest += range(offsets[i], offsets[i] + len(pos))
    if not dest:
        return None
    return (ids.to(device), valid.to(device), torch.tensor(rows, device=device), torch.tensor(cols, device=device),
            torch.tensor(dest))


def _frozen_passes(adapter, sequences: list[Sequence], offsets, layers, batch_tokens: int, desc: str,
                   progress: bool):
    """One frozen pass per length batch, shared by the probe and `--eval-heads`. Yields `(valid [B, T], rows, cols,
    dest, saved {layer: [B, T, H]}, final [n_scored, H])`: the residual stream after each of `layers`, and the final
    normed features at the scored positions (`rows`, `cols`) that go to flat indices `dest` -- the core's frozen pass
    (`hispec.distill.losses.exit_states`). Final logits (`adapter.project`) are left to the caller, chunked over
    scored positions only (a `[B, T, V]` tensor would not fit for long batches)."""
    from tqdm.auto import tqdm

    device = adapter.device
    bar = tqdm(total=len(sequences), desc=desc, unit="seq", disable=not progress, dynamic_ncols=True)
    for batch in _length_batches(sequences, batch_tokens):
        packed = _padded_batch(sequences, batch, offsets, device)
        if packed is not None:
            ids, valid, rows_t, cols_t, dest_t = packed
            T = ids.shape[1]
            positions = torch.arange(T, device=device).expand(len(batch), T)
            saved, normed = exit_states(adapter, ids, positions, valid, tuple(layers))
            yield valid, rows_t, cols_t, dest_t, saved, normed[rows_t, cols_t]
            del saved, normed
        bar.update(len(batch))
    bar.close()


@torch.no_grad()
def extract_features(adapter, sequences: list[Sequence], layers: list[int], *, top_k: int = DEFAULT_TOP_K,
                     batch_tokens: int = 4096, feature_dtype=torch.bfloat16, chunk: int = 512,
                     progress: bool = False) -> Features:
    """One frozen pass over every sequence (see module docstring)."""
    lay = _layout(sequences)
    n = lay.n
    H = adapter.hidden_size
    k = min(top_k, adapter.vocab_size)
    hidden = {l: torch.empty(n, H, dtype=feature_dtype) for l in layers}
    t_ids = torch.empty(n, k, dtype=torch.long)
    t_logp = torch.empty(n, k, dtype=torch.float32)
    t_top = torch.empty(n, dtype=torch.long)

    for _, rows_t, cols_t, dest_t, saved, final in _frozen_passes(adapter, sequences, lay.offsets, layers,
                                                                  batch_tokens, "frozen forward", progress):
        for b, h in saved.items():
            hidden[b][dest_t] = h[rows_t, cols_t].to("cpu", feature_dtype)
        for c in range(0, final.shape[0], chunk):
            ti, tl, tt = teacher_targets(adapter.project(final[c : c + chunk]), k)
            d = dest_t[c : c + chunk]
            t_ids[d], t_logp[d], t_top[d] = ti.cpu(), tl.cpu(), tt.cpu()
    return Features(hidden, t_ids, t_logp, t_top, lay.next_token, lay.segment, lay.sequence, lay.category,
                    lay.held_out, lay.categories)


# ---------------------------------------------------------------------------------------------------- heads
def topk_kl(student_logits: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) per row over the teacher's top-k tokens plus one bucket for the rest: the
    core's fused `TopkBucketKL` (hispec.distill.losses, as the trainer's feature-cache loss).

    student_logits `[n, V]` (full vocabulary); t_ids `[n, k]`, t_logp `[n, k]` the teacher's top-k ids and
    log-probabilities. Returns `[n]` fp32. The student's bucket is exactly the mass of its other V - k tokens.
    """
    return TopkBucketKL.apply(student_logits.float(), t_ids, t_logp.float(), bucket_log_mass(t_logp))[0]


def make_head(head_type: str, adapter, rank: int = 64, seed: int = 0) -> ExitHead:
    """An ExitHead on the adapter's device; trainable types in fp32 (the backbone may be bf16)."""
    torch.manual_seed(seed)
    head = ExitHead(head_type, adapter.final_norm, adapter.hidden_size, rank=rank)
    if head_type != "shared":
        head = head.to(device=adapter.device, dtype=torch.float32)
    return head


def head_logits(head: ExitHead, adapter, feats: torch.Tensor) -> torch.Tensor:
    """Exit hidden `[n, H]` (any dtype/device) -> full-vocabulary logits `[n, V]` (fp32)."""
    dtype = adapter.dtype if head.head_type == "shared" else torch.float32
    y = head(feats.to(adapter.device, dtype))
    return adapter.project(y.to(adapter.dtype)).float()


def train_head(head: ExitHead, adapter, feats: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor, *,
               steps: int, lr: float, batch_tokens: int, seed: int = 0, weight_decay: float = 0.0,
               on_step=None) -> list[float]:
    """AdamW on `topk_kl`, linear warmup (5% of steps) then cosine decay to 10%; returns the per-step losses.
    Batches are consecutive slices of seeded permutations of the N positions (a new one each epoch)."""
    params = [p for p in head.parameters() if p.requires_grad]
    if not params or steps <= 0:
        return []
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 20)

    def factor(s):
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(seed)
    n = feats.shape[0]
    bt = min(batch_tokens, n)
    perm, ptr = torch.randperm(n, generator=g), 0
    losses = []
    head.train()
    for step in range(steps):
        if ptr + bt > n:
            perm, ptr = torch.randperm(n, generator=g), 0
        idx = perm[ptr : ptr + bt]
        ptr += bt
        logits = head_logits(head, adapter, feats[idx])
        loss = topk_kl(logits, t_ids[idx].to(logits.device), t_logp[idx].to(logits.device)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    head.eval()
    return losses


def simulate_rounds(agree, gamma: int) -> tuple[int, int]:
    """Greedy self-speculation over one answer: (tokens, full-model passes).

    `agree[j]` says whether the exit's token at position j equals the full model's. A round starting at j drafts
    positions j..j+gamma-1; the leading run of agreements m (<= gamma) is accepted and the full pass adds one more
    token (the correction, or the bonus after gamma accepted drafts): m + 1 tokens, the next round starts at
    j + m + 1 (the last round is cut at the answer's end)."""
    agree = [bool(a) for a in agree]
    n, j, passes = len(agree), 0, 0
    while j < n:
        m = 0
        while m < gamma and j + m < n and agree[j + m]:
            m += 1
        j += m + 1
        passes += 1
    return n, passes


def tokens_per_pass(agree: torch.Tensor, segment: torch.Tensor, gamma: int) -> float | None:
    """Expected tokens per full-model pass over all answers (total tokens / total passes); `segment` `[n]` gives
    each position's answer id (positions of one answer contiguous and in order)."""
    if agree.numel() == 0:
        return None
    tokens = passes = 0
    _, counts = torch.unique_consecutive(segment, return_counts=True)
    for part in torch.split(agree.bool(), counts.tolist()):
        t, p = simulate_rounds(part.tolist(), gamma)
        tokens, passes = tokens + t, passes + p
    return tokens / passes


def top_vocab(tokens: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids in `tokens` (ties, and the fill when fewer are seen, by lowest id), sorted."""
    if not 1 <= size <= vocab_size:
        raise ProbeError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    counts = torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def coverage(vocab: torch.Tensor, targets: torch.Tensor) -> float | None:
    """Share of `targets` (e.g. held-out teacher argmaxes) inside the id set `vocab`."""
    if targets.numel() == 0:
        return None
    return float(torch.isin(targets, vocab).float().mean())


def restricted_argmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Argmax over the ids where `mask` `[V]` is True."""
    return logits.masked_fill(~mask.to(logits.device), float("-inf")).argmax(-1)


@torch.no_grad()
def evaluate_head(head: ExitHead, adapter, feats: torch.Tensor, t_ids, t_logp, t_top, *,
                  vocab_masks: dict[int, torch.Tensor] | None = None, chunk: int = 512) -> dict[str, torch.Tensor]:
    """Per-position results on `feats` `[n, H]`: agree1, agree5 (bool `[n]`), kl (`[n]`), and for each
    reduced vocabulary K `agree_v{K}` (its restricted argmax == teacher argmax)."""
    vocab_masks = vocab_masks or {}
    out: dict[str, list[torch.Tensor]] = {"agree1": [], "agree5": [], "kl": []}
    out.update({f"agree_v{k}": [] for k in vocab_masks})
    for c in range(0, feats.shape[0], chunk):
        logits = head_logits(head, adapter, feats[c : c + chunk])
        tt = t_top[c : c + chunk].to(logits.device)
        top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        out["agree1"].append((logits.argmax(-1) == tt).cpu())
        out["agree5"].append((top5 == tt[:, None]).any(-1).cpu())
        out["kl"].append(topk_kl(logits, t_ids[c : c + chunk].to(logits.device),
                                 t_logp[c : c + chunk].to(logits.device)).cpu())
        for k, mask in vocab_masks.items():
            out[f"agree_v{k}"].append((restricted_argmax(logits, mask) == tt).cpu())
    empty = {"agree1": torch.bool, "agree5": torch.bool, "kl": torch.float32}
    return {k: torch.cat(v) if v else torch.zeros(0, dtype=empty.get(k, torch.bool)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------- run
@dataclass
class ProbeConfig:
    layers: list[int]
    head_types: list[str] = field(default_factory=lambda: list(DEFAULT_HEAD_TYPES))
    steps: int = 200
    lr: float = 2e-3
    batch_tokens: int = 512
    rank: int = 64
    top_k: int = DEFAULT_TOP_K
    gamma: int = 4
    draft_vocab_sizes: list[int] = field(default_factory=list)
    train_sizes: list[int] = field(default_factory=list)
    train_size_layers: list[int] | None = None  # None: all layers
    seed: int = 0
    feature_dtype: torch.dtype = torch.bfloat16
    feature_batch_tokens: int = 4096


@dataclass
class ProbeResult:
    config: ProbeConfig
    model: dict
    layers: list[int]
    head_types: list[str]
    top1: list[list[float | None]]  # [layer][head type]
    top5: list[list[float | None]]
    tokens_per_pass: list[list[float | None]]
    iid_tokens_per_pass: list[list[float | None]]
    kl: list[list[float | None]]
    loss_first: list[list[float | None]]
    loss_last: list[list[float | None]]
    categories: dict[str, dict]  # cat -> {"tokens": n, "top1": [layer][head], "tokens_per_pass": [layer][head]}
    draft_vocab: dict | None
    train_curve: dict | None
    sizes: dict
    seconds: dict
    loss_curves: dict = field(default_factory=dict)

    @property
    def best_head_type(self) -> str:
        def score(j):
            vals = [row[j] for row in self.top1 if row[j] is not None]
            return sum(vals) / len(vals) if vals else -1.0

        return self.head_types[max(range(len(self.head_types)), key=score)]

    def as_dict(self, full: bool = False) -> dict:
        c = self.config
        best = self.best_head_type
        j = self.head_types.index(best)
        col = [row[j] for row in self.top1]
        d = {
            "model": self.model,
            "layers": self.layers,
            "head_types": self.head_types,
            "top1": self.top1,
            "top5": self.top5,
            "tokens_per_pass": self.tokens_per_pass,
            "iid_tokens_per_pass": self.iid_tokens_per_pass,
            "heldout_kl": self.kl,
            "train_loss_first": self.loss_first,
            "train_loss_last": self.loss_last,
            "gamma": c.gamma,
            "best_head_type": best,
            "best_layer_top1": {str(l): v for l, v in zip(self.layers, col)},
            "categories": self.categories,
            "draft_vocab": self.draft_vocab,
            "train_sizes": self.train_curve,
            "sizes": self.sizes,
            "config": {"steps": c.steps, "lr": c.lr, "batch_tokens": c.batch_tokens, "rank": c.rank,
                       "top_k": c.top_k, "seed": c.seed, "feature_dtype": str(c.feature_dtype).replace("torch.", "")},
            "seconds": self.seconds,
        }
        d = _round(d)
        if full:
            d["loss_curves"] = _round(self.loss_curves)
        return d


def _round(x, nd: int = 5):
    """Floats in nested lists / dicts rounded for JSON."""
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, list):
        return [_round(v, nd) for v in x]
    if isinstance(x, dict):
        return {k: _round(v, nd) for k, v in x.items()}
    return x


def _mean(x: torch.Tensor) -> float | None:
    return None if x.numel() == 0 else float(x.float().mean())


def _seed_for(seed: int, *parts) -> int:
    return int(_hash(f"{seed}:" + ":".join(map(str, parts)))[:8], 16)


def run_probe(adapter, features: Features, config: ProbeConfig, *, model_info: dict | None = None,
              sizes: dict | None = None, seconds: dict | None = None, progress: bool = False) -> ProbeResult:
    """Train (where needed) and evaluate every head type at every layer on precomputed `features`."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    f = features
    tr = (~f.held_out).nonzero().squeeze(-1)
    ev = f.held_out.nonzero().squeeze(-1)
    trainable = [h for h in config.head_types if h != "shared"]
    if trainable and tr.numel() == 0:
        raise ProbeError("no training positions: trainable head types need training data")
    if ev.numel() == 0:
        raise ProbeError("no held-out positions to evaluate on")
    ev_top, ev_ids, ev_logp = f.t_top[ev], f.t_ids[ev], f.t_logp[ev]
    ev_seg, ev_cat = f.segment[ev], f.category[ev]
    tr_ids, tr_logp = f.t_ids[tr], f.t_logp[tr]

    V = adapter.vocab_size
    vocab_masks, draft_vocab = {}, None
    if config.draft_vocab_sizes:
        draft_vocab = {"sizes": list(config.draft_vocab_sizes), "coverage": [], "top1": {}, "counted_tokens": int(
            tr.numel())}
        for k in config.draft_vocab_sizes:
            ids = top_vocab(f.next_token[tr], k, V)
            mask = torch.zeros(V, dtype=torch.bool)
            mask[ids] = True
            vocab_masks[k] = mask
            draft_vocab["coverage"].append(coverage(ids, ev_top))
            draft_vocab["top1"][str(k)] = [[None] * len(config.head_types) for _ in config.layers]

    L, Hn = len(config.layers), len(config.head_types)
    grid = lambda: [[None] * Hn for _ in range(L)]  # noqa: E731
    top1, top5, tpp, iid, kl, lfirst, llast = grid(), grid(), grid(), grid(), grid(), grid(), grid()
    cat_names = f.categories
    cats = {c: {"tokens": int((ev_cat == i).sum()), "top1": grid(), "tokens_per_pass": grid()}
            for i, c in enumerate(cat_names) if int((ev_cat == i).sum()) > 0}
    curves = {}
    total_steps = config.steps * len(trainable) * L
    bar = tqdm(total=total_steps + L * Hn, desc="heads", unit="step", disable=not progress, dynamic_ncols=True)
    t_train = t_eval = 0.0
    for li, layer in enumerate(config.layers):
        feats = f.hidden[layer]
        for hj, ht in enumerate(config.head_types):
            head = make_head(ht, adapter, config.rank, seed=_seed_for(config.seed, "init", layer, ht))
            ta = time.perf_counter()
            if ht != "shared":
                bar.set_description(f"train L{layer} {ht}")

                def tick(step, loss):
                    bar.update(1)
                    if step % 10 == 0:
                        bar.set_postfix(loss=f"{loss:.3f}")

                losses = train_head(head, adapter, feats[tr], tr_ids, tr_logp, steps=config.steps, lr=config.lr,
                                    batch_tokens=config.batch_tokens, seed=_seed_for(config.seed, "batches", layer,
                                                                                     ht), on_step=tick)
                curves[f"L{layer}/{ht}"] = losses
                if losses:
                    k = max(1, min(10, len(losses) // 10))
                    lfirst[li][hj] = sum(losses[:k]) / k
                    llast[li][hj] = sum(losses[-k:]) / k
            tb = time.perf_counter()
            bar.set_description(f"eval L{layer} {ht}")
            res = evaluate_head(head, adapter, feats[ev], ev_ids, ev_logp, ev_top, vocab_masks=vocab_masks)
            t_train += tb - ta
            t_eval += time.perf_counter() - tb
            bar.update(1)
            a1 = res["agree1"]
            top1[li][hj], top5[li][hj], kl[li][hj] = _mean(a1), _mean(res["agree5"]), _mean(res["kl"])
            tpp[li][hj] = tokens_per_pass(a1, ev_seg, config.gamma)
            iid[li][hj] = iid_tokens_per_pass(top1[li][hj], config.gamma)
            for ci, c in enumerate(cat_names):
                if c not in cats:
                    continue
                sel = ev_cat == ci
                cats[c]["top1"][li][hj] = _mean(a1[sel])
                cats[c]["tokens_per_pass"][li][hj] = tokens_per_pass(a1[sel], ev_seg[sel], config.gamma)
            for k in vocab_masks:
                draft_vocab["top1"][str(k)][li][hj] = _mean(res[f"agree_v{k}"])
            del head
    bar.close()

    train_curve = None
    if config.train_sizes:
        train_curve = _train_size_curve(adapter, f, tr, ev, config, trainable, progress)
    secs = dict(seconds or {})
    secs.update({"train": round(t_train, 2), "eval": round(t_eval, 2)})
    if train_curve is not None:
        secs["train_sizes"] = train_curve.pop("_seconds")
    secs["probe"] = round(time.perf_counter() - t0, 2)
    return ProbeResult(config=config, model=model_info or {}, layers=list(config.layers),
                       head_types=list(config.head_types), top1=top1, top5=top5, tokens_per_pass=tpp,
                       iid_tokens_per_pass=iid, kl=kl, loss_first=lfirst, loss_last=llast, categories=cats,
                       draft_vocab=draft_vocab, train_curve=train_curve, sizes=dict(sizes or {}), seconds=secs,
                       loss_curves=curves)


def training_subset(features: Features, train_idx: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The first `size` training positions taken whole answer by answer in a seeded order of sequences."""
    seqs = features.sequence[train_idx]
    uniq = torch.unique(seqs)
    g = torch.Generator().manual_seed(seed)
    order = uniq[torch.randperm(uniq.numel(), generator=g)]
    picked, n = [], 0
    for s in order.tolist():
        pos = train_idx[seqs == s]
        picked.append(pos)
        n += pos.numel()
        if n >= size:
            break
    return torch.cat(picked)[:size] if picked else train_idx[:0]


def _train_size_curve(adapter, f: Features, tr, ev, config: ProbeConfig, trainable: list[str], progress: bool):
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    layers = config.train_size_layers or config.layers
    types = trainable or []
    sizes = sorted(set(config.train_sizes))
    used = [min(s, int(tr.numel())) for s in sizes]
    curve = {"sizes": sizes, "used_tokens": used, "layers": list(layers), "head_types": types, "top1": {}}
    bar = tqdm(total=len(sizes) * len(layers) * len(types) * config.steps, desc="train-size curve", unit="step",
               disable=not progress or not types, dynamic_ncols=True)
    ev_top, ev_ids, ev_logp = f.t_top[ev], f.t_ids[ev], f.t_logp[ev]
    for ht in types:
        rows = []
        for layer in layers:
            row = []
            for size in sizes:
                sub = training_subset(f, tr, size, _seed_for(config.seed, "subset"))
                head = make_head(ht, adapter, config.rank, seed=_seed_for(config.seed, "init", layer, ht))
                train_head(head, adapter, f.hidden[layer][sub], f.t_ids[sub], f.t_logp[sub], steps=config.steps,
                           lr=config.lr, batch_tokens=config.batch_tokens,
                           seed=_seed_for(config.seed, "batches", layer, ht, size),
                           on_step=lambda s, l: bar.update(1))
                res = evaluate_head(head, adapter, f.hidden[layer][ev], ev_ids, ev_logp, ev_top)
                row.append(_mean(res["agree1"]))
            rows.append(row)
        curve["top1"][ht] = rows  # [layer][size]
    bar.close()
    curve["_seconds"] = round(time.perf_counter() - t0, 2)
    return curve


# ---------------------------------------------------------------------------------------------------- checkpoint heads
EXIT_NAMES = ("draft", "verify")


@torch.no_grad()
def exit_head_predictions(model, sequences: list[Sequence], *, batch_tokens: int = 4096, chunk: int = 512,
                          progress: bool = False) -> dict:
    """Teacher-forced predictions of an `EarlyExitModel`'s own heads at every scored position of `sequences`.

    One frozen pass per batch (right-padded, through `DecoderAdapter`) keeps the residual stream after the draft
    and verifier layers; each head runs on it (a stateful `layer` head over the whole sequence with a fresh cache,
    `ExitHead.run_layer_fresh`) and projects through `EarlyExitModel.project_exit`, so a reduced head vocabulary
    is honoured (argmax and top-5 only ever inside it). Returns flat `[N]` tensors (CPU): `final` (the final
    layer's argmax), `<exit>_top1` (the head's argmax), `<exit>_top5` (bool: final argmax within the head's top-5,
    top-k capped at the head's vocabulary size), and the layout: `segment`, `sequence`, `category`, `categories`.
    """
    adapter = model.adapter
    lay = _layout(sequences)
    n = lay.n
    exits = {name: getattr(model, f"{name}_layer") for name in EXIT_NAMES}
    out = {"final": torch.empty(n, dtype=torch.long)}
    for name in EXIT_NAMES:
        out[f"{name}_top1"] = torch.empty(n, dtype=torch.long)
        out[f"{name}_top5"] = torch.empty(n, dtype=torch.bool)
    filled = torch.zeros(n, dtype=torch.bool)
    for valid, rows_t, cols_t, dest_t, saved, final in _frozen_passes(
            adapter, sequences, lay.offsets, list(exits.values()), batch_tokens, "evaluating heads", progress):
        for c in range(0, final.shape[0], chunk):
            out["final"][dest_t[c : c + chunk]] = adapter.project(final[c : c + chunk]).float().argmax(-1).cpu()
        for name, layer in exits.items():
            head = model.heads[name]
            if head.stateful:  # attends over the exit's previous positions: run it over the whole sequences
                feats = head(saved[layer], head.run_layer_fresh(adapter, valid.long()))[rows_t, cols_t]
            else:
                feats = saved[layer][rows_t, cols_t]
            k = min(5, head.vocab_size or adapter.vocab_size)
            for c in range(0, feats.shape[0], chunk):
                x = feats[c : c + chunk]
                logits = model.project_exit(name, x if head.stateful else head(x)).float()
                d = dest_t[c : c + chunk]
                tt = out["final"][d].to(logits.device)
                out[f"{name}_top1"][d] = logits.argmax(-1).cpu()
                out[f"{name}_top5"][d] = (logits.topk(k, dim=-1).indices == tt[:, None]).any(-1).cpu()
        filled[dest_t] = True
    if not bool(filled.all()):
        raise ProbeError("internal error: some scored positions were not evaluated")
    out.update(segment=lay.segment, sequence=lay.sequence, category=lay.category, categories=lay.categories)
    return out


def _share(mask: torch.Tensor, given: torch.Tensor | None = None) -> float | None:
    """Mean of bool `mask` (over the positions where `given` holds); None when there are none."""
    if given is not None:
        mask = mask[given]
    return _mean(mask)


def hierarchy_figures(pred: dict, sel: torch.Tensor | None = None) -> dict:
    """The intermediate verifier against the draft: `verify_agrees_draft` (share of draft tokens whose verifier-exit
    argmax is the same token), `final_agrees_given_verify_agrees` (of those, the share the final layer keeps) and
    `verify_agrees_given_final_agrees` (of the drafts the final layer would accept, the share the verifier passes)."""
    d, v, t = pred["draft_top1"], pred["verify_top1"], pred["final"]
    if sel is not None:
        d, v, t = d[sel], v[sel], t[sel]
    vd, fd = v == d, t == d
    return {"verify_agrees_draft": _share(vd), "final_agrees_given_verify_agrees": _share(fd, vd),
            "verify_agrees_given_final_agrees": _share(vd, fd)}


@dataclass
class HeadEvalResult:
    """A checkpoint's own draft and verifier heads on held-out answers; lists are aligned with `exits`."""

    model: dict
    exits: list[str]
    layers: list[int]
    head_types: list[str]
    vocab_sizes: list[int]  # the head's output vocabulary (the model's full vocabulary when not reduced)
    reduced_vocab: list[bool]
    vocab_coverage: list[float | None]  # share of final-layer argmaxes inside the head's vocabulary
    top1: list[float | None]
    top5: list[float | None]
    tokens_per_pass: list[float | None]
    iid_tokens_per_pass: list[float | None]
    hierarchy: dict
    categories: dict  # cat -> {"tokens", "top1": [d, v], "top5": [d, v], "tokens_per_pass": [d, v], **hierarchy}
    gamma: int
    sizes: dict
    seconds: dict
    config: dict = field(default_factory=dict)

    def as_dict(self, full: bool = False) -> dict:
        d = {
            "mode": "eval-heads",
            "model": self.model,
            "exits": self.exits,
            "layers": self.layers,
            "head_types": self.head_types,
            "vocab_sizes": self.vocab_sizes,
            "reduced_vocab": self.reduced_vocab,
            "vocab_coverage": self.vocab_coverage,
            "top1": self.top1,
            "top5": self.top5,
            "tokens_per_pass": self.tokens_per_pass,
            "iid_tokens_per_pass": self.iid_tokens_per_pass,
            "gamma": self.gamma,
            **self.hierarchy,
            "categories": self.categories,
            "sizes": self.sizes,
            "config": self.config,
            "seconds": self.seconds,
        }
        return _round(d)


def evaluate_exit_heads(model, sequences: list[Sequence], *, gamma: int, batch_tokens: int = 4096,
                        model_info: dict | None = None, sizes: dict | None = None, seconds: dict | None = None,
                        config: dict | None = None, progress: bool = False) -> HeadEvalResult:
    """Held-out top-1 / top-5 agreement with the final layer's argmax, E[tokens per full pass] for `gamma` drafts
    (`tokens_per_pass`, as the probe computes it) and the hierarchy figures of an `EarlyExitModel`'s own heads,
    overall and per category, on every scored position of `sequences`."""
    t0 = time.perf_counter()
    if not sequences or not any(s.n_scored for s in sequences):
        raise ProbeError("no held-out positions to evaluate on")
    pred = exit_head_predictions(model, sequences, batch_tokens=batch_tokens, progress=progress)
    t_top, seg, cat = pred["final"], pred["segment"], pred["category"]
    V = model.adapter.vocab_size
    layers, types, vsizes, reduced, cover = [], [], [], [], []
    top1, top5, tpp, iid = [], [], [], []
    agree = {}
    for name in EXIT_NAMES:
        head = model.heads[name]
        layers.append(int(getattr(model, f"{name}_layer")))
        types.append(head.head_type)
        vsizes.append(head.vocab_size or V)
        reduced.append(head.vocab is not None)
        cover.append(coverage(head.vocab.cpu(), t_top) if head.vocab is not None else 1.0)
        agree[name] = pred[f"{name}_top1"] == t_top
        top1.append(_mean(agree[name]))
        top5.append(_mean(pred[f"{name}_top5"]))
        tpp.append(tokens_per_pass(agree[name], seg, gamma))
        iid.append(iid_tokens_per_pass(top1[-1], gamma))
    cats = {}
    for ci, c in enumerate(pred["categories"]):
        sel = cat == ci
        if not bool(sel.any()):
            continue
        cats[c] = {"tokens": int(sel.sum()),
                   "top1": [_mean(agree[x][sel]) for x in EXIT_NAMES],
                   "top5": [_mean(pred[f"{x}_top5"][sel]) for x in EXIT_NAMES],
                   "tokens_per_pass": [tokens_per_pass(agree[x][sel], seg[sel], gamma) for x in EXIT_NAMES],
                   **hierarchy_figures(pred, sel)}
    secs = dict(seconds or {})
    secs["eval"] = round(time.perf_counter() - t0, 2)
    return HeadEvalResult(model=model_info or {}, exits=list(EXIT_NAMES), layers=layers, head_types=types,
                          vocab_sizes=vsizes, reduced_vocab=reduced, vocab_coverage=cover, top1=top1, top5=top5,
                          tokens_per_pass=tpp, iid_tokens_per_pass=iid, hierarchy=hierarchy_figures(pred),
                          categories=cats, gamma=gamma, sizes=dict(sizes or {}), seconds=secs,
                          config=dict(config or {}))


def format_eval_table(r: HeadEvalResult) -> str:
    """Fixed-width text: one row per exit head (layer, head type, vocabulary, top-1, top-5, tokens per full pass),
    the verifier-vs-draft figures, then the same by category."""
    s, m = r.sizes, r.model
    lines = [
        f"checkpoint {m.get('name', '?')} ({m.get('num_layers', '?')} layers, {m.get('dtype', '?')}); held-out "
        f"{s.get('eval_items', 0)} items / {s.get('eval_sequences', 0)} sequences / {s.get('eval_tokens', 0):,} "
        f"scored tokens",
        f"held-out agreement of the checkpoint's heads with the final layer's argmax: top-1, top-5, E[tokens per "
        f"full pass] for gamma={r.gamma}",
        "",
        f"{'exit':<8}{'layer':>6}  {'head type':<10}{'vocab':>8}{'top1':>8}{'top5':>8}{'tok/pass':>10}",
    ]
    for i, name in enumerate(r.exits):
        vocab = f"{r.vocab_sizes[i]:,}" + ("*" if r.reduced_vocab[i] else "")
        lines.append(f"{name:<8}{r.layers[i]:>6}  {r.head_types[i]:<10}{vocab:>8}{_f(r.top1[i]):>8}"
                     f"{_f(r.top5[i]):>8}{_f(r.tokens_per_pass[i], '{:.2f}'):>10}")
    if any(r.reduced_vocab):
        lines.append("* reduced vocabulary; final-layer argmax inside it: " + ", ".join(
            f"{name} {_f(c)}" for name, c, red in zip(r.exits, r.vocab_coverage, r.reduced_vocab) if red))
    h = r.hierarchy
    lines += ["", f"verifier exit agrees with the draft on {_f(h['verify_agrees_draft'])} of draft tokens; the final "
              f"layer agrees with {_f(h['final_agrees_given_verify_agrees'])} of those; the verifier passes "
              f"{_f(h['verify_agrees_given_final_agrees'])} of the drafts the final layer accepts"]
    if r.categories:
        lines += ["", "by category",
                  f"{'category':<16}{'tokens':>7}{'draft top1':>12}{'verify top1':>13}{'draft t/p':>11}"
                  f"{'verify t/p':>12}{'verify=draft':>14}"]
        for c in sorted(r.categories):
            d = r.categories[c]
            lines.append(f"{c[:15]:<16}{d['tokens']:>7}{_f(d['top1'][0]):>12}{_f(d['top1'][1]):>13}"
                         f"{_f(d['tokens_per_pass'][0], '{:.2f}'):>11}{_f(d['tokens_per_pass'][1], '{:.2f}'):>12}"
                         f"{_f(d['verify_agrees_draft']):>14}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- output
def _f(v, fmt="{:.3f}", none="-"):
    return none if v is None else fmt.format(v)


def format_table(r: ProbeResult) -> str:
    """Fixed-width text: per layer and head type top-1 / top-5 agreement and tokens per full pass; then top-1 by
    category for the best head type, reduced-vocabulary agreement and the training-size curve when asked."""
    s, m = r.sizes, r.model
    lines = [
        f"model {m.get('name', '?')} ({m.get('num_layers', '?')} layers, {m.get('dtype', '?')}); train "
        f"{s.get('train_sequences', 0)} sequences / {s.get('train_tokens', 0):,} scored tokens, held-out "
        f"{s.get('eval_sequences', 0)} / {s.get('eval_tokens', 0):,}; {r.config.steps} steps x "
        f"{r.config.batch_tokens} tokens, seed {r.config.seed}",
        f"held-out agreement with the final layer's argmax: top-1, top-5, E[tokens per full pass] for "
        f"gamma={r.config.gamma}",
        "",
    ]
    w = 22
    lines.append(f"{'layer':>5}  " + "".join(f"{h:>{w}}" for h in r.head_types))
    lines.append(f"{'':>5}  " + "".join(f"{'top1  top5 tok/pass':>{w}}" for _ in r.head_types))
    for i, layer in enumerate(r.layers):
        cells = [f"{_f(r.top1[i][j]):>6}{_f(r.top5[i][j]):>6}{_f(r.tokens_per_pass[i][j], '{:.2f}'):>9}"
                 for j in range(len(r.head_types))]
        lines.append(f"{layer:>5}  " + "".join(f"{c:>{w}}" for c in cells))
    best = r.best_head_type
    j = r.head_types.index(best)
    if r.categories:
        cats = sorted(r.categories)
        lines += ["", f"top-1 agreement by category ({best} heads), by exit layer",
                  f"{'category':<16}{'tokens':>7}  " + "".join(f"{'L' + str(l):>7}" for l in r.layers)]
        for c in cats:
            d = r.categories[c]
            lines.append(f"{c[:15]:<16}{d['tokens']:>7}  " + "".join(f"{_f(d['top1'][i][j]):>7}"
                                                                     for i in range(len(r.layers))))
    if r.draft_vocab:
        dv = r.draft_vocab
        heads = r.head_types
        lines += ["", "top-1 agreement with the draft argmax restricted to the K most frequent training answer tokens",
                  "coverage (held-out teacher argmax inside the set): " + ", ".join(
                      f"K={k}: {_f(c)}" for k, c in zip(dv["sizes"], dv["coverage"])),
                  f"{'layer':>5}  " + "".join(f"{h + ' K=' + str(k):>{max(16, len(h) + 10)}}" for k in dv["sizes"]
                                              for h in heads)]
        for i, layer in enumerate(r.layers):
            lines.append(f"{layer:>5}  " + "".join(
                f"{_f(dv['top1'][str(k)][i][jj]):>{max(16, len(h) + 10)}}" for k in dv["sizes"]
                for jj, h in enumerate(heads)))
    if r.train_curve and r.train_curve["head_types"]:
        tc = r.train_curve
        lines += ["", "top-1 agreement vs training tokens (" + ", ".join(
            f"{s:,}" + ("" if u == s else f" (only {u:,})") for s, u in zip(tc["sizes"], tc["used_tokens"])) + ")",
            f"{'head':>8}{'layer':>6}  " + "".join(f"{s:>10,}" for s in tc["sizes"])]
        for ht, rows in tc["top1"].items():
            for layer, row in zip(tc["layers"], rows):
                lines.append(f"{ht:>8}{layer:>6}  " + "".join(f"{_f(v):>10}" for v in row))
    lines += ["", f"best head type (mean top-1 over layers): {best}"]
    return "\n".join(lines)


def plot(r: ProbeResult, path: str | os.PathLike) -> Path:
    """Left: top-1 (solid) and top-5 (dotted) agreement vs layer per head type. Right: agreement vs training
    tokens when a training-size curve was run, else top-1 by category for the best head type."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    for j, ht in enumerate(r.head_types):
        color = f"C{j}"
        ys = [row[j] for row in r.top1]
        ax.plot(r.layers, [float("nan") if y is None else y for y in ys], marker="o", color=color, label=f"{ht} top-1")
        ys5 = [row[j] for row in r.top5]
        ax.plot(r.layers, [float("nan") if y is None else y for y in ys5], linestyle=":", color=color, alpha=0.7,
                label=f"{ht} top-5")
    ax.set_xlabel("exit layer")
    ax.set_xticks(r.layers) if len(r.layers) <= 20 else ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("held-out agreement with final-layer argmax")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    name = r.model.get("name", "")
    ax.set_title(f"{name}: agreement by exit layer", fontsize=9)
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    tc = r.train_curve
    if tc and tc["head_types"]:
        k = 0
        for ht, rows in tc["top1"].items():
            for layer, row in zip(tc["layers"], rows):
                ax2.plot(tc["used_tokens"], [float("nan") if v is None else v for v in row], marker="o",
                         color=f"C{k % 10}", label=f"{ht} L{layer}")
                k += 1
        ax2.set_xscale("log")
        ax2.set_xlabel("training tokens")
        ax2.set_title("top-1 agreement vs training data", fontsize=9)
    else:
        best = r.best_head_type
        j = r.head_types.index(best)
        for k, c in enumerate(sorted(r.categories)):
            ys = [row[j] for row in r.categories[c]["top1"]]
            ax2.plot(r.layers, [float("nan") if y is None else y for y in ys], marker=".", color=f"C{k % 10}",
                     linestyle="-" if k < 10 else "--", label=c)
        ax2.set_xlabel("exit layer")
        ax2.set_xticks(r.layers) if len(r.layers) <= 20 else ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_title(f"top-1 agreement by category ({best} heads)", fontsize=9)
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
