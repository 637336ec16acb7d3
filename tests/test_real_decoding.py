"""End to end on the real SmolLM2-135M-Instruct: strategies reproduce transformers' greedy output."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import hispec
from hispec import latency
from hispec.bench import TieChecker
from hispec.decoding import _as_list
from hispec.prompts import encode_prompts, load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[1] / "data" / "eval" / "spec_bench_question.jsonl"  # ships in the repo

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def spec_bench_prompts():
    return [p.text for p in load_prompts(SPEC_BENCH, num=40)]  # round-robin over the 13 categories


def _reference(model, ids, mask, n):
    with torch.no_grad():
        ref = model.base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    eos = set(_as_list(model.base.generation_config.eos_token_id))
    rows = []
    for row in ref[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("num,new_tokens", [(5, 64), pytest.param(40, 128, marks=pytest.mark.slow)])
def test_spec_bench_fp32_greedy_is_identical_to_hf(demo_model_dir, spec_bench_prompts, num, new_tokens):
    """Spec-Bench prompts (5 x 64 new tokens, one per category for 5 of the 13; all 40 x 128 in the slow suite),
    batched (left-padded), untrained heads at L_d=4, L_i=8. Small in the default suite: five strategies at near-zero
    acceptance (untrained exits) took ~10 min at 5 x 128 on one AVX2 EPYC core and ~19 min at 10 x 128 on an
    AVX-512 EPYC."""
    model = hispec.EarlyExitModel.from_base(demo_model_dir, head_type="linear", dtype="fp32")
    ids, mask = encode_prompts(model.tokenizer, spec_bench_prompts[:num])
    ref = _reference(model, ids, mask, new_tokens)
    # auto with a calibration whose priors make rows speculate at first (and then adapt)
    cal = latency.calibrate(model, [[1, 2, 3, 4]], max_new_tokens=8, repeats=2)
    model.hispec_config.calibration = dataclasses.replace(cal, acceptance={k: 0.6 for k in cal.acceptance},
                                                          ngram_match=0.5).to_dict()
    for strategy in ("self-spec", "hispec", "ngram-hispec", "self-spec-lookup", "auto"):
        out = model.generate(ids, mask, max_new_tokens=new_tokens, strategy=strategy, gamma=3, window=4)
        for b, new in enumerate(out.new_tokens):
            assert new == ref[b], f"{strategy} row {b} differs from transformers' greedy output"


def test_bf16_ar_is_bit_identical_and_speculation_parts_only_at_rounding_ties(demo_model_dir, spec_bench_prompts):
    from hispec.io import matmul_speed_ratio

    # CPUs without native bf16 (AVX2-only) emulate it ~100x slower than fp32: same checks on a smaller sample there
    n_prompts, n_new = (3, 48) if matmul_speed_ratio() < 4 else (1, 24)
    model = hispec.EarlyExitModel.from_base(demo_model_dir, head_type="linear", dtype="bf16")
    ties = TieChecker(model)
    for text in spec_bench_prompts[:n_prompts]:
        ids, mask = encode_prompts(model.tokenizer, [text])
        ref = _reference(model, ids, mask, n_new)[0]
        assert model.generate(ids, mask, max_new_tokens=n_new, strategy="ar").new_tokens[0] == ref
        for strategy in ("self-spec", "hispec", "ngram-hispec", "self-spec-lookup"):
            new = model.generate(ids, mask, max_new_tokens=n_new, strategy=strategy, gamma=3, window=4).new_tokens[0]
            margin, own = ties.margin(ids, mask, ref, new), ties.own_margin(ids, mask, ref, new)
            assert margin is None or abs(margin) < 0.5 or abs(own[0]) <= own[1], \
                f"{strategy} left hf at a clear (non-tie) margin: fp32 {margin}, bf16 {own}"
