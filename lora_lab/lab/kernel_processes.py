"""The jupyter kernels the runner starts: each with the run's context in its environment, each one's process id
kept so that Ctrl-C can reach kernels running in other threads, and asyncio's leftover report of an interrupted
kernel kept off the terminal."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

__all__ = ["kernel_manager_with", "interrupt_kernels", "quiet_orphaned_kernel_tasks"]


def kernel_manager_with(extra_env: dict[str, str], unset: tuple[str, ...] = (), log_path: Path | None = None):
    """A jupyter kernel manager class whose kernels start with ``extra_env`` on top of this process's
    environment (``unset`` removed) — the runner's context reaches the notebook without touching os.environ. The
    kernel process's own stderr (its log lines, its tracebacks at shutdown) goes to ``log_path`` when given."""
    from jupyter_client.manager import AsyncKernelManager

    class ContextKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            await super()._async_launch_kernel(kernel_cmd, **kw)
            self._lora_lab_pid = getattr(getattr(self, "provisioner", None), "pid", None)
            if self._lora_lab_pid is not None:
                with _LIVE_KERNELS_LOCK:
                    _LIVE_KERNELS.add(self._lora_lab_pid)

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            # the kernel has stopped: forget its process id, which the system may give to another process
            with _LIVE_KERNELS_LOCK:
                _LIVE_KERNELS.discard(getattr(self, "_lora_lab_pid", None))
            await super()._async_cleanup_resources(restart=restart)

        async def _async_pre_start_kernel(self, **kw):
            env = dict(kw.get("env") or os.environ)
            for name in unset:
                env.pop(name, None)
            env.update(extra_env)
            kw["env"] = env
            if log_path is not None:
                kw["stderr"] = open(log_path, "w", encoding="utf-8")  # the kernel process owns it from here
            return await super()._async_pre_start_kernel(**kw)

    return ContextKernelManager


_LIVE_KERNELS: set[int] = set()  # the process ids of the running kernels this process started (for Ctrl-C)
_LIVE_KERNELS_LOCK = threading.Lock()


def interrupt_kernels() -> None:
    """SIGINT to every kernel this process started that still runs: the cell running in each ends in
    KeyboardInterrupt, and its notebook is recorded as interrupted. Kernels run in sessions of their own, so a
    terminal's Ctrl-C reaches only this process; in a side-by-side group the notebooks run in other threads."""
    with _LIVE_KERNELS_LOCK:
        pids = sorted(_LIVE_KERNELS)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGINT)
        except (ProcessLookupError, PermissionError):
            with _LIVE_KERNELS_LOCK:
                _LIVE_KERNELS.discard(pid)


class _OrphanDeadKernelFilter(logging.Filter):
    """Drop asyncio's "Task exception was never retrieved" report of what Ctrl-C left behind.

    After Ctrl-C, nbclient's task that waits for the cell's reply is left pending. When the kernel has been shut
    down the task ends in DeadKernelError; when the kernel, interrupted too, answered first, it ends in the cell's
    error, a KeyboardInterrupt. asyncio prints either traceback at exit, after the runner's one-line report. The
    interruption is already recorded, so neither says anything new.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        interrupted_cell = getattr(error, "ename", None) == "KeyboardInterrupt"
        return not (type(error).__name__ == "DeadKernelError" or interrupted_cell)


_ORPHAN_FILTER = _OrphanDeadKernelFilter()


def quiet_orphaned_kernel_tasks() -> None:
    """After an interrupted notebook: keep the orphaned task's DeadKernelError off the terminal."""
    logger = logging.getLogger("asyncio")
    if _ORPHAN_FILTER not in logger.filters:
        logger.addFilter(_ORPHAN_FILTER)
