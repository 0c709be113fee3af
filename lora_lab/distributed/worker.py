"""The process torchrun starts for :func:`lora_lab.distributed.launch`: join the process group (gloo on CPU, NCCL
with CUDA, one GPU per local rank), run the job on the config, write ``<out>/rank<r>.json``, leave the group."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from lora_lab.distributed.launch import CONFIG_NAME, rank_file
from lora_lab.lab.recording import to_json_value, write_json_atomically


def _job(name: str):
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_lab.distributed.worker")
    parser.add_argument("--job", required=True, help="module:function, called with the config dict")
    parser.add_argument("--out", required=True, type=Path, help="folder holding config.json; rank<r>.json go there")
    args = parser.parse_args(argv)
    config = json.loads((args.out / CONFIG_NAME).read_text(encoding="utf-8"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world_size": world, "job": args.job, "status": "running", "metrics": None,
              "error": None}
    started = time.monotonic()
    try:
        metrics = _job(args.job)(config)
        result.update(status="completed", metrics=to_json_value(metrics, "metrics"))
    except BaseException:
        result.update(status="failed", error=traceback.format_exc())
        raise
    finally:
        result["seconds"] = round(time.monotonic() - started, 3)
        write_json_atomically(rank_file(args.out, rank), result)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # A rank whose job completed and whose result is written leaves at once: the interpreter's own teardown has
    # been seen to abort ("terminate called without an active exception", a CPU CI run of the two-process fused
    # test) after a completed job, which torchrun then reports as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
