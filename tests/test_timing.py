"""hispec.timing: the timers that feed the latency model, `GenerationStats`' seconds and `auto`'s plain guard read the
clock only after the device finished its queued work. A CPU model stands in for a CUDA one: the helper's device
check answers "cuda" and `torch.cuda.synchronize` records its calls. And `calibrate`'s time budget, on a fake clock
where every decoder-layer pass costs one second."""

from __future__ import annotations

import json
import types

import pytest
import torch
from tiny import tiny_model

import hispec
from hispec import decoding, timing
from hispec import latency as lt
from hispec.decoding import GenerationStats
from hispec.drafters.ngram import NgramConfig


def _model():
    base = tiny_model("llama")
    base.generation_config.pad_token_id = 0
    return hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="shared")


@pytest.fixture
def as_cuda(monkeypatch):
    """Every device is taken for a CUDA one; the log gets ("sync", device) per `torch.cuda.synchronize` and
    ("clock", None) per clock read through `hispec.timing`."""
    log = []
    clock = timing.clock
    monkeypatch.setattr(timing, "device_type", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", device)))
    monkeypatch.setattr(timing, "clock", lambda: log.append(("clock", None)) or clock())
    return log


def _every_clock_read_follows_a_sync(log) -> bool:
    return all(i and log[i - 1][0] == "sync" for i, e in enumerate(log) if e[0] == "clock")


def test_timer_and_now_wait_for_the_device_and_do_nothing_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    with timing.Timer(torch.device("cpu")) as t:
        pass
    assert calls == [] and t.seconds >= 0 and timing.device_type(None) is None  # the CPU: no wait
    assert timing.device_type("cuda:1") == "cuda" and timing.device_type(torch.device("meta")) == "meta"
    log = []
    monkeypatch.setattr(timing, "device_type", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", device)))
    monkeypatch.setattr(timing, "clock", lambda: log.append(("clock", None)) or 1.5)
    with timing.Timer("cuda:0") as t:
        log.append(("work", None))
    assert [e[0] for e in log] == ["sync", "clock", "work", "sync", "clock"] and t.seconds == 0.0
    assert log[0] == ("sync", "cuda:0")


def test_calibration_timers_read_the_clock_only_after_the_device_finished(as_cuda, monkeypatch):
    """Every timed pass of the unit costs is followed by a wait on the model's device before the clock is read,
    and so is every other clock read of a calibration (answers, decoder steps, stats)."""
    model = _model()
    final = lt.KVBench.final

    def logged(self, T):
        fn = final(self, T)
        return lambda: (fn(), as_cuda.append(("work", T)))

    monkeypatch.setattr(lt.KVBench, "final", logged)
    cal = lt.calibrate(model, [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=6, repeats=2, ngram=NgramConfig(3, 1, 4))
    works = [i for i, e in enumerate(as_cuda) if e[0] == "work"]
    assert len(works) == 3 * len(cal.costs["final"])  # a warm-up and two timed rounds of every final(T)
    for i in works:
        j = next(j for j in range(i + 1, len(as_cuda)) if as_cuda[j][0] == "clock")
        assert as_cuda[j - 1] == ("sync", model.device)
    assert _every_clock_read_follows_a_sync(as_cuda)
    timed = sum(len(t) for t in (cal.costs["final"], cal.costs["layer"], *cal.costs["head"].values()))
    assert sum(e == ("sync", model.device) for e in as_cuda) >= 2 * 2 * timed  # two reads per timed repeat


def test_generate_times_every_stage_after_the_device_finished(as_cuda):
    """`GenerationStats` seconds: the prefill, every draft step and every verification wait for the device at both
    ends."""
    model = _model()
    out = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, strategy="self-spec", gamma=2)
    st = out.stats
    stages = 1 + st.levels[0].passes + st.levels[1].passes - 1  # prefill, draft steps, verifications
    assert sum(e == ("sync", model.device) for e in as_cuda) >= 2 * stages
    assert _every_clock_read_follows_a_sync(as_cuda)
    assert st.seconds["prefill"] > 0 and st.seconds["draft"] > 0 and st.seconds["target"] > 0


def test_the_plain_guard_reads_its_clock_after_the_device_finished(as_cuda, monkeypatch):
    monkeypatch.setattr(decoding._PlainGuard, "clock", staticmethod(lambda: as_cuda.append(("guard", None)) or 0.0))
    dev = torch.device("cpu")
    run = types.SimpleNamespace(gam=[torch.tensor([2])], seq=torch.tensor([5]), committed_tokens=0,
                                stats=GenerationStats(), device=dev)
    guard = decoding._PlainGuard()
    for committed in (1, 4):  # the first speculative round carries the setup (not measured), the second is measured
        guard.begin(run)
        run.committed_tokens = committed
        guard.end(run)
    assert as_cuda == [("sync", dev), ("guard", None)] * 4
    assert guard.tok["spec"] == 3  # the second round was measured


def _costly_clock(monkeypatch, model) -> list:
    """A fake clock that advances one second per decoder-layer pass (and a microsecond per read)."""
    now = [0.0]

    def clock():
        now[0] += 1e-6
        return now[0]

    run_layers = model.adapter.run_layers

    def costly(*a, **k):
        now[0] += 1.0
        return run_layers(*a, **k)

    monkeypatch.setattr(timing, "clock", clock)
    monkeypatch.setattr(model.adapter, "run_layers", costly)
    return now


def test_calibration_within_a_time_budget_cuts_work_keeps_to_it_and_stays_valid(monkeypatch):
    model = _model()
    now = _costly_clock(monkeypatch, model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (8,), generator=g).tolist() for _ in range(6)]
    kw = dict(max_new_tokens=12, repeats=4, ngram=NgramConfig(3, 1, 4))
    full = lt.calibrate(model, prompts, max_seconds=None, **kw)
    unlimited = now[0]
    assert full.budget["skipped"] == {} and full.budget["max_seconds"] is None
    budget = unlimited / 5  # (the decoder runs of step 4 are a large share of an unlimited calibration)
    now[0] = 0.0
    cal = lt.calibrate(model, prompts, max_seconds=budget, **kw)
    assert now[0] <= budget  # kept to it
    skipped = cal.budget["skipped"]
    assert skipped["prompts"]["answered"] < len(prompts) and skipped["repeats"]["timed"] < 4, skipped
    assert cal.budget["max_seconds"] == budget and 0 < cal.budget["seconds"] <= budget
    # still a complete calibration: every table, every pair of levels, usable by the latency model
    assert set(cal.costs["layer"]) == set(full.costs["layer"]) and set(cal.acceptance) == set(full.acceptance)
    assert 0 < cal.positions < full.positions and cal.measured["ar"] > 0
    cal.check(model)
    assert lt.best_hierarchy(cal).speedup_vs_plain >= 1.0
    assert lt.Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_a_budget_refuses_nonsense_and_shares_its_time_by_step(monkeypatch):
    with pytest.raises(ValueError, match="max_seconds"):
        lt.Budget(0)
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    b = lt.Budget(100.0)
    now[0] = 40.0
    assert b.fits("answers", 5.0) and not b.fits("answers", 5.1)  # answers: by 45 s
    assert b.units("costs", 10.0, 8) == 5 and b.units("costs", 100.0, 8) == 1  # costs: by 90 s; at least one
    assert lt.Budget(None).units("costs", 1e9, 8) == 8 and lt.Budget(None).fits("decoder", 1e9)
