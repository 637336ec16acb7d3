"""`context` exit heads: they read the decoder's deepest states of earlier positions (final layer where the full
model verified, else an intermediate exit's, else their own). Decoding stays lossless, and what the decoder hands
the head equals a recomputation over the whole sequence at every draft."""

from __future__ import annotations

import pytest
import torch
from test_decoding import STRATEGIES, _chi2_pvalue, _draw, _exact_joint, _hf_greedy, _ragged, _wrap
from tiny import FAMILIES, assert_same_decoding_after_a_round_trip, five_token_llama, tiny_model

import hispec
from hispec import decoding
from hispec.drafters.heads import ContextInputs
from hispec.layers import positions_from_mask
from hispec.model import CheckpointError


def _perturb(model, seed=0, scale=0.5):
    """Heads that differ from `norm` and from each other, with a real dependence on the context."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in model.heads.values():
            for lin in (head.ctx_o, head.ctx_down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * scale * lin.weight.shape[1] ** -0.5)
            head.ctx_kind.copy_(torch.randn(head.ctx_kind.shape, generator=g))
            head.ctx_rel.copy_(torch.randn(head.ctx_rel.shape, generator=g))
            if head.context["frontier"]:  # the direct path from the frontier's state and its distance
                w = head.ctx_front.weight
                w.copy_(torch.randn(w.shape, generator=g) * scale * w.shape[1] ** -0.5)
                head.ctx_dist.copy_(torch.randn(head.ctx_dist.shape, generator=g) * scale)
    return model


def _context_model(family="llama", seed=0, mid=False, window=4, frontier=1, **kw):
    model = _wrap(tiny_model(family), head_type="context",
                  context={"window": window, "heads": 2, "head_dim": 8, "frontier": frontier}, context_mid=mid, **kw)
    return _perturb(model, seed)


def test_a_context_head_starts_as_a_norm_head_and_needs_its_context():
    model = _wrap(tiny_model("llama"), head_type="context")
    head = model.heads["draft"]
    assert head.needs_context and model.context_heads and not model.stateful_heads
    assert head.context_layers == [model.draft_layer, model.num_layers]
    assert model.heads["verify"].context_layers == [model.verify_layer, model.num_layers]
    h = torch.randn(1, 3, model.adapter.hidden_size)
    states = [torch.randn(1, 3, model.adapter.hidden_size) for _ in head.context_layers]
    ctx = ContextInputs(states=states, avail=[torch.tensor([3]), torch.tensor([1])],
                        query_pos=torch.arange(3)[None], layers=head.context_layers)
    with torch.no_grad():
        assert torch.allclose(head(h, context=ctx), head.norm(h), atol=1e-6)  # zero-initialised outputs
    with pytest.raises(ValueError, match="context=ContextInputs"):
        model.exit_logits("draft", h)
    with pytest.raises(ValueError, match="reads"):
        head(h, context=ContextInputs(states=states, avail=ctx.avail, query_pos=ctx.query_pos, layers=[1, 2]))


def test_projecting_whole_buffers_first_equals_gathering_windows_first():
    """Training (whole sequences, T * W rows > buffer) projects each position once and gathers projected rows;
    decoding (a few queries over a long buffer) gathers the window first. Both give the same features and grads."""
    model = _context_model("llama", mid=True, window=4)
    head = model.heads["draft"]
    H, T = model.adapter.hidden_size, 7
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, T, H, generator=g)
    states = {L: torch.randn(2, T, H, generator=g) for L in head.context_layers}
    ctx = head.sequence_context(states, torch.tensor([[1, 2, 1, 3, 1, 2, 2]] * 2),
                                torch.tensor([[1, 1, 1, 2, 1, 1, 2]] * 2), start=torch.tensor([0, 2]))
    long = [torch.cat([s, torch.randn(2, 64, H, generator=g)], 1) for s in ctx.states]  # never-read tail
    assert ctx.states[0].shape[1] < T * 4 < long[0].shape[1]
    outs = []
    for st in (ctx.states, long):
        head.zero_grad()
        c = ContextInputs(states=st, avail=ctx.avail, query_pos=ctx.query_pos, layers=ctx.layers, start=ctx.start)
        out = head(h, context=c)
        out.square().sum().backward()
        outs.append((out.detach(), head.ctx_k.weight.grad.clone(), head.ctx_norms[1].weight.grad.clone(),
                     head.ctx_front.weight.grad.clone(), head.ctx_dist.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_context_heads_equals_hf_generate(family):
    model = _context_model(family, mid=family in ("llama", "gemma2"))
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 15)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_each_row_with_context_heads_equals_its_single_run(batch_size):
    model = _context_model("qwen2", seed=batch_size)
    ids, am = _ragged(batch_size, 8, seed=batch_size)
    ref = _hf_greedy(model.base, ids, am, 13)
    for strategy in ("self-spec", "hispec", "ngram-hispec", "self-spec-lookup"):
        out = model.generate(ids, am, max_new_tokens=13, strategy=strategy, gamma=2, window=3)
        assert torch.equal(out.sequences, ref), strategy
        for b in range(batch_size):
            one = model.generate(ids[b : b + 1, am[b].bool()], max_new_tokens=13, strategy=strategy, gamma=2, window=3)
            assert one.new_tokens[0] == out.new_tokens[b], (strategy, b)


def _record_context_calls(monkeypatch):
    calls = []
    orig = decoding._Run._logits

    def logits(self, k, hidden, head_feats=None, pos=None):
        out = orig(self, k, hidden, head_feats, pos)
        name = self.levels[k].head
        if name is not None and self.model.heads[name].needs_context:
            ctx = self._context(k, pos)
            calls.append(dict(head=name, tok=self.tok.clone(), hidden=hidden.clone(), pos=pos.clone(),
                              avail=[a.clone() for a in ctx.avail], logits=out.clone(),
                              real=pos < self.done[k][:, None]))  # rows/positions this pass actually ran
        return out

    monkeypatch.setattr(decoding._Run, "_logits", logits)
    return calls


@pytest.mark.parametrize("strategy,mid,frontier", [("self-spec", False, 1), ("self-spec", False, 0),
                                                   ("hispec", False, 1), ("hispec", True, 1), ("hispec", True, 0),
                                                   ("ngram-hispec", True, 1), ("hispec-lookup", True, 1)])
@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gemma2"])
def test_the_decoder_hands_context_heads_exactly_what_a_whole_sequence_run_computes(monkeypatch, family, strategy,
                                                                                     mid, frontier):
    """At every call of a context head, recompute the states of every layer it reads over the row's tokens as they
    stood then (drafts included), keep the positions the decoder said were available, and run the head: the logits
    must match. Stale buffers after a rollback, a wrong frontier or a wrong window would all show."""
    model = _context_model(family, seed=1, mid=mid, frontier=frontier)
    calls = _record_context_calls(monkeypatch)
    ids, am = _ragged(3, 8, seed=2)
    gamma = 3
    out = model.generate(ids, am, max_new_tokens=20, strategy=strategy, gamma=gamma, window=2)
    assert torch.equal(out.sequences, _hf_greedy(model.base, ids, am, 20))
    ad = model.adapter
    checked, dists = 0, []
    for c in calls:
        head = model.heads[c["head"]]
        final_i = head.context_layers.index(ad.num_layers)
        for b in range(c["pos"].shape[0]):
            real = c["real"][b]
            if not bool(real.any()):
                continue
            pos = c["pos"][b : b + 1, real]
            seq = c["tok"][b : b + 1, : int(pos.max()) + 1]  # the row's tokens as they stood, drafts included
            with torch.no_grad():
                _, saved = ad.forward_all(seq, positions_from_mask(torch.ones_like(seq)), ad.new_cache(1),
                                          exits=tuple(head.context_layers))
                own = saved[head.context_layers[0]]
                ctx = ContextInputs(states=[saved[L] for L in head.context_layers],
                                    avail=[a[b : b + 1] for a in c["avail"]], query_pos=pos, layers=head.context_layers)
                feats = head(own[:, pos[0]], context=ctx)
                logits = model.project_exit(c["head"], feats)[0]
            assert torch.allclose(c["hidden"][b, real], own[0, pos[0]], atol=1e-4)
            ref = c["logits"][b, real]
            fin = ref.isfinite()
            assert torch.allclose(logits[fin], ref[fin], atol=1e-3, rtol=1e-3)
            if c["head"] == "draft":
                dists.append(int(pos[0, -1]) + 1 - int(c["avail"][final_i][b]))
            checked += 1
    assert checked > 20
    if strategy == "self-spec":  # the draft's distance to the verified frontier runs 1..gamma
        assert min(dists) == 1 and max(dists) <= gamma


@pytest.mark.parametrize("strategy", ["self-spec", "hispec", "ngram-hispec", "hispec-lookup"])
def test_sampling_with_context_heads_matches_the_exact_distribution(strategy):
    model = _perturb(_wrap(five_token_llama(0), head_type="context", draft=1, verify=2, context={"window": 3, "heads": 2,
                                                                                   "head_dim": 4}, context_mid=True),
                     scale=2.0)
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=5)
    assert _chi2_pvalue(samples, outcomes, probs) > 1e-4


def test_context_heads_round_trip_through_a_checkpoint(tmp_path):
    model = _context_model("qwen3", mid=True, window=5, draft=2, verify=3)
    cfg = assert_same_decoding_after_a_round_trip(model, tmp_path / "ck").hispec_config
    assert cfg.head_type == "context" and cfg.context == {"window": 5, "heads": 2, "head_dim": 8, "frontier": 1}
    assert cfg.context_layers == {"draft": [2, 3, model.num_layers], "verify": [3, model.num_layers]}


def test_a_checkpoint_from_before_the_frontier_path_loads_without_it(tmp_path):
    import json

    model = _context_model("llama", frontier=0)
    folder = model.save(tmp_path / "ck")
    config = json.loads((folder / "config.json").read_text())
    del config["hispec"]["head"]["context"]["frontier"]  # as written before `frontier` existed
    (folder / "config.json").write_text(json.dumps(config))
    loaded = hispec.load(folder)
    assert loaded.hispec_config.context["frontier"] == 0 and not hasattr(loaded.heads["draft"], "ctx_front")
    ids, am = _ragged(2, 7)
    a = model.generate(ids, am, max_new_tokens=8, strategy="self-spec", gamma=2)
    assert torch.equal(a.sequences, loaded.generate(ids, am, max_new_tokens=8, strategy="self-spec", gamma=2).sequences)


def test_the_frontier_path_reads_the_newest_verified_final_state():
    """Changing the final state at the frontier f changes the features; changing it before f (outside the window)
    or after it (not yet verified) does not, with attention switched off."""
    model = _context_model("llama", window=2)
    head = model.heads["draft"]
    with torch.no_grad():
        head.ctx_o.weight.zero_()  # attention off: only the frontier path reads the final states
    H, T = model.adapter.hidden_size, 8
    g = torch.Generator().manual_seed(4)
    h = torch.randn(1, T, H, generator=g)
    states = {L: torch.randn(1, T, H, generator=g) for L in head.context_layers}
    final = head.context_layers.index(model.num_layers)
    ctx = head.sequence_context(states, 2)  # query t reads final states up to t - 2: f = t - 2
    with torch.no_grad():
        base = head(h, context=ctx)
        for p, changed in ((3, {5}), (6, set()), (0, {2})):  # only the query at t = p + 2 has p as its frontier
            st = [x.clone() for x in ctx.states]
            st[final][0, p] += 1.0
            out = head(h, context=ContextInputs(states=st, avail=ctx.avail, query_pos=ctx.query_pos,
                                                layers=ctx.layers))
            diff = {t for t in range(T) if not torch.allclose(out[0, t], base[0, t])}
            assert diff == changed, (p, diff)


def test_bad_context_settings_are_refused_before_any_work():
    base = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown context head settings"):
        _wrap(base, head_type="context", context={"windw": 4})
    with pytest.raises(ValueError, match="integer >= 1"):
        _wrap(base, head_type="context", context={"window": 0})
    with pytest.raises(ValueError, match="frontier must be 0 or 1"):
        _wrap(base, head_type="context", context={"frontier": 2})
    with pytest.raises(ValueError, match="head_type='context'"):
        _wrap(base, head_type="linear", context_mid=True)
    cfg = hispec.model.HispecConfig(draft_layer=2, verify_layer=4, head_type="context",
                                    context_layers={"draft": [3, 9], "verify": [4, 9]})
    with pytest.raises(CheckpointError, match="own exit 2"):
        hispec.EarlyExitModel(base, cfg)


def test_the_latency_model_calibrates_context_heads_and_auto_stays_lossless():
    from hispec import latency

    model = _context_model("llama", mid=True)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 97, (6,), generator=g).tolist()
    prompts = [base * 3, torch.randint(3, 97, (14,), generator=g).tolist()]
    cal = latency.calibrate(model, prompts, max_new_tokens=12, repeats=1)
    assert set(cal.acceptance) >= {"L2>L4", "L2>full", "L4>full", "ngram>full"}
    assert all(0.0 <= a <= 1.0 for a in cal.acceptance.values())
    assert all(t > 0 for h in cal.costs["head"].values() for t in h.values())
    model.hispec_config.calibration = cal.to_dict()
    ids, am = _ragged(3, 8, seed=6)
    out = model.generate(ids, am, max_new_tokens=14, strategy="auto")
    assert torch.equal(out.sequences, _hf_greedy(model.base, ids, am, 14))
