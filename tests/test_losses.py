"""Distillation loss (hispec/distill/losses.py): KL against a reference, temperature, CE mix, chunking, padding; the
top-k + bucket loss used with cached features (exact at k = V, grouped KL below, finite at tiny remainders)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tiny import tiny_model
from hispec.distill.losses import (
    IGNORE_INDEX,
    bucket_log_mass,
    distill_loss,
    exit_states,
    kl_per_token,
    next_token_labels,
    topk_distill_loss,
)
from hispec.distill.metrics import expected_tokens_per_round

H, V = 16, 53


def _problem(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g)
    project = lambda x: x @ w.T  # noqa: E731  (a frozen "lm_head")
    teacher = torch.randn(n, H, generator=g)
    students = {k: torch.randn(n, H, generator=g, requires_grad=True) for k in ("draft", "verify")}
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return project, teacher, students, labels


def test_kl_matches_reference_with_temperature():
    project, teacher, students, _ = _problem()
    T = 2.0
    out = distill_loss(project, teacher, students, temperature=T)
    ref_total = 0.0
    for k, s in students.items():
        p = F.softmax(project(teacher) / T, -1).double()
        q = F.softmax(project(s) / T, -1).double()
        ref = (p * (p.log() - q.log())).sum(-1).mean()
        assert out.kl[k].item() == pytest.approx(ref.item(), rel=1e-5)
        ref_total += T**2 * ref.item()
    assert out.loss.item() == pytest.approx(ref_total, rel=1e-5)
    # torch's own kl_div agrees with the per-token reference
    t, s = project(teacher), project(students["draft"])
    torch_kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean")
    assert kl_per_token(t, s, T).mean().item() == pytest.approx(torch_kl.item(), rel=1e-5)


def test_ce_mix_is_cross_entropy_on_labelled_tokens():
    project, teacher, students, labels = _problem()
    out = distill_loss(project, teacher, {"draft": students["draft"]}, labels, ce_weight=1.0)
    ref = F.cross_entropy(project(students["draft"]), labels, ignore_index=IGNORE_INDEX)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    half = distill_loss(project, teacher, {"draft": students["draft"]}, labels, ce_weight=0.5)
    assert half.loss.item() == pytest.approx(0.5 * ref.item() + 0.5 * out.kl["draft"].item(), rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_loss_and_grads_equal_unchunked(chunk):
    project, teacher, students, labels = _problem()
    full = distill_loss(project, teacher, students, labels, temperature=1.5, ce_weight=0.3, chunk_size=10_000)
    g_full = torch.autograd.grad(full.loss, list(students.values()))
    part = distill_loss(project, teacher, students, labels, temperature=1.5, ce_weight=0.3, chunk_size=chunk)
    g_part = torch.autograd.grad(part.loss, list(students.values()))
    torch.testing.assert_close(part.loss, full.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_part, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for k in students:
        assert part.agree[k].item() == full.agree[k].item()


def test_identical_student_has_zero_kl_and_full_agreement():
    project, teacher, _, _ = _problem()
    out = distill_loss(project, teacher, {"draft": teacher.clone().requires_grad_()}, chunk_size=5)
    assert out.kl["draft"].abs().item() < 1e-6
    assert out.agree["draft"].item() == 1.0


def test_next_token_labels_skip_padding():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    valid = ids != 0
    assert next_token_labels(ids, valid).tolist() == [[6, 7, -100, -100], [9, -100, -100, -100]]


def test_padding_does_not_change_the_loss():
    """A padded row in a batch gives the same per-token KL as the row alone (padding is ignored)."""
    from hispec.distill.training import _batch_inputs

    model = tiny_model("llama")
    from hispec.model import EarlyExitModel

    ee = EarlyExitModel.from_base(model, 2, 4, "linear")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ee.heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(2, 97, (2, 9))
    long = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    padded = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    alone = {"input_ids": ids[1:, :5], "attention_mask": torch.ones(1, 5, dtype=torch.long)}

    def kl_of(batch):
        hidden, teacher, labels, row = _batch_inputs(batch, ee.adapter, (2, 4), torch.float32)
        feats = {k: ee.heads[k](h) for k, h in hidden.items()}
        out = distill_loss(ee.adapter.project, teacher, feats, labels, ce_weight=0.2, per_token=True)
        return out, row

    out_pad, row = kl_of(padded)
    out_alone, _ = kl_of(alone)
    assert out_pad.n_tokens == 9 + 5
    torch.testing.assert_close(out_pad.kl_tokens["draft"][row == 1], out_alone.kl_tokens["draft"], rtol=1e-4,
                               atol=1e-6)
    # junk in the padded slots changes nothing
    junk = dict(padded, input_ids=padded["input_ids"].masked_fill(mask == 0, 42))
    torch.testing.assert_close(kl_of(junk)[0].loss, out_pad.loss)
    assert out_pad.loss.item() != kl_of(long)[0].loss.item()


def test_exit_states_match_hf_hidden_states():
    """hs[l] of output_hidden_states is the residual after l layers; hs[L] is already normed (design.md §6)."""
    model = tiny_model("qwen2")
    from hispec.layers import DecoderAdapter

    ad = DecoderAdapter(model)
    ids = torch.randint(0, 97, (2, 7))
    mask = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(7).expand(2, 7)
    states, final = exit_states(ad, ids, pos, mask, (1, 3))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(states[1], hs[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[3], hs[3], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, hs[-1], rtol=1e-4, atol=1e-5)


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 3) == pytest.approx((1 - 0.5**4) / 0.5)
    assert math.isclose(expected_tokens_per_round(0.8, 1), 1.8)


# ---------------------------------------------------------------------------------------------------- top-k + bucket
def _topk_teacher(project, teacher, k):
    logp = F.log_softmax(project(teacher).float(), -1)
    vals, ids = logp.topk(k, -1)
    return ids, vals


def _grouped_kl_reference(project, teacher, student, k):
    """KL between the teacher and student distributions coarsened to {top-k tokens, everything else}, float64."""
    p = F.softmax(project(teacher).double(), -1)
    q = F.softmax(project(student).double(), -1)
    ids = p.topk(k, -1).indices
    pk, qk = p.gather(-1, ids), q.gather(-1, ids)
    pr, qr = 1 - pk.sum(-1), 1 - qk.sum(-1)
    return (pk * (pk.log() - qk.log())).sum(-1) + torch.where(pr > 0, pr * (pr.log() - qr.log()), 0.0)


def test_topk_loss_is_the_full_kl_when_k_is_the_vocabulary():
    project, teacher, students, labels = _problem()
    ids, logp = _topk_teacher(project, teacher, V)
    top = topk_distill_loss(project, students, ids, logp, labels, ce_weight=0.25)
    full = distill_loss(project, teacher, students, labels, ce_weight=0.25)
    torch.testing.assert_close(top.loss, full.loss, rtol=1e-5, atol=1e-6)
    g_top = torch.autograd.grad(top.loss, list(students.values()))
    g_full = torch.autograd.grad(full.loss, list(students.values()))
    for a, b in zip(g_top, g_full):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for k in students:
        assert top.agree[k].item() == full.agree[k].item()


@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_loss_is_the_grouped_kl_and_a_lower_bound(k):
    project, teacher, students, _ = _problem()
    ids, logp = _topk_teacher(project, teacher, k)
    out = topk_distill_loss(project, students, ids, logp, per_token=True)
    full = distill_loss(project, teacher, students, per_token=True)
    for name, s in students.items():
        ref = _grouped_kl_reference(project, teacher, s.detach(), k)
        torch.testing.assert_close(out.kl_tokens[name].double(), ref, rtol=1e-4, atol=1e-6)
        assert (out.kl_tokens[name] <= full.kl_tokens[name] + 1e-5).all()  # coarse-graining never adds KL
    # agreement is with the teacher's argmax, topk_ids[:, 0]
    arg = project(students["draft"]).argmax(-1)
    assert out.agree["draft"].item() == pytest.approx((arg == ids[:, 0]).float().mean().item())


@pytest.mark.parametrize("chunk", [1, 6])
def test_topk_loss_chunked_equals_unchunked(chunk):
    project, teacher, students, labels = _problem()
    ids, logp = _topk_teacher(project, teacher, 8)
    full = topk_distill_loss(project, students, ids, logp, labels, ce_weight=0.3, chunk_size=10_000)
    g_full = torch.autograd.grad(full.loss, list(students.values()))
    part = topk_distill_loss(project, students, ids, logp, labels, ce_weight=0.3, chunk_size=chunk)
    g_part = torch.autograd.grad(part.loss, list(students.values()))
    torch.testing.assert_close(part.loss, full.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_part, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_topk_loss_finite_with_tiny_or_rounded_away_remainders():
    project, teacher, students, _ = _problem(n=6)
    ids = torch.stack([torch.randperm(V)[:4] for _ in range(6)])
    # row 0: remainder 1e-30; row 1: sum of top-k rounds above 1; row 2: exactly all mass in one token
    probs = torch.tensor([[1 - 3e-30, 1e-30, 1e-30, 1e-30 - 1e-30]] + [[0.5, 0.3, 0.2, 1e-7]]
                         + [[1.0, 0.0, 0.0, 0.0]] + [[0.4, 0.3, 0.2, 0.05]] * 3, dtype=torch.float64)
    logp = probs.clamp(min=1e-45).log().float()
    log_r = bucket_log_mass(logp)
    assert torch.isfinite(log_r[3:]).all() and not torch.isnan(log_r).any()
    out = topk_distill_loss(project, students, ids, logp, per_token=True)
    grads = torch.autograd.grad(out.loss, list(students.values()))
    assert torch.isfinite(out.loss) and all(torch.isfinite(g).all() for g in grads)
    for name in students:
        assert (out.kl_tokens[name] > -1e-4).all()


def test_topk_loss_checks_shapes():
    project, teacher, students, _ = _problem()
    ids, logp = _topk_teacher(project, teacher, 4)
    with pytest.raises(ValueError, match="must both be"):
        topk_distill_loss(project, students, ids, logp[:, :3])


def test_fused_topk_kl_gradcheck_argmax_and_extreme_logits():
    from hispec.distill.losses import TopkBucketKL

    g = torch.Generator().manual_seed(5)
    s = torch.randn(4, 11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 11, generator=g, dtype=torch.float64)
    for k in (1, 3, 11):
        logp, ids = F.log_softmax(t, -1).topk(k, -1)
        log_r = bucket_log_mass(logp).double()

        def f(x, logp=logp, ids=ids, log_r=log_r):
            kl, log_z, _ = TopkBucketKL.apply(x, ids, logp, log_r)
            return kl * torch.arange(1, 5, dtype=x.dtype) + 0.3 * log_z

        assert torch.autograd.gradcheck(f, (s,), eps=1e-6, atol=1e-6)
    _, _, arg = TopkBucketKL.apply(s.detach(), ids[:, :3], logp[:, :3], log_r)
    assert torch.equal(arg, s.detach().argmax(-1))
    # logits 1000 apart: the rest's mass underflows exp() relative to the max, the loss must stay exact
    project, teacher, students, _ = _problem(n=5)
    big = lambda x: 300.0 * project(x)  # noqa: E731
    ids, logp = _topk_teacher(project, teacher, 4)
    out = topk_distill_loss(big, students, ids, logp, per_token=True)
    grads = torch.autograd.grad(out.loss, list(students.values()))
    assert all(torch.isfinite(x).all() for x in grads)
    for name, st in students.items():
        p = F.softmax(project(teacher).double(), -1)
        logq = F.log_softmax(big(st.detach()).double(), -1)
        pk, lqk = p.gather(-1, ids), logq.gather(-1, ids)
        rest = logq.scatter(-1, ids, float("-inf")).logsumexp(-1)
        pr = 1 - pk.sum(-1)
        ref = (pk * (pk.log() - lqk)).sum(-1) + pr * (pr.log() - rest)
        torch.testing.assert_close(out.kl_tokens[name].double(), ref, rtol=1e-4, atol=1e-3)


def test_topk_loss_ce_is_cross_entropy():
    project, teacher, students, labels = _problem()
    ids, logp = _topk_teacher(project, teacher, 6)
    out = topk_distill_loss(project, {"draft": students["draft"]}, ids, logp, labels, ce_weight=1.0)
    ref = F.cross_entropy(project(students["draft"]), labels, ignore_index=IGNORE_INDEX)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    g1 = torch.autograd.grad(out.loss, students["draft"])[0]
    g2 = torch.autograd.grad(ref, students["draft"])[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 4])
def test_top5_agreement_is_the_final_argmax_within_the_heads_top5_in_both_losses(chunk):
    project, teacher, students, labels = _problem()
    t_arg = project(teacher).argmax(-1)
    ids, logp = _topk_teacher(project, teacher, 8)
    full = distill_loss(project, teacher, students, labels, per_token=True, topk_agree=5, chunk_size=chunk)
    top = topk_distill_loss(project, students, ids, logp, labels, per_token=True, topk_agree=5, chunk_size=chunk)
    plain = distill_loss(project, teacher, students, labels, per_token=True)
    assert plain.topk_tokens is None  # only when asked for
    for name, s in students.items():
        ref = (project(s).topk(5, -1).indices == t_arg[:, None]).any(-1).float()
        assert torch.equal(full.topk_tokens[name], ref) and torch.equal(top.topk_tokens[name], ref)
        assert (full.topk_tokens[name] >= full.agree_tokens[name]).all()  # top-1 implies top-5
        torch.testing.assert_close(full.loss, plain.loss)  # the loss itself is unchanged
