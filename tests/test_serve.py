"""Continuous batching (hispec.serve): every request's greedy output equals its solo output, whatever is in flight."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from tiny import FAMILIES, tiny_model

import hispec
from hispec.serve import Engine, EngineError, PagedKVCache, PagedKVStore, Request

STRATEGIES = ("ar", "self-spec", "hispec", "self-spec-lookup")


def _wrap(base, head_type="linear", seed=0):
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    model = hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type=head_type)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial heads, so rows accept different numbers of tokens
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _prompts(n, seed=0, vocab=97, lo=3, hi=20):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def _solo(model, req):
    out = model.generate(torch.tensor([req.prompt]), max_new_tokens=req.max_new_tokens, strategy=req.strategy,
                         gammas=req.gammas)
    return out.new_tokens[0]


def _staggered(engine, reqs, arrivals):
    """Submit reqs[i] before step arrivals[i]; step until everything is done; return the handles."""
    handles = [None] * len(reqs)
    step = 0
    while step <= max(arrivals) or engine.in_flight:
        for i, a in enumerate(arrivals):
            if a == step:
                handles[i] = engine.submit(reqs[i])
        engine.step()
        step += 1
        assert step < 10_000
    return handles


def _mixed_requests(n, seed=0, max_new=(1, 24)):
    g = torch.Generator().manual_seed(seed + 1)
    reqs = []
    for i, p in enumerate(_prompts(n, seed)):
        strategy = STRATEGIES[i % len(STRATEGIES)]
        gammas = None
        if strategy == "hispec" and i % 2:
            gammas = [int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))]
        reqs.append(Request(p, max_new_tokens=int(torch.randint(max_new[0], max_new[1], (1,), generator=g)),
                            strategy=strategy, gammas=gammas))
    return reqs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_staggered_greedy_equals_solo_on_every_family(family):
    model = _wrap(tiny_model(family))
    reqs = _mixed_requests(9, seed=len(family))
    arrivals = [0, 0, 1, 2, 2, 3, 5, 8, 13]
    engine = Engine(model, kv_blocks=64, block_size=4, max_batch=6, prefill_chunk=7)
    handles = _staggered(engine, reqs, arrivals)
    for req, h in zip(reqs, handles):
        assert h.finish_reason == "length"
        assert h.tokens == _solo(model, req), (req.strategy, req.gammas)
    assert engine.kv_blocks_used() == 0 and not engine.reserved and not engine.handles


def test_contiguous_cache_engine_gives_the_same_outputs():
    model = _wrap(tiny_model("llama"))
    reqs = _mixed_requests(7, seed=3)
    arrivals = [0, 1, 1, 2, 4, 4, 6]
    engine = Engine(model, paged=False, max_batch=4, prefill_chunk=None)
    for req, h in zip(reqs, _staggered(engine, reqs, arrivals)):
        assert h.tokens == _solo(model, req)


_WITHOUT_ALLOCATORS = r"""
import sys, warnings
sys.path.insert(0, sys.argv[1])
import torch
import transformers.generation.continuous_batching  # transformers itself, as an older one would be, loads fine
GONE = "transformers.generation.continuous_batching.cache_allocators"
for name in [m for m in list(sys.modules) if m.startswith(GONE)] + [GONE, GONE + ".cache_pool",
                                                                    GONE + ".full_attention"]:
    sys.modules[name] = None  # what an older transformers (5.17) lacks: importing it now fails
import hispec.serve as serve
from test_serve import _mixed_requests, _solo, _staggered, _wrap
from tiny import tiny_model
assert serve.PAGED_UNAVAILABLE and "--contiguous" in serve.PAGED_UNAVAILABLE, serve.PAGED_UNAVAILABLE
torch.set_num_threads(1)
model = _wrap(tiny_model("llama"))
try:
    serve.PagedKVStore.for_model(model, num_blocks=4)
    raise SystemExit("a paged store was built without allocators")
except serve.PagedKVUnavailable as e:
    assert "cache allocators" in str(e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = serve.Engine(model, max_batch=3, prefill_chunk=None)
assert not engine.paged and any("contiguous" in str(w.message) for w in caught)
reqs = _mixed_requests(4, seed=2)
for req, h in zip(reqs, _staggered(engine, reqs, [0, 0, 1, 3])):
    assert h.tokens == _solo(model, req), req.strategy
print("ok")
"""


def test_serving_imports_and_decodes_with_contiguous_caches_on_a_transformers_without_the_paged_allocators():
    """transformers 5.17 has no `continuous_batching.cache_allocators`: `hispec.serve` still imports there, the paged
    store says why it cannot be built, and the engine serves with contiguous caches (with a warning), exactly."""
    tests = pathlib.Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", _WITHOUT_ALLOCATORS, str(tests)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_layer_heads_keep_their_extra_kv_layer_in_the_paged_store():
    model = _wrap(tiny_model("qwen2"), head_type="layer")
    assert model.extra_cache_layers > 0
    reqs = _mixed_requests(6, seed=5)
    engine = Engine(model, kv_blocks=64, block_size=4, max_batch=4)
    for req, h in zip(reqs, _staggered(engine, reqs, [0, 0, 1, 3, 3, 4])):
        assert h.tokens == _solo(model, req)
    assert engine.kv_blocks_used() == 0


def test_rollback_frees_blocks_instead_of_leaving_holes():
    model = _wrap(tiny_model("llama"))
    engine = Engine(model, kv_blocks=64, block_size=2)
    h = engine.submit(Request(_prompts(1)[0], max_new_tokens=30, strategy="hispec", gammas=[3, 4]))
    peak = 0
    while engine.in_flight:
        engine.step()
        for run in engine.groups.values():
            cache = run.cache
            assert isinstance(cache, PagedKVCache)
            # every row owns exactly the blocks covering its longest layer: nothing beyond, no holes
            need = (cache.lens.max(0).values + 1) // 2
            assert [len(engine.store.allocator.block_table[r]) for r in cache.rids] == need.tolist()
            peak = max(peak, engine.kv_blocks_used())
    assert h.finished and peak > 0 and engine.kv_blocks_used() == 0


def test_paged_cache_refuses_tree_compaction():
    model = _wrap(tiny_model("llama"))
    store = PagedKVStore.for_model(model, num_blocks=4, block_size=4)
    with pytest.raises(NotImplementedError, match="tree"):
        PagedKVCache(store, [0]).compact(0, 1, 0, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1).bool())


def test_requests_beyond_the_pool_queue_or_are_refused():
    model = _wrap(tiny_model("llama"))
    engine = Engine(model, kv_blocks=10, block_size=4)
    with pytest.raises(EngineError, match="KV blocks"):
        engine.submit(Request(list(range(3, 30)), max_new_tokens=40))  # could never fit
    # each needs 6 of the 10 blocks: the second waits in the queue until the first finishes
    reqs = [Request(_prompts(1, seed=s, lo=8, hi=9)[0], max_new_tokens=12) for s in range(2)]
    hs = [engine.submit(r) for r in reqs]
    engine.step()
    assert engine.queue_length == 1 and len(engine.handles) == 1
    engine.run_until_idle()
    assert [h.tokens for h in hs] == [_solo(model, r) for r in reqs]
    assert engine.kv_blocks_used() == 0


def test_bad_requests_are_refused_with_a_clear_message():
    model = _wrap(tiny_model("llama"))
    engine = Engine(model, kv_blocks=64)
    for req, match in [(Request([]), "empty"), (Request([500]), "0..96"), (Request([5], max_new_tokens=0), ">= 1"),
                       (Request([5], max_new_tokens=300), "context"), (Request([5], strategy="nope"), "unknown"),
                       (Request([5], do_sample=True, temperature=0), "temperature")]:
        with pytest.raises(EngineError, match=match):
            engine.submit(req)
    assert engine.counts["rejected"] == 6 and engine.in_flight == 0


def test_cancel_frees_the_rows_blocks_and_leaves_the_others_exact():
    model = _wrap(tiny_model("mistral"))
    reqs = _mixed_requests(4, seed=7, max_new=(20, 30))
    engine = Engine(model, kv_blocks=64, block_size=4)
    hs = [engine.submit(r) for r in reqs]
    for _ in range(3):
        engine.step()
    engine.cancel(hs[1].id)
    engine.run_until_idle()
    assert hs[1].finish_reason == "cancelled"
    for i in (0, 2, 3):
        assert hs[i].tokens == _solo(model, reqs[i])
    assert engine.kv_blocks_used() == 0 and not engine.reserved


def test_stop_strings_and_eos_per_request():
    model = _wrap(tiny_model("llama"))
    base = model.base
    ref = _solo(model, Request([5, 6, 7], max_new_tokens=20))
    engine = Engine(model, kv_blocks=64, eos_token_id=ref[5])
    h = engine.submit(Request([5, 6, 7], max_new_tokens=20, strategy="hispec"))
    h2 = engine.submit(Request([9, 8, 7, 6], max_new_tokens=6, strategy="ar"))
    engine.run_until_idle()
    assert h.tokens == ref[: ref.index(ref[5]) + 1] and h.finish_reason == "stop"
    assert h2.finish_reason in ("length", "stop")
    del base


def test_sampling_rows_run_beside_greedy_rows():
    model = _wrap(tiny_model("llama"))
    engine = Engine(model, kv_blocks=64)
    greedy = Request([5, 6, 7, 8], max_new_tokens=15, strategy="hispec")
    hs = [engine.submit(Request([5, 6, 7], max_new_tokens=15, strategy=s, do_sample=True, temperature=0.8,
                                top_k=20)) for s in STRATEGIES]
    hg = engine.submit(greedy)
    engine.run_until_idle()
    assert all(h.finish_reason == "length" and len(h.tokens) == 15 for h in hs)
    assert hg.tokens == _solo(model, greedy)
    m = engine.metrics()
    assert m["kv_blocks_used"] == 0 and m["requests"]["finished"] == len(STRATEGIES) + 1 and m["acceptance"]


def test_long_prompt_prefill_in_chunks_while_others_decode():
    model = _wrap(tiny_model("qwen3"))
    engine = Engine(model, kv_blocks=128, block_size=8, prefill_chunk=16)
    short = Request(_prompts(1, seed=1)[0], max_new_tokens=25, strategy="self-spec")
    long = Request(_prompts(1, seed=2, lo=90, hi=100)[0], max_new_tokens=10, strategy="hispec")
    hs = engine.submit(short)
    engine.step()
    engine.step()
    hl = engine.submit(long)
    engine.step()
    before = len(hs.tokens)
    engine.step()
    assert len(hs.tokens) > before and not hl.tokens  # the short row decodes while the long prompt is prefilled
    engine.run_until_idle()
    assert hs.tokens == _solo(model, short) and hl.tokens == _solo(model, long)


@pytest.mark.slow
@pytest.mark.real_model
def test_staggered_greedy_equals_solo_on_smollm2(demo_model_dir):
    """SmolLM2-135M fp32, Spec-Bench prompts with mixed lengths, ar / self-spec / hispec rows in flight together,
    arriving while others decode; each output equals that prompt decoded alone."""
    from pathlib import Path

    from hispec.prompts import load_prompts

    model = hispec.EarlyExitModel.from_base(demo_model_dir, head_type="linear", dtype="fp32")
    path = Path(__file__).resolve().parents[1] / "data" / "eval" / "spec_bench_question.jsonl"
    texts = [p.text for p in load_prompts(path, num=6)]
    tok = model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for t in texts]
    reqs = [Request(p, max_new_tokens=n, strategy=s)
            for p, n, s in zip(prompts, (40, 12, 32, 24, 16, 36), STRATEGIES * 2)]
    engine = Engine(model, kv_blocks=256, block_size=16, prefill_chunk=64)
    handles = _staggered(engine, reqs, [0, 1, 1, 3, 6, 10])
    for req, h in zip(reqs, handles):
        assert h.tokens == _solo(model, req), req.strategy
    assert engine.kv_blocks_used() == 0


@pytest.mark.parametrize("strategy", ["self-spec", "hispec"])
def test_sampling_rows_joining_a_running_batch_keep_the_exact_distribution(strategy):
    """Sampled requests arrive while others are mid-round (their probability rows and caches are merged into the
    running batch); the joint law of their first 3 tokens is the model's (chi-square against exact enumeration)."""
    from test_decoding import WARPS, _chi2_pvalue, _exact_joint, _tiny_vocab_model

    model = _tiny_vocab_model()
    prompt, n, warp = [1, 3, 2], 3, WARPS[1]
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    engine = Engine(model, kv_blocks=4096, block_size=4, max_batch=48)
    handles, draws = [], 3000
    while len(handles) < draws or engine.in_flight:
        for _ in range(min(24, draws - len(handles))):
            handles.append(engine.submit(Request(prompt, max_new_tokens=n, strategy=strategy, do_sample=True,
                                                 gammas=[2] if strategy == "self-spec" else [2, 2], **warp)))
        engine.step()
    pvalue = _chi2_pvalue([tuple(h.tokens) for h in handles], outcomes, probs)
    assert pvalue > 1e-4, pvalue
    assert engine.stats().levels and engine.kv_blocks_used() == 0


def test_auto_rows_join_and_leave_with_their_own_policy_state():
    from test_auto import _calibrated

    model = _wrap(tiny_model("llama"))
    _calibrated(model, acceptance=lambda k: 0.6, match=0.5, realistic=True)
    reqs = [Request(p, max_new_tokens=n, strategy=s) for p, n, s in
            zip(_prompts(6, seed=9), (20, 6, 15, 25, 9, 12), ("auto", "auto", "hispec", "auto", "ar", "auto"))]
    engine = Engine(model, kv_blocks=128, block_size=4)
    runs, step = [], engine._step

    def step_and_keep_runs():  # (the runs' policies, to read after the engine folded them)
        worked = step()
        runs.extend(engine.groups.values())
        return worked

    engine._step = step_and_keep_runs
    for req, h in zip(reqs, _staggered(engine, reqs, [0, 0, 1, 2, 4, 5])):
        solo = model.generate(torch.tensor([req.prompt]), max_new_tokens=req.max_new_tokens, strategy=req.strategy)
        assert h.tokens == solo.new_tokens[0], req.strategy
    assert engine.kv_blocks_used() == 0
    # each request returns when done: `auto` prices a batch's round by every row's tokens (`_batch_pays`)
    policies = [r.policy for r in runs if r.policy is not None]
    assert policies and not any(p.together for p in policies)


def test_drafter_rows_join_and_leave_a_running_batch_exactly():
    """`eagle` / `eagle-lookup` requests of different lengths through the engine (runs of different widths joined,
    the drafter's per-row buffers included): each equals its solo run."""
    from test_eagle_decoding import _trained_drafter

    model = _wrap(tiny_model("llama"))
    model.attach_drafter(_trained_drafter(model, steps=60))
    prompts = _prompts(6, seed=4)
    reqs = [Request(p, max_new_tokens=n, strategy=s)
            for p, n, s in zip(prompts, [5, 19, 3, 12, 25, 8], ["eagle", "eagle-lookup"] * 3)]
    engine = Engine(model, kv_blocks=96, block_size=4, max_batch=4, prefill_chunk=6)
    handles = _staggered(engine, reqs, [0, 0, 1, 3, 4, 9])
    for req, h in zip(reqs, handles):
        assert h.tokens == _solo(model, req), req.strategy
    assert engine.kv_blocks_used() == 0
