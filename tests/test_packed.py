"""Prepacked CPU linears (`hispec.packed`): the same products as nn.Linear, lossless decoding on a packed model,
the stock fallback, and the calibration's record of which kernels it timed."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import REAL_SPEED_RATIO
from tiny import FAMILIES, tiny_model

import hispec
from hispec import latency, packed

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN prepacked linear")

STRATEGIES = ("ar", "self-spec", "hispec", "ngram-hispec", "self-spec-lookup", "hispec-lookup")


def _wrap(base, head_type="linear"):
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    return hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type=head_type)


def _ids(B=3, P=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (B, P), generator=g)
    am = torch.ones(B, P, dtype=torch.long)
    am[1, :3] = 0
    ids[am == 0] = 0
    return ids, am


def _hf(base, ids, am, n):
    with torch.no_grad():
        return base.generate(input_ids=ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0)


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed.available(torch.bfloat16), reason="this CPU packs no bf16 linears (AVX2 only: no AVX512-BW/VL/DQ)"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_the_linear_product(dtype, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    p = packed.PackedLinear.wrap(lin)
    assert p.weight is lin.weight and p.bias is lin.bias  # the same Parameters
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for shape in [(1, 48), (5, 48), (2, 7, 48), (3, 1, 48)]:
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            ref = torch.nn.functional.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
            got = p(x)
        assert got.dtype == dtype and got.shape == (*shape[:-1], 80)
        torch.testing.assert_close(got.float(), ref, **tol)
    x = torch.randn(4, 48).to(dtype)
    with torch.no_grad():
        assert p.covers(x)
        with packed.stock():  # the stock kernel, bit for bit
            assert not p.covers(x)
            assert torch.equal(p(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert p.covers(x)
    assert not p.covers(x.float() if dtype == torch.bfloat16 else x.double())  # another dtype: stock path


def test_a_packed_linear_follows_its_weight_and_falls_back_under_autograd():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    p = packed.PackedLinear.wrap(lin)
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = p(x)
        lin.weight.mul_(2.0)  # an in-place update: the packed copy is remade
        torch.testing.assert_close(p(x), x @ lin.weight.t() + lin.bias, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(first, p(x))
    y = p(x)  # grad enabled and the weight requires grad: the stock path, with gradients
    y.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == lin.weight.shape
    clone = copy.deepcopy(p)  # the opaque copy is dropped, remade on use
    assert clone._copies == {}
    with torch.no_grad():
        torch.testing.assert_close(clone(x), p(x))


def test_packing_keeps_ties_state_dict_and_module_types():
    base = tiny_model("qwen2")
    base.lm_head.weight = base.get_input_embeddings().weight  # tied embeddings, as in Qwen2.5-1.5B
    model = _wrap(base)
    before = {k: v.clone() for k, v in model.base.state_dict().items()}
    n_linear = sum(type(m) is torch.nn.Linear for m in model.base.modules())
    assert packed.pack(model.base) == n_linear > 0
    assert packed.pack(model.base) == 0  # idempotent
    assert packed.kind(model.base) == packed.KIND and packed.kind(tiny_model("llama")) == packed.STOCK
    assert model.base.lm_head.weight is model.base.get_input_embeddings().weight
    after = model.base.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(isinstance(m, torch.nn.Linear) for m in model.base.modules() if isinstance(m, packed.PackedLinear))


def test_pack_refuses_a_model_off_the_cpu():
    with torch.device("meta"):
        lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(packed.PackingUnavailable, match="CPU kernel"):
        packed.pack(lin)
    assert not packed.wanted(None, "meta", torch.float32) and not packed.wanted(None, "cpu", torch.float16)
    assert packed.wanted(None, "cpu", torch.float32) and packed.wanted(True, "meta", None)
    assert not packed.wanted(False, "cpu", torch.float32)


def test_a_dtype_this_cpu_cannot_pack_is_left_stock_by_default_and_refused_when_asked(monkeypatch):
    monkeypatch.setattr(packed, "_available", {torch.float32: True, torch.bfloat16: False})
    monkeypatch.setattr(packed, "_packable", frozenset({torch.float32}))
    model = hispec.EarlyExitModel.from_base(tiny_model("llama", dtype=torch.bfloat16), 1, 2, "linear")
    assert not packed.wanted(None, "cpu", torch.bfloat16) and packed.wanted(None, "cpu", torch.float32)
    packed.apply(model, None)  # the default: stock kernels, no error
    assert packed.kind(model.base) == packed.STOCK
    with pytest.raises(packed.PackingUnavailable, match="no oneDNN prepacked linear for bfloat16"):
        packed.pack(model.base)
    p = packed.PackedLinear.wrap(torch.nn.Linear(8, 8).to(torch.bfloat16))
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert not p.covers(x) and torch.equal(p(x), torch.nn.functional.linear(x, p.weight, p.bias))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_on_a_packed_model_equals_hf_generate_for_every_strategy(family):
    """Lossless with respect to the model it runs: on a packed model every strategy equals transformers' greedy
    `generate` of that same model; and in fp32 these tiny models decode the same packed or not."""
    base = tiny_model(family)
    model = _wrap(base)
    ids, am = _ids()
    stock = _hf(model.base, ids, am, 15)
    packed.apply(model)
    assert packed.kind(model.base) == packed.KIND and packed.kind(model.heads) == packed.KIND
    assert model.adapter.parts.lm_head is model.base.get_output_embeddings()  # the adapter runs the packed lm_head
    assert isinstance(model.adapter.parts.lm_head, packed.PackedLinear)
    ref = _hf(model.base, ids, am, 15)
    assert torch.equal(ref, stock)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy
    out = model.generate(ids, am, max_new_tokens=15, strategy="self-spec", tree=[3, 2])
    assert torch.equal(out.sequences, ref)


KERNEL_PAIRS = [(packed.TRANSPOSED, packed.PACKED), pytest.param(
    (packed.STREAMED, packed.STREAMED),
    marks=pytest.mark.skipif(not hispec.matvec.available(), reason="no AVX2 + FMA x86 CPU or no C compiler here"))]


@pytest.mark.parametrize("kernels", KERNEL_PAIRS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_on_one_sequence_with_other_kernels_equals_hf_generate_for_every_strategy(family, kernels):
    """Other kernels for one-row products (a single sequence's one-position passes) and for the rest: every strategy
    still gives transformers' greedy `generate` of the same model on one sequence (a batch: the test above)."""
    model = _wrap(tiny_model(family))
    packed.pack(model.base, kernels)
    packed.pack(model.heads, kernels)
    model.adapter.refresh_modules()
    assert packed.kind(model.base) in (kernels[0], f"one row {kernels[0]}, more {kernels[1]}")
    ids, am = _ids()
    ids, am = ids[:1], am[:1]
    ref = _hf(model.base, ids, am, 15)
    for strategy in STRATEGIES:
        out = model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=3, window=3)
        assert torch.equal(out.sequences, ref), strategy
    out = model.generate(ids, am, max_new_tokens=15, strategy="self-spec", tree=[3, 2])
    assert torch.equal(out.sequences, ref)


def test_sampling_on_a_packed_model_keeps_its_distribution():
    """One chi-square check (with the rule-breaking control of test_decoding) on a packed tiny model: the
    distribution is the packed model's own, enumerated from its logits. (Its draws are rows of one batch, so no
    one-row kernel takes part.)"""
    from test_decoding import _chi2_pvalue, _draw, _exact_joint, _tiny_vocab_model

    model = _tiny_vocab_model()
    packed.apply(model)
    assert packed.kind(model.base) == packed.KIND
    prompt, n, warp = [1, 3, 2], 3, dict(temperature=1.0)
    outcomes, probs = _exact_joint(model, prompt, n, warp)
    for strategy in ("hispec", "self-spec-lookup"):
        samples = _draw(model, prompt, n, warp, strategy, draws=6000, seed=11)
        assert _chi2_pvalue(samples, outcomes, probs) > 1e-4, strategy


def test_default_packing_follows_the_measured_speed_ratio_on_this_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(packed, "_pays", {})  # as in a new process
    folder = _wrap(tiny_model("llama")).save(tmp_path / "ck")
    calls = []

    def ratio(value):
        def measure(module, *args, **kwargs):
            calls.append(module.dtype)
            packed.pack(module)  # as the real one leaves it
            return value
        return measure

    monkeypatch.setattr(packed, "speed_ratio", ratio(0.97))  # e.g. fp32 on a Xeon with AMX: stock kernels
    model = hispec.load(folder)
    assert packed.kind(model.base) == packed.STOCK and packed.kind(model.heads) == packed.STOCK
    assert not any(isinstance(m, packed.PackedLinear) for m in model.base.modules())  # unpacked after measuring
    assert packed.kind(hispec.load(folder, pack=True).base) == packed.KIND  # asked for: packed regardless
    assert packed.measured_ratio(model.base) == {1: {packed.PACKED: 0.97}, packed.MANY: {packed.PACKED: 0.97}}
    ids, am = _ids()
    assert torch.equal(model.generate(ids, am, max_new_tokens=8, strategy="hispec").sequences,
                       _hf(model.base, ids, am, 8))
    hispec.load(folder)
    assert calls == [torch.float32]  # measured once per process for this architecture, size, dtype, threads
    with packed.for_generation(tiny_model("llama")) as n:  # the data generator follows the same answer
        assert n == 0
    monkeypatch.setattr(packed, "_pays", {})
    monkeypatch.setattr(packed, "speed_ratio", ratio(packed.PAYS_BELOW - 0.01))
    model = hispec.load(folder)
    assert packed.kind(model.base) == packed.KIND and packed.kind(model.heads) == packed.KIND
    with packed.for_generation(tiny_model("llama")) as n:
        assert n > 0


def test_each_input_size_gets_the_kernel_measured_fastest_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(packed, "_pays", {})
    measured = {1: {packed.PACKED: 1.25, packed.TRANSPOSED: 0.7}, packed.MANY: {packed.PACKED: 0.7,
                                                                               packed.TRANSPOSED: 1.3}}
    monkeypatch.setattr(packed, "speed_ratio", lambda module, *a, **k: measured)
    folder = _wrap(tiny_model("llama")).save(tmp_path / "ck")
    model = hispec.load(folder)
    both = f"one row {packed.TRANSPOSED}, more {packed.PACKED}"
    assert packed.kind(model.base) == both and packed.kind(model.heads) == both
    lin = model.base.model.layers[0].mlp.down_proj
    assert isinstance(lin, packed.PackedLinear) and (lin.one, lin.many) == (packed.TRANSPOSED, packed.PACKED)
    one, four = torch.randn(1, 1, lin.in_features), torch.randn(1, 4, lin.in_features)
    with torch.no_grad():
        assert lin._kernel(one) == packed.TRANSPOSED and lin._kernel(four) == packed.PACKED
        assert lin._kernel(torch.randn(2, 1, lin.in_features)) == packed.PACKED  # two rows of a batch: "more"
        torch.testing.assert_close(lin(one), torch.nn.functional.linear(one, lin.weight, lin.bias))
    ids, am = _ids()
    ref = _hf(model.base, ids, am, 10)
    for strategy in ("ar", "self-spec", "hispec"):  # one-row and multi-row passes mixed: still the model's output
        out = model.generate(ids[:1], am[:1], max_new_tokens=10, strategy=strategy).sequences
        assert torch.equal(out, ref[:1]), strategy
        assert torch.equal(model.generate(ids, am, max_new_tokens=10, strategy=strategy).sequences, ref), strategy
    lin.set_kernels(*json.loads(json.dumps([packed.TRANSPOSED, packed.PACKED])))  # names as a memo file gives them
    with torch.no_grad():
        assert lin._kernel(one) is packed.TRANSPOSED and lin._kernel(four) is packed.PACKED
    with pytest.raises(ValueError, match="unknown linear kernel"):
        lin.set_kernels("mkl", packed.PACKED)
    assert packed.kernels_that_pay({1: 0.8, 4: 0.95}) == (packed.PACKED, packed.STOCK)
    assert packed.kernels_that_pay(0.95) is None
    assert packed.kernels_that_pay({"1": {"transposed": 0.5, packed.PACKED: 0.6}, "4": 0.84}) == (
        packed.TRANSPOSED, packed.PACKED)


def test_the_measured_ratio_is_kept_on_disk_so_only_the_first_process_measures(tmp_path, monkeypatch):
    memo = tmp_path / "cache" / "packing.json"
    monkeypatch.setattr(packed, "memo_path", lambda: memo)
    monkeypatch.setattr(packed, "_pays", {})
    calls = []
    monkeypatch.setattr(packed, "speed_ratio", lambda module: calls.append(1) or 0.97)
    folder = _wrap(tiny_model("llama")).save(tmp_path / "ck")
    assert packed.kind(hispec.load(folder).base) == packed.STOCK and calls == [1]
    assert list(json.loads(memo.read_text()).values()) == [{"1": {packed.PACKED: 0.97},
                                                            str(packed.MANY): {packed.PACKED: 0.97}}]
    monkeypatch.setattr(packed, "_pays", {})  # a new process
    assert packed.kind(hispec.load(folder).base) == packed.STOCK and calls == [1]
    bf16 = [1] if packed.available(torch.bfloat16) else []  # another key (measured only where bf16 packs at all)
    assert packed.kind(hispec.load(folder, dtype="bf16").base) == packed.STOCK and calls == [1, *bf16]
    memo.write_text("{not json")  # damaged: measured again and rewritten
    monkeypatch.setattr(packed, "_pays", {})
    hispec.load(folder)
    assert len(calls) == 2 + len(bf16) and len(json.loads(memo.read_text())) == 1


def test_the_speed_ratio_measurement_times_the_model_both_ways_and_unpack_restores_it():
    base = tiny_model("llama")
    before = {name: p for name, p in base.named_parameters()}
    r = REAL_SPEED_RATIO(base, rows=(1, 2), repeats=1)
    streamed = {packed.STREAMED} if hispec.matvec.available() else set()
    assert set(r) == {1, 2} and all(set(v) == {packed.PACKED, packed.TRANSPOSED, *streamed} for v in r.values())
    assert all(0.01 < x < 100 for v in r.values() for x in v.values()) and packed.kind(base) == packed.KIND
    assert packed.unpack(base) > 0 and packed.kind(base) == packed.STOCK
    assert all(type(m) is torch.nn.Linear for m in base.modules() if isinstance(m, torch.nn.Linear))
    after = dict(base.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the very same Parameters


def test_the_measurement_times_the_linears_up_to_a_budget_of_weight_and_keeps_no_other_copies(monkeypatch):
    base = tiny_model("llama")
    first = base.model.layers[0].self_attn.q_proj
    monkeypatch.setattr(packed, "MEASURED_BYTES", first.weight.numel() * 4 + 1)  # q_proj, then k_proj crosses it
    timed = []
    real = packed.PackedLinear.forward
    monkeypatch.setattr(packed.PackedLinear, "forward", lambda self, x: timed.append(self) or real(self, x))
    took = packed.time_kernels(base, rows=(1, 3), repeats=2)
    attn = base.model.layers[0].self_attn
    assert {id(m) for m in timed} == {id(attn.q_proj), id(attn.k_proj)}
    assert all(len(times) == 2 for per in took.values() for times in per.values()) and set(took) == {1, 3}
    assert all(set(m._copies) <= {packed.PACKED} for m in base.modules() if isinstance(m, packed.PackedLinear))


def test_load_packs_on_cpu_unless_told_not_to(tmp_path):
    folder = _wrap(tiny_model("llama")).save(tmp_path / "ck")
    assert packed.kind(hispec.load(folder).base) == packed.KIND
    assert packed.kind(hispec.load(folder, pack=False).base) == packed.STOCK
    assert packed.kind(hispec.load(folder, dtype="fp16").base) == packed.STOCK  # fp16: no packed kernel


def test_a_calibration_records_the_kernels_it_timed():
    model = _wrap(tiny_model("llama"))
    here = latency.machine_fingerprint(model.device, model)
    assert here["linear"] == packed.STOCK
    cal = latency.Calibration.from_dict({
        "machine": here, "dtype": "float32", "threads": 1, "model": latency.model_identity(model),
        "costs": {"layer": {"1": 1e-3}, "final": {"1": 1e-3}, "head": {}, "ngram": 1e-5},
        "acceptance": {}, "ngram_match": 0.0, "context": 16, "positions": 10})
    cal.check(model)
    packed.apply(model)
    with pytest.raises(latency.CalibrationError, match=r"linear kernels: calibrated stock, the model runs onednn"):
        cal.check(model)
    old = latency.Calibration.from_dict({**cal.to_dict(), "machine": {k: v for k, v in here.items() if k != "linear"}})
    with pytest.raises(latency.CalibrationError, match="linear kernels"):  # before packing existed: stock
        old.check(model)


@pytest.mark.skipif(not hispec.matvec.available(), reason="no AVX2 + FMA x86 CPU or no C compiler here")
def test_a_calibration_with_the_streamed_kernel_is_refused_after_that_kernel_changed():
    model = _wrap(tiny_model("llama"))
    packed.pack(model.base, (packed.STREAMED, packed.STREAMED))
    here = latency.machine_fingerprint(model.device, model)
    assert here["streamed"] == hispec.matvec.library_path().stem  # the build: a digest of its source and flags
    cal = latency.Calibration.from_dict({
        "machine": here, "dtype": "float32", "threads": 1, "model": latency.model_identity(model),
        "costs": {"layer": {"1": 1e-3}, "final": {"1": 1e-3}, "head": {}, "ngram": 1e-5},
        "acceptance": {}, "ngram_match": 0.0, "context": 16, "positions": 10})
    cal.check(model)
    before = {k: v for k, v in here.items() if k != "streamed"}  # (calibrations from before the kernel had a build)
    for machine in ({**here, "streamed": "matvec-0123456789abcdef"}, before):
        stale = latency.Calibration.from_dict({**cal.to_dict(), "machine": machine})
        with pytest.raises(latency.CalibrationError, match="the streamed kernel: calibrated with build"):
            stale.check(model)


def test_reduced_vocabulary_heads_project_through_packed_rows_and_stay_lossless():
    model = _wrap(tiny_model("llama"))
    model.set_exit_vocab("draft", list(range(0, 97, 2)))
    model.set_exit_vocab("verify", list(range(40)))
    ids, am = _ids()
    hidden = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = {e: model.exit_logits(e, hidden) for e in ("draft", "verify")}
        packed.apply(model)
        got = {e: model.exit_logits(e, hidden) for e in ("draft", "verify")}
    for e in want:
        torch.testing.assert_close(got[e], want[e], atol=1e-5, rtol=1e-5)
    rows = model.adapter.__dict__.get("_vocab_rows_cache", {})
    assert len(rows) == 2 and all(isinstance(r[2], packed.PackedLinear) for r in rows.values())
    ref = _hf(model.base, ids, am, 15)
    for strategy in ("self-spec", "hispec", "self-spec-lookup"):
        assert torch.equal(model.generate(ids, am, max_new_tokens=15, strategy=strategy, gamma=2).sequences, ref)


def test_default_packing_steps_aside_when_the_copies_would_not_fit_in_memory(monkeypatch):
    real = packed.available_memory()
    assert real is None or real > 2**20  # this machine's MemAvailable, read
    base = tiny_model("llama")
    need = packed.packed_bytes(base)
    assert need == sum(m.weight.numel() * 4 for m in base.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(packed, "available_memory", lambda: int(need / packed.MEMORY_SHARE) - 1)
    model = _wrap(base)
    with pytest.warns(UserWarning, match="not prepacking"):
        packed.apply(model)
    assert packed.kind(model.base) == packed.STOCK
    packed.apply(model, True)  # asked for explicitly: packed regardless
    assert packed.kind(model.base) == packed.KIND
    monkeypatch.setattr(packed, "available_memory", lambda: 100 * need)
    roomy = packed.apply(_wrap(tiny_model("llama")))
    assert packed.kind(roomy.base) == packed.KIND
