"""Document prompts: the model's own answers become the passage of a further instruction (summarise it, extract
from it, answer a question from it, rewrite it, translate it), which the model then answers too.

Why: Spec-Bench's weakest categories for a drafter trained on self-written prompts are the ones whose prompt carries a
long text the answer draws on (summarisation, RAG, extraction, translation: SmolLM2's 2.01M-token drafter 0.19-0.36
top-1 there against 0.51-0.56 on math and STEM,
recipes/artifacts/smollm2-135m/eagle3/drafter_eval_spec_bench_40x128_bf16_2.01m_2400steps.txt). A self-written prompt
is at most `self_prompt_max_new_tokens` long, so it never carries such a text, and nothing offline supplies articles.
The model's own finished answers do: a few hundred tokens of prose on every topic of the task mix, written in its own
style. An instruction over one of them teaches the drafter the copy-and-condense answers those categories produce,
with no text from outside the repository (and never a benchmark's: only training answers are used, held-out prompts'
answers never).

Contract: `document_prompts(answers, tokenizer, fraction, *, seed, max_prompt_tokens, min_answer_tokens)` ->
`[{"id", "messages": [{"role": "user", "content"}], "template"}]`. Each answer (a row of
`hispec.distill.answers.read_responses`: a single user turn and the model's reply of at least `min_answer_tokens`
tokens; a reply cut at the answer step's token cap is fine, its passage is cut shorter anyway) is picked with
probability `fraction` by a seeded hash of its id, so the pick is deterministic and stable as the answer set grows
(an answer picked once stays picked: earlier document prompts keep their answers). Its template is chosen by
another hash; the passage is the reply cut at a paragraph, else a sentence, else a word boundary (`_cut`) so the
rendered prompt fits `max_prompt_tokens` (the answer step drops longer prompts), and a prompt whose passage would
shrink below a third of the reply's words, or repeats itself (`repetitive`: a word 4-gram five times, the loop a small
model's capped answer ends in), is skipped. Templates marked `short` (translation) take the first ~60 words only.
Ids are `hispec.distill.data.prompt_id`, so the answer step resumes them like any prompt.
`answer_document_prompts(...)` is the training step's use: build them over the training answers, answer them into
the self-distillation folder, return the chats.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter

from hispec.distill.answers import generate_responses, read_responses
from hispec.distill.data import prompt_id, render_chat
from hispec.distill.items import seeded_hash

logger = logging.getLogger("hispec.train")

# (name, template, short): {doc} is the passage, {question} the instruction the passage answered.
TEMPLATES: tuple[tuple[str, str, bool], ...] = (
    ("summary", "Summarize the following text in a few sentences.\n\n{doc}", False),
    ("summary", "{doc}\n\nSummarize the text above in one short paragraph.", False),
    ("summary", "Write a short summary of this article:\n\n{doc}", False),
    ("summary", "Give a TL;DR of the following:\n\n{doc}", False),
    ("summary", "Summarize the main points of this passage as a bulleted list:\n\n{doc}", False),
    ("extraction", "Extract the key facts from the text below and return them as JSON.\n\n{doc}", False),
    ("extraction", "From the following text, list every name, number and date it mentions.\n\n{doc}", False),
    ("extraction", "Read the text and extract the three most important points.\n\n{doc}", False),
    ("extraction", "{doc}\n\nExtract the steps or items described above as a numbered list.", False),
    ("rag", "Answer the question using only the passage below.\n\nPassage:\n{doc}\n\nQuestion: {question}", False),
    ("rag", "Context:\n{doc}\n\nBased on the context above, answer: {question}", False),
    ("rag", "Passage: {doc}\n\nAccording to the passage, what is its main idea? Answer briefly.", False),
    ("rag", "Document:\n{doc}\n\nWhat question does this document answer, and what is the answer in one sentence?",
     False),
    ("rewrite", "Rewrite the following text in simpler words:\n\n{doc}", False),
    ("rewrite", "Proofread and improve the following text:\n\n{doc}", False),
    ("rewrite", "Write a title and a one-sentence description for this text:\n\n{doc}", False),
    ("translation", "Translate the following text into French:\n\n{doc}", True),
    ("translation", "Translate the following text into German:\n\n{doc}", True),
    ("translation", "Translate the following text into Spanish:\n\n{doc}", True),
    ("translation", "Translate this into Chinese:\n\n{doc}", True),
)
SHORT_WORDS = 60  # passage length of a `short` template (translation), in words


def _cut(text: str, fits, least: float | None = None) -> str:
    """The longest prefix of `text` that `fits` (a predicate, monotone in length): cut at a paragraph boundary if
    that keeps half the words (and `least`), else at a sentence boundary if that keeps `least` words (default a
    third of them), else at a word boundary ("" when not even one word fits)."""
    if fits(text):
        return text
    n = len(text.split())
    least = n / 3 if least is None else least
    for pattern, need in ((r"\n\s*\n", max(least, n / 2)), (r"(?<=[.!?])\s+", least), (r"\s+", 1)):
        ends = [m.start() for m in re.finditer(pattern, text)]
        found, lo, hi = "", 0, len(ends) - 1
        while lo <= hi:  # prefixes grow with the cut point: binary search for the last that fits
            mid = (lo + hi) // 2
            cand = text[:ends[mid]].rstrip()
            if cand and fits(cand):
                found, lo = cand, mid + 1
            else:
                hi = mid - 1
        if found and len(found.split()) >= need:
            return found
    return ""


def repetitive(text: str, n: int = 4, limit: int = 5) -> bool:
    """A word n-gram (lower-cased) occurring `limit` times or more: the loops a small model's capped answers end in."""
    words = text.lower().split()
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return bool(grams) and max(grams.values()) >= limit


def _pick(seed: int, rid: str, fraction: float) -> bool:
    return int(seeded_hash(seed, "document", rid)[:8], 16) < fraction * 0x100000000


def document_prompts(answers, tokenizer, fraction: float, *, seed: int = 0, max_prompt_tokens: int = 256,
                     min_answer_tokens: int = 64, templates=TEMPLATES) -> list[dict]:
    """Instructions over the model's own answers (see the module docstring), in the order of `answers`."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"document_prompt_fraction must be in [0, 1], got {fraction!r}")
    out = []
    for row in answers:
        msgs = row.get("messages") or []
        if (len(msgs) != 2 or msgs[0].get("role") != "user" or msgs[1].get("role") != "assistant"
                or row.get("response_tokens", 0) < min_answer_tokens):
            continue
        rid = row["id"]
        if not _pick(seed, rid, fraction):
            continue
        name, template, short = templates[int(seeded_hash(seed, "template", rid)[:8], 16) % len(templates)]
        question, reply = msgs[0]["content"].strip(), msgs[1]["content"].strip()
        words = reply.split()
        if short and len(words) > SHORT_WORDS:
            reply = _cut(reply, lambda t: len(t.split()) <= SHORT_WORDS, SHORT_WORDS / 3)

        def content(doc: str) -> str:
            return template.format(doc=doc, question=question)

        def fits(doc: str) -> bool:
            text = render_chat(tokenizer, [{"role": "user", "content": content(doc)}], add_generation_prompt=True)
            return len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_prompt_tokens

        doc = _cut(reply, fits)
        if not doc or len(doc.split()) < len(reply.split()) / 3 or repetitive(doc):
            continue
        messages = [{"role": "user", "content": content(doc)}]
        out.append({"id": prompt_id(messages), "messages": messages, "template": name})
    return out


def answer_document_prompts(state, model, tokenizer, train_answers: list[dict], sd_dir, d, g, seed: int
                            ) -> tuple[list[dict], int]:
    """The training step's use (`train/heads.py`, `document_prompt_fraction`): document prompts over
    `train_answers` (answers to training prompts only, so no held-out text becomes a passage), answered by the
    model into `sd_dir` like every self-distilled prompt (resumable, sharded over processes) -> (their chats as
    `{messages, text}` rows, the number of document prompts)."""
    docs = document_prompts(train_answers, tokenizer, d.document_prompt_fraction, seed=seed,
                            max_prompt_tokens=g.gen_max_prompt_tokens)
    t0 = time.time()
    n_new = generate_responses(model, tokenizer, docs, sd_dir, g, rank=state.process_index,
                               world_size=state.num_processes, seed=seed, show_progress=state.is_local_main_process)
    state.wait_for_everyone()
    answers = read_responses(sd_dir)
    rows = [{"messages": answers[p["id"]]["messages"], "text": ""} for p in docs if p["id"] in answers]
    logger.info("document prompts: %d over %d training answers, %d new answers in %.1fs, %d in all", len(docs),
                len(train_answers), n_new, time.time() - t0, len(rows))
    return rows, len(docs)
