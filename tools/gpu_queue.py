"""Run a queue of notebooks on a GPU host in calls of limited length, resuming where the last call stopped.

A host lent for a few minutes per call cannot run every notebook in one. Each call runs what fits in its time:

* the notebooks that time nothing (``lora_lab.lab.side_by_side.SHARES_THE_GPU``: 01-04) run side by side, up to
  ``--parallel`` at once, as ``lora-lab run --parallel`` runs them (on a memory-capped profile one at a time);
* every other one runs alone on the GPU, one after another, so its timings share the GPU with nothing;
* a notebook runs only if its expected time fits what is left of ``--limit`` (expected: its last published run's
  wall time from ``outputs/<profile>/run_summary.json``, or the gpu profile's, times ``--margin``, plus ``--slack``;
  ``--default`` seconds when it has none; ``--expect NN=S`` sets it), else it waits for the next call; a smaller one
  further down the queue may go first. One expected to take longer than a whole call runs alone at the start of a
  call, with all of its time.

Each notebook runs with ``lora-lab run --profile P --only NN --outputs-dir <runs>/NN`` (its own runs root, so
notebooks running side by side never write one summary file; ``<runs>`` is ``build/runs/<profile>/queue``), and what
happened is kept in ``<runs>/state.json``, so the next call skips what is done. A notebook stopped at a call's end
and finished in a later one (``--retry-failed``; its benchmarks resume from what they kept) gets ``calls`` and
``seconds_all_calls`` in its run summary, which publishing carries over and the run tables show. Publish each with
``lora-lab publish --profile P --only NN --from <runs>/NN``.

    python tools/gpu_queue.py run --profile gpu --jobs 05,06,07,10,01,02,03,04,09 --limit 540
    python tools/gpu_queue.py status
    bash tools/remote_gpu_run.sh COMMIT --limit 560 command -- .venv-gpu/bin/python tools/gpu_queue.py run \
        --profile gpu --jobs 05,06,07,10,09,01,02,03,04 --limit 540          # on a remote host, packed with the runs
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lora_lab.lab.recording import write_json_atomically
from lora_lab.lab.side_by_side import (  # the notebooks that time nothing: side by side
    SHARES_THE_GPU,
    side_by_side_allowed,
)

ROOT = Path(__file__).resolve().parents[1]


class QueueError(Exception):
    """Bad input; the message names it."""


def expected_seconds(job: str, profile: str, outputs: Path, margin: float, slack: float, default: float) -> float:
    """The job's last published wall time on ``profile`` (else the gpu profile's; over every call it took) times
    ``margin`` plus ``slack``."""
    for name in dict.fromkeys((profile, "gpu")):
        path = outputs / name / "run_summary.json"
        if path.is_file():
            entries = json.loads(path.read_text()).get("notebooks") or {}
            seconds = next((e.get("seconds_all_calls", e.get("seconds")) for stem, e in entries.items()
                            if stem[:2] == job), None)  # a run resumed over several calls: all of them
            if isinstance(seconds, (int, float)):
                return seconds * margin + slack
    return default


def _load(state_path: Path) -> dict:
    if state_path.is_file():
        try:
            return json.loads(state_path.read_text())
        except ValueError as error:
            raise QueueError(f"{state_path}: not a queue state file ({error}); remove it to start over") from None
    return {"jobs": {}}


def _save(state_path: Path, state: dict) -> None:
    state_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(state_path)


def _start(job: str, args, timeout: float) -> subprocess.Popen:
    command = [*args.lora_lab, "run", "--profile", args.profile, "--only", job,
               "--outputs-dir", str(Path(args.runs) / job)]
    log = open(Path(args.runs) / f"{job}.log", "w", encoding="utf-8")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    process.job, process.log, process.deadline, process.began = job, log, time.monotonic() + timeout, time.monotonic()
    process.runs = args.runs
    return process


def _record_calls(root: Path, job: str, calls: list[dict]) -> None:
    """A run that finished in a later call than it began (its benchmarks resumed): its entry in the runs root's
    run_summary.json also gets ``calls`` (how many) and ``seconds_all_calls`` (their seconds added up), which
    ``lora-lab publish`` carries over and the run tables show; the runner's ``seconds`` stay the last call's."""
    for path in root.glob("*/run_summary.json"):
        summary = json.loads(path.read_text())
        for stem, entry in (summary.get("notebooks") or {}).items():
            if stem[:2] == job:
                entry["calls"] = len(calls)
                entry["seconds_all_calls"] = round(sum(float(c["seconds"]) for c in calls), 1)
        write_json_atomically(path, summary)


def _wait(processes: list[subprocess.Popen], state: dict, state_path: Path) -> None:
    """Wait for every process; one past its deadline is stopped and recorded as timed out."""
    for process in processes:
        try:
            code = process.wait(timeout=max(1.0, process.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = "timeout"
        process.log.close()
        seconds = round(time.monotonic() - process.began, 1)
        prior = state["jobs"].get(process.job, {})  # an earlier call's attempt (a state file without calls: its one)
        earlier = prior.get("calls") or ([{"exit": prior.get("exit"), "seconds": prior["seconds"]}]
                                         if isinstance(prior.get("seconds"), (int, float)) else [])
        calls = [*earlier, {"exit": code, "seconds": seconds}]
        state["jobs"][process.job] = {"status": "done" if code == 0 else "failed", "exit": code, "seconds": seconds,
                                      "calls": calls}
        _save(state_path, state)
        if code == 0 and len(calls) > 1:
            _record_calls(Path(process.runs) / process.job, process.job, calls)
        print(f"  {process.job}: {'done' if code == 0 else 'FAILED'} (exit {code}) in {seconds:.0f} s", flush=True)


def run(args) -> int:
    jobs = [j.strip()[:2] for j in args.jobs.split(",") if j.strip()]
    if not jobs or any(not (len(j) == 2 and j.isdigit()) for j in jobs):
        raise QueueError(f"--jobs takes notebook numbers, e.g. 05,06,01; got {args.jobs!r}")
    if args.limit <= 0 or args.parallel < 1:
        raise QueueError("--limit must be positive and --parallel at least 1")
    if side_by_side_allowed(args.profile, args.parallel) < args.parallel:
        print(f"{args.profile}: one notebook at a time (its memory cap stands for one card's memory)", flush=True)
        args.parallel = 1
    state_path, outputs = Path(args.state), Path(args.outputs)
    state = _load(state_path)
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    pending = [j for j in jobs if state["jobs"].get(j, {}).get("status") not in ("done",)
               and (args.retry_failed or state["jobs"].get(j, {}).get("status") != "failed")]
    expect = {j: expected_seconds(j, args.profile, outputs, args.margin, args.slack, args.default) for j in pending}
    for item in args.expect:
        job, _, seconds = item.partition("=")
        try:
            expect[job.strip()[:2]] = float(seconds)
        except ValueError:
            raise QueueError(f"--expect takes NN=SECONDS, e.g. 05=400; got {item!r}") from None
    print(f"queue: {len(pending)} to run of {len(jobs)} ({', '.join(pending) or 'none'}), {args.limit:.0f} s in this "
          f"call", flush=True)
    ran = False
    while pending:
        left = args.limit - (time.monotonic() - began)
        fits = [j for j in pending if expect[j] <= left]
        if not fits and not ran:  # longer than any call: it runs alone, with the whole of this one
            batch = [pending[0]]
            print(f"{batch[0]}: expected {expect[batch[0]]:.0f} s, more than this call's {left:.0f} s: it runs alone "
                  "with all of them", flush=True)
        elif not fits:
            break
        elif fits[0] not in SHARES_THE_GPU:  # it times something (or needs every GPU): alone
            batch = [fits[0]]
        else:  # the non-timing notebooks that fit, side by side
            batch = [j for j in fits if j in SHARES_THE_GPU][:args.parallel]
        ran = True
        print(f"running {', '.join(batch)} (expected {max(expect[j] for j in batch):.0f} s, {left:.0f} s left)",
              flush=True)
        _wait([_start(j, args, left) for j in batch], state, state_path)
        pending = [j for j in pending if j not in batch]
    for job in pending:
        print(f"  {job}: waits for the next call (expected {expect[job]:.0f} s)")
    return status(args, jobs)


def status(args, jobs: list[str] | None = None) -> int:
    state = _load(Path(args.state))["jobs"]
    jobs = jobs or sorted(state)
    print(f"{'notebook':8s} {'status':8s} {'exit':>7s} {'seconds':>8s}")
    for job in jobs:
        entry = state.get(job, {})
        print(f"{job:8s} {entry.get('status', 'pending'):8s} {str(entry.get('exit', '-')):>7s} "
              f"{entry.get('seconds', '-')!s:>8s}")
    return 0 if all(state.get(j, {}).get("status") == "done" for j in jobs) else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run what fits in this call")
    p.add_argument("--profile", default="gpu")
    p.add_argument("--jobs", required=True, help="notebook numbers in the order to run them, e.g. 05,06,01,02")
    p.add_argument("--limit", type=float, required=True, help="seconds this call may take")
    p.add_argument("--parallel", type=int, default=4, help="non-timing notebooks side by side (default 4)")
    p.add_argument("--margin", type=float, default=1.15, help="expected = last run's seconds x margin + slack")
    p.add_argument("--slack", type=float, default=20.0)
    p.add_argument("--default", type=float, default=600.0, help="expected seconds of a notebook never run")
    p.add_argument("--expect", nargs="*", default=[], metavar="NN=SECONDS",
                   help="expected seconds of a notebook, instead of its last run's (e.g. 05=400 06=460)")
    p.add_argument("--retry-failed", action="store_true", help="run again what failed in an earlier call")
    p.add_argument("--lora-lab", nargs="+", default=[str(ROOT / ".venv-gpu" / "bin" / "lora-lab")],
                   help="the command that runs notebooks (default: .venv-gpu/bin/lora-lab)")
    st = sub.add_parser("status", help="what is done, failed or pending")
    st.add_argument("--profile", default="gpu")
    for q in (p, st):
        q.add_argument("--runs", default=None, help="runs roots of the notebooks (default: build/runs/<profile>/queue, "
                                                   "packed with the profile's runs by tools/remote_gpu_run.sh)")
        q.add_argument("--state", default=None, help="the state file (default: <runs>/state.json)")
        q.add_argument("--outputs", default=str(ROOT / "outputs"))
    args = parser.parse_args(argv)
    args.runs = args.runs or str(ROOT / "build" / "runs" / args.profile / "queue")
    args.state = args.state or str(Path(args.runs) / "state.json")
    try:
        return run(args) if args.command == "run" else status(args)
    except QueueError as error:
        print(f"gpu_queue.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
