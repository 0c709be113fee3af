"""A job for :func:`lora_lab.distributed.launch` that runs several jobs one after another in the same process group
(one torchrun start and one import per rank for all of them): ``config["jobs"]`` is a list of ``[label,
"module:function", config]``; the result maps each label to that job's metrics, or to ``{"error": traceback}`` when
it raised."""
from __future__ import annotations

import importlib
import traceback
from typing import Any


def run_in_order(config: dict[str, Any]) -> dict[str, Any]:
    results = {}
    for label, job, job_config in config["jobs"]:
        module, _, function = job.partition(":")
        try:
            results[label] = getattr(importlib.import_module(module), function)(job_config)
        except Exception:
            results[label] = {"error": traceback.format_exc()}
    return results
