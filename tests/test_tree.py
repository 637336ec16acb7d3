"""Tree drafts (hispec/decoding/tree.py): greedy output is transformers' own for every family and tree shape, sampling keeps
the distribution (chi-square against exact enumeration, with a power check), bad trees are refused before work."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_context_head import _context_model
from test_decoding import (_chi2_pvalue, _exact_joint, _hf_greedy, _oracle, _ragged, _tiny_vocab_model, _wrap)
from test_layer_head import _layer_model
from tiny import FAMILIES, negate_exits, tiny_model

from hispec import sampling
from hispec.decoding import dynamic_tree, tree as tree_mod
from hispec.cache import KVCache
from hispec.drafters.ngram import NgramConfig

SHAPES = ([1], [3], [1, 1, 1], [3, 2, 1], [4, 2, 2, 1], "2x2x2x2")
DYNAMIC = ("dyn-3-2-2-5", "dyn-4-3-2-8", "dyn-1-3-1-2", "dyn-5-4-4-16")
LOOKUP_SHAPES = ([3], [2, 2, 1], "dyn-3-2-2-5")


def _perturbed(family="qwen2", head_type="linear", scale=0.05, seed=0):
    model = _wrap(tiny_model(family), head_type=head_type)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a non-trivial head so rows accept different counts
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _lookup_tree(model, ids, am, n, shape, **kw):
    """`self-spec-lookup` with a tree, the lookup matching 2-grams (a tiny random model repeats single tokens so
    often that 1-grams would serve every round); also checks that both drafters served rounds."""
    out = model.generate(ids, am, max_new_tokens=n, strategy="self-spec-lookup", tree=shape,
                         ngram=NgramConfig(min_ngram=2), **kw)
    lv0 = out.stats.levels[0]
    assert lv0.name.startswith("ngram|") and 0 < lv0.lookups < lv0.proposals + lv0.passes, shape
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_trees_equal_hf_generate_for_every_family(family):
    """Static shapes, dynamic trees and trees under the lookup-first exit: transformers' own greedy output."""
    model = _wrap(tiny_model(family))
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    for strategy, shapes in (("self-spec", SHAPES + DYNAMIC), ("self-spec-lookup", LOOKUP_SHAPES)):
        for shape in shapes:
            if strategy == "self-spec":
                out = model.generate(ids, am, max_new_tokens=17, strategy=strategy, tree=shape)
            else:
                out = _lookup_tree(model, ids, am, 17, shape)
            assert torch.equal(out.sequences, ref), (strategy, shape)
            assert out.stats.new_tokens == 4 * 17


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_each_row_of_a_tree_batch_equals_its_single_run(batch_size):
    model = _perturbed()
    ids, am = _ragged(batch_size, 8, seed=batch_size)
    ref = _hf_greedy(model.base, ids, am, 13)
    for shape in ([3, 2], [2, 2, 2, 1]):
        out = model.generate(ids, am, max_new_tokens=13, strategy="self-spec", tree=shape)
        assert torch.equal(out.sequences, ref)
        for b in range(batch_size):
            single = model.generate(ids[b : b + 1, am[b].bool()], max_new_tokens=13, strategy="draft>full",
                                    tree=shape)
            assert single.new_tokens[0] == out.new_tokens[b]


@pytest.mark.parametrize("shape,max_new", [([2], 1), ([3, 2, 1], 3), ([2, 2, 2, 2], 5), ([4, 1, 1, 1], 7)])
def test_max_length_falling_inside_a_tree(shape, max_new):
    model = _wrap(_oracle(tiny_model("llama"), 2))  # deep paths are accepted, so the limit cuts through trees
    ids, am = _ragged(3, 6)
    ref = _hf_greedy(model.base, ids, am, max_new)
    out = model.generate(ids, am, max_new_tokens=max_new, strategy="self-spec", tree=shape)
    assert torch.equal(out.sequences, ref)
    assert all(len(t) == max_new for t in out.new_tokens)


@pytest.mark.parametrize("shape", [[3, 2, 1], [2, 2, 2, 2, 2]])
@pytest.mark.parametrize("oracle", [False, True])
def test_eos_inside_a_tree_stops_the_row_exactly_like_hf(shape, oracle):
    base = tiny_model("mistral")
    model = _wrap(_oracle(base, 2) if oracle else base)
    ids, am = _ragged(3, 7)
    free = _hf_greedy(model.base, ids, am, 20)
    eos = int(free[0, 7 + 5])  # a token row 0 produces at step 6: it becomes EOS
    ref = _hf_greedy(model.base, ids, am, 20, eos_token_id=eos)
    out = model.generate(ids, am, max_new_tokens=20, strategy="self-spec", tree=shape, eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) <= 6


@contextlib.contextmanager
def _truncations():
    """Records (physical length, largest position kept) of every range the contiguous cache rolls back."""
    lengths = []
    orig = KVCache.truncate_ranges

    def spy(self, ranges, keep_below):
        orig(self, ranges, keep_below)
        lengths.extend((self.get_seq_length(start), int(keep_below.max())) for start, end in ranges if start < end)

    KVCache.truncate_ranges = spy
    try:
        yield lengths
    finally:
        KVCache.truncate_ranges = orig


def test_oracle_heads_accept_whole_paths_and_the_cache_keeps_only_them():
    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    ref = _hf_greedy(model.base, ids, torch.ones_like(ids), 21)
    with _truncations() as lengths:
        out = model.generate(ids, max_new_tokens=21, strategy="self-spec", tree=[3, 2, 2, 1])
    assert torch.equal(out.sequences, ref)
    s = out.stats
    assert s.accepted_at_target == s.proposed_to_target  # every round the full depth
    assert s.tokens_per_target_pass > 4  # 4 drafts + 1 per full pass (the prefill counts as a pass)
    # after every rollback a range holds one slot per kept position: no holes pile up from rejected branches
    assert lengths and all(phys <= kept for phys, kept in lengths)


def test_a_chain_shaped_tree_does_what_the_chain_does():
    model = _perturbed(scale=0.08)
    ids, am = _ragged(3, 8, seed=5)
    chain = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", gamma=3)
    tree = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", tree=[1, 1, 1])
    assert torch.equal(chain.sequences, tree.sequences)
    assert chain.stats.target_row_passes == tree.stats.target_row_passes
    assert chain.stats.accepted_at_target == tree.stats.accepted_at_target


def test_wider_trees_accept_more_per_full_pass():
    model = _perturbed(scale=0.08)
    ids, am = _ragged(4, 8, seed=6)
    ref = _hf_greedy(model.base, ids, am, 24)
    tpp = {}
    for shape in ([1, 1, 1], [4, 2, 1]):
        out = model.generate(ids, am, max_new_tokens=24, strategy="self-spec", tree=shape)
        assert torch.equal(out.sequences, ref)
        tpp[str(shape)] = out.stats.tokens_per_target_pass
    assert tpp["[4, 2, 1]"] > tpp["[1, 1, 1]"]


def test_heads_that_accept_nothing_still_give_identical_output():
    model = negate_exits(_wrap(tiny_model("gemma3"), head_type="linear"))
    ids, am = _ragged(3, 8)
    ref = _hf_greedy(model.base, ids, am, 12)
    out = model.generate(ids, am, max_new_tokens=12, strategy="self-spec", tree=[2, 2, 1])
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gemma2", "opt"])
def test_greedy_tree_with_layer_heads_equals_hf_generate(family):
    model = _layer_model(family)
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 15)
    for shape in ([3, 2, 1], [2, 2, 2]):
        out = model.generate(ids, am, max_new_tokens=15, strategy="self-spec", tree=shape)
        assert torch.equal(out.sequences, ref), shape


def test_a_layer_head_drafts_the_same_path_in_a_tree_as_in_a_chain():
    """A `layer` head's own KV must be rolled back to the accepted path: its chain-shaped tree accepts exactly what
    the chain does (stale KV of rejected branches would change its drafts)."""
    model = _layer_model("llama", scale=0.05)
    ids, am = _ragged(3, 8, seed=1)
    chain = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", gamma=3)
    tree = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", tree=[1, 1, 1])
    assert torch.equal(chain.sequences, tree.sequences)
    assert chain.stats.accepted_at_target == tree.stats.accepted_at_target


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gemma2"])
def test_greedy_tree_with_context_heads_equals_hf_generate(family):
    model = _context_model(family, mid=family == "llama")
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 15)
    for shape in ([3, 2, 1], [1, 1, 1]):
        out = model.generate(ids, am, max_new_tokens=15, strategy="self-spec", tree=shape)
        assert torch.equal(out.sequences, ref), shape


# ---------------------------------------------------------------------------------------------- lookup first
def _spy_lookup_rounds(monkeypatch):
    """Record each `tree._lookup_first` call as (rows before, rows the lookup served, rows after)."""
    rounds, orig = [], tree_mod._lookup_first

    def spy(run):
        B, served = len(run.seq), run.stats.levels[0].lookups
        follow = orig(run)
        rounds.append((B, run.stats.levels[0].lookups - served, len(run.seq)))
        return follow

    monkeypatch.setattr(tree_mod, "_lookup_first", spy)
    monkeypatch.setattr(dynamic_tree, "_lookup_first", spy)  # (dynamic trees' round lives there)
    return rounds


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_each_row_of_a_lookup_first_tree_batch_equals_its_single_run(batch_size, monkeypatch):
    """In a batch some rows are served by the lookup while others draft a tree (the mixed round of
    `tree._lookup_first`); every row must still be what it is alone and what hf gives."""
    model = _perturbed()
    ids, am = _ragged(batch_size, 8, seed=batch_size)
    ref = _hf_greedy(model.base, ids, am, 13)
    rounds = _spy_lookup_rounds(monkeypatch)
    for shape in ([3, 2], "dyn-3-2-2-5"):
        out = _lookup_tree(model, ids, am, 13, shape)
        assert torch.equal(out.sequences, ref)
        if batch_size > 1:
            assert any(0 < served < B for B, served, _ in rounds), rounds  # a mixed round happened
        rounds.clear()
        for b in range(batch_size):
            single = model.generate(ids[b : b + 1, am[b].bool()], max_new_tokens=13, strategy="ngram|draft>full",
                                    tree=shape, ngram=NgramConfig(min_ngram=2))
            assert single.new_tokens[0] == out.new_tokens[b]


@pytest.mark.parametrize("oracle", [False, True])
def test_lookup_first_tree_limits_and_eos_like_hf(oracle, monkeypatch):
    base = tiny_model("mistral")
    model = _wrap(_oracle(base, 2) if oracle else base)
    ids, am = _ragged(6, 7)
    rounds = _spy_lookup_rounds(monkeypatch)
    for max_new in (3, 4, 7):
        ref = _hf_greedy(model.base, ids, am, max_new)
        out = model.generate(ids, am, max_new_tokens=max_new, strategy="self-spec-lookup", tree=[2, 2, 1])
        assert torch.equal(out.sequences, ref) and all(len(t) == max_new for t in out.new_tokens)
    # some row was served to its limit by a chain and left before the tree round of a mixed batch
    assert any(0 < served < B and after < B for B, served, after in rounds), rounds
    free = _hf_greedy(model.base, ids, am, 20)
    eos = int(free[0, 7 + 5])
    ref = _hf_greedy(model.base, ids, am, 20, eos_token_id=eos)
    out = model.generate(ids, am, max_new_tokens=20, strategy="self-spec-lookup", tree=[3, 2], eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) <= 6


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_lookup_first_tree_with_context_and_layer_heads_equals_hf_generate(family):
    for model in (_context_model(family, mid=family == "llama"), _layer_model(family)):
        ids, am = _ragged(4, 9)
        ref = _hf_greedy(model.base, ids, am, 15)
        for shape in ([3, 2, 1], [4]):
            out = _lookup_tree(model, ids, am, 15, shape)
            assert torch.equal(out.sequences, ref), shape


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tree=[]), "tree is empty"),
        (dict(tree=""), "expected widths"),
        (dict(tree=[0]), "integers >= 1"),
        (dict(tree=[2, -1]), "integers >= 1"),
        (dict(tree=[2.5]), "integers >= 1"),
        (dict(tree=[True]), "integers >= 1"),
        (dict(tree="2xb"), "expected widths"),
        (dict(tree=3), "list of widths"),
        (dict(tree=[8, 8, 8]), "nodes; at most"),
        (dict(tree=[2] * 6, max_new_tokens=5), "deeper than the tokens"),
        (dict(tree=[2], strategy="hispec"), "one draft exit or the EAGLE-3 drafter under the full model"),
        (dict(tree=[2], strategy="ngram"), "one draft exit or the EAGLE-3 drafter under the full model"),
        (dict(tree=[2], strategy="ar"), "one draft exit or the EAGLE-3 drafter under the full model"),
        (dict(tree=[2], strategy="auto"), "not 'auto'"),
        (dict(tree=[2], policy=object()), "policy"),
    ],
)
def test_bad_trees_get_a_clear_error_before_any_work(kwargs, match):
    from hispec import decoding

    model = _wrap(tiny_model("llama"))
    called = []
    orig = decoding._Run.__init__

    def init(self, *a, **kw):
        called.append(1)
        orig(self, *a, **kw)

    decoding._Run.__init__ = init
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(torch.tensor([[5, 6, 7]]), **kwargs)
    finally:
        decoding._Run.__init__ = orig
    assert not called


def test_tree_strings_and_lists_parse_alike():
    assert tree_mod.parse_tree("4x2x1") == tree_mod.parse_tree([4, 2, 1]) == tree_mod.parse_tree("4,2,1")
    spec = tree_mod.parse_tree((3, 2))
    assert spec.size == 3 + 6 and spec.depth == 2 and str(spec) == "3x2"
    assert tree_mod.parse_tree(None) is None


def test_cache_compact_keeps_each_rows_chosen_slots():
    c = KVCache(1, 2)
    k = torch.arange(2 * 1 * 6 * 1, dtype=torch.float).reshape(2, 1, 6, 1)
    c.update(k, -k, 0)
    c.set_slot_meta(0, 1, torch.ones(2, 6, dtype=torch.bool), torch.tensor([[0, 1, 2, 2, 3, 3]] * 2))
    c.compact(0, 1, 2, torch.tensor([[1, 3], [0, 0]]), torch.tensor([[True, True], [True, False]]))
    valid, pos = c.slot_meta(0)
    assert c.get_seq_length(0) == 4
    assert valid.tolist() == [[True] * 4, [True, True, True, False]]
    assert pos[0].tolist() == [0, 1, 2, 3]
    assert c._keys[0][0, 0, :4, 0].tolist() == [0, 1, 3, 5] and c._keys[0][1, 0, :3, 0].tolist() == [6, 7, 8]


# ---------------------------------------------------------------------------------------------- sampling
def _draw_tree(model, prompt, n, warp, shape, draws, seed, strategy="self-spec"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * draws)
    out = model.generate(ids, max_new_tokens=n, strategy=strategy, do_sample=True, tree=shape, generator=g,
                         **warp)
    return [tuple(t) for t in out.new_tokens], out.stats


WARPS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("warp", WARPS, ids=["plain", "warped"])
@pytest.mark.parametrize("shape", [[2], [3, 2], [2, 2, 1], [4, 1, 1]], ids=str)
def test_tree_sampling_matches_the_exact_distribution(shape, warp):
    model = _tiny_vocab_model()
    prompt, n = [1, 3, 2], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples, stats = _draw_tree(model, prompt, n, warp, shape, draws=6000, seed=11)
    p = _chi2_pvalue(samples, outcomes, probs)
    print(f"tree {shape} {warp}: chi-square p = {p:.4g}")
    assert p > 1e-4
    lv = stats.levels[1]
    assert 0 < lv.accepted < lv.proposed  # drafts were accepted and rejected: the test exercised both paths


def test_tree_sampling_with_a_deterministic_drafter(monkeypatch):
    """A point-mass draft distribution: the first child is its token, the other siblings cannot be drawn (no mass
    left) and must be skipped, and the residual is p without that token."""
    from hispec import decoding

    model = _tiny_vocab_model()
    orig = decoding._Run._logits
    seen = []

    def steep(self, k, hidden, head_feats=None, pos=None):  # the draft's logits so steep softmax is one-hot
        out = orig(self, k, hidden, head_feats, pos)
        if k == 0:
            out = out * 1e4
            seen.append(bool(((sampling.logits_to_probs(out) == 1).sum(-1) == 1).all()))
        return out

    monkeypatch.setattr(decoding._Run, "_logits", steep)
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples, stats = _draw_tree(model, prompt, n, warp, [3, 2], draws=6000, seed=3)
    p = _chi2_pvalue(samples, outcomes, probs)
    print(f"deterministic drafter: chi-square p = {p:.4g}")
    assert p > 1e-4
    assert seen and all(seen)  # really deterministic
    assert stats.levels[0].proposed < 6000 * (3 + 6)  # siblings without mass were not drafted
    assert 0 < stats.levels[1].accepted < stats.levels[1].proposed


def _with_replacement_rule(p, q, cands, valid, generator=None):
    """The classic bug: siblings drawn without replacement verified as if drawn with replacement (q is not
    renormalised after a rejection)."""
    B, k = cands.shape
    acc = torch.full((B,), -1, dtype=torch.long)
    p = p.clone()
    for r in range(k):
        x = cands[:, r : r + 1]
        qx, px = q.gather(-1, x)[:, 0], p.gather(-1, x)[:, 0]
        u = torch.rand(B, generator=generator)
        ok = valid[:, r] & (acc < 0) & (qx > 0)
        hit = ok & (u * qx <= px)
        acc = torch.where(hit, torch.full_like(acc, r), acc)
        res = (p - q).clamp(min=0)
        res = res / res.sum(-1, keepdim=True).clamp(min=1e-30)
        p = torch.where((ok & ~hit)[:, None], res, p)
    return acc, p


def _first_child_only(p, q, cands, valid, generator=None):
    """Another wrong rule: accept the first child by p/q but resample from p itself (no residual)."""
    B = cands.shape[0]
    x = cands[:, :1]
    u = torch.rand(B, generator=generator)
    hit = valid[:, 0] & (u * q.gather(-1, x)[:, 0] <= p.gather(-1, x)[:, 0])
    return torch.where(hit, 0, -1), p


@pytest.mark.parametrize("rule", [_with_replacement_rule, _first_child_only], ids=["with-replacement", "no-residual"])
def test_the_distribution_test_rejects_a_wrong_tree_rule(monkeypatch, rule):
    model = _tiny_vocab_model()
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    monkeypatch.setattr(sampling, "recursive_accept", rule)
    samples, _ = _draw_tree(model, prompt, n, warp, [3, 2], draws=6000, seed=11)
    p = _chi2_pvalue(samples, outcomes, probs)
    print(f"wrong rule {rule.__name__}: chi-square p = {p:.4g}")
    assert p < 1e-6


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("case", ["random", "point-mass", "q-equals-p", "disjoint"])
def test_recursive_accept_returns_exact_samples_of_p(case, k):
    """One node, many rows at once: k children drawn without replacement from q by `sample_without_replacement`,
    verified by `recursive_accept`, the residual sampled when all are rejected: the outcome follows p."""
    from scipy import stats

    g = torch.Generator().manual_seed(k)
    V, B = 5, 200_000
    p = torch.rand(V, generator=g) ** 2
    q = {"random": torch.rand(V, generator=g) ** 2, "point-mass": torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]),
         "q-equals-p": p.clone(), "disjoint": torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])}[case]
    if case == "disjoint":
        p = torch.tensor([0.0, 0.0, 1.0, 2.0, 1.0])
    p, q = p / p.sum(), q / q.sum()
    P, Q = p.expand(B, V), q.expand(B, V)
    cands, valid = sampling.sample_without_replacement(Q, k, g)
    assert bool((valid.sum(1) == min(k, int((q > 0).sum()))).all())
    acc, res = sampling.recursive_accept(P, Q, cands, valid, g)
    out = torch.where(acc >= 0, cands.gather(1, acc.clamp(min=0)[:, None])[:, 0], sampling.sample(res, g))
    counts = torch.bincount(out, minlength=V).double()
    keep = p > 0
    assert counts[~keep].sum() == 0
    exp = p[keep].double() / p[keep].double().sum() * counts.sum()
    pv = stats.chisquare(counts[keep].numpy(), exp.numpy()).pvalue
    assert pv > 1e-4, (case, k, pv)


# ---------------------------------------------------------------------------------------------- CLIs
from test_bench import checkpoint, common, prompts_file, run_cli  # noqa: E402,F401  (fixtures)


def test_bench_runs_tree_strategies_losslessly(checkpoint, prompts_file, capsys):  # noqa: F811
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies",
                               "hf,self-spec,tree:3x2x1,lookup-tree:3")
    assert rc == 0, out.err
    assert summary["lossless"] is True
    for name, hierarchy in (("tree:3x2x1", "L2>full[tree 3x2x1]"), ("lookup-tree:3", "ngram|L2>full[tree 3]")):
        s = summary["strategies"][name]
        assert s["identical"] == 1.0 and s["tokens_per_target_pass"] >= 1.0 and s["tokens_per_s"] > 0
        assert s["predicted_speedup_vs_ar"] > 0  # static trees are priced by the latency model (hispec.latency)
        assert s["hierarchy"] == hierarchy
        assert any(line.startswith(name + " ") for line in out.out.splitlines())


def test_bench_refuses_a_bad_tree_before_any_work(checkpoint, prompts_file, capsys):  # noqa: F811
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", "hf,tree:0x2")
    assert rc == 2 and "integers >= 1" in out.err


def test_generate_cli_takes_a_tree(checkpoint, capsys):  # noqa: F811
    import json

    from hispec.cli.generate import main as gen_main

    args = ["--model", str(checkpoint), "--prompt", "write a poem.", "--max-new-tokens", "9", "--json",
            "--threads", "1"]
    assert gen_main(args + ["--strategy", "ar"]) == 0
    ref = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert gen_main(args + ["--strategy", "self-spec", "--tree", "3x2x1"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["completion"] == ref["completion"] and got["stats"]["strategy"].endswith("[tree 3x2x1]")
    assert gen_main(args + ["--tree", "2x0"]) == 2
    assert "--tree" in capsys.readouterr().err
    assert gen_main(args + ["--strategy", "hispec", "--tree", "2"]) == 2
    assert "one draft exit" in capsys.readouterr().err


def test_tree_sampling_with_eos_matches_the_truncated_distribution():
    """EOS accepted inside a tree ends the row there: the law of the output is the model's law of sequences cut
    after their first EOS (what plain sampling gives)."""
    model = _tiny_vocab_model()
    prompt, n, warp, eos = [1, 3, 2], 3, dict(temperature=1.0), 4
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    cut = {}
    for o, p in zip(outcomes, probs.tolist()):
        t = o[: o.index(eos) + 1] if eos in o else o
        cut[t] = cut.get(t, 0.0) + p
    g = torch.Generator().manual_seed(7)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="self-spec", do_sample=True,
                         tree=[3, 2], generator=g, eos_token_id=eos, pad_token_id=0, **warp)
    samples = [tuple(t) for t in out.new_tokens]
    assert any(len(s) < n for s in samples)
    keys = list(cut)
    p = _chi2_pvalue(samples, keys, torch.tensor([cut[k] for k in keys]))
    print(f"tree sampling with EOS: chi-square p = {p:.4g}")
    assert p > 1e-4


@pytest.mark.parametrize("warp", WARPS, ids=["plain", "warped"])
@pytest.mark.parametrize("shape", [[2], [3, 2]], ids=str)
def test_lookup_first_tree_sampling_matches_the_exact_distribution(shape, warp):
    """Rounds served by the n-gram (point-mass drafts, chain verification) and tree rounds (children drawn without
    replacement) in one run: the output law is still the model's."""
    model = _tiny_vocab_model()
    prompt, n = [1, 3, 2, 1, 3], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples, stats = _draw_tree(model, prompt, n, warp, shape, draws=6000, seed=13, strategy="self-spec-lookup")
    p = _chi2_pvalue(samples, outcomes, probs)
    print(f"lookup-first tree {shape} {warp}: chi-square p = {p:.4g}")
    assert p > 1e-4
    lv0, lv1 = stats.levels
    assert 0 < lv0.lookups < lv0.proposals + lv0.passes  # both drafters proposed
    assert 0 < lv1.accepted < lv1.proposed


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_end_a_tree_row_after_the_completing_token():
    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    free = model.generate(ids, max_new_tokens=14, strategy="ar").new_tokens[0]
    stop = _CharTokenizer().decode(free[5:7])
    out = model.generate(ids, max_new_tokens=14, strategy="self-spec", tree=[2, 2, 2], stop_strings=[stop],
                         tokenizer=_CharTokenizer())
    text = _CharTokenizer().decode(out.new_tokens[0])
    assert stop in text and stop not in text[:-1]
    assert out.new_tokens[0] == free[: len(out.new_tokens[0])]


# ---------------------------------------------------------------------------------------------- dynamic trees
@pytest.mark.parametrize("batch_size", [1, 5])
def test_each_row_of_a_dynamic_tree_batch_equals_its_single_run(batch_size):
    model = _perturbed(seed=batch_size)
    ids, am = _ragged(batch_size, 8, seed=batch_size)
    ref = _hf_greedy(model.base, ids, am, 13)
    out = model.generate(ids, am, max_new_tokens=13, strategy="self-spec", tree="dyn-4-3-3-10")
    assert torch.equal(out.sequences, ref)
    for b in range(batch_size):
        single = model.generate(ids[b : b + 1, am[b].bool()], max_new_tokens=13, strategy="self-spec",
                                tree="dyn-4-3-3-10")
        assert single.new_tokens[0] == out.new_tokens[b]


@pytest.mark.parametrize("oracle", [False, True])
def test_dynamic_tree_limit_and_eos_inside_a_tree(oracle):
    base = tiny_model("mistral")
    model = _wrap(_oracle(base, 2) if oracle else base)
    ids, am = _ragged(3, 7)
    for n in (4, 5, 9):
        ref = _hf_greedy(model.base, ids, am, n)
        out = model.generate(ids, am, max_new_tokens=n, strategy="self-spec", tree="dyn-4-2-2-6")
        assert torch.equal(out.sequences, ref) and all(len(t) == n for t in out.new_tokens)
    free = _hf_greedy(model.base, ids, am, 20)
    eos = int(free[0, 7 + 5])
    ref = _hf_greedy(model.base, ids, am, 20, eos_token_id=eos)
    out = model.generate(ids, am, max_new_tokens=20, strategy="self-spec", tree="dyn-5-3-2-9", eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]])
    assert out.new_tokens[0][-1] == eos


def test_dynamic_tree_with_oracle_heads_accepts_its_full_depth_and_keeps_no_holes():
    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    ref = _hf_greedy(model.base, ids, torch.ones_like(ids), 21)
    with _truncations() as lengths:
        # all 3 + 3 * 6 drafted nodes verified, beam = topk: the oracle's top-1 path is always in the tree
        out = model.generate(ids, max_new_tokens=21, strategy="self-spec", tree="dyn-4-3-3-30")
        part = model.generate(ids, max_new_tokens=21, strategy="self-spec", tree="dyn-4-3-2-9")
    assert torch.equal(out.sequences, ref) and torch.equal(part.sequences, ref)
    assert out.stats.accepted_at_target == out.stats.proposed_to_target
    assert part.stats.tokens_per_target_pass > 1.5
    assert lengths and all(phys <= kept for phys, kept in lengths)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dynamic_tree_with_layer_and_context_heads(family):
    for model in (_layer_model(family), _context_model(family)):
        ids, am = _ragged(3, 9)
        ref = _hf_greedy(model.base, ids, am, 15)
        out = model.generate(ids, am, max_new_tokens=15, strategy="self-spec", tree="dyn-4-3-2-8")
        assert torch.equal(out.sequences, ref)


def test_a_layer_head_drafts_the_same_in_a_one_path_dynamic_tree_as_in_a_chain():
    model = _layer_model("llama", scale=0.05)
    ids, am = _ragged(3, 8, seed=1)
    chain = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", gamma=3)
    dyn = model.generate(ids, am, max_new_tokens=16, strategy="self-spec", tree="dyn-3-1-1-3")
    assert torch.equal(chain.sequences, dyn.sequences)
    assert chain.stats.accepted_at_target == dyn.stats.accepted_at_target


@pytest.mark.parametrize("spec,match", [("dyn-3-2-3-4", "beam"), ("dyn-3-2-2", "expected"), ("dyn-0-2-2-2", "depth"),
                                        ("dyn-2-2-2-9", "only 6 are drafted"), ("dyn-a-2-2-2", "expected")])
def test_bad_dynamic_trees_are_refused(spec, match):
    model = _wrap(tiny_model("llama"))
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[5, 6, 7]]), tree=spec)


def test_dynamic_trees_refuse_sampling_before_any_work():
    model = _wrap(tiny_model("llama"))
    with pytest.raises(ValueError, match="greedy only"):
        model.generate(torch.tensor([[5, 6, 7]]), tree="dyn-3-2-2-4", do_sample=True)
