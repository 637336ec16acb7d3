"""Document prompts (hispec.distill.document_prompts): the model's own answers as the passages of further
instructions. Deterministic and stable as the answers grow, cut at paragraph / sentence boundaries to fit the
prompt budget, loops and short answers skipped; end to end through train/heads.py, where held-out prompts' answers
never become passages."""
from __future__ import annotations

import json
import random
import re

import pytest

from hispec.distill.data import render_chat
from hispec.distill.document_prompts import TEMPLATES, _cut, document_prompts, repetitive
from tiny import char_tokenizer

SENTENCES = ["the river runs past the old mill.", "a heron waits in the reeds.", "children count boats at noon.",
             "rain came late this year.", "the baker opens at six.", "two bridges cross the water here.",
             "moss covers the north wall.", "a bell rings from the hill."]


def _answer(i: int, rng: random.Random, paragraphs: int = 3, tokens: int = 120) -> dict:
    text = "\n\n".join(" ".join(rng.sample(SENTENCES, 4)) for _ in range(paragraphs))
    msgs = [{"role": "user", "content": f"describe place {i}"}, {"role": "assistant", "content": text}]
    return {"id": f"{i:016x}", "messages": msgs, "response_tokens": tokens, "finished": True}


def _answers(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_answer(i, rng) for i in range(n)]


def _parse(prompt: str) -> tuple[str, str, str | None]:
    """A document prompt -> (its template's name, the passage, the question or None)."""
    for name, template, _ in TEMPLATES:
        pattern = re.escape(template).replace(re.escape("{doc}"), "(?P<doc>.*)")
        pattern = pattern.replace(re.escape("{question}"), "(?P<question>.*)")
        m = re.fullmatch(pattern, prompt, flags=re.S)
        if m:
            return name, m.group("doc"), m.groupdict().get("question")
    raise AssertionError(f"not a document prompt: {prompt!r}")


def _passage(prompt: str) -> str:
    return _parse(prompt)[1]


def test_picks_are_deterministic_and_stable_as_the_answers_grow():
    tok = char_tokenizer()
    small, big = _answers(40), _answers(120)
    a = document_prompts(small, tok, 0.5, seed=7, max_prompt_tokens=400)
    assert a == document_prompts(small, tok, 0.5, seed=7, max_prompt_tokens=400)
    b = document_prompts(big, tok, 0.5, seed=7, max_prompt_tokens=400)
    assert a == [p for p in b if p["id"] in {q["id"] for q in a}] == b[:len(a)]  # earlier prompts kept, same text
    assert 25 <= len(b) <= 95  # ~half of 120
    assert len({p["id"] for p in b}) == len(b)
    other = document_prompts(big, tok, 0.5, seed=8, max_prompt_tokens=400)
    assert {p["id"] for p in other} != {p["id"] for p in b}  # the seed matters
    assert document_prompts(big, tok, 0.0, seed=7) == []
    assert len(document_prompts(big, tok, 1.0, seed=7, max_prompt_tokens=400)) == 120
    assert {p["template"] for p in document_prompts(big, tok, 1.0, seed=7, max_prompt_tokens=400)} == {
        name for name, _, _ in TEMPLATES}
    with pytest.raises(ValueError, match="document_prompt_fraction"):
        document_prompts(big, tok, 1.5)


def test_every_prompt_fits_the_budget_and_its_passage_is_cut_at_a_boundary():
    tok = char_tokenizer()
    answers = _answers(60, seed=1)
    budget = 260  # the char tokenizer: ~1 token per character, so most passages (~420 characters) are cut
    out = document_prompts(answers, tok, 1.0, seed=0, max_prompt_tokens=budget)
    replies = {a["messages"][1]["content"] for a in answers}
    assert out
    cut = 0
    for p in out:
        text = render_chat(tok, p["messages"], add_generation_prompt=True)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) <= budget
        doc = _passage(p["messages"][0]["content"])
        full = next(r for r in replies if r.startswith(doc))
        if doc != full:
            cut += 1
            assert doc.endswith(".")  # at a sentence (or paragraph) end, never inside a sentence
            assert len(doc.split()) >= len(full.split()) / 3
        if p["template"] == "translation":
            assert len(doc.split()) <= 60
    assert cut > len(out) / 3


def test_cut_prefers_paragraphs_then_sentences_then_words():
    text = "one two three. four five six.\n\nseven eight nine. ten eleven twelve."
    words = lambda k: (lambda t: len(t.split()) <= k)  # noqa: E731
    assert _cut(text, words(100)) == text
    assert _cut(text, words(6)) == "one two three. four five six."  # the paragraph: half the words
    assert _cut(text, words(11)) == "one two three. four five six."  # still the paragraph (half the words)
    text = "one two.\n\nthree four five. six seven eight. nine ten eleven twelve."
    assert _cut(text, words(9)) == "one two.\n\nthree four five. six seven eight."  # a sentence
    assert _cut(text, words(5)) == "one two.\n\nthree four five."  # a sentence: a third of the words
    assert _cut(text, words(3)) == "one two.\n\nthree"  # no sentence end keeps a third: words
    assert _cut(text, words(4), least=4) == "one two.\n\nthree four"  # `least` raised: words again
    assert _cut(text, words(0)) == ""


def test_loops_short_answers_and_other_shapes_are_skipped():
    tok = char_tokenizer()
    rng = random.Random(2)
    good = _answer(0, rng)
    loop = _answer(1, rng)
    loop["messages"][1]["content"] = "i am here to help you. " * 12
    short = _answer(2, rng, tokens=30)
    multi = _answer(3, rng)
    multi["messages"] = multi["messages"] * 2
    assert repetitive(loop["messages"][1]["content"]) and not repetitive(good["messages"][1]["content"])
    out = document_prompts([good, loop, short, multi], tok, 1.0, seed=0, max_prompt_tokens=1000)
    assert len(out) == 1 and _passage(out[0]["messages"][0]["content"]) in good["messages"][1]["content"]


def test_rag_prompts_carry_the_question_the_passage_answered():
    tok = char_tokenizer()
    answers = _answers(80, seed=3)
    by_id = {a["id"]: a for a in answers}
    out = document_prompts(answers, tok, 1.0, seed=0, max_prompt_tokens=1000)
    questions = [_parse(p["messages"][0]["content"])[2] for p in out]
    assert any(q is not None for q in questions)
    asked = {a["messages"][0]["content"] for a in by_id.values()}
    assert all(q in asked for q in questions if q is not None)


def test_training_answers_documents_but_never_held_out_ones(tmp_path):
    """train/heads.py end to end: the document prompts are answered into the self-distillation folder and trained
    on; their passages come from training answers only (the eval file's answers never), and a rerun answers
    nothing new. The base prompts' answers are there already (a resumed data job): prose, where a tiny random
    model would write loops."""
    from test_train import _run
    from tiny import save_tiny

    from hispec.distill.data import prompt_id

    save_tiny(tmp_path / "model")
    rng = random.Random(0)
    sd = tmp_path / "self_distill"
    sd.mkdir()
    questions = {"train": [f"train question {i}" for i in range(16)], "held": [f"held out {i}" for i in range(4)]}
    with open(sd / "part-rank0.jsonl", "w") as f:
        for q in questions["train"] + questions["held"]:
            msgs = [{"role": "user", "content": q}]
            reply = " ".join(rng.sample(SENTENCES, 6))
            f.write(json.dumps({"id": prompt_id(msgs), "messages": msgs + [{"role": "assistant", "content": reply}],
                                "response_tokens": 100, "finished": True}) + "\n")
    for split, name in (("train", "train.jsonl"), ("held", "eval.jsonl")):
        (tmp_path / name).write_text("".join(json.dumps({"question": q}) + "\n" for q in questions[split]))
    out = tmp_path / "run"

    def argv(output_dir):
        return ["--model_name_or_path", str(tmp_path / "model"), "--train_file", str(tmp_path / "train.jsonl"),
                "--eval_file", str(tmp_path / "eval.jsonl"), "--text_column", "question", "--self_distill", "true",
                "--self_distill_dir", str(sd), "--document_prompt_fraction", "1.0", "--gen_max_new_tokens", "8",
                "--gen_batch_size", "8", "--gen_max_prompt_tokens", "240", "--output_dir", str(output_dir),
                "--max_steps", "1", "--per_device_train_batch_size", "2", "--max_seq_length", "64"]

    assert _run(argv(out)) == 0
    rows = [json.loads(x) for x in (sd / "part-rank0.jsonl").read_text().splitlines()]
    base = {r["id"]: r for r in rows[:20]}
    docs = rows[20:]
    assert len(docs) == 16 and not set(base) & {r["id"] for r in docs}  # one per training answer, none held out
    held = [r["messages"][1]["content"] for r in base.values() if r["messages"][0]["content"].startswith("held")]
    trained = [r["messages"][1]["content"] for r in base.values() if r["messages"][0]["content"].startswith("train")]
    for r in docs:
        doc = _passage(r["messages"][0]["content"])
        assert any(a.startswith(doc) for a in trained) and not any(a.startswith(doc) for a in held)
    info = json.loads((out / "hispec_train.json").read_text())
    assert info["data"]["sources"]["document_prompts"] == info["data"]["sources"]["document_answers"] == 16
    assert info["data"]["train_examples"] == 32
    assert _run(argv(tmp_path / "run2")) == 0
    assert len((sd / "part-rank0.jsonl").read_text().splitlines()) == len(rows)  # nothing new to answer


def test_document_prompts_need_self_distillation(tmp_path):
    from test_train import _run
    from hispec.distill.args import ConfigError

    (tmp_path / "x.jsonl").write_text(json.dumps({"question": "what is a heron?"}) + "\n")
    with pytest.raises(ConfigError, match="document_prompt_fraction builds prompts"):
        _run(["--model_name_or_path", str(tmp_path), "--train_file", str(tmp_path / "x.jsonl"),
              "--document_prompt_fraction", "0.3", "--output_dir", str(tmp_path / "o")])
