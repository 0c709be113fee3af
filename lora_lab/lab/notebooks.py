"""The numbered notebooks as files: finding them, and reading their ``parameters`` cell (plain JSON, no kernel).

A notebook's parameters cell holds literals only (``R = 8  # LoRA rank``); papermill replaces values, so a
value derived from another would go stale. These literals are the *registered* parameters: a run with other
values is recorded as overridden and its predictions are not graded.

:data:`PARAMETER_RULES` says, in one place, which values each parameter name of the notebooks accepts (``R``
an integer >= 1, ``TARGETS`` known layer names, ...): ``lora-lab run -p`` checks a value against it before
anything runs, so a bad value is named with its rule rather than failing deep inside a cell (``R = 0`` divided
by zero in the scale ``ALPHA / R``).
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_lab.lab.profiles import PROFILES

__all__ = [
    "NOTEBOOK_NAME",
    "NotebookError",
    "discover_notebooks",
    "read_cells",
    "parameters_cell_index",
    "declared_parameters",
    "METADATA_KEY",
    "required_gpus",
    "PARAMETER_RULES",
    "Rule",
    "parameter_problem",
]

NOTEBOOK_NAME = re.compile(r"^(\d\d)_[A-Za-z0-9_\-]+\.ipynb$")
METADATA_KEY = "lora_lab"  # notebook-level metadata of the lab: {"lora_lab": {"gpus": 2}}


class NotebookError(ValueError):
    """A notebook file that breaks the contract (no parameters cell, a cell that is not Python, ...)."""


def discover_notebooks(notebooks_dir: Path | str) -> list[Path]:
    """``NN_*.ipynb`` files of ``notebooks_dir``, sorted by name."""
    directory = Path(notebooks_dir)
    if not directory.is_dir():
        raise NotebookError(f"notebooks directory {directory} does not exist")
    return sorted(path for path in directory.iterdir() if NOTEBOOK_NAME.match(path.name))


def read_cells(path: Path | str) -> list[dict]:
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8")).get("cells")
    except (OSError, ValueError) as error:
        raise NotebookError(f"{Path(path).name}: cannot read the notebook ({error})") from None
    if not isinstance(cells, list):
        raise NotebookError(f"{Path(path).name}: not a notebook (no list of cells)")
    return cells


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags") or [])


def parameters_cell_index(cells: list[dict]) -> int | None:
    for index, cell in enumerate(cells):
        if "parameters" in _tags(cell):
            return index
    return None


def declared_parameters(path: Path | str) -> dict[str, Any]:
    """``{name: literal default}`` of the cell tagged ``parameters``; a non-literal value is an error."""
    path = Path(path)
    cells = read_cells(path)
    index = parameters_cell_index(cells)
    if index is None:
        raise NotebookError(f"{path.name}: no cell is tagged 'parameters' (the notebook contract requires one, "
                            "with PROFILE)")
    try:
        tree = ast.parse(_source(cells[index]))
    except SyntaxError as error:
        raise NotebookError(f"{path.name}: the parameters cell is not valid Python: {error}") from None
    declared: dict[str, Any] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            try:
                declared[target.id] = ast.literal_eval(value)
            except ValueError:
                raise NotebookError(
                    f"{path.name}: parameter {target.id} is not a literal ({ast.unparse(value)}); papermill replaces "
                    "values, so derived values belong in the next cell"
                ) from None
    return declared


def required_gpus(path: Path | str) -> int:
    """How many GPUs the notebook needs: its notebook-level metadata ``{"lora_lab": {"gpus": N}}``, 0 without it.

    On the gpu profile a notebook that needs N GPUs runs only on a machine with at least N; ``lora-lab run`` skips
    it elsewhere and says why. The cpu profile runs it (its cpu path), as every notebook.
    """
    path = Path(path)
    try:
        metadata = json.loads(path.read_text(encoding="utf-8")).get("metadata") or {}
    except (OSError, ValueError) as error:
        raise NotebookError(f"{path.name}: cannot read the notebook ({error})") from None
    lab = metadata.get(METADATA_KEY) or {}
    if not isinstance(lab, dict):
        raise NotebookError(f"{path.name}: metadata {METADATA_KEY!r} must be an object like "
                            f"{{\"gpus\": 2}}, got {lab!r}")
    gpus = lab.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise NotebookError(f"{path.name}: metadata {METADATA_KEY}.gpus must be a non-negative integer, got {gpus!r}")
    return gpus


# --------------------------------------------------------------------------------------------
# What values the notebooks' parameters accept
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A parameter's accepted values: ``text`` says it to the user, ``accepts(value)`` checks it."""

    text: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_at_least(low: int) -> Rule:
    return Rule(f"an integer >= {low}", lambda value: _is_int(value) and value >= low)


def _above(low: float, what: str = "a number") -> Rule:
    return Rule(f"{what} > {low:g}", lambda value: _is_number(value) and value > low)


def _list_of(item: Rule, non_empty: bool = True) -> Rule:
    text = f"a {'non-empty ' if non_empty else ''}list, each item {item.text}"
    return Rule(text, lambda value: isinstance(value, (list, tuple)) and (bool(value) or not non_empty)
                and all(item.accepts(element) for element in value))


def _one_of(names: tuple[str, ...]) -> Rule:
    return Rule(f"one of {', '.join(names)}", lambda value: isinstance(value, str) and value in names)


# the linear layers of the bundled Qwen2-family architectures (lora_lab/configs), the notebooks' models
LINEAR_LAYER_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_NAMES = ("fp32", "bf16", "fp16")  # what the memory sweep of notebook 04 measures
MEMORY_MODES = ("full", "lora", "lora_ckpt", "lora_ckpt_chunked", "full_ckpt_chunked")  # notebook 04's setups


def _targets(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    names = [name.strip() for name in value.split(",")]
    return all(names) and all(name in LINEAR_LAYER_NAMES for name in names) and len(set(names)) == len(names)


def _model_spec(value: Any, empty_ok: bool) -> bool:
    if not isinstance(value, str) or (not value.strip() and not empty_ok):
        return False
    if value.startswith("random:"):
        from lora_lab.models import random_model_names

        return value[len("random:"):] in random_model_names()
    return value == value.strip()


def _extra_point(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 3 and value[0] in DTYPE_NAMES
            and _is_int(value[1]) and value[1] >= 1 and _is_int(value[2]) and value[2] >= 2)


_MODEL_TEXT = "random:<a bundled config>, a local checkpoint directory or a hub id"
_COUNT, _SIZE, _SEED = _int_at_least(1), _int_at_least(1), _int_at_least(0)
_TOKENS_PER_SEQUENCE = _int_at_least(2)  # a causal-LM loss needs a next token
_RATE = _above(0, "a learning rate")

#: Every parameter name the notebooks' parameters cells declare, with the values it accepts. A notebook that
#: declares a new parameter adds its rule here (a test checks that every declared parameter has one and that
#: every registered default passes it). PROFILE is set with ``--profile``, not ``-p``.
PARAMETER_RULES: dict[str, Rule] = {
    "PROFILE": _one_of(("auto", *PROFILES)),
    "MODEL": Rule(f'"" (the model of the profile) or {_MODEL_TEXT}', lambda value: _model_spec(value, empty_ok=True)),
    "MODEL_CPU": Rule(_MODEL_TEXT, lambda value: _model_spec(value, empty_ok=False)),
    "MODEL_GPU": Rule(_MODEL_TEXT, lambda value: _model_spec(value, empty_ok=False)),
    "R": _int_at_least(1),
    "ALPHA": _above(0),
    "TARGETS": Rule("comma-separated, distinct names of linear layers, from " + ", ".join(LINEAR_LAYER_NAMES),
                    _targets),
    "SEED": _SEED,
    "B_SEED": _SEED,
    "DRIFT_SEED": _SEED,
    "B_STD": _above(0, "a standard deviation"),
    "TOKENS": _SIZE,
    "STEPS": _COUNT,
    "STEPS_CPU": _COUNT,
    "STEPS_GPU": _COUNT,
    "SENTENCES": _SIZE,
    "SENTENCES_CPU": _SIZE,
    "SENTENCES_GPU": _SIZE,
    "MEMO_STEPS_CPU": _COUNT,
    "MEMO_STEPS_GPU": _COUNT,
    "TRAIN_STEPS": _COUNT,
    "MEMO_MAX_STEPS": _COUNT,
    "LR": _RATE,
    "MEMO_LR": _RATE,
    "DRIFT_BATCH_CPU": _SIZE,
    "DRIFT_BATCH_GPU": _SIZE,
    "DRIFT_LENGTH_CPU": _SIZE,
    "DRIFT_LENGTH_GPU": _SIZE,
    "MEMO_BATCH_CPU": _SIZE,
    "MEMO_BATCH_GPU": _SIZE,
    "MEMO_LENGTH_CPU": _TOKENS_PER_SEQUENCE,
    "MEMO_LENGTH_GPU": _TOKENS_PER_SEQUENCE,
    "MEMO_TARGET_LOSS": _above(0, "a loss"),
    "N_BOOT": _COUNT,
    "SUBSET": _SIZE,
    "GAP": _above(1, "a factor"),
    "BATCH": _SIZE,
    "LENGTHS": _list_of(_TOKENS_PER_SEQUENCE),
    "EXTRA_POINTS": Rule(f"a list of [dtype, batch, length] with dtype one of {', '.join(DTYPE_NAMES)}, batch "
                         ">= 1 and length >= 2", lambda value: isinstance(value, (list, tuple))
                         and all(_extra_point(point) for point in value)),
    "DTYPES": _list_of(_one_of(DTYPE_NAMES)),
    "MODES": _list_of(_one_of(MEMORY_MODES)),
    "CHUNK_SIZE": _SIZE,
    "LOWEST_CHUNK_SIZES": _list_of(_SIZE, non_empty=False),
    "RUN_BENCHMARKS": Rule("True or False", lambda value: isinstance(value, bool)),
    "REPETITIONS": _COUNT,
    "SEEDS": _COUNT,
    "CALLS": _COUNT,
    "NUMERICS_TOKENS_GPU": _SIZE,
    "NUMERICS_SHAPES": Rule("a non-empty list of distinct MoE layer shape names of fused_moe.LAYER_SHAPES",
                            lambda value: _moe_shape_names(value)),
    "BUDGET_S": Rule("seconds > 0, or a list of them (one per session)",
                     lambda value: _positive_seconds(value)),
    "ROUNDS": _COUNT,
    "SESSIONS": _COUNT,
    "LAYERS": _COUNT,
    "BENCH_MODELS": Rule("comma-separated, distinct names of the whole-step models, from llama, qwen2, qwen3_moe",
                         lambda value: isinstance(value, str) and bool(value)
                         and len(set(value.split(","))) == len(value.split(","))
                         and all(name in ("llama", "qwen2", "qwen3_moe") for name in value.split(","))),
}


def _moe_shape_names(value) -> bool:
    from lora_lab.experiments.fused_moe import LAYER_SHAPES

    names = list(value) if isinstance(value, (list, tuple)) else None
    return bool(names) and len(set(names)) == len(names) and all(
        isinstance(n, str) and n in LAYER_SHAPES for n in names)


def _positive_seconds(value) -> bool:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)


def parameter_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not an accepted value of parameter ``name`` (None when it is, or no rule names it)."""
    rule = PARAMETER_RULES.get(name)
    if rule is None or rule.accepts(value):
        return None
    return f"parameter {name} = {value!r} is not {rule.text}"
