"""``lora-lab``: run, grade, verify, validate and publish the pre-registered notebooks.

    lora-lab run      [--profile auto|cpu|gpu] [--only 01,03] [-p NAME VALUE ...]   -> build/runs/<profile>/
    lora-lab grade    [--profile auto|cpu|gpu] [--outputs-dir build/runs]            (default: outputs/)
    lora-lab publish  --profile gpu [--only 05]       build/runs/<profile>/ -> outputs/<profile>/ (+ notebooks/)
    lora-lab verify
    lora-lab validate
    lora-lab check-prose
    lora-lab launch   JOB [--nproc 2] [--config JSON] [--out DIR]       torchrun; prints each rank's metrics
    lora-lab ledger   show --profile gpu [--benchmark loss] [--method M]   rows of outputs/<profile>/measurements.csv
    lora-lab ledger   add --profile gpu FILE.csv        append another ledger's rows (e.g. from a GPU machine)
    lora-lab --version

Exit codes: 0 fine; 1 a notebook failed (run), a pre-registration rule was broken (verify), prose states
a number no run recorded or there was nothing to check (check-prose); 2 bad input (unknown parameter or a value
its rule refuses, malformed or uncommitted predictions file, not a git repository, no lora_lab checkout, a run
that cannot be published, an output folder that cannot be written, no metrics to grade, ...); 130 interrupted
(Ctrl-C).
Grading exits 0 whatever the hit rate: a miss is a finding, not a failure.

Paths not given on the command line are taken from the checkout the running ``lora_lab`` package lives in, else
from the one around the current directory (:func:`lora_lab.lab.predictions.repository_root`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_lab.lab.recording import PROFILE_CHOICES

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
MATRIX_DOCUMENT = "docs/gpu.md"  # keeps `lora-lab runs --matrix` (publish rewrites it)
DEFAULT_REPO = "the checkout of the lora_lab package that runs, else the one around cwd"


def repo_root() -> Path:
    """The checkout the defaults point into (see :func:`lora_lab.lab.predictions.repository_root`)."""
    from lora_lab.lab.predictions import repository_root

    return repository_root()


def _paths(parser: argparse.ArgumentParser, *, notebooks=True, outputs=True, predictions=False) -> None:
    if notebooks:
        parser.add_argument("--notebooks-dir", type=Path, default=None,
                            help="notebooks folder (default: <repo>/notebooks)")
    if outputs:
        parser.add_argument("--outputs-dir", type=Path, default=None,
                            help="outputs root; results go to <it>/<profile>/ (default: <repo>/outputs)")
    if predictions:
        parser.add_argument("--predictions", type=Path, default=None,
                            help="predictions file (default: <repo>/predictions/predictions.yaml)")


def build_parser() -> argparse.ArgumentParser:
    from lora_lab import __version__

    parser = argparse.ArgumentParser(
        prog="lora-lab", description="Run, grade, verify, validate and publish the pre-registered notebooks.")
    parser.add_argument("--version", action="version", version=f"lora-lab {__version__}",
                        help="print the version of the lora_lab package this command runs, and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="execute notebooks with papermill into build/runs/<profile>/ (scratch)")
    run.add_argument("--profile", choices=PROFILE_CHOICES, default="auto", help="auto = gpu iff CUDA is available")
    run.add_argument("--only", default=None, help="comma-separated notebook numbers or stems, e.g. 01,03")
    run.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="override a parameters-cell value (Python literal, else text), checked against its type and its rule "
             "in lora_lab.lab.notebooks.PARAMETER_RULES before anything runs; repeatable",
    )
    run.add_argument("--cell-timeout", type=float, default=None,
                     help="seconds a single cell may run (default: no limit)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars (also: TQDM_DISABLE=1)")
    run.add_argument("--parallel", type=int, default=1, metavar="N",
                     help="run up to N of the notebooks that time nothing (01-04) side by side, each in its own "
                          "kernel; every other notebook runs alone (default 1: one after another)")
    run.add_argument("--notebooks-dir", type=Path, default=None, help="notebooks folder (default: <repo>/notebooks)")
    run.add_argument("--outputs-dir", type=Path, default=None,
                     help="runs root; results go to <it>/<profile>/ (default: <repo>/build/runs)")

    grade = commands.add_parser("grade", help="grade predictions against outputs/<profile>/, write the scoreboard")
    grade.add_argument("--profile", choices=PROFILE_CHOICES, default="auto")
    grade.add_argument("--no-write", action="store_true", help="print only; do not write scoreboard.md/.png")
    _paths(grade, predictions=True)

    verify = commands.add_parser("verify", help="check from git history: append-only, predicted before measured")
    verify.add_argument("--repo", type=Path, default=None, help=f"repository to check (default: {DEFAULT_REPO})")
    verify.add_argument("--predictions", default="predictions/predictions.yaml",
                        help="predictions file, relative to the repo root")
    verify.add_argument("--outputs", default="outputs", help="outputs root, relative to the repo root")

    validate = commands.add_parser("validate", help="validate the predictions file only")
    _paths(validate, outputs=False, predictions=True)

    publish = commands.add_parser("publish", help="copy a checked run into outputs/<profile>/ (gpu: and notebooks/)")
    publish.add_argument("--profile", choices=PROFILE_CHOICES[1:], required=True)
    publish.add_argument("--only", default=None, help="comma-separated notebook numbers or stems")
    publish.add_argument("--from", dest="runs_dir", type=Path, default=None,
                         help="runs root holding <profile>/ (default: <repo>/build/runs)")
    publish.add_argument("--notebooks", dest="to_notebooks", action=argparse.BooleanOptionalAction, default=None,
                         help="also publish the executed notebooks into notebooks/ (default: for the gpu profile)")
    _paths(publish)

    prose = commands.add_parser("check-prose",
                                help="fail on numbers in markdown that no run recorded and no source cites")
    prose.add_argument("--repo", type=Path, default=None, help=f"repository to check (default: {DEFAULT_REPO})")
    launch = commands.add_parser("launch", help="run a job module:function on N processes (torchrun), print each "
                                                "rank's metrics as JSON")
    launch.add_argument("job", help="module:function taking the config dict, e.g. lora_lab.distributed.jobs:train_lora")
    launch.add_argument("--nproc", type=int, default=2, help="processes (one per GPU on a GPU machine; default 2)")
    launch.add_argument("--config", default="{}", help="the job's config: JSON text, or @file holding JSON")
    launch.add_argument("--out", type=Path, default=None,
                        help="folder for config.json, rank<r>.json and torchrun.log (default: a new temporary one)")
    launch.add_argument("--timeout", type=float, default=None, help="seconds before the job is stopped")
    _ledger_parser(commands)
    runs = commands.add_parser("runs", help="what each published run of a profile took: wall time, the largest GPU "
                                            "process, device, cap, commit")
    which = runs.add_mutually_exclusive_group(required=True)
    which.add_argument("--profile", choices=PROFILE_CHOICES[1:])
    which.add_argument("--matrix", action="store_true",
                       help="every notebook on each GPU profile (gpu, gpu-40g, gpu-24g, gpu-sm80): wall time, GPU "
                            "memory, cells skipped or shrunk")
    runs.add_argument("--write", type=Path, default=None,
                      help="with --matrix: replace the generated table in this file (between its markers) instead of "
                           "printing it")
    _paths(runs, notebooks=False)
    return parser


def _ledger_parser(commands) -> None:
    from lora_lab.lab.ledger import PROFILES

    ledger = commands.add_parser("ledger", help="show or add rows of the measurement ledger "
                                                "(outputs/<profile>/measurements.csv)")
    verbs = ledger.add_subparsers(dest="verb", metavar="VERB", required=True)
    show = verbs.add_parser("show", help="print the rows (as CSV) that match")
    add = verbs.add_parser("add", help="append the rows of another ledger file, each checked first")
    add.add_argument("file", type=Path, help="a ledger file, e.g. written by a benchmark's --ledger FILE.csv")
    for verb in (show, add):
        verb.add_argument("--profile", choices=PROFILES, required=True)
        verb.add_argument("--ledger", type=Path, default=None,
                          help="the ledger file (default: <repo>/outputs/<profile>/measurements.csv)")
    for column in ("benchmark", "cell", "method", "statistic", "commit"):
        show.add_argument(f"--{column}", default=None, help=f"only rows whose {column} is this")


def command_ledger(args: argparse.Namespace) -> int:
    import csv

    from lora_lab.lab.ledger import COLUMNS, LedgerError, append_measurements, read_measurements

    try:
        if args.verb == "add":
            if not args.file.is_file():
                raise LedgerError(f"{args.file}: no such file")
            rows = read_measurements(ledger=args.file)
            where = append_measurements(rows, profile=args.profile, ledger=args.ledger)
            print(f"{len(rows)} rows of {args.file} appended to {where}")
            return EXIT_OK
        match = {c: getattr(args, c) for c in ("benchmark", "cell", "method", "statistic", "commit")
                 if getattr(args, c) is not None}
        rows = read_measurements(profile=args.profile, ledger=args.ledger, **match)
    except LedgerError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    writer = csv.DictWriter(sys.stdout, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({**row, "value": repr(row["value"]), "published": str(row["published"]).lower(),
                      "n": row["n"] or "", "sessions": row["sessions"] or ""} for row in rows)
    return EXIT_OK


def command_launch(args: argparse.Namespace) -> int:
    import json

    from lora_lab.distributed.launch import LaunchError, launch

    try:
        text = args.config
        if text.startswith("@"):
            try:
                text = Path(args.config[1:]).read_text(encoding="utf-8")
            except OSError as error:
                raise ValueError(f"--config {args.config}: cannot read {args.config[1:]} ({error.strerror or error})"
                                 ) from None
        try:
            config = json.loads(text)
        except ValueError as error:
            source = f"the file {args.config[1:]}" if args.config.startswith("@") else repr(text[:60])
            raise ValueError(f"--config: {source} is not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config must be a JSON object, got {type(config).__name__}")
        results = launch(args.job, config, nproc=args.nproc, out_dir=args.out, timeout=args.timeout)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(results, indent=2))
    return EXIT_OK


def command_run(args: argparse.Namespace) -> int:
    from lora_lab.lab.kernel_processes import quiet_orphaned_kernel_tasks
    from lora_lab.lab.runner import (
        DEFAULT_RUNS_DIR,
        RunnerError,
        parse_only,
        parse_value,
        run,
    )

    overrides = {}
    for name, value in args.parameter:
        if name in overrides:
            print(f"error: parameter {name!r} is given twice", file=sys.stderr)
            return EXIT_BAD_INPUT
        overrides[name] = parse_value(value)
    try:
        return run(
            profile=args.profile,
            only=parse_only(args.only),
            overrides=overrides,
            notebooks_dir=args.notebooks_dir or repo_root() / "notebooks",
            outputs_root=args.outputs_dir or repo_root() / DEFAULT_RUNS_DIR,
            cell_timeout=args.cell_timeout,
            disable_progress=True if args.no_progress else None,
            parallel=args.parallel,
        )
    except (RunnerError, RuntimeError, ValueError) as error:
        print(f"error: {error}\nnothing was run.", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        quiet_orphaned_kernel_tasks()
        print("interrupted (Ctrl-C): the notebook that was running is recorded as interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def command_grade(args: argparse.Namespace) -> int:
    from lora_lab.lab.grading import grade
    from lora_lab.lab.predictions import PredictionError
    from lora_lab.lab.recording import resolve_profile
    from lora_lab.lab.runner import RunnerError, check_writable

    try:
        # grading reads recorded metrics, so a named profile needs no device; only "auto" is resolved
        profile = args.profile if args.profile != "auto" else resolve_profile(args.profile)
        profile_dir = (args.outputs_dir or repo_root() / "outputs") / profile
        if not any(profile_dir.glob("*.metrics.json")):
            raise ValueError(f"no *.metrics.json in {profile_dir}: nothing to grade (lora-lab run writes a run's "
                             f"metrics into build/runs/<profile>/: grade them with --outputs-dir build/runs)")
        if not args.no_write:
            check_writable(profile_dir, "--outputs-dir (or --no-write)")
        grade(
            profile,
            predictions_path=args.predictions,
            outputs_root=args.outputs_dir,
            notebooks_dir=args.notebooks_dir,
            write=not args.no_write,
        )
    except (PredictionError, RunnerError, RuntimeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def command_verify(args: argparse.Namespace) -> int:
    from lora_lab.lab.verify import GitError, verify

    try:
        report = verify(args.repo or repo_root(), predictions_path=args.predictions, outputs=args.outputs)
    except GitError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(report.text())
    return EXIT_OK if report.ok else EXIT_FAILED


def command_validate(args: argparse.Namespace) -> int:
    from lora_lab.lab.predictions import PredictionError, default_predictions_path, load_predictions

    path = args.predictions or default_predictions_path()
    try:
        predictions = load_predictions(path, notebooks_dir=args.notebooks_dir)
    except PredictionError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    superseding = sum(bool(prediction.supersedes) for prediction in predictions)
    print(f"{path}: {len(predictions)} valid prediction(s), {superseding} superseding an earlier one")
    return EXIT_OK


def command_publish(args: argparse.Namespace) -> int:
    from lora_lab.lab.publishing import PublishError, publish
    from lora_lab.lab.runner import DEFAULT_RUNS_DIR, RunnerError, parse_only

    try:
        done = publish(
            args.profile,
            runs_root=args.runs_dir or repo_root() / DEFAULT_RUNS_DIR,
            outputs_root=args.outputs_dir or repo_root() / "outputs",
            notebooks_dir=args.notebooks_dir or repo_root() / "notebooks",
            only=parse_only(args.only),
            to_notebooks=args.to_notebooks,
        )
    except (PublishError, RunnerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for item in done:
        also = f" and {item.notebook_destination}" if item.notebook_destination else ""
        print(f"published {item.notebook} -> {item.destination}{also}")
    document = repo_root() / MATRIX_DOCUMENT
    if done and args.outputs_dir is None and document.is_file():  # the checkout's own outputs: keep its table current
        from lora_lab.lab.run_table import write_matrix

        if write_matrix(document, repo_root() / "outputs"):
            print(f"{MATRIX_DOCUMENT}: the table of runs per profile rewritten")
    return EXIT_OK


def command_runs(args: argparse.Namespace) -> int:
    from lora_lab.lab.run_table import runs_matrix, runs_table, write_matrix

    outputs = args.outputs_dir or repo_root() / "outputs"
    if args.write is not None and not args.matrix:
        print("error: --write goes with --matrix (the generated table a document keeps)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if not args.matrix:
            print(runs_table(outputs / args.profile))
        elif args.write is None:
            print(runs_matrix(outputs))
        else:
            changed = write_matrix(args.write, outputs)
            print(f"{args.write}: the table {'rewritten' if changed else 'already current'}")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def command_check_prose(args: argparse.Namespace) -> int:
    from lora_lab.lab.prose import check_prose

    report = check_prose(args.repo or repo_root())
    print(report.text())
    return EXIT_OK if report.ok else EXIT_FAILED


COMMANDS = {
    "run": command_run,
    "grade": command_grade,
    "verify": command_verify,
    "validate": command_validate,
    "publish": command_publish,
    "check-prose": command_check_prose,
    "launch": command_launch,
    "ledger": command_ledger,
    "runs": command_runs,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    from lora_lab.lab.predictions import RepositoryNotFound

    try:
        return COMMANDS[args.command](args)
    except RepositoryNotFound as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
