"""Start a job on N processes with ``torchrun`` and collect what each rank returned.

A job is a function ``module:function`` that takes one JSON-able config dict and returns a dict of metrics. The
launcher writes the config to ``<out>/config.json``, runs ``python -m torch.distributed.run --standalone
--nproc-per-node N -m lora_lab.distributed.worker ...`` as a subprocess and, when it ends, reads
``<out>/rank<r>.json`` of every rank: so a notebook cell can run a two-GPU job and read its numbers::

    from lora_lab.distributed import launch
    ranks = launch("lora_lab.distributed.jobs:train_lora", {"steps": 5}, nproc=2)
    ranks[0]["metrics"]["losses"]

The same from a shell: ``lora-lab launch lora_lab.distributed.jobs:train_lora --nproc 2 --config '{"steps": 5}'``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "launch", "torchrun_command", "rank_file", "read_rank_results"]

CONFIG_NAME = "config.json"


class LaunchError(RuntimeError):
    """The job failed on some rank, or torchrun itself failed; the message holds each rank's error."""


def rank_file(out_dir: Path | str, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.json"


def torchrun_command(job: str, out_dir: Path | str, nproc: int) -> list[str]:
    """The command :func:`launch` runs (this interpreter, ``torch.distributed.run``, one node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "lora_lab.distributed.worker", "--job", job, "--out", str(out_dir)]


def read_rank_results(out_dir: Path | str, nproc: int) -> list[dict[str, Any]]:
    """Each rank's ``{"rank", "world_size", "job", "status", "metrics", "error"}`` (None for a rank that wrote
    nothing)."""
    results = []
    for rank in range(nproc):
        path = rank_file(out_dir, rank)
        results.append(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None)
    return results


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (torchrun passes it on to the workers), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _check_job(job: str) -> None:
    module, sep, function = job.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"job must be 'module:function', got {job!r}")


def launch(job: str, config: dict[str, Any] | None = None, nproc: int = 2, out_dir: Path | str | None = None,
           timeout: float | None = None, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``job(config)`` on ``nproc`` processes (torchrun, one node) and return every rank's result, rank 0 first.

    ``out_dir`` (default: a new temporary folder) receives ``config.json``, ``rank<r>.json`` and ``torchrun.log``
    (the processes' output). ``env`` is added to this process's environment. Raises :class:`LaunchError` naming
    each failed rank's exception (or torchrun's output when no rank reported), and ``ValueError`` on a bad job
    name or process count, before anything starts.
    """
    _check_job(job)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="lora_lab_launch_"))
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(nproc):
        rank_file(out, rank).unlink(missing_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(config or {}, indent=2) + "\n", encoding="utf-8")
    child_env = dict(os.environ)
    # the workers import this lora_lab, whether or not it is installed
    package_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    log = out / "torchrun.log"
    with open(log, "w", encoding="utf-8") as handle:
        # a session of its own: on a timeout (or Ctrl-C) torchrun and every worker are stopped together
        proc = subprocess.Popen(torchrun_command(job, out, nproc), stdout=handle, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
        except BaseException:
            _stop(proc)
            raise
    results = read_rank_results(out, nproc)
    failed = [(rank, r) for rank, r in enumerate(results) if r is None or r.get("status") != "completed"]
    if code != 0 or failed:
        reported = [f"rank {rank}: {r['error'].strip().splitlines()[-1]}" for rank, r in failed
                    if r is not None and r.get("error")]
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
        why = "timed out" if code is None else f"exit code {code}"
        raise LaunchError(f"{job} on {nproc} process(es) failed ({why}); "
                          + ("; ".join(reported) if reported else f"no rank reported an error; {log}:\n{tail}"))
    return results
