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

For throughput measurements the exact values do not matter, and the replay is slow: on this project's 2-core
CPU, recording the Qwen2.5-7B-shaped build took 85 s and replaying 0.8 G of its parameters 5.5 s, so a
72B-parameter model would take tens of minutes per rank. ``MetaInit(record=False)`` only moves the parameters
to meta (writes to them do nothing), and :func:`materialize_random` fills each rank's shards on the device from a
seeded generator: normal(0, std) weights, ones for norms and DoRA magnitudes, zero biases, LoRA's A uniform in
±1/√fan_in and B zero. The shapes and kinds of values are the model's; the values are not.

Buffers are not moved to meta (they are computed at construction, e.g. rotary frequencies, and are small).
A write that cannot be replayed — through a view or ``.data`` of a parameter, with an explicit ``generator=``, or
from another meta tensor — is refused when it happens, naming the function.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["MetaInit", "InitPlan", "RandomFill", "RecordedWrite", "materialize_random"]

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

    def __init__(self, record: bool = True):
        self.record = record  # False: parameters go to meta, nothing is recorded (fill with materialize_random)
        self._writes: dict[int, list[RecordedWrite]] = {}
        self._params: list[nn.Parameter] = []  # strong references: ids stay unique while recording
        self._mode = _Recorder(self) if record else None
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
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        nn.Module.register_parameter = self._original
        return False

    def plan(self, model: nn.Module) -> InitPlan:
        """The writes of each of ``model``'s parameters, by name (call it before ``fully_shard`` replaces them)."""
        if not self.record:
            raise ValueError("MetaInit(record=False) recorded no writes: fill the model with materialize_random")
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

        _allocate(model, device)
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


def _allocate(model: nn.Module, device) -> None:
    """``model.to_empty(device)`` keeping its real buffers and its tied parameters tied."""
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


def _fill_kind(name: str) -> str:
    leaf = name.split(".")
    if any("lora_B" in part or "lora_embedding_B" in part for part in leaf):
        return "zero"
    if any("lora_A" in part or "lora_embedding_A" in part for part in leaf):
        return "lora_a"
    if any("magnitude" in part for part in leaf):
        return "one"
    if leaf[-1] == "bias":
        return "zero"
    if any("norm" in part for part in leaf[:-1]) or leaf[-1].endswith("norm"):
        return "one"
    return "normal"


@torch.no_grad()
def materialize_random(model: nn.Module, device: torch.device | str, *, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Allocate a meta-built (sharded or whole) model's parameters on ``device`` and fill this rank's part of each
    from a generator on ``device``: normal(0, ``std``) weights, ones for norms and DoRA magnitudes, zeros for
    biases and LoRA B, LoRA A uniform in ±1/√fan_in (what ``kaiming_uniform_(a=√5)`` draws from).

    The values are seeded (``seed``, the parameter's index and this rank) but are not those of a CPU
    build: use it where only shapes and speed matter; :meth:`InitPlan.materialize` gives the exact values.
    """
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("materialize_random fills a model built on meta (MetaInit); this one has real parameters")
    from torch.distributed.tensor import DTensor

    _allocate(model, device)
    gen = torch.Generator(device=torch.device(device))
    done = set()
    for index, (name, p) in enumerate(model.named_parameters(remove_duplicate=False)):
        if id(p) in done:
            continue
        done.add(id(p))
        data = p.data
        local = data.to_local() if isinstance(data, DTensor) else data
        if local.numel() == 0:
            continue
        kind = _fill_kind(name)
        if kind == "zero":
            local.zero_()
        elif kind == "one":
            local.fill_(1.0)
        else:
            rank = dist.get_rank() if isinstance(data, DTensor) and dist.is_initialized() else 0
            gen.manual_seed(seed * 1_000_003 + index * 1_009 + rank)
            if kind == "lora_a":
                bound = 1.0 / max(1, p.shape[-1]) ** 0.5
                local.uniform_(-bound, bound, generator=gen)
            else:
                local.normal_(0.0, std, generator=gen)
    return model


@dataclass
class RandomFill:
    """What :class:`InitPlan` is for an exact build, for a ``MetaInit(record=False)`` one: ``materialize`` calls
    :func:`materialize_random` with this seed and standard deviation."""

    seed: int = 0
    std: float = 0.02

    def materialize(self, model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
        return materialize_random(model, device, seed=self.seed, std=self.std)
