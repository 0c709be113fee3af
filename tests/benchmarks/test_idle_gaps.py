"""benchmarks/idle_gaps.py: the idle intervals of a synchronised step, read from a synthetic Chrome trace."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gaps(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import idle_gaps

    return idle_gaps


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def one_step(mark: str, t0: float) -> list[dict]:
    """A step over [t0, t0 + 1000] us: the host launches a GEMM 110 us in (inside aten::mm inside the autograd
    function), a multiply that follows the GEMM with no gap, a kernel 90 us after the multiply (launched 40 us into
    that gap), a 3 us gap below the threshold, and then waits in cudaDeviceSynchronize until the step ends."""
    c = int(t0)  # correlation ids unique per step
    return [
        _x("user_annotation", mark, t0, 1000),
        _x("cpu_op", "FwdGradLinearCrossEntropyFunction", t0 + 10, 490),
        _x("cpu_op", "aten::mm", t0 + 100, 20),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 110, 5, correlation=c + 1),
        _x("kernel", "nvjet_gemm", t0 + 200, 400, tid=7, correlation=c + 1),
        _x("cpu_op", "aten::mul", t0 + 550, 10),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 555, 3, correlation=c + 2),
        _x("kernel", "mul_kernel", t0 + 600, 10, tid=7, correlation=c + 2),
        _x("cpu_op", "aten::add", t0 + 640, 20),
        _x("cuda_driver", "cuLaunchKernelEx", t0 + 650, 5, correlation=c + 3),
        _x("kernel", "logit_grad_kernel", t0 + 700, 200, tid=7, correlation=c + 3),
        _x("gpu_memcpy", "Memcpy DtoH", t0 + 903, 50, tid=7, correlation=c + 4),
        _x("cuda_runtime", "cudaDeviceSynchronize", t0 + 905, 90),
    ]


def test_step_gaps_finds_each_idle_interval_and_what_ended_it(gaps):
    events = one_step(gaps.STEP_MARK, 0.0)
    rows = gaps.step_gaps(events, min_gap_us=5.0)
    assert [(r["position"], r["start_us"], r["gap_us"]) for r in rows] == [(0, 0.0, 200.0), (1, 610.0, 90.0),
                                                                          (2, 953.0, 47.0)]
    first, middle, last = rows
    assert first["next_kernel"] == "nvjet_gemm"
    assert first["launched_by"] == "aten::mm < FwdGradLinearCrossEntropyFunction"
    assert first["launch_lag_us"] == 110.0 and first["host_waits"] == ""
    assert middle["next_kernel"] == "logit_grad_kernel" and middle["launched_by"] == "aten::add"
    assert middle["launch_lag_us"] == 40.0
    assert last["next_kernel"] == "(end of step)" and last["launch_lag_us"] is None
    assert last["host_waits"] == "cudaDeviceSynchronize"


def test_events_outside_steps_are_ignored_and_steps_group(gaps, tmp_path):
    stray = [_x("kernel", "before", -500.0, 100, tid=7), _x("cpu_op", "aten::zero_", -600.0, 50)]
    events = stray + one_step(gaps.STEP_MARK, 0.0) + one_step(gaps.STEP_MARK, 2000.0)
    events.append({"ph": "i", "name": "an instant", "ts": 5.0})  # not a complete event: dropped by load_trace
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = gaps.step_gaps(gaps.load_trace(trace))
    assert {r["step"] for r in rows} == {0, 1} and len(rows) == 6
    idle, grouped = gaps.summarise(rows, steps=2)
    assert idle == pytest.approx(200.0 + 90.0 + 47.0)
    assert [g["next_kernel"] for g in grouped] == ["nvjet_gemm", "logit_grad_kernel", "(end of step)"]
    assert all(g["count"] == 2 for g in grouped)
    assert grouped[0]["per_step_us"] == pytest.approx(200.0) and grouped[0]["mean_launch_lag_us"] == 110.0


def test_a_busy_step_has_no_gaps_and_no_steps_gives_nothing(gaps):
    mark = gaps.STEP_MARK
    busy = [_x("user_annotation", mark, 0.0, 100), _x("kernel", "k", -10.0, 115, tid=7)]
    assert gaps.step_gaps(busy) == []
    assert gaps.step_gaps([_x("kernel", "k", 0.0, 10, tid=7)]) == []
    assert gaps.summarise([], steps=0) == (0.0, [])
