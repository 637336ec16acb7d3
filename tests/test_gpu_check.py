"""tools/gpu_check.py on CPU with its tiny settings (a tiny random Llama built in-process, random heads, 2 prompts
x 8 tokens): every step's record in results.jsonl, the table, the one JSON line; a failing step is recorded and the
run goes on; the time budget skips the remaining steps and interrupts a step still running at the deadline.

The GPU run itself (the demo GGUF, the shipped heads, CUDA, torch.compile with inductor) is not tested here: no
machine running the suite has a GPU. `hf-static` is exercised on CPU through transformers' static cache and its
compile route with the `eager` backend (dynamo traces the graph, no kernels are generated).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, load_tool

gc = load_tool("gpu_check")

HISPEC = ("ar", "self-spec", "ngram", "auto")


def _records(out) -> list[dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]  # every line is one JSON object


def _steps(records) -> dict[str, dict]:
    by_step = {}
    for r in records:
        assert r["step"] not in by_step, f"step {r['step']} recorded twice in one run"
        by_step[r["step"]] = r
    return by_step


def test_tiny_run_records_every_step_and_ends_with_a_table_and_one_json_line(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--tiny", "--out", str(out),
                           "--threads", "1", "--compile", "on", "--compile-backend", "eager"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])  # the last line of stdout is the JSON summary, and only it is JSON
    assert not any(line.startswith("{") for line in lines[:-1])

    steps = _steps(_records(out))
    names = ["start", "convert", "export", "load", "calibrate"] + [f"bench:{s}" for s in gc.STRATEGIES] + ["summary"]
    assert list(steps) == names
    assert all(r["status"] == "ok" for r in steps.values()), {k: r.get("error") for k, r in steps.items()}
    assert len({r["run"] for r in steps.values()}) == 1
    assert steps["start"]["settings"]["tiny"] and steps["start"]["environment"]["device"] == "cpu"
    assert steps["calibrate"]["calibration_s"] > 0
    hf = steps["bench:hf"]
    assert hf["new_tokens"] > 0 and hf["tokens_per_s"] > 0 and hf["identical"] is True
    assert len(hf["per_prompt"]) == 2 and all(len(p["tokens"]) <= 8 for p in hf["per_prompt"])
    static = steps["bench:hf-static"]  # transformers' static cache, through its compile route (eager backend)
    assert static["cache"] == "StaticCache" and static["compiled"] is True
    for s in HISPEC:
        assert steps[f"bench:{s}"]["identical"] is True and steps[f"bench:{s}"]["identical_prompts"] == "2/2"
    assert steps["bench:auto"]["hierarchy"].startswith("auto")
    assert steps["summary"]["strategies"] == summary["strategies"]

    assert summary["tool"] == "gpu_check" and summary["complete"] and summary["exit_status"] == 0
    assert summary["lossless"] is True and summary["calibration_s"] == steps["calibrate"]["calibration_s"]
    assert list(summary["strategies"]) == list(gc.STRATEGIES)
    for s, r in summary["strategies"].items():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["identical"] is True
        assert r["speedup_vs_hf"] == pytest.approx(r["tokens_per_s"] / summary["strategies"]["hf"]["tokens_per_s"],
                                                   rel=1e-2)
    assert summary["strategies"]["hf"]["speedup_vs_hf"] == 1.0
    assert summary["strategies"]["hf-static"]["speedup_vs_hf_static"] == 1.0

    table = "\n".join(lines[:-1])
    assert "tok/s" in table and "vs hf" in table and "identical" in table
    for s in gc.STRATEGIES:
        assert any(line.startswith(f"{s} ") and " ok " in line and "yes 2/2" in line for line in lines), s
    assert "StaticCache, compiled" in table and "calibration:" in table
    assert (out / "table.txt").read_text().strip() == table.strip()
    assert json.loads((out / "summary.json").read_text())["strategies"] == summary["strategies"]


def _run(args, capsys):
    rc = gc.main(args)
    stdout = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(stdout[-1]), "\n".join(stdout[:-1])


def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path, capsys):
    out = tmp_path / "check"
    rc, summary, table = _run(["--tiny", "--out", str(out), "--strategies", "hf,no-such-strategy,ar"], capsys)
    assert rc == 3 and not summary["complete"]
    steps = _steps(_records(out))
    bad = steps["bench:no-such-strategy"]
    assert bad["status"] == "failed" and "no-such-strategy" in bad["error"] and "Traceback" in bad["traceback"]
    assert steps["bench:ar"]["status"] == "ok" and steps["bench:ar"]["identical"] is True  # after the failure
    assert summary["strategies"]["no-such-strategy"]["status"] == "failed"
    assert summary["strategies"]["ar"]["tokens_per_s"] > 0 and summary["lossless"] is True
    assert any(line.startswith("no-such-strategy") and "failed" in line for line in table.splitlines())
    assert "summary" in steps  # the run ended normally

    # a step others need fails: they are skipped, saying why; the run still ends with its summary
    out2 = tmp_path / "check2"
    rc, summary, _ = _run(["--tiny", "--out", str(out2), "--heads", str(tmp_path / "missing-heads"),
                           "--strategies", "hf,ar"], capsys)
    steps = _steps(_records(out2))
    assert rc == 3 and steps["convert"]["status"] == "ok" and steps["export"]["status"] == "failed"
    for name in ("load", "calibrate", "bench:hf", "bench:ar"):
        assert steps[name]["status"] == "skipped" and "needs" in steps[name]["reason"]
    assert summary["strategies"]["ar"]["tokens_per_s"] is None and summary["lossless"] is None


def test_the_time_budget_skips_the_remaining_steps(tmp_path, capsys, monkeypatch):
    """The clock jumps past the budget once `hf` is measured: every later step is skipped, the results stay."""
    jump = [0.0]
    monkeypatch.setattr(gc, "_clock", lambda: time.monotonic() + jump[0])
    bench = gc.GpuCheck.bench

    def bench_then_jump(self, strategy):
        result = bench(self, strategy)
        if strategy == "hf":
            jump[0] = 1e6
        return result

    monkeypatch.setattr(gc.GpuCheck, "bench", bench_then_jump)
    out = tmp_path / "check"
    rc, summary, table = _run(["--tiny", "--out", str(out), "--time-budget-s", "600"], capsys)
    steps = _steps(_records(out))
    assert rc == 3 and steps["bench:hf"]["status"] == "ok" and summary["strategies"]["hf"]["tokens_per_s"] > 0
    for s in gc.STRATEGIES[1:]:
        assert steps[f"bench:{s}"]["status"] == "skipped" and "time budget" in steps[f"bench:{s}"]["reason"]
        assert summary["strategies"][s]["status"] == "skipped"
    assert "skipped" in table and json.loads((out / "summary.json").read_text())["steps"]["bench:auto"] == "skipped"


def test_a_step_running_past_its_limit_is_interrupted_and_recorded(tmp_path, capsys, monkeypatch):
    """A calibration that would hang is cut at --calibration-max-s: `timeout`, `auto` skipped, the rest runs."""
    def hang(self):
        time.sleep(60)

    monkeypatch.setattr(gc.GpuCheck, "calibrate", hang)
    out = tmp_path / "check"
    t0 = time.monotonic()
    rc, summary, _ = _run(["--tiny", "--out", str(out), "--calibration-max-s", "0.5", "--strategies",
                           "hf,ar,auto"], capsys)
    assert time.monotonic() - t0 < 45
    steps = _steps(_records(out))
    assert steps["calibrate"]["status"] == "timeout" and steps["calibrate"]["seconds"] < 10
    assert steps["bench:ar"]["status"] == "ok" and steps["bench:hf"]["status"] == "ok"
    assert steps["bench:auto"]["status"] == "skipped" and "calibrate timeout" in steps["bench:auto"]["reason"]
    assert rc == 3 and summary["calibration_s"] is None


def test_results_are_appended_per_run_and_survive_as_written(tmp_path):
    path = tmp_path / "results.jsonl"
    gc.append_record(path, {"step": "a"})
    gc.append_record(path, {"step": "b", "x": 1.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == ["a", "b"]


def test_gguf_pieces_are_put_together_and_checked_against_the_pins(tmp_path):
    import hashlib
    from types import SimpleNamespace

    from hispec import fetch

    data = bytes(range(256)) * 40
    pieces = [tmp_path / "p1.bin", tmp_path / "p2.bin"]
    pieces[0].write_bytes(data[:3000])
    pieces[1].write_bytes(data[3000:])
    spec = SimpleNamespace(gguf_name="m.gguf", gguf_size=len(data), gguf_sha256=hashlib.sha256(data).hexdigest())
    with pytest.raises(ValueError, match="SHA-256"):  # out of order: refused, nothing under the final name
        gc.place_gguf(pieces[::-1], tmp_path / "models", spec)
    target = tmp_path / "models" / fetch.DOWNLOADS / "m.gguf"
    assert not target.exists() and not list(target.parent.iterdir())
    assert gc.place_gguf(pieces, tmp_path / "models", spec) == target and target.read_bytes() == data
    assert gc.place_gguf([tmp_path / "gone.bin"], tmp_path / "models", spec) == target  # in place: kept


def test_sigterm_ends_the_running_step_and_the_summary_is_still_written(tmp_path, capsys, monkeypatch):
    import signal

    def killed(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    monkeypatch.setattr(gc.GpuCheck, "calibrate", killed)
    out, work = tmp_path / "check", tmp_path / "work"
    before = signal.getsignal(signal.SIGTERM)
    rc, summary, _ = _run(["--tiny", "--out", str(out), "--work-dir", str(work), "--strategies", "hf,ar"], capsys)
    assert signal.getsignal(signal.SIGTERM) is before
    steps = _steps(_records(out))
    assert steps["convert"]["status"] == "ok" and steps["calibrate"]["status"] == "terminated"
    assert steps["bench:hf"]["status"] == "skipped" and "SIGTERM" in steps["bench:hf"]["reason"]
    assert rc == 3 and summary["steps"]["bench:ar"] == "skipped" and "summary" in steps
    assert (work / "checkpoint" / "config.json").is_file() and not (out / "checkpoint").exists()
