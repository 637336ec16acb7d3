"""hispec-probe (hispec.probe + hispec.cli.probe): agreement by exit layer and head type.

Offline: a tiny random llama with a character-level tokenizer (and a chat template) saved as a plain HF folder
stands in for a real model; the metric helpers are checked on handcrafted inputs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hispec import probe
from hispec.cli.probe import main
from hispec.distill import items, metrics
from hispec.distill.answers import AnswerCache, model_fingerprint
from hispec.distill.data import chat_ids
from hispec.distill.losses import teacher_topk, topk_kl
from hispec.distill.training import exit_logits, fit_head
from hispec.layers import DecoderAdapter
from hispec.prompts import eos_ids
from hispec.vocab import coverage, select_vocab
from tiny import char_tokenizer, save_tiny, tiny_model

PROMPTS = [
    {"prompt": "write a poem about the sea.", "category": "writing"},
    {"prompt": "what is 12 times 7?", "category": "math"},
    {"prompt": "name three colours.", "category": "writing"},
    {"prompt": "solve x + 3 = 5.", "category": "math"},
    {"prompt": "list two fruits.", "category": "writing"},
    {"prompt": "what is 9 minus 4?", "category": "math"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(capsys, argv):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---------------------------------------------------------------------------------------------------- helpers
def test_parse_layers():
    assert probe.parse_layers(None, 30) == list(range(2, 29, 2))
    assert probe.parse_layers("2-28:2", 30) == list(range(2, 29, 2))
    assert probe.parse_layers("8, 2,4-6", 30) == [2, 4, 5, 6, 8]
    assert probe.parse_layers(None, 6) == [2, 4]
    for bad in ("0", "30", "2-40:2", "a", "6-2"):
        with pytest.raises(probe.ProbeError):
            probe.parse_layers(bad, 30)
    with pytest.raises(probe.ProbeError, match="unknown head type"):
        probe.parse_head_types("shared,mlp")
    with pytest.raises(probe.ProbeError, match="--eval-heads"):
        probe.parse_head_types("linear,layer")


def test_simulate_rounds_handcrafted():
    # all agree, gamma 4: rounds commit 5 + 5 tokens
    assert metrics.simulate_rounds([1] * 10, 4) == (10, 2)
    # never agree: one token per full pass
    assert metrics.simulate_rounds([0] * 7, 4) == (7, 7)
    # 1,1,0 -> round 1 accepts 2 and corrects position 2 (3 tokens); then 1,1,1,1 accepted + bonus (5 tokens)
    assert metrics.simulate_rounds([1, 1, 0, 1, 1, 1, 1, 1], 4) == (8, 2)
    # gamma caps the accepted run: 6 agreements with gamma 2 -> 3 + 3 tokens
    assert metrics.simulate_rounds([1] * 6, 2) == (6, 2)
    # the last round is cut at the answer's end: 3 positions all agreeing -> one pass
    assert metrics.simulate_rounds([1, 1, 1], 4) == (3, 1)
    assert metrics.simulate_rounds([0, 1, 1, 0, 0], 1) == (5, 4)  # 0 | 1,1 | 0 | 0
    # over answers: rounds never cross an answer boundary
    agree = torch.tensor([1, 1, 1, 1, 0, 0, 0])
    seg = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert metrics.tokens_per_pass(agree, seg, 4) == pytest.approx(7 / 4)  # (4 tokens, 1 pass) + (3, 3)
    # by frontier distance (a context head): the k-th draft of a round reads column k (the last one beyond)
    by_d = [[1, 0], [1, 0], [0, 1], [1, 1], [1, 0]]
    # round at 0: d1 ok, position 1 at d2 fails -> 2 tokens; round at 2: d1 fails -> 1; round at 3: d1 ok, 4 at d2
    # fails -> cut at the end (2 tokens)
    assert metrics.simulate_rounds(by_d, 4) == (5, 3)
    assert metrics.simulate_rounds([[a] for a in [1, 1, 0, 1, 1, 1, 1, 1]], 4) == (8, 2)  # one column: as before
    assert metrics.tokens_per_pass(torch.tensor(by_d), torch.zeros(5, dtype=torch.long), 4) == pytest.approx(5 / 3)
    assert metrics.expected_tokens_per_round(0.0, 4) == 1.0
    assert metrics.expected_tokens_per_round(1.0, 4) == 5.0
    assert metrics.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_top_vocab_and_coverage_handcrafted():
    """The probe's draft vocabularies are `hispec.vocab.select_vocab` over the training answers' token counts."""
    counts = torch.bincount(torch.tensor([5, 5, 5, 3, 3, 9, 9, 1, 7]), minlength=10)  # 5:3, 3:2, 9:2, 1:1, 7:1

    def top_vocab(size):
        return select_vocab(size, 10, counts)

    assert top_vocab(1).tolist() == [5]
    assert top_vocab(2).tolist() == [3, 5]  # 3 and 9 tie: the lower id wins
    assert top_vocab(4).tolist() == [1, 3, 5, 9]  # 1 and 7 tie
    assert top_vocab(7).tolist() == [0, 1, 2, 3, 5, 7, 9]  # fill with the lowest unseen ids
    vocab = top_vocab(3)  # {3, 5, 9}
    assert coverage(vocab, torch.tensor([5, 3, 0, 9, 8])) == pytest.approx(3 / 5)
    assert math.isnan(coverage(vocab, torch.tensor([], dtype=torch.long)))
    with pytest.raises(ValueError):
        top_vocab(11)
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0], [5.0, 1.0, 0.0, 3.0]])
    mask = torch.tensor([True, False, True, True])
    assert metrics.restricted_argmax(logits, mask).tolist() == [3, 0]


def test_topk_kl_matches_bucketed_kl():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5, 20, generator=g) * 3
    s = torch.randn(5, 20, generator=g) * 3
    ids, logp = teacher_topk(t, 20)
    full = (logp.exp() * (logp - torch.log_softmax(s, -1).gather(-1, ids))).sum(-1)
    assert torch.allclose(topk_kl(s, ids, logp), full, atol=1e-5)  # k = V: exact KL
    assert torch.equal(ids[:, 0], t.argmax(-1))  # the teacher's argmax, which agreement is counted against
    ids, logp = teacher_topk(t, 4)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    pk, qk = p.gather(-1, ids), q.gather(-1, ids)
    P = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    Q = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    ref = (P * (P.log() - Q.log())).sum(-1)
    assert torch.allclose(topk_kl(s, ids, logp), ref, atol=1e-5)
    assert topk_kl(t, ids, logp).abs().max() < 1e-5  # student == teacher


def test_trained_head_beats_zero_shot():
    """Constructed case: the teacher's features are n(h) + B n(h), which a linear head can represent exactly and
    the zero-shot final norm cannot; training must lower the loss and raise held-out agreement above zero-shot."""
    torch.manual_seed(0)
    adapter = DecoderAdapter(tiny_model("llama"))
    H = adapter.hidden_size
    B = torch.randn(H, H) * 0.6
    with torch.no_grad():
        h = torch.randn(1400, H)
        n = adapter.final_norm(h)
        ids, logp = teacher_topk(adapter.project(n + n @ B.T), 16)
    tr, ev = slice(0, 1000), slice(1000, None)

    def evaluate(head):
        return metrics.head_agreement(lambda x: exit_logits(head, adapter, x), h[ev], ids[ev], logp[ev])

    def train(head):
        return fit_head(head, adapter, h[tr], ids[tr], logp[tr], steps=150, schedule=probe.schedule(150, 1e-2),
                        batch_tokens=256, seed=0)

    base = evaluate(probe.make_head("shared", adapter))
    head = probe.make_head("linear", adapter, seed=1)
    losses = train(head)
    trained = evaluate(head)
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert trained["kl"].mean() < base["kl"].mean()
    assert trained["agree1"].float().mean() > base["agree1"].float().mean() + 0.2
    assert trained["agree5"].float().mean() >= trained["agree1"].float().mean()
    # deterministic given the seeds
    assert train(probe.make_head("linear", adapter, seed=1)) == losses


def test_items_split_and_chat_spans(tmp_path):
    f = _jsonl(tmp_path / "mix.jsonl", [
        {"prompt": "hi there", "response": "hello!"},
        {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "b."},
                      {"role": "user", "content": "c?"}, {"role": "assistant", "content": "dd."}]},
        {"question": "what is 2+2?", "answer": "4"},  # a prompt (the reference answer is not the model's own)
        {"turns": ["q1", "q2"], "category": "writing", "question_id": 1},
    ])
    got = items.read_items(f)
    assert [it.kind for it in got] == ["chat", "chat", "prompt", "prompt"]
    assert [it.category for it in got] == ["mix", "mix", "mix", "writing"]
    tok = char_tokenizer()
    ids, spans = items.chat_sequence(tok, got[1].messages, 1024)
    scored = "".join(tok.decode(ids[a:b]) for a, b in spans)
    assert scored.replace(" ", "") == "b.\ndd.\n"  # exactly the two assistant turns (+ their line ends)
    train, held = items.split_items(got * 2, 0.5, seed=3)
    assert {it.key for it in train}.isdisjoint({it.key for it in held}) and len(train) + len(held) == 8
    assert items.split_items(got, 0.5, seed=3) == items.split_items(got, 0.5, seed=3)
    picked = items.select_items(got, 3)
    assert [it.category for it in picked] == ["mix", "writing", "mix"]  # round-robin over categories
    txt = tmp_path / "doc.txt"
    txt.write_text("some plain text to score.\nmore text.\n")
    assert [it.kind for it in items.read_items(txt)] == ["prompt", "prompt"]
    assert [it.kind for it in items.read_items(txt, raw_text=True)] == ["text"]


def test_answer_cache_serves_shorter_requests(tmp_path):
    c = AnswerCache(tmp_path, "abc" * 8, "float32")
    c.put_many([([1, 2, 3], [7, 8, 9, 10], False, 4), ([4], [5, 2], True, 4)])
    c2 = AnswerCache(tmp_path, "abc" * 8, "float32")  # from disk
    assert c2.get([1, 2, 3], 2) == [7, 8]
    assert c2.get([1, 2, 3], 8) is None  # unfinished and shorter than asked: regenerate
    assert c2.get([4], 100) == [5, 2]  # finished (EOS): valid for any length
    assert AnswerCache(tmp_path, "xyz" * 8, "float32").get([4], 1) is None  # another model


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_table_json_plot_and_cache(model_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    cache = tmp_path / "cache"
    argv = ["--model", model_dir, "--data", data, "--eval-fraction", "0.34", "--max-new-tokens", "12",
            "--layers", "2,5", "--head-types", "shared,norm,linear", "--steps", "4", "--batch-tokens", "32",
            "--draft-vocab-sizes", "10,40", "--cache-dir", cache, "--json-out", tmp_path / "out.json",
            "--no-progress", "--seed", "1"]
    plot = tmp_path / "probe.png"
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", plot]
    except ImportError:
        plot = None
    rc, out, err = _run(capsys, argv)
    assert rc == 0, err
    lines = out.strip().splitlines()
    res = json.loads(lines[-1])
    assert "layer" in out and "top1" in out and "by category" in out
    assert res["layers"] == [2, 5] and res["head_types"] == ["shared", "norm", "linear"]
    assert len(res["top1"]) == 2 and all(len(row) == 3 for row in res["top1"])
    for key in ("top1", "top5", "tokens_per_pass"):
        for row in res[key]:
            for v in row:
                assert v is not None
                assert (0.0 <= v <= 1.0) if key != "tokens_per_pass" else (1.0 <= v <= 5.0)
    for row1, row5 in zip(res["top1"], res["top5"]):
        assert all(b >= a for a, b in zip(row1, row5))
    assert res["sizes"]["generated"] == 6 and res["sizes"]["eval_items"] == 2 and res["sizes"]["train_tokens"] > 0
    assert set(res["categories"]) <= {"writing", "math"}
    assert len(res["draft_vocab"]["coverage"]) == 2 and all(0 <= c <= 1 for c in res["draft_vocab"]["coverage"])
    assert res["draft_vocab"]["coverage"][1] >= res["draft_vocab"]["coverage"][0]
    assert res["train_loss_first"][0][0] is None and res["train_loss_first"][0][1] is not None
    assert {"generate", "features", "train", "eval", "total"} <= set(res["seconds"])
    full = json.loads((tmp_path / "out.json").read_text())
    assert full["top1"] == res["top1"] and "L2/linear" in full["loss_curves"]
    if plot is not None:
        assert plot.stat().st_size > 1000
    # a rerun generates nothing (answers cached) and gives the same numbers (deterministic given --seed)
    rc, out2, err2 = _run(capsys, argv)
    assert rc == 0, err2
    res2 = json.loads(out2.strip().splitlines()[-1])
    assert res2["sizes"]["generated"] == 0 and res2["sizes"]["cached"] == 6
    assert res2["top1"] == res["top1"] and res2["top5"] == res["top5"]
    assert res2["train_loss_last"] == res["train_loss_last"]


def test_cli_full_chats_eval_data_and_train_sizes(model_dir, tmp_path, capsys):
    chats = _jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"question {i}?"},
                      {"role": "assistant", "content": f"answer number {i} is {i * 7}."}]} for i in range(8)])
    held = _jsonl(tmp_path / "spec_bench_question.jsonl", [
        {"question_id": i, "category": c, "turns": [f"{c} task {i}", "again"]}
        for i, c in enumerate(["writing", "math", "qa"])])
    rc, out, err = _run(capsys, ["--model", model_dir, "--data", chats, "--eval-data", held, "--max-new-tokens", "6",
                                 "--layers", "1-4:3", "--head-types", "shared,lowrank", "--rank", "4", "--steps", "3",
                                 "--batch-tokens", "16", "--train-sizes", "20,60,100000", "--no-cache",
                                 "--no-progress"])
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["layers"] == [1, 4]
    assert res["sizes"]["generated"] == 3  # only the held-out prompts were answered; chats are teacher-forced
    assert res["sizes"]["train_sequences"] == 8
    assert sorted(res["categories"]) == ["math", "qa", "writing"]
    curve = res["train_sizes"]
    assert curve["head_types"] == ["lowrank"] and curve["sizes"] == [20, 60, 100000]
    assert curve["used_tokens"][:2] == [20, 60] and curve["used_tokens"][2] == res["sizes"]["train_tokens"]
    assert len(curve["top1"]["lowrank"]) == 2 and all(len(r) == 3 for r in curve["top1"]["lowrank"])
    assert "training tokens" in out


@pytest.mark.parametrize("extra, message", [
    (["--layers", "6"], "out of range"),
    (["--layers", "0,2"], "out of range"),
    (["--head-types", "shared,mlp"], "unknown head type"),
    (["--data", "MISSING.jsonl"], "does not exist"),
    (["--data", "EMPTY"], "no usable"),
    (["--data", "SPEC"], "evaluation sets"),
    (["--eval-fraction", "1.5"], "eval-fraction"),
    (["--steps", "-1"], "--steps"),
    (["--head-types", "lowrank", "--rank", "33"], "exceeds the hidden size"),
    (["--draft-vocab-sizes", "98"], "exceeds the model's vocabulary"),
    (["--model", "/nonexistent/model"], "does not exist"),
])
def test_bad_input_exit_2(model_dir, tmp_path, capsys, monkeypatch, extra, message):
    import hispec.model

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded on bad input")

    monkeypatch.setattr(hispec.model, "load_base_model", no_load)
    data = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    spec = _jsonl(tmp_path / "spec_bench_question.jsonl", [{"turns": ["x"], "category": "writing"}])
    subst = {"MISSING.jsonl": tmp_path / "missing.jsonl", "EMPTY": empty, "SPEC": spec}
    extra = [subst.get(x, x) for x in extra]
    argv = ["--model", model_dir, "--data", data, "--no-progress", "--no-cache", *extra]
    try:
        rc, out, err = _run(capsys, argv)
    except SystemExit as e:  # argparse-level errors
        rc, err = e.code, capsys.readouterr().err
    assert rc == 2
    assert message in err


# ---------------------------------------------------------------------------------------------------- --eval-heads
def _perturbed_checkpoint(folder, path, draft, verify, head_type, *, scale, seed, gamma=4, vocab=None, **kw):
    """A hispec checkpoint of the tiny model with heads that differ from the base and from each other; `vocab`
    maps an exit to a reduced output vocabulary."""
    import hispec

    model = hispec.EarlyExitModel.from_base(str(folder), draft, verify, head_type, gamma=gamma, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    for name, ids in (vocab or {}).items():
        model.set_exit_vocab(name, ids)
    return model.save(path)


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        # linear heads, the draft restricted to every third token id (33 of 97)
        "linear": _perturbed_checkpoint(model_dir, root / "linear", 2, 4, "linear", scale=0.03, seed=1, gamma=3,
                                        vocab={"draft": list(range(0, 97, 3))}),
        # layer heads (stateful: attention over the exit's previous positions); the verifier restricted to 3 tokens
        # (the final layer's three most frequent argmaxes on these prompts)
        "layer": _perturbed_checkpoint(model_dir, root / "layer", 2, 3, "layer", scale=0.01, seed=2,
                                       vocab={"verify": [19, 44, 51]}),
        # context heads (read the final layer's states up to the frontier t - d); the draft on every other token id
        "context": _perturbed_checkpoint(model_dir, root / "context", 2, 3, "context", scale=0.05, seed=3, gamma=3,
                                         vocab={"draft": list(range(0, 97, 2))},
                                         context={"window": 4, "heads": 2, "head_dim": 8}),
    }


@torch.no_grad()
def _independent_eval(ckpt, prompts, max_new_tokens, gamma):
    """The figures of --eval-heads recomputed one prompt at a time: the base model's greedy answer (HF generate),
    then teacher-forced argmaxes of the final layer and of each head over prompt + answer (heads projected on the
    full vocabulary, restricted to the head's ids by hand)."""
    import hispec

    model = hispec.load(ckpt)
    tok, ad, V = model.tokenizer, model.adapter, model.adapter.vocab_size
    eos = eos_ids(tok, model.base.generation_config)
    N = ad.num_layers
    per = []  # (category, final, {exit: (argmax, top5 hit, unrestricted argmax, [argmax at distance d = 1..gamma])})
    for rec in prompts:
        ids = chat_ids(tok, [{"role": "user", "content": rec["prompt"]}], True)
        x = torch.tensor([ids])
        gen = model.base.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos)
        new = gen[0, len(ids):].tolist()
        cut = next((j for j, t in enumerate(new) if t in eos), None)
        new = new if cut is None else new[: cut + 1]
        seq = torch.tensor([ids + new])
        pos = torch.arange(len(ids) - 1, seq.shape[1] - 1)  # position p predicts token p + 1 (the answer's)
        _, saved = ad.forward_all(seq, torch.arange(seq.shape[1])[None], ad.new_cache(1),
                                  exits=(model.draft_layer, model.verify_layer, N))
        final = ad.final_logits(saved[N][0, pos]).argmax(-1)
        heads = {}
        for name, layer in (("draft", model.draft_layer), ("verify", model.verify_layer)):
            head = model.heads[name]
            out = []
            for d in range(1, gamma + 1) if head.needs_context else [1]:
                if head.needs_context:  # the final layer's states up to t - d, as after a full pass at t - d
                    feats = head(saved[layer], context=head.sequence_context(saved, d))[0, pos]
                elif head.stateful:
                    feats = head(saved[layer], head.run_layer_fresh(ad))[0, pos]
                else:
                    feats = head(saved[layer][0, pos])
                logits = ad.project(feats).float()
                free = logits.argmax(-1)
                if head.vocab is not None:
                    allowed = torch.zeros(V, dtype=torch.bool)
                    allowed[head.vocab] = True
                    logits = logits.masked_fill(~allowed, float("-inf"))
                k = min(5, head.vocab_size or V)
                out.append((logits.argmax(-1), (logits.topk(k, -1).indices == final[:, None]).any(-1), free))
            heads[name] = (*out[0], [o[0] for o in out])
        per.append((rec["category"], final, heads))

    def figures(rows):
        out = {}
        for name in ("draft", "verify"):
            agree = [h[name][0] == f for _, f, h in rows]
            tokens = passes = 0
            for _, f, h in rows:  # the k-th draft of a round is at frontier distance k + 1
                by_d = torch.stack([a == f for a in h[name][3]], 1)
                t, p = metrics.simulate_rounds(by_d.tolist(), gamma)
                tokens, passes = tokens + t, passes + p
            out[name] = {"top1": float(torch.cat(agree).float().mean()),
                         "top5": float(torch.cat([h[name][1] for _, _, h in rows]).float().mean()),
                         "tokens_per_pass": tokens / passes,
                         "free_top1": float(torch.cat([h[name][2] == f for _, f, h in rows]).float().mean()),
                         "by_distance": [float(torch.cat([h[name][3][d] == f for _, f, h in rows]).float().mean())
                                         for d in range(len(rows[0][2][name][3]))]}
        d = torch.cat([h["draft"][0] for _, _, h in rows])
        v = torch.cat([h["verify"][0] for _, _, h in rows])
        t = torch.cat([f for _, f, _ in rows])
        out["verify_agrees_draft"] = float((v == d).float().mean())
        out["final_agrees_given_verify_agrees"] = float((t == d)[v == d].float().mean()) if (v == d).any() else None
        out["verify_agrees_given_final_agrees"] = float((v == d)[t == d].float().mean()) if (t == d).any() else None
        out["tokens"] = int(t.numel())
        out["final"] = t
        return out

    cats = sorted({c for c, _, _ in per})
    return figures(per), {c: figures([r for r in per if r[0] == c]) for c in cats}, model


def _approx(x):
    return pytest.approx(x, abs=2e-5)


@pytest.mark.parametrize("kind", ["linear", "layer", "context"])
def test_eval_heads_matches_an_independent_teacher_forced_computation(model_dir, checkpoints, tmp_path, capsys, kind):
    ckpt = checkpoints[kind]
    data = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    gamma = 2 if kind == "layer" else 3  # the checkpoint's own gamma (3); layer: --gamma 2
    argv = ["--model", ckpt, "--eval-heads", "--eval-data", data, "--max-new-tokens", "10", "--gen-batch-size", "1",
            "--feature-batch-tokens", "1", "--cache-dir", tmp_path / "cache", "--json-out", tmp_path / "out.json",
            "--no-progress"] + (["--gamma", "2"] if kind == "layer" else [])
    rc, out, err = _run(capsys, argv)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    exp, exp_cats, model = _independent_eval(ckpt, PROMPTS, 10, gamma)

    assert res["mode"] == "eval-heads" and res["exits"] == ["draft", "verify"]
    assert res["layers"] == [model.draft_layer, model.verify_layer] == ([2, 4] if kind == "linear" else [2, 3])
    assert res["head_types"] == [kind, kind] and res["gamma"] == gamma
    assert res["config"]["gamma_from"] == ("--gamma" if kind == "layer" else "checkpoint")
    if kind == "context":  # top-1 by frontier distance 1..gamma; tokens per pass drafts the k-th token at k + 1
        for name in ("draft", "verify"):
            assert list(res["top1_by_distance"][name].values()) == [_approx(v) for v in exp[name]["by_distance"]]
            assert res["top1_by_distance"][name]["1"] == _approx(exp[name]["top1"])
        assert len({round(v, 6) for v in exp["draft"]["by_distance"]}) > 1  # the distance matters
    else:
        assert res["top1_by_distance"] == {}
    assert res["sizes"]["eval_items"] == 6 and res["sizes"]["eval_tokens"] == exp["tokens"]
    assert res["sizes"]["generated"] == 6
    for i, name in enumerate(("draft", "verify")):
        assert res["top1"][i] == _approx(exp[name]["top1"]), name
        assert res["top5"][i] == _approx(exp[name]["top5"]), name
        assert res["tokens_per_pass"][i] == _approx(exp[name]["tokens_per_pass"]), name
        assert res["iid_tokens_per_pass"][i] == _approx(metrics.expected_tokens_per_round(res["top1"][i], gamma))
    for key in ("verify_agrees_draft", "final_agrees_given_verify_agrees", "verify_agrees_given_final_agrees"):
        assert res[key] == _approx(exp[key]), key
    # the figures have teeth: neither head always or never agrees, and neither does the verifier with the draft
    assert all(0 < v < 1 for v in res["top1"]) and all(v > 1 for v in res["tokens_per_pass"])
    assert 0 < res["verify_agrees_draft"] < 1
    assert sorted(res["categories"]) == sorted(exp_cats) == ["math", "writing"]
    for c, e in exp_cats.items():
        got = res["categories"][c]
        assert got["tokens"] == e["tokens"]
        assert got["top1"] == [_approx(e["draft"]["top1"]), _approx(e["verify"]["top1"])]
        assert got["top5"] == [_approx(e["draft"]["top5"]), _approx(e["verify"]["top5"])]
        assert got["tokens_per_pass"] == [_approx(e["draft"]["tokens_per_pass"]),
                                          _approx(e["verify"]["tokens_per_pass"])]
        assert got["verify_agrees_draft"] == _approx(e["verify_agrees_draft"])

    # the reduced vocabulary is honoured: sizes reported, agreement computed inside the set (which differs here
    # from the unrestricted head's), top-5 capped at the set's size
    reduced = 1 if kind == "layer" else 0
    vocab = model.heads[res["exits"][reduced]].vocab
    assert res["vocab_sizes"] == {"linear": [33, 97], "layer": [97, 3], "context": [49, 97]}[kind]
    assert res["reduced_vocab"] == [reduced == 0, reduced == 1]
    cover = float(torch.isin(exp["final"], vocab).float().mean())
    assert res["vocab_coverage"][reduced] == _approx(cover) and res["vocab_coverage"][1 - reduced] == 1.0
    e = exp[res["exits"][reduced]]
    assert e["top1"] != _approx(e["free_top1"])
    assert res["top1"][reduced] <= res["top5"][reduced] <= res["vocab_coverage"][reduced] + 1e-9
    if kind == "layer":
        assert res["top5"][1] == _approx(cover)  # 3 tokens: "top-5" is the whole set

    # the table, --json-out, and the model info
    assert "draft" in out and "verify" in out and "by category" in out and "tok/pass" in out
    assert "reduced vocabulary" in out and "verifier exit agrees with the draft" in out
    assert json.loads((tmp_path / "out.json").read_text())["top1"] == res["top1"]
    assert res["model"]["head_type"] == kind and res["model"]["checkpoint"] is True

    # default batching (right-padded batches, chunked projections) gives the same figures up to float noise
    i = argv.index("--feature-batch-tokens")
    rc, out2, err2 = _run(capsys, argv[:i] + argv[i + 2 :])
    assert rc == 0, err2
    res2 = json.loads(out2.strip().splitlines()[-1])
    assert res2["sizes"]["generated"] == 0 and res2["sizes"]["cached"] == 6  # answers came from the cache
    assert res2["top1"] == pytest.approx(res["top1"], abs=0.02)
    assert res2["verify_agrees_draft"] == pytest.approx(res["verify_agrees_draft"], abs=0.02)


def test_checkpoint_base_shares_cached_answers_with_the_plain_base(model_dir, checkpoints):
    import hispec

    plain = model_fingerprint(hispec.load_base_model(str(model_dir)))
    assert model_fingerprint(hispec.load(checkpoints["linear"]).base) == plain
    assert model_fingerprint(hispec.load_base_model(str(checkpoints["layer"]))) == plain


@pytest.mark.parametrize("extra, message", [
    (["--model", "PLAIN"], "not a hispec checkpoint"),
    (["--model", "NOHEADS"], "has no hispec_heads.safetensors"),
    (["--model", "FILE"], "not a hispec checkpoint folder"),
    (["--model", "/nonexistent/ckpt"], "does not exist"),
    (["--no-eval-data"], "needs held-out data"),
    (["--layers", "2"], "--layers does not apply"),
    (["--head-types", "linear"], "--head-types does not apply"),
    (["--steps", "10"], "--steps does not apply"),
    (["--layers", "2", "--steps", "0", "--data", "DATA"], "--data, --layers, --steps do not apply"),
    (["--eval-data", "MISSING.jsonl"], "does not exist"),
    (["--eval-data", "EMPTY"], "no usable"),
    (["--gamma", "0"], "--gamma must be >= 1"),
])
def test_eval_heads_bad_input_exit_2(model_dir, checkpoints, tmp_path, capsys, monkeypatch, extra, message):
    import shutil

    import hispec.model

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded on bad input")

    monkeypatch.setattr(hispec.model, "load_base_model", no_load)
    monkeypatch.setattr(hispec.model, "load", no_load)
    data = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    noheads = tmp_path / "noheads"
    shutil.copytree(checkpoints["linear"], noheads)
    (noheads / "hispec_heads.safetensors").unlink()
    subst = {"PLAIN": model_dir, "NOHEADS": noheads, "FILE": data, "DATA": data, "EMPTY": empty,
             "MISSING.jsonl": tmp_path / "missing.jsonl"}
    eval_data = [] if "--no-eval-data" in extra else ["--eval-data", data]
    extra = [subst.get(x, x) for x in extra if x != "--no-eval-data"]
    argv = ["--model", checkpoints["linear"], "--eval-heads", *eval_data, "--no-progress", "--no-cache", *extra]
    rc, out, err = _run(capsys, argv)
    assert rc == 2
    assert message in err
    assert out == ""


def _approx_tree(expected):
    """Nested pytest.approx: floats to 1e-4 relative (the JSON rounds them to 5 digits), the rest exactly."""
    if isinstance(expected, dict):
        return {k: _approx_tree(v) for k, v in expected.items()}
    if isinstance(expected, list):
        return [_approx_tree(v) for v in expected]
    if isinstance(expected, float):
        return pytest.approx(expected, rel=1e-4, abs=2e-5)
    return expected


def test_cli_figures_unchanged_since_before_the_distill_core(model_dir, tmp_path, capsys):
    """tests/fixtures/probe-53f8a82.json holds the probe's result JSON (all but timings and the model's path) as
    computed by the code of commit 53f8a82, before the probe moved onto hispec.distill, for these inputs: a plain
    run, then one with draft vocabularies reading the cached answers."""
    from pathlib import Path

    expected = json.loads((Path(__file__).parent / "fixtures" / "probe-53f8a82.json").read_text())
    data = _jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    for name, extra in (("default", []), ("vocab", ["--draft-vocab-sizes", "10,40"])):
        argv = ["--model", model_dir, "--data", data, "--eval-fraction", "0.34", "--max-new-tokens", "12",
                "--layers", "2,5", "--head-types", "shared,norm,linear", "--steps", "4", "--batch-tokens", "32",
                "--cache-dir", tmp_path / "cache", "--json-out", tmp_path / f"{name}.json", "--no-progress",
                "--seed", "1", *extra]
        rc, _, err = _run(capsys, argv)
        assert rc == 0, err
        res = json.loads((tmp_path / f"{name}.json").read_text())
        res.pop("seconds", None)
        res["model"].pop("path", None)
        assert res == _approx_tree(expected[name]), name
