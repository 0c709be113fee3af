"""A notebook's answer, written from the figures its own run recorded.

The prose that answers a notebook's question quotes figures. Typed by hand they go stale the moment the notebook
runs again; so the answer cells are code: they read this run's metrics through :func:`figures` and show the text
with :func:`show_answer`. A figure that the run did not record raises :class:`MissingFigure`, naming it, instead
of printing a stale or invented number.

    fig = lab.figures()
    lab.show_answer(f"The fused op costs {fig.x('target_time_vs_base')} the frozen layer "
                    f"({fig.interval('target_time_vs_base')}).")

A repeated measurement (:func:`lora_lab.lab.measure.summarize`) is quoted by its median; ``interval`` gives its 95%
interval and ``sessions`` how many processes it pooled.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["Figures", "MissingFigure", "figures", "show_answer"]


class MissingFigure(KeyError):
    """An answer quotes a figure this run did not record."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0]) if self.args else "missing figure"


class Figures:
    """Read-only view of one run's metrics, with the formats the answers use."""

    def __init__(self, metrics: Mapping[str, Any], profile: str = ""):
        self._metrics = dict(metrics)
        self.profile = profile

    def has(self, *keys: str) -> bool:
        """Whether every one of ``keys`` was recorded (with a finite value)."""
        return all(key in self._metrics and _finite(self._metrics[key]) for key in keys)

    def raw(self, key: str) -> Any:
        """The recorded value as is (a summary stays a dict)."""
        if key not in self._metrics:
            near = sorted(name for name in self._metrics if key.split("_")[0] in name)[:8]
            raise MissingFigure(f"the answer quotes {key!r}, which this run ({self.profile or 'no profile'}) did not "
                                f"record" + (f"; recorded names near it: {', '.join(near)}" if near else ""))
        return self._metrics[key]

    def __getitem__(self, key: str) -> float:
        """The value as a number: a repeated measurement's median, a boolean as 0/1."""
        value = self.raw(key)
        if isinstance(value, Mapping):
            if "median" not in value:
                raise MissingFigure(f"{key!r} is a table ({', '.join(list(value)[:5])}…), not a figure")
            value = value["median"]
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, (int, float)):
            raise MissingFigure(f"{key!r} is {type(value).__name__} {value!r}, not a figure")
        return float(value)

    def get(self, key: str, default: float | None = None) -> float | None:
        return self[key] if self.has(key) else default

    def num(self, key: str, digits: int = 3) -> str:
        """``1.570``; integers with thousands separators (``16,384``)."""
        value = self[key]
        if value == int(value) and abs(value) >= 1000 and digits == 0:
            return f"{int(value):,}"
        return f"{value:,.{digits}f}"

    def x(self, key: str, digits: int = 3) -> str:
        """A ratio: ``1.570×``."""
        return f"{self[key]:.{digits}f}×"

    def pct(self, key: str, digits: int = 1) -> str:
        """A fraction as a percentage: ``0.447`` → ``44.7%``."""
        return f"{100 * self[key]:.{digits}f}%"

    def sci(self, key: str, digits: int = 2) -> str:
        """``2.37e-4``."""
        return f"{self[key]:.{digits}e}".replace("e-0", "e-").replace("e+0", "e")

    def interval(self, key: str, digits: int = 3) -> str:
        """A repeated measurement's 95% interval: ``[1.558, 1.578]`` (empty for a single value)."""
        value = self.raw(key)
        if isinstance(value, Mapping) and "ci95" in value:
            low, high = value["ci95"]
            return f"[{low:.{digits}f}, {high:.{digits}f}]"
        return ""

    def sessions(self, key: str) -> int:
        value = self.raw(key)
        return int(value.get("sessions", 1)) if isinstance(value, Mapping) else 1

    def low(self, key: str) -> float:
        value = self.raw(key)
        return float(value["ci95"][0]) if isinstance(value, Mapping) and "ci95" in value else self[key]

    def high(self, key: str) -> float:
        value = self.raw(key)
        return float(value["ci95"][1]) if isinstance(value, Mapping) and "ci95" in value else self[key]

    def above(self, key: str, threshold: float) -> str:
        """How a repeated ratio stands against ``threshold``: 'above', 'below' or 'level with' (interval across it)."""
        if self.low(key) > threshold:
            return "above"
        if self.high(key) < threshold:
            return "below"
        return "level with"


def _finite(value: Any) -> bool:
    if isinstance(value, Mapping):
        value = value.get("median")
    if isinstance(value, bool):
        return True
    return isinstance(value, (int, float)) and math.isfinite(value)


def figures() -> Figures:
    """The figures of the run in progress (after ``lab.start_run``), as recorded so far."""
    from lora_lab.lab.recording import current_run

    run = current_run()
    return Figures(run.metrics, run.name)


def show_answer(markdown: str) -> None:
    """Show ``markdown`` as a rendered cell output in a notebook (plain text elsewhere)."""
    text = markdown.strip() + "\n"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # pragma: no cover - IPython is there wherever notebooks run
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))
