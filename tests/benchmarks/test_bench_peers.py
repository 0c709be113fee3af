"""benchmarks/bench_peers.py: its ``--smoke`` run on the CPU (ours and PEFT timed, every other peer a skipped row
with its error), and a cell with a fake peer that runs, and one that fails."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peers

    return bench_peers


def _smoke_env() -> dict:
    """The benchmark subprocess's environment: no display, no progress bars, Triton's interpreter without CUDA."""
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return env


@pytest.mark.slow
def test_smoke_run_times_ours_and_peft_and_records_every_other_peer_as_skipped(tmp_path):
    env = _smoke_env()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--out", str(tmp_path), "--smoke",
           "--repetitions", "2", "--ops", "lora_linear", "lora_qkv", "lora_mlp", "moe_full", "loss", "--moe-shapes",
           "qwen3_30b_a3b"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = measure.read_csv(tmp_path / "peers_ops.csv")
    assert all(r["smoke"] is True for r in rows)
    by = {}
    for r in rows:
        by.setdefault((r["op"], r["impl"]), []).append(r)
    for op in ("lora_linear", "moe_full", "loss"):
        assert {r["rep"] for r in by[(op, "ours")]} == {0, 1} and all(r["ms"] > 0 for r in by[(op, "ours")])
    for op in ("lora_linear", "lora_qkv", "lora_mlp"):  # PEFT's outputs agree with ours (fp32: to rounding)
        peft = by[(op, "peft")]
        assert peft and all(r["status"] == "ok" and r["ms"] > 0 and r["out_rel_err"] < 1e-5 for r in peft), op
    for key in [("lora_linear", "axolotl"), ("lora_linear", "unsloth"), ("moe_full", "llamafactory"),
                ("moe_full", "veomni"), ("moe_full", "sonicmoe"), ("moe_full", "liger"), ("loss", "quack"),
                ("loss", "liger")]:
        assert key in by, key  # every peer of the op has rows: timed, failed or skipped
        for row in by[key]:
            if row["status"] == "skipped":
                assert row["error"] and row["tried"] and row["ms"] is None and row["rep"] == 0, row
            if not torch.cuda.is_available():
                assert row["status"] == "skipped", row  # no peer runs its CUDA kernels on a CPU
    if not torch.cuda.is_available():
        assert "runs CUDA kernels only" in by[("loss", "liger")][0]["error"]


def _args():
    return argparse.Namespace(repetitions=2, smoke=True)


def test_a_fake_peer_runs_beside_ours_and_one_that_fails_is_an_error_row(bench, monkeypatch):
    """A fake axolotl whose ``apply_lora_o`` runs the PEFT layer it is given: timed (its first call too), its output
    checked against ours; a fake unsloth that raises: one ``error`` row with the message, the others still timed."""
    def apply_lora_o(self, X):
        return self.o_proj(X)

    def refusing(self, X):
        raise RuntimeError("made-up kernel failure")

    for name, fn in (("axolotl", apply_lora_o), ("unsloth", refusing)):
        path = {"axolotl": "axolotl.kernels.lora", "unsloth": "unsloth.kernels.fast_lora"}[name]
        parts = path.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, path, types.SimpleNamespace(apply_lora_o=fn))
    impls = {n: bench.peer_loader.load(n, "lora_linear", check_device=False) for n in ("peft", "axolotl", "unsloth")}
    assert all(isinstance(i, bench.peer_loader.PeerOp) for i in impls.values())
    rows = bench.lora_cell("lora_linear", "c", (16, 32, 32, 4), impls, _args(), torch.device("cpu"), torch.float32)
    ok = {(r["impl"], r["rep"]) for r in rows if r["status"] == "ok"}
    assert ok == {(i, rep) for i in ("ours", "peft", "axolotl") for rep in range(2)}
    assert all(r["out_rel_err"] < 1e-5 for r in rows if r["impl"] == "axolotl")
    assert all(r["first_call_s"] > 0 for r in rows if r["status"] == "ok")  # the first call's seconds, each row
    (failed,) = [r for r in rows if r["impl"] == "unsloth"]
    assert failed["status"] == "error" and "made-up kernel failure" in failed["error"] and failed["ms"] is None


def test_a_peer_that_computes_something_else_shows_in_its_output_error(bench, monkeypatch):
    parts = "axolotl.kernels.lora".split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, "axolotl.kernels.lora",
                        types.SimpleNamespace(apply_lora_o=lambda self, X: self.o_proj.base_layer(X)))  # no adapter
    impls = {"axolotl": bench.peer_loader.load("axolotl", "lora_linear", check_device=False)}
    rows = bench.lora_cell("lora_linear", "c", (16, 32, 32, 4), impls, _args(), torch.device("cpu"), torch.float32)
    assert min(r["out_rel_err"] for r in rows if r["impl"] == "axolotl") > 1e-3


@pytest.fixture
def step_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peers_step

    return bench_peers_step


def _step_args(tmp_path, **kw):
    args = argparse.Namespace(smoke=True, layers=1, batch=2, seq=16, steps=1, repetitions=2, checkpointing_now="off",
                              checkpoint_dir=str(tmp_path / "ckpt"),
                              impls=["ours", "ours_cublas_base", "ours_pure_cublas", "ours_quack", "peft", "axolotl",
                                     "unsloth"],
                              sequential=False, out=str(tmp_path))
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [False, True])
def test_full_depth_smoke_rows_feed_the_step_metrics(step_bench, monkeypatch, tmp_path, sequential):
    from lora_lab.experiments import peer_comparison, step_floor

    for name in ("axolotl", "unsloth"):
        monkeypatch.setitem(sys.modules, name, None)  # missing, whether or not installed
    args = _step_args(tmp_path, sequential=sequential)
    rows = step_bench.run_model("llama3_8b", args, torch.device("cpu"), torch.float32)
    assert {r["order"] for r in rows} == {"sequential" if sequential else "rotated"}
    if sequential:  # written after every implementation
        assert (tmp_path / step_bench.CSV).is_file()
    skipped = {r["impl"]: r for r in rows if r["status"] == "skipped"}
    assert set(skipped) == {"axolotl", "unsloth", "ours_quack"}
    assert all("ModuleNotFoundError" in skipped[i]["error"] for i in ("axolotl", "unsloth"))
    assert "bf16 or fp16" in skipped["ours_quack"]["error"]  # never the Triton route timed under QuACK's name
    ok = {(r["impl"], r["rep"]) for r in rows if r["status"] == "ok"}
    assert ok == {(i, rep) for i in ("ours", "ours_cublas_base", "ours_pure_cublas", "peft") for rep in range(2)}
    metrics = peer_comparison.step_metrics(rows)
    assert metrics["peers_step_llama3_8b_ckpt_off_fastest_peer"] == "peft"  # the cuBLAS-base recipe is ours, no peer
    assert metrics["peers_step_llama3_8b_ckpt_off_speedup_vs_fastest_peer"]["n"] == 2
    assert metrics["peers_step_llama3_8b_ckpt_off_cublas_base_speedup_vs_ours"]["n"] == 2
    assert metrics["peers_step_llama3_8b_ckpt_off_pure_cublas_speedup_vs_ours"]["n"] == 2
    assert "peers_step_llama3_8b_ckpt_off_quack_speedup_vs_ours" not in metrics
    # the floor beside each step: a made-up rate (CPU has no measured one) gives floor / step per implementation
    cfg = step_bench.whole.model_config("llama", 1, True)
    floor = step_floor.floor_rows("llama3_8b", cfg, 2, 16, "off", tflops=1e-6)
    table = peer_comparison.floor_table(rows, [floor])
    assert {line["impl"] for line in table} == {"ours", "ours_cublas_base", "ours_pure_cublas", "peft"}
    for line in table:
        steps = [r["step_ms"] for r in rows if r["impl"] == line["impl"] and r["status"] == "ok"]
        assert line["step_ms"] == pytest.approx(statistics.median(steps))
        assert line["floor_share"] == pytest.approx(floor["floor_ms"] / line["step_ms"])
    assert floor["floor_ms"] == pytest.approx(floor["flops_total"] / 1e6 * 1e3)
    assert peer_comparison.floor_table(rows, [dict(floor, floor_ms=None)])[0]["floor_share"] is None


@pytest.mark.slow
def test_unsloth_path_loads_the_random_checkpoint_it_writes_offline(step_bench, monkeypatch, tmp_path):
    """A fake ``unsloth.FastLanguageModel`` that loads with transformers and wraps with PEFT: the checkpoint and
    tokenizer the benchmark writes load from disk alone, and the loaded model trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(model_name, max_seq_length, dtype, load_in_4bit):
            calls["load"] = (model_name, max_seq_length, dtype, load_in_4bit)
            return (AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype),
                    AutoTokenizer.from_pretrained(model_name))

        @staticmethod
        def get_peft_model(model, r, target_modules, lora_alpha, lora_dropout, bias, use_gradient_checkpointing):
            calls["peft"] = (r, lora_alpha, use_gradient_checkpointing)
            return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules))

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    peer = step_bench.peer_loader.load("unsloth", "model", check_device=False)
    args = _step_args(tmp_path)
    model = step_bench.PeerModel("llama3_8b", "unsloth", args, torch.device("cpu"), torch.float32, peer)
    model.step()
    assert calls["load"][1:] == (16, torch.float32, False) and calls["peft"] == (16, 32, False)
    assert Path(calls["load"][0]).parent == tmp_path / "ckpt" and len(model.losses) == 1
    tokenizer = AutoTokenizer.from_pretrained(calls["load"][0])
    assert len(tokenizer) == model.head[1]


@pytest.mark.slow
def test_sessions_run_as_separate_processes_and_pool(tmp_path):
    env = _smoke_env()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--out", str(tmp_path), "--smoke",
           "--repetitions", "2", "--sessions", "2", "--ops", "loss", "--peers", "quack"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in measure.read_csv(tmp_path / "peers_ops.csv") if r["impl"] == "ours"]
    assert {(r["session"], r["rep"]) for r in rows} == {(0, 0), (0, 1), (1, 2), (1, 3)}
    assert measure.sessions_in(rows) == 2


def test_stub_missing_stands_in_for_absent_loggers_only(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import peers

    absent = "lora_lab_absent_logger_xyz"
    monkeypatch.delitem(sys.modules, absent, raising=False)
    try:
        assert peers.stub_missing([absent, "json"]) == [absent]  # json is installed: never replaced
        assert sys.modules[absent].__spec__.name == absent and not hasattr(sys.modules[absent], "__path__")
        assert peers.stub_missing([absent]) == []  # already there
    finally:
        sys.modules.pop(absent, None)
