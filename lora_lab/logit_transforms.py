"""What a transformers causal LM does to its logits between the lm_head and the loss, read from its forward's code.

The fused loss (and the chunked one of :mod:`lora_lab.loss`) computes ``cross_entropy(softcap(H Wᵀ))`` from the
final hidden states ``H``. A ``*ForCausalLM`` forward may do more between the decoder body and the loss: scale the
hidden states or the logits (Granite's ``logits / config.logits_scaling``, Cohere's ``logits * logit_scale``,
Falcon-H1's ``lm_head_multiplier``, MiniCPM3's ``hidden_states / config.logits_scaling``), soft-cap them (Gemma-2/3's
``final_logit_softcapping``, RecurrentGemma's ``logits_soft_cap``), or something else (cut the vocabulary, another
head module, its own unshifted loss). :func:`logit_transform` reads the forward's statements from the decoder body's
call to the loss and returns the ones the op can take — multiplicative scales, folded into the hidden states
(``(s·H) Wᵀ = s·(H Wᵀ)``), then one soft-cap — or raises :class:`UnsupportedLogitTransform` naming the class and
the statement it cannot take. Values are read from the model when the loss runs (a config changed after patching
is followed).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LogitTransform", "UnsupportedLogitTransform", "logit_transform"]


class UnsupportedLogitTransform(ValueError):
    """The model's forward does something between its head and its loss that the fused loss cannot reproduce."""


@dataclass(frozen=True)
class LogitTransform:
    """``scales``: (``"*"`` or ``"/"``, attribute path from the model) applied in order to the hidden states (the
    model applies them to its hidden states or logits; a product commutes with the head); ``softcap``: the path of
    the soft-cap value (None: no soft-cap; the value None at run time: none either); ``cast_hidden``: the forward
    casts the hidden states to the head's dtype before the head; ``loss_added_when``: the flag under which the
    forward adds a term to its loss after the causal-LM loss (an MoE router's auxiliary loss), which the fused loss
    does not add."""

    scales: tuple[tuple[str, str], ...] = ()
    softcap: str | None = None
    cast_hidden: bool = False
    loss_added_when: str | None = None  # "output_router_logits": the forward adds a router loss when that is on

    def apply(self, lm: nn.Module, hidden: torch.Tensor, head_weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                                            float | None]:
        """(the hidden states to give the op, the soft-cap to pass it)."""
        if self.cast_hidden:
            hidden = hidden.to(head_weight.dtype)
        for op, path in self.scales:
            value = _value(lm, path)
            if not torch.is_tensor(value):
                value = float(value)
            hidden = hidden * value if op == "*" else hidden / value
        return hidden, self.softcap_value(lm)

    def softcap_value(self, lm: nn.Module) -> float | None:
        cap = None if self.softcap is None else _value(lm, self.softcap)
        return None if cap is None else float(cap)

    def describe(self) -> str:
        parts = [f"logits {op} {path}" for op, path in self.scales]
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap}")
        return ", ".join(parts) or "none"


def _value(lm: nn.Module, path: str):
    obj = lm
    for name in path.split(".")[1:]:  # "self.config.x"
        obj = getattr(obj, name)
    return obj


def _path(node) -> str | None:
    """``self.a.b`` as "self.a.b"; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return ".".join(["self", *reversed(names)])
    return None


def _forward_function(lm: nn.Module):
    for cls in type(lm).__mro__:
        if "forward" in cls.__dict__:
            return cls, inspect.unwrap(cls.__dict__["forward"])
    raise UnsupportedLogitTransform(f"{type(lm).__name__} has no forward")


def _head_path(lm: nn.Module, head: nn.Module) -> str:
    for name, module in lm.named_modules():
        if module is head:
            return "self." + name
    raise UnsupportedLogitTransform(f"{type(lm).__name__}'s output embeddings are not one of its submodules")


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls(node, path: str) -> bool:
    return any(isinstance(n, ast.Call) and _path(n.func) == path for n in ast.walk(node))


def logit_transform(lm: nn.Module, head: nn.Module) -> LogitTransform:
    """The transform ``lm``'s forward applies between ``head`` (its output embeddings) and its loss; raises
    :class:`UnsupportedLogitTransform` where the fused loss cannot reproduce it."""
    cls, fn = _forward_function(lm)
    transform = analyze_forward(fn, f"{cls.__name__}.forward", _head_path(lm, head),
                                "self." + getattr(lm, "base_model_prefix", ""))
    loss_fn = getattr(lm, "loss_function", None)
    from transformers.loss.loss_utils import ForCausalLMLoss

    if loss_fn is not ForCausalLMLoss:
        raise UnsupportedLogitTransform(f"{cls.__name__} computes its loss with "
                                        f"{getattr(loss_fn, '__name__', loss_fn)!s}, not transformers' "
                                        "ForCausalLMLoss; the fused loss cannot reproduce it")
    return transform


@functools.lru_cache(maxsize=256)
def analyze_forward(fn, name: str, head_path: str, body_path: str) -> LogitTransform:
    """:func:`logit_transform` on the source of the forward ``fn`` (``name`` for messages), whose head is the
    module at ``head_path`` ("self.lm_head") and decoder body at ``body_path`` ("self.model"). Cached: the
    source is read and parsed once per forward."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        raise UnsupportedLogitTransform(f"{name}: its source cannot be read ({e}), so what it does to the logits "
                                        "before the loss is unknown") from e
    stmts = tree.body[0].body

    def refuse(what: str):
        return UnsupportedLogitTransform(f"{name} {what}; the fused loss cannot reproduce it")

    at_head = [i for i, s in enumerate(stmts) if _calls(s, head_path)]
    if not at_head:
        raise refuse(f"does not call its output embeddings {head_path} directly (another head module or transform "
                     "sits between the decoder's hidden states and the logits)")
    k = at_head[0]
    at_body = [i for i, s in enumerate(stmts[:k]) if isinstance(s, (ast.Assign, ast.AnnAssign))
               and _calls(s.value, body_path)]
    if not at_body:
        raise refuse(f"does not take the hidden states from {body_path}(...) before {head_path}")
    b = at_body[-1]
    targets = stmts[b].targets if isinstance(stmts[b], ast.Assign) else [stmts[b].target]
    if len(targets) != 1 or not isinstance(targets[0], ast.Name):
        raise refuse(f"assigns the decoder's output in an unexpected way: {ast.unparse(stmts[b])}")
    outputs = targets[0].id
    scales: list[tuple[str, str]] = []
    hidden_names: set[str] = set()

    def hidden_source(node) -> bool:  # outputs.last_hidden_state, outputs[0] or a hidden-state name
        if isinstance(node, ast.Name):
            return node.id in hidden_names
        if isinstance(node, ast.Attribute):
            return isinstance(node.value, ast.Name) and node.value.id == outputs and node.attr == "last_hidden_state"
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == outputs
                and isinstance(node.slice, ast.Constant) and node.slice.value == 0)

    def scaled(node, accept) -> bool:  # accept(x) or x */ self.attr ... (recorded in scales)
        found = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)) and _path(node.right):
            found.append(("*" if isinstance(node.op, ast.Mult) else "/", _path(node.right)))
            node = node.left
        if not accept(node):
            return False
        scales.extend(reversed(found))
        return True

    for s in stmts[b + 1:k]:  # between the decoder body and the head
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            target = s.targets[0].id
            if target == "slice_indices":
                continue
            if scaled(s.value, hidden_source):
                hidden_names.add(target)
                continue
        raise refuse(f"changes the hidden states before the head: {ast.unparse(s)}")

    head_stmt = stmts[k]
    cast = []

    def head_call(node) -> bool:  # self.head(h[:, slice_indices, :]) with .float() / .contiguous() / h.to(dtype)
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args \
                and not node.keywords and node.func.attr in ("float", "contiguous"):
            node = node.func.value
        if not (isinstance(node, ast.Call) and _path(node.func) == head_path and len(node.args) == 1
                and not node.keywords):
            return False
        arg = node.args[0]
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to" \
                and "weight.dtype" in ast.unparse(arg):
            cast.append(True)
            arg = arg.func.value
        if isinstance(arg, ast.Subscript) and ast.unparse(arg.slice).strip("()") == ":, slice_indices, :":
            arg = arg.value
        return hidden_source(arg)

    if not (isinstance(head_stmt, ast.Assign) and len(head_stmt.targets) == 1
            and isinstance(head_stmt.targets[0], ast.Name) and scaled(head_stmt.value, head_call)):
        raise refuse(f"computes its logits as {ast.unparse(head_stmt)}")
    logits = head_stmt.targets[0].id
    softcap: str | None = None
    locals_: dict[str, str] = {}

    def softcap_of(node) -> str | None:  # tanh(logits / c) * c with one config value c
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.Call)):
            return None
        call, c = node.left, ast.unparse(node.right)
        if not (ast.unparse(call.func) in ("torch.tanh", "nn.functional.tanh", "F.tanh", "torch.nn.functional.tanh")
                and len(call.args) == 1 and ast.unparse(call.args[0]) == f"{logits} / {c}"):
            return None
        return locals_.get(c, _path(node.right))

    def cap_block(s) -> str | None:  # if self.config.c is not None: logits /= c; tanh; *= c (or in one line)
        test = s.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
                and _path(test.left) and not s.orelse):
            return None
        c = ast.unparse(test.left)
        lines = [ast.unparse(x) for x in s.body]
        three = [f"{logits} = {logits} / {c}", f"{logits} = torch.tanh({logits})", f"{logits} = {logits} * {c}"]
        if lines == three or (len(s.body) == 1 and isinstance(s.body[0], ast.Assign)
                              and softcap_of(s.body[0].value) == c):
            return c
        return None

    loss_call = None
    for s in stmts[k + 1:]:
        text = ast.unparse(s)
        if _calls(s, "self.loss_function"):
            loss_call = s
            break
        if text == "loss = None":
            continue
        if isinstance(s, ast.If) and "loss" in text:
            break  # a loss computed otherwise: refused below
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            target = s.targets[0].id
            if target != logits and logits not in _names(s) and _path(s.value):
                locals_[target] = _path(s.value)  # cap = self.config.logits_soft_cap
                continue
            if target == logits and softcap is None and softcap_of(s.value):
                softcap = softcap_of(s.value)
                continue
            if target == logits and softcap is None and isinstance(s.value, ast.BinOp) \
                    and scaled(s.value, lambda n: isinstance(n, ast.Name) and n.id == logits):
                continue
        if isinstance(s, ast.If) and softcap is None and cap_block(s):
            softcap = cap_block(s)
            continue
        raise refuse(f"does this to its logits before the loss: {text}" if logits in _names(s) else
                     f"runs this between its head and its loss: {text}")
    if loss_call is None:
        raise refuse("computes its loss without self.loss_function (transformers' shifted causal-LM loss)")
    if logits not in _names(loss_call):
        raise refuse(f"passes something other than {logits!r} to its loss: {ast.unparse(loss_call)}")
    added_when = None
    for s in stmts[stmts.index(loss_call) + 1:]:  # a term added to the loss afterwards (a router's aux loss)
        adds = [n for n in ast.walk(s) if (isinstance(n, ast.AugAssign) and ast.unparse(n.target) == "loss")
                or (isinstance(n, ast.Assign) and "loss" in map(ast.unparse, n.targets) and "loss" in _names(n.value))]
        if not adds:
            continue
        if isinstance(s, ast.If) and ast.unparse(s.test) == "output_router_logits" and added_when is None:
            added_when = "output_router_logits"
            continue
        raise refuse(f"adds to its loss after the causal-LM loss: {ast.unparse(adds[0])}")
    return LogitTransform(scales=tuple(scales), softcap=softcap, cast_hidden=bool(cast), loss_added_when=added_when)
