"""End to end on the real SmolLM2-135M-Instruct: every strategy reproduces transformers' greedy output exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hispec
from hispec.prompts import encode_prompts, load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "spec_bench_question.jsonl"

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def spec_bench_prompts():
    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH} not found")
    return [p.text for p in load_prompts(SPEC_BENCH, num=20)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_spec_bench_greedy_is_identical_to_hf(demo_model_dir, spec_bench_prompts, dtype):
    """20 Spec-Bench prompts x 128 new tokens, batched (left-padded), untrained heads at L_d=4, L_i=8."""
    model = hispec.EarlyExitModel.from_base(demo_model_dir, head_type="linear", dtype=dtype)
    ids, mask = encode_prompts(model.tokenizer, spec_bench_prompts)
    with torch.no_grad():
        ref = model.base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False)
    ref_new = ref[:, ids.shape[1] :]
    eos = set(hispec.decoding._as_list(model.base.generation_config.eos_token_id))
    for strategy in ("self-spec", "hispec"):
        out = model.generate(ids, mask, max_new_tokens=128, strategy=strategy, gamma=3, window=4)
        for b, new in enumerate(out.new_tokens):
            expect = ref_new[b].tolist()
            cut = next((i + 1 for i, t in enumerate(expect) if t in eos), len(expect))
            assert new == expect[:cut], f"{strategy} row {b} differs from transformers' greedy output"
