"""The EAGLE-3 drafter (hispec.drafters.eagle3) and its training loss (hispec.distill.drafter), on tiny random targets."""

from __future__ import annotations

import pytest
import torch

from hispec.distill.drafter import (
    GATES, DrafterCollator, DrafterForTraining, draft_vocab_from_cache, summarize, ttt_loss,
)
from hispec.drafters.eagle3 import (
    Eagle3Config, Eagle3Drafter, default_aux_layers, is_drafter_run, load_drafter, save_drafter,
)
from hispec.model import base_identity
from tiny import FAMILIES, tiny_model


def _drafter(target, draft_vocab_size=None, seed=0, aux_layers=None):
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target.config, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size)
    d = Eagle3Drafter(cfg).eval()
    if draft_vocab_size:
        d.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[
            :draft_vocab_size])
    return d


def _aux_states(target, ids, layers):
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], -1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_incremental_draft_steps_equal_the_training_time_test(family):
    """Decoding (step 0 over the context, then one position per step on the stored keys) gives the logits that
    training-time test computes for the same entry: what the drafter learns is what it drafts with."""
    target = tiny_model(family)
    if family == "opt":  # word_embed_proj_dim 16 != hidden 32
        with pytest.raises(ValueError, match="embeds tokens in 16 dimensions, not its hidden size 32"):
            _drafter(target)
        return
    d = _drafter(target, draft_vocab_size=40)
    B, T, j = 2, 9, 5
    ids = torch.randint(0, target.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    aux = _aux_states(target, ids[:, :T], d.config.aux_layers)
    emb = target.get_input_embeddings()
    with torch.no_grad():
        ttt = d.ttt_logits(aux, emb, ids[:, 1:], steps=3)
        pos = torch.arange(1, T + 1).expand(B, T)
        r = d.step(emb(ids[:, 1:j + 2]), d.fuse(aux[:, :j + 1]), pos[:, :j + 1])
        torch.testing.assert_close(r.logits, ttt[0][:, :j + 1], rtol=1e-5, atol=1e-5)
        past, h = (r.key, r.value), r.hidden[:, j:j + 1]
        for s in (1, 2):
            mask = torch.ones(B, 1, past[0].shape[2] + 1, dtype=torch.bool)
            r = d.step(emb(ids[:, j + 1 + s:j + 2 + s]), h, pos[:, j:j + 1] + s, past, mask)
            torch.testing.assert_close(r.logits[:, 0], ttt[s][:, j], rtol=1e-5, atol=1e-5)
            past = (torch.cat([past[0], r.key], 2), torch.cat([past[1], r.value], 2))
            h = r.hidden


def test_right_padding_does_not_change_real_positions():
    target = tiny_model("llama")
    d = _drafter(target)
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    aux = _aux_states(target, ids, d.config.aux_layers)
    emb = target.get_input_embeddings()
    with torch.no_grad():
        alone = d.ttt_logits(aux[:, :5], emb, ids[:, 1:6], steps=2)
        valid = torch.tensor([[True] * 5 + [False] * 3])
        padded = d.ttt_logits(aux, emb, torch.cat([ids[:, 1:6], torch.zeros(1, 3, dtype=torch.long)], 1), 2, valid)
    # step s reads teacher-forced tokens up to entry 5 - s; entries whose tokens all lie inside agree
    torch.testing.assert_close(padded[0][:, :5], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[1][:, :4], alone[1][:, :4], rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_maps_draft_ids_back_to_target_ids():
    d = _drafter(tiny_model("llama"), draft_vocab_size=10)
    chosen = torch.tensor([3, 96, 0, 50, 7, 8, 9, 11, 12, 40])
    d.set_draft_vocab(chosen)
    assert torch.equal(d.draft_token_ids(), chosen.sort().values)
    assert torch.equal(d.to_target(torch.arange(10)), chosen.sort().values)
    assert int(d.t2d.sum()) == 10 and bool(d.t2d[96]) and not bool(d.t2d[1])
    with pytest.raises(ValueError, match="needs 10 distinct ids"):
        d.set_draft_vocab(torch.tensor([1, 1, 2]))
    full = _drafter(tiny_model("llama"))
    assert full.d2t is None and full.draft_token_ids() is None
    assert torch.equal(full.to_target(torch.tensor([5])), torch.tensor([5]))


def test_init_from_target_copies_the_draft_rows_of_the_lm_head():
    target = tiny_model("llama")
    d = _drafter(target, draft_vocab_size=12)
    d.init_from_target(target.lm_head.weight, target.model.norm.weight)
    assert torch.equal(d.lm_head.weight, target.lm_head.weight[d.draft_token_ids()])
    assert torch.equal(d.norm.weight, target.model.norm.weight)


def test_a_widened_draft_vocabulary_keeps_the_trained_rows_and_scores_new_tokens_as_the_target():
    target = tiny_model("llama")
    d = _drafter(target, draft_vocab_size=40, seed=3)
    d.init_from_target(target.lm_head.weight, target.model.norm.weight)
    with torch.no_grad():  # as if trained: its own rows and norm
        d.lm_head.weight.add_(0.1 * torch.randn_like(d.lm_head.weight))
        d.norm.weight.mul_(torch.rand_like(d.norm.weight) + 0.5)
    ranking = list(range(96, -1, -1))
    w = d.widened(60, ranking, target.lm_head.weight, target.model.norm.weight)
    old, new = d.draft_token_ids().tolist(), w.draft_token_ids().tolist()
    added = [t for t in ranking if t not in old][:20]
    assert new == sorted(old + added) and w.config.draft_vocab_size == 60
    h = torch.randn(5, d.config.hidden_size)
    with torch.no_grad():
        before, after = d.lm_head(d.norm(h)), w.lm_head(w.norm(h))
        by_target = target.lm_head(target.model.norm(h))
    pos = {t: i for i, t in enumerate(new)}
    assert torch.allclose(after[:, [pos[t] for t in old]], before, atol=1e-5)  # the trained rows, with their tokens
    assert torch.allclose(after[:, [pos[t] for t in added]], by_target[:, added], atol=1e-5)
    for name, p in d.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(p, w.state_dict()[name]), name
    for size in (40, 97):
        with pytest.raises(ValueError, match="widens from 40 to more tokens"):
            d.widened(size, ranking, target.lm_head.weight)


def test_bad_shapes_are_refused_with_what_to_choose():
    cfg = tiny_model("llama").config
    with pytest.raises(ValueError, match="out of range for a 6-layer target"):
        Eagle3Config.for_target(cfg, aux_layers=[1, 7])
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Config.for_target(cfg, aux_layers=[2, 2])
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Config.for_target(cfg, aux_layers=[])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.for_target(cfg, draft_vocab_size=1000)
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(6) == [1, 3, 5]


def test_save_and_load_keep_the_drafter_and_refuse_newer_formats(tmp_path):
    target = tiny_model("qwen2")
    d = _drafter(target, draft_vocab_size=30)
    save_drafter(d, tmp_path / "run", base=base_identity(target), extra={"ttt_steps": 3})
    assert is_drafter_run(tmp_path / "run") and not is_drafter_run(tmp_path)
    back, meta = load_drafter(tmp_path / "run")
    assert meta["ttt_steps"] == 3 and back.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    import json

    p = tmp_path / "run" / "hispec_drafter.json"
    data = json.loads(p.read_text())
    data["config"]["version"] = 99
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="newer hispec"):
        load_drafter(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="holds no EAGLE-3 drafter"):
        load_drafter(tmp_path)


def test_int8_storage_is_a_quarter_of_fp32_and_drafts_what_the_float_drafter_drafts(tmp_path):
    """`storage="int8"` (and tools/pack_artifact.py on a drafter run): per-row int8 weights, loaded back as floats
    within half a quantisation step of the originals, the same greedy step-0 drafts on a batch of inputs; the json
    says version 2 so an older reader is told to upgrade; the float format stays version 1."""
    import json

    from conftest import load_tool

    target = tiny_model("qwen2")
    d = _drafter(target, draft_vocab_size=30)
    with torch.no_grad():
        d.lm_head.weight.mul_(30)  # (decisive logits: int8 noise must not flip argmaxes)
    save_drafter(d, tmp_path / "f", base=base_identity(target), extra={"ttt_steps": 3})
    assert load_tool("pack_artifact").main([str(tmp_path / "f"), str(tmp_path / "q"), "--drafter-storage",
                                            "int8"]) == 0
    assert load_tool("pack_artifact").main([str(tmp_path / "f"), str(tmp_path / "g"), "--gamma", "2"]) == 2
    assert not (tmp_path / "g").exists()  # (exit-head options refused for a drafter run, nothing written)
    assert load_tool("pack_artifact").main([str(tmp_path / "f"), str(tmp_path / "h"), "--drafter-dtype", "bf16"]) == 0
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "h" / "hispec_drafter.safetensors"))  # bf16 on disk: half the file
    assert stored and all(v.dtype == torch.bfloat16 for v in stored.values() if v.is_floating_point())
    half, _ = load_drafter(tmp_path / "h")  # loaded back: the weights rounded to bf16
    assert all(torch.equal(half.state_dict()[k], v.to(torch.bfloat16).float()) for k, v in d.state_dict().items()
               if v.is_floating_point() and not k.startswith("rotary_emb."))
    assert json.loads((tmp_path / "h" / "hispec_drafter.json").read_text())["ttt_steps"] == 3
    meta = json.loads((tmp_path / "q" / "hispec_drafter.json").read_text())
    assert meta["version"] == 2 and meta["storage"] == "int8" and meta["ttt_steps"] == 3
    assert json.loads((tmp_path / "f" / "hispec_drafter.json").read_text())["version"] == 1
    size = lambda f: (tmp_path / f / "hispec_drafter.safetensors").stat().st_size  # noqa: E731
    assert size("q") < 0.35 * size("f")  # (a quarter of the weights, plus scales, buffers and headers)
    back, _ = load_drafter(tmp_path / "q")
    for k, v in d.state_dict().items():
        w = back.state_dict()[k]
        if v.dim() == 2 and v.is_floating_point():
            step = v.abs().amax(1, keepdim=True) / 127
            assert ((w - v).abs() <= step / 2 + 1e-7).all(), k
        else:
            assert torch.equal(w, v), k
    H = d.config.hidden_size
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 9, len(d.config.aux_layers) * H, generator=g)
    ids = torch.randint(0, target.config.vocab_size, (2, 9), generator=g)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        a = d.ttt_logits(aux, embed, ids, 2)
        b = back.ttt_logits(aux, embed, ids, 2)
    assert all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))
    meta["version"] = 3
    (tmp_path / "q" / "hispec_drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="upgrade hispec"):
        load_drafter(tmp_path / "q")
    with pytest.raises(ValueError, match="storage must be one of"):
        save_drafter(d, tmp_path / "x", base={}, storage="int4")


def _cache_items(target, lengths, k=8, aux_layers=(1, 3, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for n in lengths:
        ids = torch.randint(0, target.config.vocab_size, (n,), generator=g)
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        v, i = out.logits[0].log_softmax(-1).topk(k)
        item = {"input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.bool), "teacher_topk_ids": i,
                "teacher_topk_logprobs": v}
        for layer in aux_layers:
            item[f"hidden.{layer}"] = out.hidden_states[layer][0]
        items.append(item)
    return items


def test_packing_a_new_run_over_an_artifact_keeps_the_artifacts_reports(tmp_path, capsys):
    """tools/pack_artifact.py RUN OUT where OUT is an artifact already: the new drafter replaces the old one, the run's
    files replace theirs by name, and OUT's own reports (benchmark tables the README cites) stay, named on stderr."""
    from conftest import load_tool

    target = tiny_model("llama")
    for name, seed in (("old", 0), ("new", 1)):
        torch.manual_seed(seed)
        save_drafter(_drafter(target, draft_vocab_size=30), tmp_path / name, base=base_identity(target))
    (tmp_path / "old" / "bench_old.txt").write_text("old table")
    (tmp_path / "old" / "metrics.json").write_text('{"old": 1}')
    (tmp_path / "new" / "metrics.json").write_text('{"new": 1}')
    pack = load_tool("pack_artifact")
    assert pack.main([str(tmp_path / "old"), str(tmp_path / "art")]) == 0
    assert pack.main([str(tmp_path / "new"), str(tmp_path / "art")]) == 0
    err = capsys.readouterr().err
    assert "kept 1 file(s)" in err and "bench_old.txt" in err
    art = tmp_path / "art"
    assert (art / "bench_old.txt").read_text() == "old table"
    assert (art / "metrics.json").read_text() == '{"new": 1}'
    new, _ = load_drafter(tmp_path / "new")
    packed, _ = load_drafter(art)
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in new.state_dict().items())


def test_collator_aligns_entry_j_with_token_j_plus_1_and_teacher_j_plus_1_plus_s():
    target = tiny_model("llama")
    items = _cache_items(target, [6, 4])
    items[0]["loss_mask"][3] = False
    b = DrafterCollator([1, 3, 5], steps=2)(items)
    assert b["aux"].shape == (2, 5, 3 * 32) and b["topk_ids"].shape == (2, 5, 2, 8)
    assert torch.equal(b["input_ids"][0], items[0]["input_ids"][1:])
    assert torch.equal(b["aux"][0, :, 32:64], items[0]["hidden.3"][:5])
    assert torch.equal(b["topk_ids"][0, 2, 1], items[0]["teacher_topk_ids"][4])  # j=2, s=1 -> position 4
    assert b["loss_mask"][0, :, 0].tolist() == [True, True, False, True, True]  # position 3 is outside the loss
    assert b["loss_mask"][0, :, 1].tolist() == [True, False, True, True, False]  # the last entry has no step 1
    assert b["valid"][1].tolist() == [True, True, True, False, False]
    assert not b["loss_mask"][1, 3:].any()


def test_ttt_training_learns_the_teacher_and_chains_agreement():
    target = tiny_model("llama")
    d = _drafter(target, draft_vocab_size=60, seed=3)
    d.init_from_target(target.lm_head.weight, target.model.norm.weight)
    batch = DrafterCollator(d.config.aux_layers, steps=3)(_cache_items(target, [20, 15, 18]))
    model = DrafterForTraining(d, target.get_input_embeddings()).train()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = ttt_loss(model, batch, steps=3, decay=0.8)
    for _ in range(150):
        r = ttt_loss(model, batch, steps=3, decay=0.8)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    last = ttt_loss(model, batch, steps=3, decay=0.8)
    assert last.loss.item() < 0.8 * first.loss.item()
    assert last.top1[0] > first.top1[0] + 0.2
    assert all(last.chain[s] <= last.chain[s - 1] + 1e-9 for s in (1, 2))  # a chain only shortens
    m = summarize(last.sums, 3)
    assert m["accepted_per_round"] == pytest.approx(sum(m["chain"]), abs=1e-3)
    assert all(p.grad is None for p in target.parameters())  # the target stays frozen


def test_ttt_loss_on_the_trained_positions_equals_the_loss_over_the_whole_batch():
    """The lm_head runs only where some step trains (answers, not prompts or padding); the loss, its gradient and
    every statistic equal those computed from the whole batch's logits by hand."""
    target = tiny_model("llama")
    d = _drafter(target, draft_vocab_size=60, seed=5)
    items = _cache_items(target, [14, 9, 11])
    items[0]["loss_mask"][:6] = False  # a prompt
    items[2]["loss_mask"][:3] = False
    steps, decay = 3, 0.7
    batch = DrafterCollator(d.config.aux_layers, steps)(items)
    model = DrafterForTraining(d, target.get_input_embeddings())
    got = ttt_loss(model, batch, steps, decay)
    got.loss.backward()
    grads = [p.grad.clone() for p in d.parameters()]
    d.zero_grad()
    full = d.ttt_logits(batch["aux"], target.get_input_embeddings(), batch["input_ids"], steps, batch["valid"])
    index = torch.full((d.config.vocab_size,), -1, dtype=torch.long)
    index[d.draft_token_ids()] = torch.arange(60)
    loss, chain = 0.0, torch.ones_like(batch["valid"])
    gate, proposed = 0.3, torch.ones_like(batch["valid"])  # a confidence gate, by hand: GATES[3]
    for s, lg in enumerate(full):
        assert lg.shape[:2] == batch["valid"].shape  # (no selection: every entry)
        m, tk, lp = batch["loss_mask"][..., s], batch["topk_ids"][..., s, :], batch["topk_logprobs"][..., s, :]
        p = lp.exp() * (index[tk] >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        ce = -(p * lg.float().log_softmax(-1).gather(-1, index[tk].clamp_min(0))).sum(-1)
        loss = loss + decay ** s * (ce * m).sum() / m.sum()
        ok = d.to_target(lg.argmax(-1)) == tk[..., 0]
        chain = chain & ok
        assert got.sums[f"ce{s}"] == pytest.approx(float((ce * m).sum().detach()), rel=1e-5)
        assert got.sums[f"top1_{s}"] == float((ok & m).sum())
        assert got.sums[f"in_vocab{s}"] == float(((index[tk[..., 0]] >= 0) & m).sum()) >= got.sums[f"top1_{s}"]
        assert got.sums[f"chain{s}"] == float((chain & batch["loss_mask"][..., 0] & m).sum())
        proposed = proposed & (lg.float().softmax(-1).max(-1).values >= gate)
        assert got.sums[f"gate3_drafted{s}"] == float((proposed & batch["loss_mask"][..., 0] & m).sum())
        assert got.sums[f"gate3_accepted{s}"] == float((proposed & chain & batch["loss_mask"][..., 0] & m).sum())
    assert got.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    m0 = batch["loss_mask"][..., 0]
    in_vocab = ((index[batch["topk_ids"][..., 0, 0]] >= 0) & m0).sum() / m0.sum()
    assert summarize(got.sums, steps)["in_vocab"] == pytest.approx(float(in_vocab), abs=1e-4)
    assert 0 < float(in_vocab) < 1  # a draft vocabulary of 60 of 97 tokens leaves some targets out
    gated = summarize(got.sums, steps)["gated"]
    assert [g["gate"] for g in gated] == list(GATES) and GATES[3] == gate
    assert gated[0]["drafted"] == pytest.approx(steps) and gated[0]["accepted"] == pytest.approx(
        summarize(got.sums, steps)["accepted_per_round"], abs=1e-3)
    for a, b in zip(gated, gated[1:]):  # a higher gate proposes (and so gets accepted) no more
        assert b["drafted"] <= a["drafted"] + 1e-9 and b["accepted"] <= a["accepted"] + 1e-9
        assert b["accepted"] <= b["drafted"] + 1e-9
    loss.backward()
    for g, p in zip(grads, d.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-6)


def test_draft_vocabulary_counts_the_teachers_top1(tmp_path):
    target = tiny_model("llama")
    items = _cache_items(target, [30, 30])
    counts = torch.bincount(torch.cat([it["teacher_topk_ids"][:, 0] for it in items]), minlength=97)
    vocab = draft_vocab_from_cache(items, 5, 97)
    top = sorted(range(97), key=lambda t: (-int(counts[t]), t))[:5]
    assert vocab.tolist() == sorted(top)
