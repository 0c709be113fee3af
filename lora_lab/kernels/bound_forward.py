"""The per-instance ``forward`` the patchers install: a small object that holds the function and the module.

Not a closure over the module (``copy.deepcopy`` copies functions by reference, so a deep-copied model's forward
would still run on the original's parameters) and not a ``types.MethodType`` (pickle stores a bound method as
"look the function's name up on the object", which a module does not have, so ``torch.load`` of a saved patched
model fails). ``copy.deepcopy`` and pickle copy this object like any other: its ``module`` becomes the copied
module, and ``function`` (a module-level function) is stored by reference.
"""
from __future__ import annotations

__all__ = ["BoundForward"]


class BoundForward:
    """``module.forward = BoundForward(fn, module)``: calling it calls ``fn(module, *args, **kwargs)``."""

    __slots__ = ("function", "module")

    def __init__(self, function, module):
        self.function = function
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<patched forward {self.function.__name__} of {type(self.module).__name__}>"
