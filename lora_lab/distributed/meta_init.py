"""Build a model on the meta device and fill it in later, shard by shard, with exactly the values a normal CPU
build with the same seeds gives.

A seeded CPU build draws every initial value from torch's CPU generator, in an order only the build itself knows
(transformers draws at construction, again in ``post_init``, ties weights, ...). :class:`MetaInit` runs the same
build with every parameter on ``meta`` and records, per parameter, each in-place write to it (``nn.init.*``,
``Tensor.normal_``, ``zero_``, ...) together with the generator state just before the write; the generator is
advanced as the real build would advance it (the write runs once on a throw-away CPU tensor of the parameter's
shape), so later draws — the LoRA factors' init, say — see the same state as in a normal build.
:meth:`InitPlan.materialize` replays the writes of one parameter at a time into a full CPU tensor and keeps this
rank's shard of it: peak extra memory is one full parameter, never the model.

Buffers are not moved to meta (they are computed at construction, e.g. rotary frequencies, and are small).
A write that cannot be replayed — through a view or ``.data`` of a parameter, with an explicit ``generator=``, or
from another meta tensor — is refused when it happens, naming the function.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["MetaInit", "InitPlan", "RecordedWrite"]

# writes whose result does not depend on the tensor's previous values: a replay starts at the last of them
_OVERWRITES = {
    "normal_", "uniform_", "zeros_", "zero_", "ones_", "fill_", "constant_", "copy_", "kaiming_uniform_",
    "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_", "eye_", "dirac_",
    "sparse_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
}
_METADATA = {"requires_grad_", "share_memory_", "retain_grad", "set_"}


def _is_write(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__") and name not in _METADATA


@dataclass
class RecordedWrite:
    func: object
    args: tuple  # the arguments after the parameter (CPU values)
    kwargs: dict
    rng_state: torch.Tensor  # the CPU generator's state just before the write

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", repr(self.func))


class _Recorder(TorchFunctionMode):
    def __init__(self, owner: MetaInit):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        # nn.init.* hand the parameter over as the keyword ``tensor`` (handle_torch_function), methods as self
        target = args[0] if args else kwargs.get("tensor")
        if not (_is_write(func) and isinstance(target, torch.Tensor) and target.device.type == "meta"):
            return func(*args, **kwargs)
        writes = self.owner._writes.get(id(target))
        if writes is None:
            raise NotImplementedError(
                f"MetaInit: {getattr(func, '__name__', func)} writes to a meta tensor that is not a parameter "
                "(a view or .data of one?); this write cannot be replayed when the model is materialised"
            )
        if kwargs.get("generator") is not None:
            raise NotImplementedError(f"MetaInit: {func.__name__} with an explicit generator= cannot be replayed")
        call_kwargs = kwargs
        rest, kwargs = tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "tensor"}
        for a in list(rest) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.device.type == "meta":
                raise NotImplementedError(f"MetaInit: {func.__name__} reads another meta tensor; cannot replay it")
        rest = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in rest)
        state = torch.random.get_rng_state()
        # advance the CPU generator exactly as the write on a real CPU parameter would
        func(torch.empty(target.shape, dtype=target.dtype), *rest, **kwargs)
        writes.append(RecordedWrite(func, rest, dict(kwargs), state))
        return func(*args, **call_kwargs)


class MetaInit:
    """Context manager: parameters created inside live on ``meta``; every write to them is recorded.

    ::

        with MetaInit() as meta:
            model = build_the_model()          # any seeded CPU build; no parameter memory is allocated
            lora_lab.add_lora(model, ...)
        plan = meta.plan(model)                # parameter name -> its writes; before sharding
        shard_model(model)
        plan.materialize(model, "cpu")         # each rank: its shards, equal to the CPU build's values
    """

    def __init__(self):
        self._writes: dict[int, list[RecordedWrite]] = {}
        self._params: list[nn.Parameter] = []  # strong references: ids stay unique while recording
        self._mode = _Recorder(self)
        self._original = None

    def _track(self, param: torch.Tensor) -> None:
        if id(param) not in self._writes:
            self._writes[id(param)] = []
            self._params.append(param)

    def __enter__(self) -> MetaInit:
        original = self._original = nn.Module.register_parameter
        meta = self

        def register_parameter(module, name, param):
            original(module, name, param)
            p = module._parameters.get(name)
            if p is None:
                return
            if p.device.type != "meta":  # move a new parameter to meta (a tied, already-meta one stays itself)
                kwargs = dict(p.__dict__)
                p = type(p)(p.to("meta"), requires_grad=p.requires_grad)
                p.__dict__.update(kwargs)
                module._parameters[name] = p
            meta._track(p)

        nn.Module.register_parameter = register_parameter
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        nn.Module.register_parameter = self._original
        return False

    def plan(self, model: nn.Module) -> InitPlan:
        """The writes of each of ``model``'s parameters, by name (call it before ``fully_shard`` replaces them)."""
        plan = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            writes = self._writes.get(id(p))
            if writes is None:
                raise ValueError(f"{name} was not created inside this MetaInit")
            starts = [i for i, w in enumerate(writes) if w.name in _OVERWRITES]
            if not starts:
                raise ValueError(
                    f"{name}: no recorded write sets all its values ({[w.name for w in writes] or 'none'}); it "
                    "was probably filled by a factory function on the meta device (torch.zeros(device='meta')), "
                    "which cannot be seen: initialise it with nn.init.* instead"
                )
            plan[name] = (tuple(p.shape), p.dtype, writes[starts[-1]:])
        return InitPlan(plan)


@dataclass
class InitPlan:
    """Parameter name -> (shape, dtype, the writes that make its value)."""

    writes: dict[str, tuple[tuple, torch.dtype, list[RecordedWrite]]] = field(default_factory=dict)

    def full_value(self, name: str) -> torch.Tensor:
        """The full CPU tensor the seeded build gives parameter ``name`` (replays its writes)."""
        shape, dtype, writes = self.writes[name]
        value = torch.empty(shape, dtype=dtype)
        state = torch.random.get_rng_state()
        try:
            with torch.no_grad():
                for w in writes:
                    torch.random.set_rng_state(w.rng_state)
                    w.func(value, *w.args, **w.kwargs)
        finally:
            torch.random.set_rng_state(state)
        return value

    @torch.no_grad()
    def materialize(self, model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
        """Allocate ``model``'s parameters on ``device`` (a sharded model: this rank's shards only) and fill them.

        Buffers are kept as they are (moved to ``device``). One full parameter at a time is built on the CPU.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        buffers = {}
        for module in model.modules():
            for bname, b in module._buffers.items():
                if b is not None:
                    if b.device.type == "meta":
                        raise ValueError(f"buffer {bname} of {type(module).__name__} is on meta; MetaInit keeps "
                                         "buffers real, so the model was built some other way")
                    buffers[(module, bname)] = b
        # to_empty gives every module its own new parameter: note the tied ones (lm_head = embed_tokens) to re-tie
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for pname, p in module._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((module, pname))
        model.to_empty(device=device)
        for (first, first_name), *others in holders.values():
            for module, pname in others:
                module._parameters[pname] = first._parameters[first_name]
        for (module, bname), b in buffers.items():
            module._buffers[bname] = b.to(device)
        done = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in done:
                continue
            done.add(id(p))
            if name not in self.writes:
                raise ValueError(f"{name} is not in this plan (the plan was made from another model)")
            full = self.full_value(name)
            data = p.data
            if isinstance(data, DTensor):
                local = data.to_local()
                # this rank's rows, cut locally (src_data_rank=None: no communication)
                shard = distribute_tensor(full.to(device=local.device, dtype=local.dtype), data.device_mesh,
                                          data.placements, src_data_rank=None).to_local()
                local.copy_(shard)
            else:
                data.copy_(full.to(dtype=data.dtype))
        return model
