"""bench_whole_step: the whole-step comparison's code path on CPU (tiny Llama-like config, fp32, Triton's interpreter),
its pooling of two sessions, and failing variants recorded as rows."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
LOSS_IMPL = {"peft": "torch", "peft_liger": "liger", "peft_patch": "torch", "peft_patch_fused_loss": "lora_lab",
             "peft_liger_patch": "liger", "peft_liger_patch_lora_lab_loss": "lora_lab"}


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_whole_step

    return bench_whole_step


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole_step")
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_whole_step.py"), "--out", str(out), "--smoke",
           "--models", "llama", "--repetitions", "1", "--sessions", "2", "--steps", "1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done.stdout


@pytest.mark.slow
def test_smoke_rows_for_every_variant_pooled_over_two_sessions(smoke_run):
    out, stdout = smoke_run
    rows = measure.read_csv(out / "whole_step.csv")
    summary = {s["variant"]: s for s in measure.read_csv(out / "whole_step_summary.csv")}
    assert set(summary) == set(LOSS_IMPL)
    for variant, impl in LOSS_IMPL.items():
        mine = [r for r in rows if r["variant"] == variant]
        if "liger" in variant and not HAS_LIGER:
            assert all(r["status"] == "error" and "not installed" in r["error"] for r in mine)
            continue
        assert [r["status"] for r in mine] == ["ok", "ok"], mine
        assert sorted(r["session"] for r in mine) == [0, 1]
        assert sorted(r["rep"] for r in mine) == [0, 1]  # renumbered across sessions
        assert all(r["step_ms"] > 0 and r["timing"] == "loop" for r in mine)
        s = summary[variant]
        assert s["sessions"] == 2 and s["n"] == 2 and s["loss_impl"] == impl
        # fp32, interpreter: the first steps' losses of every variant track PEFT's
        assert s["loss_max_rel_diff_vs_peft"] < 1e-4
    memory = measure.read_csv(out / "whole_step_memory.csv")
    assert len(memory) == len(LOSS_IMPL) and {r["session"] for r in memory} == {0}  # the first session's pass only
    # the summary table is printed last
    last = stdout.strip().splitlines()
    assert "variant" in last[-len(LOSS_IMPL) - 1] and last[-1].split()[1] == "peft_liger_patch_lora_lab_loss"


def test_failing_variants_are_rows_not_crashes(bench, monkeypatch):
    class Fake:
        def __init__(self, model_name, variant, args, device, dtype):
            if variant == "peft_patch":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
            if variant == "peft_liger":
                raise ImportError("liger-kernel is not installed")
            self.losses = []

        def step(self):
            self.losses.append(torch.tensor(2.0))

        def describe(self):
            return {"loss_impl": "torch"}

    monkeypatch.setattr(bench, "Variant", Fake)
    args, _ = bench.parse_args(["--out", "x", "--smoke", "--repetitions", "2", "--variants", "peft", "peft_patch",
                                "peft_liger"])
    device, dtype = torch.device("cpu"), torch.float32
    memory = bench.memory_pass("llama", args.variants, args, device, dtype)
    rows = bench.timing_pass("llama", args.variants, args, device, dtype)
    assert {r["variant"]: r["status"] for r in memory} == {"peft": "ok", "peft_patch": "oom", "peft_liger": "error"}
    assert [r["status"] for r in rows if r["variant"] == "peft"] == ["ok", "ok"]
    assert [r["status"] for r in rows if r["variant"] == "peft_patch"] == ["oom", "oom"]
    summary = {s["variant"]: s for s in bench.summarize(rows, memory)}
    assert summary["peft"]["status"] == "ok" and summary["peft"]["sessions"] == 1
    assert summary["peft_patch"]["status"] == "oom" and "out of memory" in summary["peft_patch"]["error"]
    assert summary["peft_liger"]["status"] == "error" and "not installed" in summary["peft_liger"]["error"]
    bench.print_table(list(summary.values()))  # prints error rows too


class _FakeVariant:
    built: list[str] = []

    def __init__(self, model_name, variant, args, device, dtype):
        type(self).built.append(variant)
        self.losses = []

    def step(self):
        self.losses.append(torch.tensor(2.0))

    def describe(self):
        return {"loss_impl": "torch"}


@pytest.mark.parametrize("session_index, memory_rows", [(None, 2), (0, 2), (1, 0)])
def test_only_the_first_session_runs_the_memory_pass(bench, monkeypatch, tmp_path, session_index, memory_rows):
    """Peaks and first losses come from the first session's memory pass; a later session only times (it builds
    each variant once, for the timing pass)."""
    monkeypatch.setattr(bench, "Variant", _FakeVariant)
    monkeypatch.setattr(_FakeVariant, "built", [])
    argv = ["--out", str(tmp_path), "--smoke", "--repetitions", "1", "--steps", "1", "--models", "llama",
            "--variants", "peft", "peft_patch"]
    args, _ = bench.parse_args(argv + ([] if session_index is None else ["--session-index", str(session_index)]))
    bench.run_session(args, tmp_path)
    assert len(measure.read_csv(tmp_path / bench.CSV)) == 2
    memory = tmp_path / bench.MEMORY_CSV
    assert (len(measure.read_csv(memory)) if memory.exists() else 0) == memory_rows
    assert len(_FakeVariant.built) == 2 + memory_rows


def test_child_sessions_get_their_own_out_and_one_session(bench):
    argv = ["--out", "/a", "--sessions", "3", "--smoke", "--models", "llama"]
    assert bench._replace_out(argv, Path("/a/session1")) == ["--smoke", "--models", "llama", "--out", "/a/session1",
                                                            "--sessions", "1"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (pip install lora_lab[liger])")
def test_notebook_10_metrics_from_the_smoke_run(smoke_run):
    """lora_lab.experiments.whole_step.benchmark_metrics: every ratio a notebook-10 prediction reads, pooled over the
    two sessions, and the peaks (None on the CPU: no CUDA peak) left out of the peak ratios."""
    from lora_lab.experiments import whole_step as ws

    out, _ = smoke_run
    metrics = ws.benchmark_metrics(out)
    for key in ("recipe_speedup_vs_peft", "recipe_speedup_vs_peft_liger", "fused_loss_speedup_vs_patch",
                "lora_lab_loss_time_vs_liger_loss", "recipe_lora_lab_loss_speedup_vs_peft",
                "recipe_lora_lab_loss_speedup_vs_peft_liger"):
        value = metrics[f"llama_{key}"]
        assert value["sessions"] == 2 and value["n"] == 2 and value["median"] > 0, key
    assert metrics["llama_losses_max_rel_diff_vs_peft"] <= 1e-4
    assert "llama_recipe_peak_vs_peft_liger" not in metrics
    rows = [r for r in measure.read_csv(out / "whole_step.csv") if r["variant"] in ("peft", ws.RECIPE)]
    expected = measure.ratio_summary(rows, "step_ms", {"variant": "peft"}, {"variant": ws.RECIPE})
    assert metrics["llama_recipe_speedup_vs_peft"]["median"] == expected["median"]
