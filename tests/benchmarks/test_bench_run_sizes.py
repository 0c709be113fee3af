"""What the GPU notebooks' benchmark runs cost by default: bench_loss.py's timed calls per repetition,
bench_gated_deltanet.py's secondary columns (none unless asked for), bench_moe.py's warm-up calls per loop, and
bench_whole_step.py's sessions sharing Triton's disk cache of autotuning results (as bench_moe.py's do)."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


def test_bench_loss_times_five_calls_per_repetition_by_default(scripts):
    """Notebook 07 passes no call counts: each repetition's median is of 5 calls, and a command line still sets
    other bounds."""
    bench = scripts("bench_loss")
    args = bench.build_parser().parse_args(["--out", "o"])
    assert (args.min_calls, args.max_calls) == (5, 5)
    args = bench.build_parser().parse_args(["--out", "o", "--min-calls", "10", "--max-calls", "10"])
    assert (args.min_calls, args.max_calls) == (10, 10)


def test_gated_deltanet_times_no_secondary_column_unless_asked(scripts):
    """Notebook 05 passes no --secondary and reads only the loop's figure: no profiler or do_bench pass by default."""
    bench = scripts("bench_gated_deltanet")
    assert bench.build_parser().parse_args(["--out", "o"]).secondary == []
    args = bench.build_parser().parse_args(["--out", "o", "--secondary", "kernel", "back_to_back"])
    assert args.secondary == ["kernel", "back_to_back"]


def test_moe_layer_loops_warm_up_once(scripts):
    """Notebook 06 passes no --warmup: each implementation's loop starts with one untimed call (its first calls and
    peak-memory call ran before the repetitions); the timed calls per loop stay 10 at most."""
    args = scripts("bench_moe").build_parser().parse_args(["--out", "o"])
    assert (args.warmup, args.calls) == (1, 10)
    assert scripts("bench_moe").build_parser().parse_args(["--out", "o", "--warmup", "3"]).warmup == 3


def test_whole_step_sessions_keep_autotuning_results_on_disk(scripts, monkeypatch, tmp_path):
    """Each session is started with TRITON_CACHE_AUTOTUNING=1 unless the caller set it: a later session (or this
    benchmark after bench_moe.py at the same layer shape) reuses Liger's and our kernels' picks."""
    bench = scripts("bench_whole_step")
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    seen = []

    def fake_run(cmd, env=None, **kwargs):
        seen.append(env)
        raise SystemExit("stop after the first session's start")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="first session"):
        bench.main(["--out", str(tmp_path), "--sessions", "2", "--smoke"])
    assert seen and seen[0] is not None and seen[0]["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # the caller's choice is kept
    assert bench.session_environment()["TRITON_CACHE_AUTOTUNING"] == "0"
