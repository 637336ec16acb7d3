"""The EAGLE-3 drafter as a decoding level (`eagle`, `eagle-lookup`): greedy output equals plain greedy decoding
for every family, sampling keeps the target distribution (χ² with a power check), drafts really get accepted."""

from __future__ import annotations

import pytest
import torch
from test_decoding import _chi2_pvalue, _exact_joint, _hf_greedy, _ragged, _tiny_vocab_model, _wrap
from tiny import FAMILIES, tiny_model

from hispec import sampling
from hispec.decoding import rounds
from hispec.distill.drafter import DrafterCollator, DrafterForTraining, sequence_items, ttt_loss
from hispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter

EAGLE = ("eagle", "eagle-lookup")


def _trained_drafter(model, draft_vocab_size=None, steps=60, seed=0):
    """A drafter fitted for a moment to the model's own greedy continuations, so it drafts what the model says
    often enough for acceptance, rollback and re-entry of accepted tokens to all happen."""
    base = model.base
    torch.manual_seed(seed)
    V = model.adapter.vocab_size
    d = Eagle3Drafter(Eagle3Config.for_target(base.config, draft_vocab_size=draft_vocab_size))
    if draft_vocab_size:
        d.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size])
    d.init_from_target(base.get_output_embeddings().weight.detach(), None)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(3, V, (6, 5), generator=g)
    out = model.generate(prompts, max_new_tokens=24, strategy="ar")
    seqs = [(p.tolist() + t, 5) for p, t in zip(prompts, out.new_tokens)]
    batch = DrafterCollator(d.config.aux_layers, 3)(sequence_items(model.adapter, seqs, d.config.aux_layers))
    train = DrafterForTraining(d, base.get_input_embeddings()).train()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = ttt_loss(train, batch, 3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "opt"])
def test_greedy_with_the_drafter_equals_hf_generate(family):
    model = _wrap(tiny_model(family))
    model.attach_drafter(_trained_drafter(model, draft_vocab_size=60))
    ids, am = _ragged(4, 9)
    ref = _hf_greedy(model.base, ids, am, 17)
    accepted, gated = 0, 0
    for strategy in EAGLE:
        for gamma, gate in ((1, 0.0), (3, 0.0), (3, 0.5)):
            out = model.generate(ids, am, max_new_tokens=17, strategy=strategy, gamma=gamma, draft_gate=gate)
            assert torch.equal(out.sequences, ref), (strategy, gamma, gate)
            assert out.stats.levels[0].name in ("eagle3", "ngram|eagle3")
            accepted += out.stats.levels[1].accepted
            gated += out.stats.levels[0].gated
            assert gate or not out.stats.levels[0].gated
    assert accepted > 0  # drafts were accepted: the context re-entry path ran
    assert gated > 0  # and the confidence gate cut chains short


def test_drafts_are_accepted_and_rejected_and_each_row_equals_its_own_run():
    model = _wrap(tiny_model("llama"))
    model.attach_drafter(_trained_drafter(model, steps=120))
    ids = torch.randint(3, 97, (6, 5), generator=torch.Generator().manual_seed(1))  # the prompts it was fitted on
    am = torch.ones_like(ids)
    am[1, :2] = am[3, :1] = 0  # and two of them shortened (left padding)
    ids[am == 0] = 0
    both = model.generate(ids, am, max_new_tokens=20, strategy="eagle", gamma=4)
    assert torch.equal(both.sequences, _hf_greedy(model.base, ids, am, 20))
    lv = both.stats.levels[1]
    assert 0 < lv.accepted < lv.proposed and lv.rejections > 0
    with torch.no_grad():  # a sharper drafter (the same argmax, so the same drafts): its confidences spread out
        model.drafter.lm_head.weight.mul_(20)
    gated = model.generate(ids, am, max_new_tokens=20, strategy="eagle", gamma=4, draft_gate=0.4)
    assert torch.equal(gated.sequences, both.sequences)
    assert gated.stats.levels[0].gated > 0 and gated.stats.levels[1].proposed < lv.proposed
    # the drafts the gate drops are the ones least likely to pass: accepted per proposed draft goes up
    assert gated.stats.levels[1].acceptance > lv.acceptance
    for b in range(len(ids)):
        keep = am[b].bool()
        alone = model.generate(ids[b:b + 1, keep], max_new_tokens=20, strategy="eagle", gamma=4)
        assert alone.new_tokens[0] == both.new_tokens[b]
        alone = model.generate(ids[b:b + 1, keep], max_new_tokens=20, strategy="eagle", gamma=4, draft_gate=0.4)
        assert alone.new_tokens[0] == gated.new_tokens[b]
    with pytest.raises(ValueError, match="draft_gate must be in"):
        model.generate(ids, am, max_new_tokens=2, strategy="eagle", draft_gate=1.0)
    plain = model.generate(ids, am, max_new_tokens=20, strategy="ngram", draft_gate=0.6)  # ignored there
    assert torch.equal(plain.sequences, both.sequences) and plain.stats.levels[0].gated == 0


def test_opt_has_no_drafter_and_hierarchies_are_checked():
    model = _wrap(tiny_model("opt"))
    with pytest.raises(ValueError, match="embeds tokens in 16 dimensions"):
        Eagle3Config.for_target(model.base.config)
    model = _wrap(tiny_model("llama"))
    with pytest.raises(ValueError, match="needs an EAGLE-3 drafter"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, strategy="eagle")
    model.attach_drafter(_trained_drafter(model, steps=1))
    with pytest.raises(ValueError, match="drafts directly for the full model"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, strategy="eagle3>verify>full")
    other = _wrap(tiny_model("qwen3"))
    wrong = Eagle3Drafter(Eagle3Config.for_target(tiny_model("llama").config))
    wrong.config.target_num_layers = 7
    with pytest.raises(ValueError, match="made for a 7-layer model"):
        other.attach_drafter(wrong)


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "warped"])
@pytest.mark.parametrize("strategy", EAGLE)
@pytest.mark.parametrize("draft_vocab,gate", [(None, 0.0), (3, 0.0), (None, 0.6)], ids=["full", "vocab3", "gate"])
def test_sampling_with_the_drafter_matches_the_exact_distribution(strategy, warp, draft_vocab, gate):
    model = _tiny_vocab_model()
    d = Eagle3Drafter(Eagle3Config.for_target(model.base.config, draft_vocab_size=draft_vocab))
    if draft_vocab:  # a proposal with smaller support than the target's
        d.set_draft_vocab(torch.tensor([0, 2, 3]))
    with torch.no_grad():
        d.lm_head.weight.mul_(30)  # a confident drafter, clearly different from the target (gate 0.6 cuts ~1/3)
    model.attach_drafter(d)
    prompt, n = [1, 3, 2], 3
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    g = torch.Generator().manual_seed(11)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy=strategy, do_sample=True,
                         gamma=2, generator=g, draft_gate=gate, **warp)
    pvalue = _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs)
    print(f"{strategy} draft vocab {draft_vocab} gate {gate} {warp}: chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-4
    lv = out.stats.levels[1]
    assert 0 < lv.accepted < lv.proposed  # the test has teeth: proposals accepted and rejected
    assert (out.stats.levels[0].gated > 0) == (gate > 0)


def _power_check_setup():
    """A confident drafter on the tiny-vocabulary model and the exact joint law of its 3 new tokens."""
    model = _tiny_vocab_model()
    d = Eagle3Drafter(Eagle3Config.for_target(model.base.config))
    with torch.no_grad():
        d.lm_head.weight.mul_(30)
    model.attach_drafter(d)
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    return (model, prompt, n, warp, *_exact_joint(model, prompt, n, warp))


def test_the_distribution_test_rejects_a_wrong_rule_with_the_drafter(monkeypatch):
    model, prompt, n, warp, outcomes, probs = _power_check_setup()

    def always_accept(cands, m, q_rows, p_rows, generator=None):
        return m.clone(), sampling.sample(p_rows[torch.arange(len(m)), m], generator)

    monkeypatch.setattr(rounds, "speculative_accept", always_accept)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="eagle", do_sample=True,
                         gamma=2, generator=torch.Generator().manual_seed(11), **warp)
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) < 1e-6


def test_a_gate_on_the_drawn_drafts_own_probability_is_caught(monkeypatch):
    """The draft gate must read the drafter's distribution before a token is drawn: gating on the drawn token's
    own probability proposes from q cut to its likely tokens while verification divides by q, which biases the
    output. The chi-square test sees it (this is the rule the decoder does NOT use)."""
    from hispec.decoding import eagle

    model, prompt, n, warp, outcomes, probs = _power_check_setup()
    right = eagle._EagleDrafting._eagle_token

    def drawn_token_gate(self, logits, grow):
        token, _ = right(self, logits, grow)
        return token, self._eagle_probs(logits).gather(1, token[:, None])[:, 0]

    monkeypatch.setattr(eagle._EagleDrafting, "_eagle_token", drawn_token_gate)
    out = model.generate(torch.tensor([prompt] * 6000), max_new_tokens=n, strategy="eagle", do_sample=True,
                         gamma=2, generator=torch.Generator().manual_seed(11), draft_gate=0.6, **warp)
    assert out.stats.levels[0].gated > 0
    assert _chi2_pvalue([tuple(t) for t in out.new_tokens], outcomes, probs) < 1e-6


def test_the_bench_runs_gated_drafter_chains_beside_the_plain_ones():
    """hispec-bench's `eagle-gate:G` strategies: the drafter's chain with `draft_gate=G`, identical to `hf`,
    fewer drafts proposed than the ungated chain."""
    from hispec.bench.runner import BenchConfig, gate_of, run_bench, split_verification
    from hispec.prompts import Prompt
    from test_bench import char_tokenizer

    assert gate_of("eagle-gate:0.3") == ("eagle", 0.3) and gate_of("eagle-lookup-gate:0") == ("eagle-lookup", 0.0)
    assert gate_of("eagle") is None and split_verification("eagle-gate:0.3") == ("eagle-gate:0.3", None)
    for bad, message in (("eagle-gate:x", "must be a number"), ("eagle-gate:1.5", r"in \[0, 1\)")):
        with pytest.raises(ValueError, match=message):
            gate_of(bad)
    model = _wrap(tiny_model("llama"), tokenizer=char_tokenizer())
    d = _trained_drafter(model, steps=60)
    with torch.no_grad():
        d.lm_head.weight.mul_(20)  # confidences that spread around the gate
    model.attach_drafter(d)
    config = BenchConfig(strategies=("hf", "eagle", "eagle-gate:0.4", "eagle-lookup-gate:0.4"), max_new_tokens=12,
                         chat=False, warmup=0)
    result = run_bench(model, [Prompt("the cat sat on"), Prompt("a red cat")], config)
    by = {s: [r.samples[s][0] for r in result.records] for s in config.strategies}
    for s in config.strategies:
        assert all(x.tokens == y.tokens for x, y in zip(by[s], by["hf"])), s
    drafted = {s: sum(x.counters.drafted for x in by[s]) for s in ("eagle", "eagle-gate:0.4")}
    assert drafted["eagle-gate:0.4"] < drafted["eagle"]
