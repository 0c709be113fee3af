"""Regenerate ``outputs/<profile>/run_history.json`` from git history (see :mod:`lora_lab.lab.history`).

Every committed version of ``outputs/<profile>/<notebook>.metrics.json`` is one published run, graded against
the predictions registered before the commit that published it, under the rules in force at the commit it ran
from (``lora_lab.lab.rules``): a later rule or grading amendment applies to later runs only; labels are today's.
Runs published but not committed yet are kept. Run from the repository root::

    PYTHONPATH=$PWD python tools/seed_run_history.py [--profile gpu --profile cpu]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_lab.lab.history import regenerate
from lora_lab.lab.predictions import load_predictions
from lora_lab.lab.provenance import find_repo_root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", choices=("cpu", "gpu"), default=None,
                        help="profile to regenerate (repeatable; default: both)")
    args = parser.parse_args(argv)
    root = find_repo_root(Path.cwd())
    if root is None:
        print("error: run from inside the lora_lab repository", file=sys.stderr)
        return 2
    predictions = load_predictions(root / "predictions" / "predictions.yaml", notebooks_dir=root / "notebooks")
    for profile in args.profile or ["cpu", "gpu"]:
        path = regenerate(root, profile, predictions, root / "outputs" / profile)
        print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
