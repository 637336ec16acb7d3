"""Sequence-level verification (HSD, `hispec.sampling.hsd_accept`) is lossless: proven by exact enumeration.

The draft tree is small enough to enumerate: vocabulary V, drafts of length 1..3, and proposal / target rows that
depend on the whole prefix (a table of rows per prefix, not one row per position). For every draft the rule's
closed-form branch probabilities (`hsd_branches`, `hsd_length_probs`) give the exact law of what it emits (accepted
prefix + one token); emissions are continued with the target to a fixed length, summed over drafts weighted by
their proposal probability and compared with the target's own joint distribution. The same enumeration applied to
deliberately wrong rules (the reference code's min(P, Q) capping, no capping, no residual) shows the test's power.
A chi-square test with 1e5 draws then ties the sampler (`hsd_draw`'s backward scan) to those probabilities.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from hispec import sampling
from hispec.sampling import hsd_accept, hsd_branches, hsd_length_probs

KINDS = ("random", "point-mass", "equal", "zeros")


def _tables(V: int, depth: int, kind: str, seed: int):
    """Target and proposal rows per prefix (tuples of length 0..depth; targets one deeper for the bonus row)."""
    g = torch.Generator().manual_seed(seed)

    def dirichlet():
        x = -torch.rand(V, generator=g, dtype=torch.float64).log()
        x = x ** 2.5  # peaked rows: ratios far from 1 in both directions
        return x / x.sum()

    P, Q = {}, {}
    for L in range(depth + 2):
        for s in itertools.product(range(V), repeat=L):
            p = dirichlet()
            if kind == "zeros":  # a zero in p (the draft may hit it) and a different zero in q (top-k drafters)
                z = torch.randperm(V, generator=g)[:2]
                p[z[0]] = 0
                p = p / p.sum()
            P[s] = p
            if kind == "random":
                Q[s] = dirichlet()
            elif kind == "point-mass":
                Q[s] = torch.nn.functional.one_hot(torch.randint(V, (1,), generator=g)[0], V).double()
            elif kind == "equal":
                Q[s] = p.clone()
            else:
                q = dirichlet()
                q[z[1]] = 0
                Q[s] = q / q.sum()
    return P, Q


def _rows(drafts, lengths, P, Q, V: int, M: int, seed: int = 0):
    """Batched rule inputs for drafts (tuples), padded to M candidates with garbage the rule must ignore."""
    g = torch.Generator().manual_seed(seed)
    N = len(drafts)
    cands = torch.randint(V, (N, M), generator=g)
    q_rows = torch.rand(N, M, V, generator=g, dtype=torch.float64)
    p_rows = torch.rand(N, M + 1, V, generator=g, dtype=torch.float64)
    for n, (x, m) in enumerate(zip(drafts, lengths)):
        cands[n, :m] = torch.tensor(x[:m])
        for t in range(m):
            q_rows[n, t] = Q[x[:t]]
        for t in range(m + 1):
            p_rows[n, t] = P[x[:t]]
    return cands, torch.tensor(lengths), q_rows, p_rows


def _joint(P, seq) -> float:
    return float(torch.prod(torch.stack([P[seq[:t]][seq[t]] for t in range(len(seq))])))


def _continue(P, emitted: tuple, total: int) -> dict:
    """The law of `emitted` continued with the target rows to `total` tokens."""
    out = {}
    for tail in itertools.product(range(len(P[()])), repeat=total - len(emitted)):
        z = emitted + tail
        w = 1.0
        for t in range(len(emitted), total):
            w *= float(P[z[:t]][z[t]])
        out[z] = w
    return out


def _exact_output(P, Q, V: int, gammas=(1, 2, 3), branches=hsd_branches, resample="residual"):
    """gamma -> (max |output law - target law| over outcomes of gamma + 1 tokens, E[accepted], E[token-wise
    accepted]), every draft length evaluated in one ragged batch of width max(gammas)."""
    M = max(gammas)
    drafts, lengths = [], []
    for gm in gammas:
        for x in itertools.product(range(V), repeat=gm):
            drafts.append(x)
            lengths.append(gm)
    cands, m, q_rows, p_rows = _rows(drafts, lengths, P, Q, V, M)
    accept_all, stop, residual = branches(cands, m, q_rows, p_rows)
    length = hsd_length_probs(accept_all, stop, m)  # [N, M+1]
    for t in (accept_all, stop, residual, length):
        assert torch.isfinite(t).all()
    assert torch.allclose(length.sum(-1), torch.ones(len(drafts), dtype=torch.float64))
    results = {}
    for gm in gammas:
        out, e_hsd, e_tok = {}, 0.0, 0.0
        for n in [i for i, L in enumerate(lengths) if L == gm]:
            x = drafts[n]
            qx = _joint(Q, x)
            if qx == 0:
                continue
            r = [float(P[x[:t]][x[t]] / Q[x[:t]][x[t]]) for t in range(gm)]
            e_tok += qx * sum(math.prod(min(1.0, v) for v in r[:i]) for i in range(1, gm + 1))
            for a in range(gm + 1):
                pa = float(length[n, a])
                e_hsd += qx * pa * a
                if pa == 0:
                    continue
                if a == gm:
                    nxt = P[x]
                elif resample == "residual":
                    res = residual[n, a]
                    nxt = res / res.sum() if res.sum() > 0 else P[x[:a]]
                else:  # a wrong rule: resample from the target itself
                    nxt = P[x[:a]]
                for v in range(V):
                    if nxt[v] > 0:
                        for z, w in _continue(P, x[:a] + (v,), gm + 1).items():
                            out[z] = out.get(z, 0.0) + qx * pa * float(nxt[v]) * w
        err = max(abs(out.get(z, 0.0) - _joint(P, z)) for z in itertools.product(range(V), repeat=gm + 1))
        results[gm] = (err, e_hsd, e_tok)
    return results


@pytest.mark.parametrize("V", [3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_enumeration_output_law_is_the_target(V, kind):
    for seed in range(3):
        P, Q = _tables(V, 3, kind, seed)
        for gm, (err, e_hsd, e_tok) in _exact_output(P, Q, V).items():
            assert err < 1e-12, (kind, V, seed, gm, err)
            assert e_hsd >= e_tok - 1e-12  # never accepts less than the token-wise rule
            if kind in ("point-mass", "equal") or gm == 1:  # nothing to gain: the two rules accept alike
                assert abs(e_hsd - e_tok) < 1e-12
            if kind == "equal":
                assert abs(e_hsd - gm) < 1e-12


def test_exact_enumeration_hsd_accepts_more_than_token_wise():
    P, Q = _tables(4, 3, "random", 0)
    res = _exact_output(P, Q, 4)
    gains = {gm: e_hsd / e_tok for gm, (_, e_hsd, e_tok) in res.items()}
    assert gains[1] == pytest.approx(1.0)
    assert gains[2] > 1.002 and gains[3] > 1.015  # +0.2% and +1.5% accepted tokens on these tables


# --------------------------------------------------------------------------------------------- wrong rules
def _variant(cap: str):
    """A wrong rule's branches: `min` is the reference code's min(P_t, Q_t) capping with full acceptance
    min(1, R_m); `none` does not cap the prefix at all."""

    def branches(cands, m, q_rows, p_rows):
        M = cands.shape[1]
        real = torch.arange(M) < m[:, None]
        p_x = p_rows[:, :M].gather(-1, cands[..., None]).squeeze(-1)
        q_x = q_rows.gather(-1, cands[..., None]).squeeze(-1)
        R = torch.cat([torch.ones_like(p_x[:, :1]),
                       torch.where(real, p_x / q_x.clamp(min=1e-30), torch.ones_like(p_x)).cumprod(-1)], -1)
        c = R.clamp(max=1) if cap == "min" else R
        accept_all = R.gather(1, m[:, None]).squeeze(1).clamp(max=1)
        d = c[:, :M, None] * p_rows[:, :M] - q_rows
        excess, deficit = d.clamp(min=0).sum(-1), (-d).clamp(min=0).sum(-1)
        stop = excess / torch.maximum(excess, deficit).clamp(min=1e-30)
        stop = torch.where(R[:, 1:] >= 1, torch.ones_like(stop), stop)
        stop[:, 0] = 1
        return accept_all, stop, d.clamp(min=0)

    return branches


@pytest.mark.parametrize("wrong", ["min-capping", "no-capping", "no-residual"])
def test_exact_enumeration_rejects_wrong_rules(wrong):
    P, Q = _tables(4, 3, "random", 0)
    kw = dict(resample="target") if wrong == "no-residual" else dict(branches=_variant(wrong.split("-")[0]))
    res = _exact_output(P, Q, 4, **kw)
    assert res[3][0] > 1e-3  # the same enumeration that finds the right rule exact (1e-12) sees the wrong one
    if wrong != "no-residual":
        assert res[1][0] < 1e-12  # (the capping variants agree with HSD on one candidate)


# --------------------------------------------------------------------------------------------- Monte Carlo
def _dense(P, Q, V, depth):
    """Tables as tensors indexed by a prefix's base-V code: P[t] `[V^t, V]` (t <= depth), Q[t] (t < depth)."""
    code = lambda s: sum(v * V ** i for i, v in enumerate(s))  # noqa: E731
    Pd = [torch.zeros(V ** t, V, dtype=torch.float64) for t in range(depth + 1)]
    Qd = [torch.zeros(V ** t, V, dtype=torch.float64) for t in range(depth)]
    for s, row in P.items():
        if len(s) <= depth:
            Pd[len(s)][code(s)] = row
    for s, row in Q.items():
        if len(s) < depth:
            Qd[len(s)][code(s)] = row
    return Pd, Qd


def _monte_carlo(P, Q, V, gm, draws, seed, accept=hsd_accept):
    """Drafts from Q, verified in one batched call, emissions continued with P: counts over V^(gm+1) outcomes."""
    g = torch.Generator().manual_seed(seed)
    Pd, Qd = _dense(P, Q, V, gm)
    N = draws
    x = torch.zeros(N, gm, dtype=torch.long)
    code = torch.zeros(N, dtype=torch.long)
    q_rows = torch.zeros(N, gm, V, dtype=torch.float64)
    p_rows = torch.zeros(N, gm + 1, V, dtype=torch.float64)
    for t in range(gm):
        q_rows[:, t], p_rows[:, t] = Qd[t][code], Pd[t][code]
        x[:, t] = torch.multinomial(q_rows[:, t], 1, generator=g)[:, 0]
        code = code + x[:, t] * V ** t
    p_rows[:, gm] = Pd[gm][code]
    m = torch.full((N,), gm)
    a, nxt = accept(x, m, q_rows, p_rows, generator=g)
    z = torch.cat([x, torch.zeros(N, 1, dtype=torch.long)], 1)
    z[torch.arange(N), a] = nxt
    code = torch.zeros(N, dtype=torch.long)
    for t in range(gm + 1):  # continue with the target after the emitted token
        fresh = t > a
        if bool(fresh.any()):
            z[fresh, t] = torch.multinomial(Pd[t][code[fresh]], 1, generator=g)[:, 0]
        if t < gm:
            code = code + z[:, t] * V ** t
    full = (z * V ** torch.arange(gm + 1)).sum(1)
    return torch.bincount(full, minlength=V ** (gm + 1)).double(), a


def _target_law(P, V, gm):
    probs = torch.zeros(V ** (gm + 1), dtype=torch.float64)
    for z in itertools.product(range(V), repeat=gm + 1):
        probs[sum(v * V ** i for i, v in enumerate(z))] = _joint(P, z)
    return probs


def _chi2(counts, probs):
    from scipy import stats

    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


@pytest.mark.parametrize("kind", KINDS)
def test_sampler_matches_the_exact_law(kind):
    V, gm = 4, 3
    P, Q = _tables(V, gm, kind, 0)
    counts, a = _monte_carlo(P, Q, V, gm, 100_000, seed=1)
    pvalue = _chi2(counts, _target_law(P, V, gm))
    print(f"HSD sampler, {kind}: chi-square p = {pvalue:.3g}, mean accepted {a.double().mean():.3f}")
    assert pvalue > 1e-4


@pytest.mark.parametrize("wrong", ["min-capping", "no-capping"])
def test_the_sampler_test_rejects_a_wrong_rule(wrong):
    V, gm = 4, 3
    P, Q = _tables(V, gm, "random", 0)
    branches = _variant(wrong.split("-")[0])

    def accept(cands, m, q_rows, p_rows, generator=None):  # the wrong branches through HSD's own sampler
        return sampling.hsd_draw(*branches(cands, m, q_rows, p_rows), m, p_rows, generator)

    counts, _ = _monte_carlo(P, Q, V, gm, 100_000, seed=1, accept=accept)
    pvalue = _chi2(counts, _target_law(P, V, gm))
    print(f"wrong rule {wrong}: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6


def test_token_wise_sampler_passes_the_same_check():
    V, gm = 4, 3
    P, Q = _tables(V, gm, "random", 0)
    counts, _ = _monte_carlo(P, Q, V, gm, 100_000, seed=1, accept=sampling.speculative_accept)
    assert _chi2(counts, _target_law(P, V, gm)) > 1e-4


# --------------------------------------------------------------------------------------------- corners
def test_corners_give_finite_probabilities_and_valid_tokens():
    V, M = 5, 4
    g = torch.Generator().manual_seed(0)
    p = torch.rand(6, M + 1, V, generator=g).softmax(-1)
    q = torch.rand(6, M, V, generator=g).softmax(-1)
    cands = torch.randint(V, (6, M), generator=g)
    q[0] = p[0, :M]  # q == p: everything accepted
    q[1] = torch.nn.functional.one_hot(cands[1], V).float()  # point mass (n-gram)
    p[2, :, cands[2, 0]] = 0  # p is zero at the first draft: nothing accepted
    p[2] /= p[2].sum(-1, keepdim=True)
    p[3] = torch.nn.functional.one_hot(torch.randint(V, (M + 1,), generator=g), V).float()  # one-hot target
    q[4] = torch.nn.functional.one_hot(cands[4], V).float()  # point mass that is the target's one-hot
    p[4, :M] = q[4]
    m = torch.tensor([M, M, M, M, M, 0])
    accept_all, stop, residual = hsd_branches(cands, m, q, p)
    assert torch.isfinite(accept_all).all() and torch.isfinite(stop).all() and torch.isfinite(residual).all()
    assert accept_all[0] == 1 and accept_all[4] == 1 and accept_all[5] == 1 and accept_all[2] == 0
    for seed in range(20):
        a, nxt = hsd_accept(cands, m, q, p, torch.Generator().manual_seed(seed))
        assert a[0] == M and a[4] == M and a[2] == 0 and a[5] == 0
        assert ((0 <= nxt) & (nxt < V)).all()
        assert p[torch.arange(6), a, nxt].gt(0).all()  # never a token the target rules out
    a, nxt = hsd_accept(cands[:, :0], torch.zeros(6, dtype=torch.long), q[:, :0], p[:, :1])
    assert (a == 0).all()
    # impossible drafts (q(x) = 0, as if rounding had drawn them) over many positions stay finite
    M = 60
    q = torch.rand(2, M, V, generator=g).softmax(-1)
    p = torch.rand(2, M + 1, V, generator=g).softmax(-1)
    cands = torch.randint(V, (2, M), generator=g)
    q.scatter_(-1, cands[..., None], 0.0)
    p[1, 7, cands[1, 7]] = 0
    accept_all, stop, residual = hsd_branches(cands, torch.tensor([M, M]), q, p)
    assert torch.isfinite(accept_all).all() and torch.isfinite(stop).all() and torch.isfinite(residual).all()
    a, _ = hsd_accept(cands, torch.tensor([M, M]), q, p, g)
    assert a[0] == M and a[1] <= 7


def test_unknown_verification_is_refused_naming_the_choices():
    assert sampling.check_verification("hsd") == "hsd"
    with pytest.raises(ValueError, match="token, hsd"):
        sampling.check_verification("foo")


# --------------------------------------------------------------------------------------------- checkpoint default
def _tiny_checkpoint_model(**kw):
    import hispec
    from tiny import tiny_model

    base = tiny_model("llama")
    base.generation_config.eos_token_id = None
    return hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="shared", **kw)


def test_checkpoint_records_and_reads_back_the_verification_default(tmp_path):
    import hispec
    from hispec.model import HispecConfig

    model = _tiny_checkpoint_model(verification="hsd")
    model.save(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["hispec"]["decoding"]["verification"] == "hsd"
    loaded = hispec.load(tmp_path / "ckpt")
    assert loaded.hispec_config.verification == "hsd"
    ids = torch.tensor([[5, 6, 7, 8]])
    out = loaded.generate(ids, max_new_tokens=6, strategy="hispec", do_sample=True,
                          generator=torch.Generator().manual_seed(0))
    assert out.stats.verification == "hsd" and out.stats.as_dict()["verification"] == "hsd"
    assert loaded.generate(ids, max_new_tokens=6, strategy="hispec", verification="token").stats.verification == "token"
    # absent = token (checkpoints written before HSD existed), and a plain config does not grow the key
    dec = dict(cfg["hispec"]["decoding"])
    del dec["verification"]
    assert HispecConfig.from_dict({**cfg["hispec"], "decoding": dec}).verification == "token"
    assert "verification" not in HispecConfig.from_dict({**cfg["hispec"], "decoding": dec}).to_dict()["decoding"]
    cfg["hispec"]["decoding"]["verification"] = "foo"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hispec.CheckpointError, match="verification 'foo' is unknown.*token, hsd"):
        hispec.load(tmp_path / "ckpt")


def test_unknown_verification_is_refused_before_any_work():
    with pytest.raises(ValueError, match="token, hsd"):
        _tiny_checkpoint_model(verification="foo")
    model = _tiny_checkpoint_model()
    model.hispec_config.verification = "foo"  # set by hand: generate refuses it before touching the model
    calls = []
    model.adapter.run_layers = lambda *a, **k: calls.append(1)
    with pytest.raises(ValueError, match="unknown verification 'foo'"):
        model.generate(torch.tensor([[5, 6, 7]]), strategy="hispec", do_sample=True)
    assert not calls


def test_hispec_generate_cli_takes_the_verification(tmp_path, capsys):
    from tiny import char_tokenizer

    from hispec.cli.generate import main

    model = _tiny_checkpoint_model()
    model.tokenizer = char_tokenizer()
    model.save(tmp_path / "ckpt")
    argv = ["--model", str(tmp_path / "ckpt"), "--prompt", "hello there", "--max-new-tokens", "6", "--strategy",
            "hispec", "--do-sample", "--seed", "0", "--json"]
    assert main(argv + ["--verification", "hsd"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["stats"]["verification"] == "hsd" and line["new_tokens"] == 6
    with pytest.raises(SystemExit):
        main(argv + ["--verification", "foo"])
    assert "invalid choice: 'foo'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- counters
def test_counters_under_hsd_count_what_the_rule_buys():
    """LevelStats count accepted / proposed per verification under either rule; HSD's extra acceptances show up
    as more tokens per full pass (the exact gain of the rule is checked by enumeration above)."""
    from test_decoding import _tiny_vocab_model

    model = _tiny_vocab_model()
    ids = torch.tensor([[1, 3, 2]] * 2000)
    stats = {}
    for rule in ("token", "hsd"):
        out = model.generate(ids, max_new_tokens=12, strategy="self-spec", do_sample=True, gamma=4, verification=rule,
                             generator=torch.Generator().manual_seed(0))
        s = stats[rule] = out.stats
        assert s.new_tokens == 12 * len(ids)
        top = s.top
        assert 0 < top.accepted < top.proposed and 0 < top.rejections <= top.row_passes
        # every full pass after the prefill commits its accepted drafts plus one token of its own, up to the limit
        assert s.new_tokens <= len(ids) + top.accepted + (top.row_passes - len(ids))
        assert s.new_tokens >= top.accepted + (top.row_passes - len(ids))
    gain = stats["hsd"].tokens_per_target_pass / stats["token"].tokens_per_target_pass
    print(f"tokens per full pass: token {stats['token'].tokens_per_target_pass:.3f}, "
          f"hsd {stats['hsd'].tokens_per_target_pass:.3f} ({gain - 1:+.1%})")
    assert gain > 1.01


def test_oracle_heads_accept_everything_under_hsd_sampling():
    from test_decoding import _oracle, _wrap
    from tiny import tiny_model

    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.randint(3, 97, (4, 6), generator=torch.Generator().manual_seed(3))
    for strategy in ("self-spec", "hispec"):
        out = model.generate(ids, max_new_tokens=16, strategy=strategy, gamma=3, window=4, do_sample=True,
                             verification="hsd", generator=torch.Generator().manual_seed(0))
        for lv in out.stats.levels[1:]:
            assert lv.accepted == lv.proposed and lv.rejections == 0, (strategy, lv)
        assert out.stats.tokens_per_target_pass > 3
