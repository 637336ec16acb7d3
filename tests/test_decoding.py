"""Decoding is lossless: greedy equals HF greedy for every strategy and family; sampling keeps the distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny import FAMILIES, five_token_llama, negate_exits, tiny_model

import hispec
from hispec import sampling
from hispec.decoding import rounds

# every hierarchy shape: plain, one exit, two exits, n-gram alone / under one / two exits, an exit skipped, the
# lookup-first exit (`ngram|EXIT`) under the full model and under a verifier
STRATEGIES = ("ar", "self-spec", "hispec", "ngram", "ngram-self-spec", "ngram-hispec", "verify>full",
              "ngram>verify>full", "self-spec-lookup", "hispec-lookup", "ngram|verify>full")
SPECULATIVE = STRATEGIES[1:]


def _wrap(base, head_type="shared", draft=2, verify=4, **kw):
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    return hispec.EarlyExitModel.from_base(base, draft_layer=draft, verify_layer=verify, head_type=head_type, **kw)


def _linear_heads(family):
    """A tiny model of `family` with linear heads nudged off the identity, so rows accept different counts."""
    model = _wrap(tiny_model(family), head_type="linear")
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _ragged(B, P, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    am = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        am[b, : (b * 3) % (P - 1)] = 0  # left padding, a different amount per row
    ids[am == 0] = 0
    return ids, am


def _hf_greedy(base, ids, am, n, **kw):
    with torch.no_grad():
        return base.generate(input_ids=ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate_for_every_strategy(family):
    model = _wrap(tiny_model(family))
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=17, strategy=strategy, gamma=3, window=4)
        assert torch.equal(out.sequences, ref), strategy


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_each_row_equals_its_single_sequence_run(batch_size):
    model = _linear_heads("qwen2")
    ids, am = _ragged(batch_size, 8, seed=batch_size)
    ref = _hf_greedy(model.base, ids, am, 13)
    for strategy in SPECULATIVE:
        out = model.generate(ids, am, max_new_tokens=13, strategy=strategy, gamma=2, window=3)
        assert torch.equal(out.sequences, ref)
        for b in range(batch_size):
            single = model.generate(ids[b : b + 1, am[b].bool()], max_new_tokens=13, strategy=strategy, gamma=2,
                                    window=3)
            assert single.new_tokens[0] == out.new_tokens[b]


@pytest.mark.parametrize("gamma,window,max_new", [(1, 1, 5), (3, 4, 7), (4, 2, 11), (5, 6, 9)])
def test_max_length_falling_inside_a_draft_or_window(gamma, window, max_new):
    model = _wrap(tiny_model("llama"))
    ids, am = _ragged(3, 6)
    ref = _hf_greedy(model.base, ids, am, max_new)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=max_new, strategy=strategy, gamma=gamma, window=window)
        assert torch.equal(out.sequences, ref)
        assert all(len(t) == max_new for t in out.new_tokens)


def test_eos_inside_a_window_stops_the_row_exactly_like_hf():
    model = _wrap(tiny_model("mistral"))
    ids, am = _ragged(3, 7)
    free = _hf_greedy(model.base, ids, am, 20)
    eos = int(free[0, 7 + 5])  # a token row 0 produces at step 6: it becomes EOS
    ref = _hf_greedy(model.base, ids, am, 20, eos_token_id=eos)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=20, strategy=strategy, gamma=3, window=4, eos_token_id=eos,
                             pad_token_id=0)
        assert torch.equal(out.sequences, ref[:, : out.sequences.shape[1]]), strategy
        assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) <= 6


def _oracle(base, draft):
    """Make every layer from `draft` on an identity on the residual stream: exits agree with the final layer."""
    with torch.no_grad():
        for layer in base.model.layers[draft:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return base


def _record_positions(model):
    seen = []
    run = model.adapter.run_layers

    def spy(hidden, start, end, *, position_ids, cache, valid=None, **kw):  # (kw: e.g. an EAGLE-3 level's capture)
        v = torch.ones(position_ids.shape, dtype=torch.bool) if valid is None else valid
        for b, t in v.nonzero().tolist():
            for layer in range(start, end):
                seen.append((layer, b, int(position_ids[b, t])))
        return run(hidden, start, end, position_ids=position_ids, cache=cache, valid=valid, **kw)

    model.adapter.run_layers = spy
    return seen


@pytest.mark.parametrize("strategy", ["self-spec", "hispec"])
def test_oracle_heads_accept_everything_and_no_position_is_processed_twice(strategy):
    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    ref = _hf_greedy(model.base, ids, torch.ones_like(ids), 16)
    seen = _record_positions(model)
    out = model.generate(ids, max_new_tokens=16, strategy=strategy, gamma=3, window=4)
    assert torch.equal(out.sequences, ref)
    assert len(seen) == len(set(seen)), "a layer processed the same position twice"
    s = out.stats
    assert s.accepted_at_target == s.proposed_to_target
    if strategy == "hispec":
        assert s.accepted_at_verify == s.proposed_to_verify
    assert s.layer_evals == len(seen) <= (6 + 16) * model.num_layers  # each position at most once per layer
    assert s.tokens_per_target_pass > 3


def test_heads_that_accept_nothing_still_give_identical_output():
    model = negate_exits(_wrap(tiny_model("gemma3"), head_type="linear"))
    ids, am = _ragged(3, 8)
    ref = _hf_greedy(model.base, ids, am, 12)
    for strategy in SPECULATIVE:
        out = model.generate(ids, am, max_new_tokens=12, strategy=strategy, gamma=3, window=2)
        assert torch.equal(out.sequences, ref)
        if "ngram" not in strategy and "lookup" not in strategy:  # (a lookup copies the repeats these models fall into)
            assert out.stats.accepted_at_target <= 2


def test_stats_count_stages_consistently():
    model = _wrap(tiny_model("qwen3"))
    ids, am = _ragged(2, 6)
    ar = model.generate(ids, am, max_new_tokens=10, strategy="ar")
    assert ar.stats.target_passes == 10 and ar.stats.drafted == 0 and ar.stats.new_tokens == 20
    assert ar.stats.layer_evals == (int(am.sum()) - 2 + 20) * model.num_layers
    hs = model.generate(ids, am, max_new_tokens=10, strategy="hispec", gamma=2, window=3)
    s = hs.stats
    assert s.new_tokens == 20 and s.drafted > 0 and s.verify_passes > 0 and s.target_passes > 0
    assert 0 <= s.accepted_at_verify <= s.proposed_to_verify <= s.drafted
    assert set(s.seconds) == {"prefill", "draft", "verify", "target"}
    assert s.as_dict()["tokens_per_target_pass"] == s.tokens_per_target_pass


class _Collect:
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.chunks.append("END")


def test_streamer_receives_tokens_as_they_are_committed():
    model = _wrap(tiny_model("llama"))
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    streamer = _Collect()
    out = model.generate(ids, max_new_tokens=9, strategy="hispec", streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist() and streamer.chunks[-1] == "END"
    assert sum(streamer.chunks[1:-1], []) == out.new_tokens[0]


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_end_the_row_after_the_completing_token():
    model = _wrap(tiny_model("llama"))
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    free = model.generate(ids, max_new_tokens=12, strategy="ar").new_tokens[0]
    stop = _CharTokenizer().decode(free[4:6])
    for strategy in STRATEGIES:
        out = model.generate(ids, max_new_tokens=12, strategy=strategy, stop_strings=[stop], tokenizer=_CharTokenizer())
        text = _CharTokenizer().decode(out.new_tokens[0])
        assert stop in text and stop not in text[:-1]
        assert out.new_tokens[0] == free[: len(out.new_tokens[0])]


class _CountingCharTokenizer(_CharTokenizer):
    def __init__(self):
        self.decoded = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("strategy", ["ar", "hispec", "ngram-hispec"])
def test_commit_reads_only_new_tokens_so_long_outputs_stay_linear(strategy):
    """Stop strings spanning round boundaries are found at the same token as a scan of the whole text would, while
    each round decodes only a bounded window behind its new tokens (the old scan decoded everything every round)."""
    model = _wrap(tiny_model("llama"))
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    n = 120
    free = model.generate(ids, max_new_tokens=n, strategy="ar").new_tokens
    stop = _CharTokenizer().decode(free[0][100:103])
    tok = _CountingCharTokenizer()
    out = model.generate(ids, max_new_tokens=n, strategy=strategy, stop_strings=[stop], tokenizer=tok, gamma=3)
    for b in range(2):
        text = _CharTokenizer().decode(free[b])
        first = text.find(stop)
        want = free[b][: first + len(stop)] if first >= 0 else free[b]
        assert out.new_tokens[b] == want
    assert max(tok.decoded) <= 2 * len(stop) + 8 + 2 * 8 + 2  # the window behind new tokens, plus one round's


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(gamma=0), "gamma"),
        (dict(window=0), "window"),
        (dict(strategy="nope"), "unknown strategy"),
        (dict(max_new_tokens=10_000), "exceeds the model's context"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(strategy="verify>draft>full"), "strictly deeper"),
        (dict(strategy="draft>ngram>full"), "lowest level"),
        (dict(strategy="draft>verify"), "must end with the full model"),
        (dict(strategy="ngram>L3>full"), "unknown strategy or level 'L3'"),
        (dict(strategy="ngram|full"), "pairs the lookup with an exit"),
        (dict(strategy="ngram|L3>full"), "pairs the lookup with an exit"),
        (dict(strategy="draft>ngram|verify>full"), "can only be the lowest level"),
        (dict(strategy="hispec-lookup", tree=[2, 1]), "one draft exit or the EAGLE-3 drafter under the full model"),
        (dict(strategy="hispec", gammas=[2]), "one per level"),
        (dict(strategy="self-spec", gammas=[0]), "gammas must be integers >= 1"),
        (dict(strategy="ngram", ngram=dict(max_ngram=0)), "max_ngram must be an integer >= 1"),
        (dict(strategy="ngram", ngram=dict(min_ngram=3, max_ngram=2)), "min_ngram"),
        (dict(do_sample=True, verification="foo"), "unknown verification 'foo': choose one of token, hsd"),
        (dict(verification="HSD"), "unknown verification"),
    ],
)
def test_bad_input_gets_a_clear_error_before_any_work(kwargs, match):
    model = _wrap(tiny_model("llama"))
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[5, 6, 7]]), **kwargs)


class _RandomGammas:
    """A policy that gives every row random gammas each round, 0 (level and all below off) included."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.zeros = 0

    def choose(self, run):
        for i, lv in enumerate(run.levels[:-1]):
            run.gam[i] = torch.randint(0, 5, run.gam[i].shape, generator=self.g)
            self.zeros += int((run.gam[i] == 0).sum())

    def observe(self, *a):
        pass

    def keep_rows(self, idx):
        pass


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gemma2"])
def test_rows_switching_levels_on_and_off_every_round_stay_identical(family):
    """Per-row gammas, 0 = the row does not use that level or any below it (down to plain decoding), changed at
    random every round in one batch: greedy output is still transformers' own, for every hierarchy."""
    model = _linear_heads(family)
    ids, am = _ragged(5, 9, seed=4)
    ref = _hf_greedy(model.base, ids, am, 15)
    for strategy in SPECULATIVE:
        policy = _RandomGammas(seed=len(strategy))
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, policy=policy)
        assert torch.equal(out.sequences, ref), strategy
        assert policy.zeros > 0


def test_the_lookup_first_exit_drafts_where_the_lookup_finds_nothing():
    """`ngram|draft`: a row whose context repeats is served by the lookup (no exit pass), the others by the exit;
    output is hf's either way, and the level's name says both drafters."""
    model = _wrap(_oracle(tiny_model("llama"), 2))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 21, 33, 45, 57, 69, 81, 93, 11, 23]])
    ref = _hf_greedy(model.base, ids, torch.ones_like(ids), 12)
    out = model.generate(ids, max_new_tokens=12, strategy="self-spec-lookup", gamma=2)
    assert torch.equal(out.sequences, ref)
    lv0 = out.stats.levels[0]
    assert lv0.name == "ngram|L2" and 0 < lv0.lookups < lv0.proposals
    assert out.stats.strategy == "ngram|L2>full"


def test_empty_prompt_is_refused():
    model = _wrap(tiny_model("llama"))
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 0]]))


# ---------------------------------------------------------------------------------------------- sampling
def _tiny_vocab_model(seed=0, head_type="linear"):
    model = _wrap(five_token_llama(seed), head_type=head_type, draft=1, verify=2)
    with torch.no_grad():  # heads clearly different from the final layer: q != r != p
        for head in model.heads.values():
            head.adapter.weight.copy_(torch.randn_like(head.adapter.weight) * 0.8)
    return model


def _exact_joint(model, prompt, n, warp):
    """Exact distribution of the first n new tokens, enumerated from the model's own logits."""
    V = model.adapter.vocab_size
    outcomes = list(itertools.product(range(V), repeat=n))
    probs = []
    with torch.no_grad():
        for seq in outcomes:
            ids = torch.tensor([prompt + list(seq)])
            logits = model.base(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            p = sampling.logits_to_probs(logits, **warp)
            probs.append(float(torch.prod(p[torch.arange(n), torch.tensor(seq)])))
    return outcomes, torch.tensor(probs)


def _draw(model, prompt, n, warp, strategy, draws, seed, gamma=2, window=2, verification="token"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * draws)
    out = model.generate(ids, max_new_tokens=n, strategy=strategy, do_sample=True, gamma=gamma, window=window,
                         generator=g, verification=verification, **warp)
    assert out.stats.verification == verification
    return [tuple(t) for t in out.new_tokens]


def _chi2_pvalue(samples, outcomes, probs):
    from scipy import stats

    counts = torch.zeros(len(outcomes))
    index = {o: i for i, o in enumerate(outcomes)}
    for s in samples:
        counts[index[s]] += 1
    expected = probs / probs.sum() * len(samples)
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


WARPS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)]
# sequence-level verification (hispec.sampling.hsd_accept) at every level: one exit, two exits, an n-gram (point-mass
# proposals) under two exits
HSD_STRATEGIES = ("self-spec", "hispec", "ngram-hispec", "hispec-lookup")
SAMPLING_CASES = [(s, "token") for s in SPECULATIVE] + [(s, "hsd") for s in HSD_STRATEGIES]


@pytest.mark.parametrize("warp", WARPS, ids=["plain", "warped"])
@pytest.mark.parametrize("strategy,verification", SAMPLING_CASES, ids=[f"{s}-{v}" for s, v in SAMPLING_CASES])
def test_sampling_matches_the_exact_distribution(strategy, verification, warp):
    model = _tiny_vocab_model()
    prompt, n = [1, 3, 2], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=11, verification=verification)
    pvalue = _chi2_pvalue(samples, outcomes, probs)
    print(f"{strategy} {verification} {warp}: chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-4
    if "ngram" in strategy:  # the test has teeth: point-mass proposals were made, some accepted, some rejected
        out = model.generate(torch.tensor([prompt] * 500), max_new_tokens=n, strategy=strategy, do_sample=True,
                             gamma=2, window=2, generator=torch.Generator().manual_seed(1),
                             verification=verification, **warp)
        lv = out.stats.levels[1]
        assert out.stats.levels[0].proposed > 100 and 0 < lv.accepted < lv.proposed
    if "lookup" in strategy:  # both drafters of the level proposed: the lookup's point masses and the exit's rows
        out = model.generate(torch.tensor([prompt] * 500), max_new_tokens=n, strategy=strategy, do_sample=True,
                             gamma=2, window=2, generator=torch.Generator().manual_seed(1),
                             verification=verification, **warp)
        lv0 = out.stats.levels[0]
        assert 50 < lv0.lookups < lv0.proposals and 0 < out.stats.levels[1].accepted < out.stats.levels[1].proposed


@pytest.mark.parametrize("strategy", ["hispec", "ngram", "self-spec-lookup"])
def test_the_distribution_test_rejects_a_wrong_acceptance_rule(monkeypatch, strategy):
    model = _tiny_vocab_model()
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)

    def always_accept(cands, m, q_rows, p_rows, generator=None):  # the classic bug: no rejection step
        a = m.clone()
        return a, sampling.sample(p_rows[torch.arange(len(m)), a], generator)

    monkeypatch.setattr(rounds, "speculative_accept", always_accept)
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=11)
    assert _chi2_pvalue(samples, outcomes, probs) < 1e-6


@pytest.mark.parametrize("strategy", ["hispec", "ngram-hispec"])
def test_the_distribution_test_rejects_a_wrong_rule_under_hsd(monkeypatch, strategy):
    """The hsd runs above go through `hsd_accept`: replacing it by a rule without rejections is detected."""
    model = _tiny_vocab_model()
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)

    def always_accept(cands, m, q_rows, p_rows, generator=None):
        return m.clone(), sampling.sample(p_rows[torch.arange(len(m)), m], generator)

    monkeypatch.setattr(rounds, "hsd_accept", always_accept)
    monkeypatch.setattr(rounds, "speculative_accept", None)  # and nothing falls back to the token-wise rule
    samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=11, verification="hsd")
    pvalue = _chi2_pvalue(samples, outcomes, probs)
    print(f"{strategy} hsd, always-accept: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6


def test_the_distribution_test_sees_the_reference_codes_capping(monkeypatch):
    """A subtle wrong rule: HSD with the authors' code's min(P, Q) capping (tests/test_hsd.py) is detected too."""
    from test_hsd import _variant

    model = _tiny_vocab_model()
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    monkeypatch.setattr(sampling, "hsd_branches", _variant("min"))
    samples = _draw(model, prompt, n, warp, "self-spec", draws=6000, seed=11, verification="hsd")
    pvalue = _chi2_pvalue(samples, outcomes, probs)
    print(f"self-spec hsd, min(P, Q) capping: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_output_is_the_same_under_either_verification(family):
    """Greedy decoding matches exact prefixes: `verification` changes nothing (also in the checkpoint default)."""
    model = _linear_heads(family)
    ids, am = _ragged(3, 8, seed=2)
    ref = _hf_greedy(model.base, ids, am, 14)
    for strategy in SPECULATIVE:
        outs = [model.generate(ids, am, max_new_tokens=14, strategy=strategy, gamma=3, window=3, verification=v)
                for v in ("token", "hsd")]
        assert torch.equal(outs[0].sequences, ref) and torch.equal(outs[1].sequences, ref), strategy
        assert [lv.as_dict() | {"seconds": 0} for lv in outs[0].stats.levels] == [
            lv.as_dict() | {"seconds": 0} for lv in outs[1].stats.levels]
    model.hispec_config.verification = "hsd"
    assert model.generate(ids, am, max_new_tokens=14, strategy="hispec").stats.verification == "hsd"
    assert torch.equal(model.generate(ids, am, max_new_tokens=14, strategy="hispec").sequences, ref)
