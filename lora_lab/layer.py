"""The LoRA layer and the model surgery around it.

A LoRA linear keeps the pretrained weight W (out x in) frozen and learns a rank-r update:

    h = W x + b + (alpha / r) * B A x          A: r x in,  B: out x r

A starts Kaiming-uniform (a = sqrt(5), PEFT's default; the paper used a Gaussian) and B starts at
zero, so a fresh layer computes exactly what the base layer computes. The product is evaluated as
(x @ A^T) @ B^T: two skinny matmuls through an M x r intermediate, never the out x in matrix B A.

Variants, each in PEFT 0.21's formulation (``add_lora`` keyword arguments):

* rsLoRA (``use_rslora=True``): the scale is s = alpha / sqrt(r) instead of alpha / r.
* DoRA (``use_dora=True``): a trainable magnitude m (one per output row) rescales the adapted weight,
  W' = m * (W + s B A) / ||W + s B A||, the norm taken over each row (the input dimension) and
  detached from the graph (DoRA paper, section 4.3).
* LoRA-FA (``lora_fa=True``): A stays frozen at its initialisation; only B (and m) train.
* PiSSA (``init_lora_weights="pissa"``): with W = U S V^T (fp32 SVD) and the top r singular triplets,
  A = sqrt(S_r / s) V_r^T and B = U_r sqrt(S_r / s), and the base weight becomes the residual W - s B A,
  so the layer starts out computing W x + b (up to rounding) with the principal part trainable.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.adapter_layer import (  # noqa: F401 - WIDENED_DTYPES, resolve_adapter_dtype, replace_module: public here too
    WIDENED_DTYPES,
    AdapterLinear,
    adapter_layers,
    install_adapter_layers,
    replace_module,
    resolve_adapter_dtype,
)
from lora_lab.adapter_layer import check_flags as _check_flags
from lora_lab.adapter_layer import check_rank_alpha as _check_rank_alpha
from lora_lab.dtypes import as_float_dtype
from lora_lab.embedding_lora import LoRAEmbedding
from lora_lab.modules_to_save import TrainedCopy, install_modules_to_save, plan_modules_to_save
from lora_lab.targets import (  # noqa: F401 - all_linear, find_target_linears, peft_layers: public here too
    _is_all_linear,
    _matched_linears,
    all_linear,
    find_target_linears,
    peft_layers,
)

__all__ = [
    "AdapterLinear",
    "LoRALinear",
    "ParameterCount",
    "adapter_layers",
    "add_lora",
    "remove_lora",
    "merge_lora",
    "count_parameters",
    "lora_layers",
    "all_lora_layers",
    "find_target_linears",
    "all_linear",
    "peft_layers",
    "replace_module",
    "fill_lora_B",
    "SingleChild",
    "resolve_adapter_dtype",
]




# what LoRALinear can start from, in PEFT 0.21's meanings: True (A Kaiming-uniform, B zero), False (A and B both
# nn.Linear's default init: the layer does not start as the base layer), "gaussian" (A ~ N(0, 1/r^2), B zero), PiSSA
INITS = (True, False, "gaussian", "pissa")


def _check_init(init) -> None:
    if not any(init is i or (isinstance(init, str) and init == i) for i in INITS):
        raise ValueError(f"init_lora_weights={init!r} is not supported; lora_lab implements {INITS!r}")


class LoRALinear(AdapterLinear):
    """``h = base(x) + s * (x @ A^T) @ B^T`` around a frozen ``nn.Linear``, s = alpha / r.

    ``lora_A`` and ``lora_B`` (and DoRA's ``magnitude``) live on the base weight's device, in ``adapter_dtype``:
    by default (``None``) fp32 when the base weight is bf16 or fp16 (as PEFT's ``autocast_adapter_dtype``: a bf16
    factor near 1 cannot take an update below ~4e-3, so small optimizer steps are lost), else the weight's dtype;
    pass ``adapter_dtype="bf16"`` (or any float dtype) to keep them in that dtype. The branch runs in the
    adapter dtype (the input is cast to it) and the layer's output is rounded once to the input's dtype, as in
    PEFT. ``dropout`` applies to the
    input of the low-rank branch only, as in PEFT. ``use_rslora=True`` takes s = alpha / sqrt(r);
    ``use_dora=True`` adds the trainable DoRA magnitude ``magnitude`` (see :meth:`forward`), else
    ``magnitude`` is None. ``init_lora_weights="pissa"`` starts A and B from W's principal singular
    vectors and replaces ``base.weight`` in place by the residual (see :meth:`_pissa_init`).
    """

    kind = "LoRA"

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, *,
                 use_rslora: bool = False, use_dora: bool = False, init_lora_weights: bool | str = True,
                 adapter_dtype: torch.dtype | str | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        if isinstance(base, LoRALinear):  # pragma: no cover - LoRALinear is not an nn.Linear
            raise TypeError("this layer already carries LoRA")
        _check_rank_alpha(r, alpha)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        _check_flags(use_rslora=use_rslora, use_dora=use_dora)
        _check_init(init_lora_weights)
        if init_lora_weights == "pissa" and r > min(base.in_features, base.out_features):
            raise ValueError(f"PiSSA needs r <= min(in, out) = {min(base.in_features, base.out_features)}, got r={r}")
        self.base = base
        self.init_lora_weights = init_lora_weights
        self.r = r
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.use_dora = use_dora
        # rsLoRA (Kalajdzievski 2023): alpha / sqrt(r) keeps the update's scale stable as r grows.
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.dropout_p = float(dropout)
        self.lora_fa = False  # LoRA-FA: A frozen at its initialisation (set by add_lora/load_adapter, saved with it)
        self.in_features = base.in_features
        self.out_features = base.out_features
        w = base.weight
        dtype = resolve_adapter_dtype(w.dtype, adapter_dtype)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=w.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, r, device=w.device, dtype=dtype))
        # PEFT's default init of A: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)).
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if init_lora_weights is False:
            # PEFT's init_lora_weights=False leaves both factors at nn.Linear's default init (drawn in this order,
            # A then B): B ~ U(-1/sqrt(r), 1/sqrt(r)), so the fresh layer already changes the output.
            nn.init.kaiming_uniform_(self.lora_B, a=math.sqrt(5))
        else:
            if init_lora_weights == "gaussian":
                # PEFT's "gaussian": A ~ N(0, std = 1/r) in place of the Kaiming draw
                nn.init.normal_(self.lora_A, std=1 / r)
            # B = 0 through nn.init, not torch.zeros: a write that lora_lab.distributed.MetaInit can see and replay
            nn.init.zeros_(self.lora_B)
        for p in self.base.parameters():
            p.requires_grad_(False)
        if init_lora_weights == "pissa":
            self._pissa_init()
        self.magnitude = None
        if use_dora:
            # m starts as ||W + s B A|| per row (= ||W||, B being 0): a fresh DoRA layer computes W x + b.
            with torch.no_grad():
                m = torch.linalg.norm(w + self.scaling * (self.lora_B @ self.lora_A), dim=1).to(dtype)
            self.magnitude = nn.Parameter(m)

    @torch.no_grad()
    def _pissa_init(self) -> None:
        """PiSSA (Meng et al. 2024), as PEFT's ``init_lora_weights="pissa"``: in fp32, W = U S V^T (full SVD),
        A = diag(sqrt(S_r / s)) V_r^T, B = U_r diag(sqrt(S_r / s)), so s B A = U_r S_r V_r^T, and the base
        weight (in place, in its dtype) becomes the residual W - s B A."""
        w = self.base.weight
        u, sv, vh = torch.linalg.svd(w.to(torch.float32), full_matrices=False)
        root = torch.sqrt(sv[: self.r] / self.scaling)
        a = torch.diag(root) @ vh[: self.r]
        b = u[:, : self.r] @ torch.diag(root)
        self.lora_A.copy_(a)
        self.lora_B.copy_(b)
        # (s * B) @ A: PEFT's order of operations, so that its reload rebuilds the same residual bits
        w.data = (w.to(torch.float32) - self.scaling * b @ a).to(w.dtype)

    def freeze_A(self) -> None:
        """LoRA-FA (Zhang et al. 2023): A stays at its current value, only B (and a DoRA magnitude) train.
        Recorded as ``lora_fa`` so that ``save_adapter`` writes it and ``load_adapter`` restores it."""
        self.lora_A.requires_grad_(False)
        self.lora_fa = True

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The low-rank branch without scaling: (dropout(x) @ A^T) @ B^T."""
        if self.dropout_p > 0 and self.training:
            x = F.dropout(x, p=self.dropout_p, training=True)
        x = x.to(self.lora_A.dtype)  # fp32 adapters on a bf16 model: the branch runs in fp32, as in PEFT
        # F.linear(x, A) is x @ A^T: the same GEMM nn.Linear (and so PEFT) runs, which is what makes
        # bit-for-bit parity with PEFT possible.
        return F.linear(F.linear(x, self.lora_A), self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LoRA: ``h = W x + b + s * B A x`` (the scale multiplies the branch output, PEFT's order).

        DoRA: with n = ||W + s B A|| per output row (detached) and g = m / n,
        ``h = W x + b + (g - 1) * W x + g * s * B A x`` = ``g * (W + s B A) x + b``. Evaluated as PEFT does:
        the extra term is added to the base output, and W x is that output minus b, except in training with
        dropout, where both W x and B A x read the dropped-out input (so the base output keeps the clean x).
        """
        result = self.base(x)
        if self.magnitude is None:
            # with adapters in a wider dtype than W the sum is formed in it and rounded once (PEFT's order)
            return (result + self.lora_delta(x) * self.scaling).to(result.dtype)
        dropped = self.dropout_p > 0 and self.training
        if dropped:
            x = F.dropout(x, p=self.dropout_p, training=True)
        g = (self.magnitude / self.weight_norm()).view(1, -1)
        lora_result = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        if dropped:
            base_result = F.linear(x, self.base.weight)
        elif self.base.bias is not None:
            base_result = result - self.base.bias
        else:
            base_result = result
        return (result + ((g - 1) * base_result + g * lora_result * self.scaling)).to(result.dtype)

    def weight_norm(self) -> torch.Tensor:
        """DoRA's n = ||W + s B A||, the L2 norm of each output row, detached (no gradient flows through it).

        B A is formed as (I A^T) B^T transposed, through the same GEMMs as PEFT, so the bits agree with PEFT's.
        """
        A, B, W = self.lora_A, self.lora_B, self.base.weight
        eye = torch.eye(A.shape[1], device=A.device, dtype=A.dtype)
        ba = F.linear(F.linear(eye, A), B).T
        # in the wider of W's and the adapter's dtypes (fp32 adapters on a bf16 W: an fp32 norm, as PEFT's)
        norm = torch.linalg.norm(W + self.scaling * ba.detach(), dim=1)
        return norm.to(torch.promote_types(W.dtype, A.dtype)).detach()

    def delta_weight(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """s * B A, the out x in matrix a LoRA merge adds to W (computed in ``dtype``, fp32 by default).

        For DoRA this is only the directional update; the merged weight is :meth:`merged_weight`.
        """
        B, A = self.lora_B, self.lora_A
        if dtype is not None:
            B, A = B.to(dtype), A.to(dtype)
        return (B @ A) * self.scaling

    @torch.no_grad()
    def merged_weight(self, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight that computes this layer in one GEMM, in ``compute_dtype``.

        LoRA: ``W + s B A``. DoRA: ``m / ||W + s B A|| * (W + s B A)``, m and the row norm broadcast over rows.
        """
        v = self.base.weight.to(compute_dtype) + self.delta_weight(compute_dtype)
        if self.magnitude is None:
            return v
        return (self.magnitude.to(compute_dtype) / torch.linalg.norm(v, dim=1)).view(-1, 1) * v

    @torch.no_grad()
    def merge(self, compute_dtype: torch.dtype | str = torch.float32) -> nn.Linear:
        """Return a plain ``nn.Linear`` with the merged weight (:meth:`merged_weight`; LoRA: ``W + s B A``).

        The weight is formed in ``compute_dtype`` (fp32 by default; a dtype or a name such as "bf16") and rounded
        once to W's dtype. Raises if the merged weight is not finite (nothing is modified then).
        """
        compute_dtype = as_float_dtype(compute_dtype, "compute_dtype")
        w = self.base.weight
        merged_w = self.merged_weight(compute_dtype).to(w.dtype)
        if not torch.isfinite(merged_w).all():
            raise FloatingPointError(
                f"merging LoRA into a {tuple(w.shape)} weight produced non-finite values"
            )
        out = nn.Linear(
            self.in_features, self.out_features, bias=self.base.bias is not None,
            device=w.device, dtype=w.dtype,
        )
        out.weight.copy_(merged_w)
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        out.weight.requires_grad_(self.base.weight.requires_grad)
        if out.bias is not None:
            out.bias.requires_grad_(self.base.bias.requires_grad)
        return out

    def extra_repr(self) -> str:
        variants = "".join(f", {n}=True" for n in ("use_rslora", "use_dora", "lora_fa") if getattr(self, n))
        if self.lora_A.dtype != self.base.weight.dtype:
            variants += f", adapter_dtype={self.lora_A.dtype}"
        if self.init_lora_weights is not True:
            variants += f", init_lora_weights={self.init_lora_weights!r}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"alpha={self.alpha}, scaling={self.scaling:g}, dropout={self.dropout_p}{variants}"
        )


def fill_lora_B(model: nn.Module, std: float, generator: torch.Generator | None = None) -> int:
    """Fill every LoRA B factor of ``model`` with N(0, std²); returns how many parameters were filled.

    A fresh adapter has B = 0 and changes nothing, so a check of the LoRA path needs B ≠ 0 first. Matches
    PEFT's and lora_lab's factors alike (parameter names containing ``lora_B``), in ``named_parameters`` order:
    drawn in place from torch's RNG on the parameter's device, or, given a CPU ``generator``, from it.
    """
    filled = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                if generator is None:
                    p.normal_(0, std)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
                filled += 1
    if not filled:
        raise ValueError("fill_lora_B: the model has no LoRA B parameter (no adapter added?)")
    return filled


class SingleChild(nn.Module):
    """A parent whose one child is ``child``, registered as ``name``; forward passes straight through.

    PEFT and the kernel patcher work on module trees: this is the smallest tree around one layer.
    """

    def __init__(self, child: nn.Module, name: str = "layer"):
        super().__init__()
        self.add_module(name, child)
        self._child_name = name

    def forward(self, *args, **kwargs):
        return getattr(self, self._child_name)(*args, **kwargs)


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """All LoRA layers of a model, with their module names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def all_lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAEmbedding]]:
    """The LoRA layers on linears and on embeddings, in model order: what a PEFT LoRA adapter file holds."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAEmbedding))]


def _forget_adapter_config(model: nn.Module) -> None:
    """Drop what add_lora/add_vera recorded for save_adapter (the model has no adapter layers any more)."""
    for attr in ("_lora_lab_config", "_lora_lab_vera"):
        if hasattr(model, attr):
            delattr(model, attr)


def remove_lora(model: nn.Module) -> nn.Module:
    """Unwrap every adapter layer (LoRALinear, LoRAEmbedding, VeRALinear) back to its base layer, without merging:
    the base weights are untouched; a modules_to_save module goes back to the original, its trained copy dropped.

    Refused for a model with PiSSA layers, whose bases hold the residual W - s B A, not the pretrained W
    (``merge_lora`` gives back a model that computes what the adapted one does)."""
    pissa = [n for n, layer in lora_layers(model) if layer.init_lora_weights == "pissa"]
    if pissa:
        raise ValueError(f"{pissa[0]} is a PiSSA layer: its base weight is the residual W - s B A, not W; "
                         "remove_lora would leave that residual in the model (merge_lora(model) instead)")
    for name, layer in adapter_layers(model):
        replace_module(model, name, layer.base)
    _forget_adapter_config(model)
    return model


def _wrap(model: nn.Module, specs: dict[str, dict], lora_fa: bool = False) -> None:
    """Wrap the ``nn.Linear`` modules named in ``specs`` ({name: LoRALinear keyword arguments}) and freeze every
    other parameter; with ``lora_fa`` the new layers' A is frozen too (LoRA-FA).

    The parameters of LoRA layers already in the model keep their ``requires_grad``: a second ``add_lora``
    adds an adapter, it does not freeze the first one. All layers are built before the model's tree changes
    (a PiSSA layer turns its base weight into the residual as it is built: callers check everything first).
    """
    modules = dict(model.named_modules())
    _refuse_tied_pissa(model, [n for n, spec in specs.items() if spec.get("init_lora_weights") == "pissa"])
    wrapped = [(n, (LoRAEmbedding if isinstance(modules[n], nn.Embedding) else LoRALinear)(modules[n], **spec))
               for n, spec in specs.items()]
    install_adapter_layers(model, wrapped)
    if lora_fa:
        for _, layer in wrapped:
            layer.freeze_A()


def _refuse_tied_pissa(model: nn.Module, names: Sequence[str]) -> None:
    """PiSSA turns each target's weight into a residual in place: refuse a target whose weight another module shares
    (a tied ``lm_head`` and ``embed_tokens``), which would be rewritten with it."""
    if not names:
        return
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    for n in names:
        w = model.get_submodule(n).weight
        others = [o for o in owners.get(id(w), []) if o != f"{n}.weight"]
        if others:
            raise ValueError(
                f"init_lora_weights='pissa' on {n}: its weight is tied to {others[0]}, which PiSSA's residual would "
                f"rewrite too; exclude {n} from the targets, or untie it first (e.g. "
                f"model.{n}.weight = nn.Parameter(model.{n}.weight.detach().clone()))"
            )


def _record_config(model: nn.Module, had_lora: bool, r, alpha, dropout, targets, exclude) -> None:
    """What ``save_adapter`` writes as target_modules/exclude_modules. After several add_lora calls, name
    lists are joined; anything else is left for ``save_adapter`` to derive from the wrapped layers."""
    new = {
        "r": r,
        "alpha": alpha,
        "dropout": dropout,
        # "all-linear": save_adapter writes the names it selected (PEFT's expansion depends on the model's class)
        "targets": None if _is_all_linear(targets) else targets if isinstance(targets, str) else list(targets),
        "exclude": exclude if exclude is None or isinstance(exclude, str) else list(exclude),
    }
    old = getattr(model, "_lora_lab_config", None)
    if had_lora:
        joinable = (
            old is not None and isinstance(old.get("targets"), list) and old.get("exclude") is None
            and isinstance(new["targets"], list) and new["exclude"] is None
        )
        new["targets"] = old["targets"] + [t for t in new["targets"] if t not in old["targets"]] if joinable else None
        new["exclude"] = None
    model._lora_lab_config = new


def add_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    targets: Sequence[str] | str = ("q_proj", "v_proj"),
    dropout: float = 0.0,
    exclude: Sequence[str] | str | None = None,
    *,
    use_rslora: bool = False,
    use_dora: bool = False,
    lora_fa: bool = False,
    init_lora_weights: bool | str = True,
    adapter_dtype: torch.dtype | str | None = None,
    modules_to_save: Sequence[str] | None = None,
) -> nn.Module:
    """Freeze ``model`` and wrap every ``nn.Linear`` whose name matches ``targets`` in a LoRALinear (an
    ``nn.Embedding`` in a :class:`lora_lab.embedding_lora.LoRAEmbedding`, PEFT's LoRA for embeddings: plain LoRA or
    rsLoRA, init True, "gaussian" or False).

    Variants (PEFT 0.21's formulations; see :class:`LoRALinear`): ``use_rslora`` scales by alpha / sqrt(r)
    (PEFT's ``use_rslora``); ``use_dora`` adds DoRA's trainable magnitude (PEFT's ``use_dora``); ``lora_fa``
    freezes A at its initialisation so only B (and a DoRA magnitude) train (LoRA-FA's frozen A; PEFT's
    ``create_lorafa_optimizer`` also reshapes B's gradient, which this does not); ``init_lora_weights="pissa"``
    starts each layer from its weight's principal singular vectors and turns its base weight into the residual
    (PEFT's ``init_lora_weights="pissa"``; it changes the model's base weights in place). The other starts, as in
    PEFT: ``init_lora_weights=True`` (default) A Kaiming-uniform and B = 0, so the model computes what it did;
    ``"gaussian"`` A ~ N(0, 1/r^2) and B = 0; ``False`` A and B both drawn as nn.Linear's default weights (B not
    zero: the model's output changes at once; PEFT's setting for tests).

    ``adapter_dtype``: the dtype of A, B and DoRA's magnitude. ``None`` (default) keeps them in fp32 on a bf16 or
    fp16 model, as PEFT does (``autocast_adapter_dtype=True``): in bf16 most small optimizer updates round away
    (notebook 09 measures the share); elsewhere they take the weight's dtype. ``"bf16"`` (or any float dtype)
    forces that dtype, e.g. to save memory on a bf16 model.

    ``targets`` and ``exclude`` follow PEFT's ``target_modules``/``exclude_modules``: a list matches a
    module whose name equals an entry or ends with ``.entry``; a string is a regex matched against the
    whole name (so ``"q_proj"`` matches no module of a transformers model: pass ``["q_proj"]``), and
    ``"all-linear"`` selects every ``nn.Linear`` but the output head. Each entry of a list must match some
    module (a typo is an error naming the nearest module names). A model with PEFT's layers is refused (take
    its base back with ``merge_and_unload()``/``unload()``, or load its saved adapter with ``load_adapter``).
    Calling ``add_lora`` again on other targets adds LoRA there and leaves the layers of the earlier calls as they
    are (still trainable); wrapping a module that already carries LoRA is an error, and so is adding LoRA to a model
    with VeRA layers. A new layer takes the train/eval mode of the module it replaces (``load_model`` gives an
    eval-mode model: dropout stays off until ``model.train()``). PiSSA on a weight another module shares (an
    ``lm_head`` tied to ``embed_tokens``) is refused, since its residual would rewrite the embedding too (PEFT only
    warns): untie it or leave it out. The ``out_proj`` of an ``nn.MultiheadAttention`` is refused (MHA reads its
    weight without calling it). All checks run before anything changes, so a failing call leaves the model as it
    was.

    ``modules_to_save`` (PEFT's field of that name): modules trained in full beside the adapter, e.g.
    ``["lm_head"]`` or a classifier head; each module whose name ends with an entry gets a trainable copy
    (:class:`lora_lab.modules_to_save.TrainedCopy`) that ``save_adapter`` writes beside the LoRA factors.
    Returns the model (modified in place).
    """
    _check_rank_alpha(r, alpha)
    _check_flags(use_rslora=use_rslora, use_dora=use_dora, lora_fa=lora_fa)
    _check_init(init_lora_weights)
    if adapter_dtype is not None:
        as_float_dtype(adapter_dtype, "adapter_dtype")  # a bad dtype is refused before anything changes
    lora_kinds = (LoRALinear, LoRAEmbedding, TrainedCopy)
    other = [(n, m.kind) for n, m in adapter_layers(model) if not isinstance(m, lora_kinds)]
    if other:
        raise ValueError(f"{type(model).__name__} carries {other[0][1]} layers ({other[0][0]}, ...); LoRA and "
                         f"{other[0][1]} do not mix in one model (an adapter file holds one kind)")
    what = "lora_lab's DoRA (use_dora=True)" if use_dora else "LoRALinear"
    targets, exclude, matched = _matched_linears(model, targets, exclude, what, allow_embedding=not use_dora)
    embeddings = [n for n, m in matched if isinstance(m, nn.Embedding)]
    if embeddings and (init_lora_weights not in (True, False, "gaussian") or lora_fa):
        raise ValueError(f"target {embeddings[0]} is an nn.Embedding: LoRA there takes init_lora_weights True, "
                         f"False or 'gaussian' and no lora_fa, got init_lora_weights={init_lora_weights!r}, "
                         f"lora_fa={lora_fa}")
    if modules_to_save is not None:
        copies = plan_modules_to_save(model, modules_to_save, [n for n, _ in matched])
    had_lora = bool(lora_layers(model))
    if init_lora_weights == "pissa":
        small = [(n, m) for n, m in matched if r > min(m.in_features, m.out_features)]
        if small:
            n, m = small[0]
            raise ValueError(f"PiSSA needs r <= min(in, out); {n} is {m.in_features} -> {m.out_features}, r={r}")
    spec = {"r": r, "alpha": alpha, "dropout": dropout, "use_rslora": use_rslora, "use_dora": use_dora,
            "init_lora_weights": init_lora_weights, "adapter_dtype": adapter_dtype}
    _wrap(model, {n: spec for n, _ in matched}, lora_fa=lora_fa)
    if modules_to_save is not None:
        install_modules_to_save(model, copies)
    _record_config(model, had_lora, r, alpha, dropout, targets, exclude)
    return model


def merge_lora(model: nn.Module, compute_dtype: torch.dtype | str = torch.float32) -> nn.Module:
    """Replace every LoRALinear with its merged nn.Linear (``W + s B A``; DoRA: ``m (W + s B A) / ||W + s B A||``),
    every LoRAEmbedding with an embedding of weight ``W + s (B A)^T``, every VeRALinear with its own merge, and every
    modules_to_save module with its trained copy. A merged layer gets its own weight: on a model with tied input and
    output embeddings, merging LoRA on one of them leaves the other as it was. In place; returns model.

    ``compute_dtype``: the dtype the merged weight is formed in before its one rounding to W's dtype; a
    ``torch.dtype`` or a name as :func:`lora_lab.load_model` takes them ("fp32", "bf16", "float16", ...)."""
    compute_dtype = as_float_dtype(compute_dtype, "compute_dtype")
    layers = adapter_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer: nothing to merge")
    merged = [(name, layer.merge(compute_dtype)) for name, layer in layers]  # all computed before any swap
    for name, linear in merged:
        replace_module(model, name, linear)
    _forget_adapter_config(model)
    return model


class ParameterCount(NamedTuple):
    """``trainable``: parameters that train; ``frozen``: frozen parameters outside adapter layers (the base model's);
    ``frozen_adapter``: frozen parameters of adapter layers (LoRA-FA's A, MiCA's B)."""

    trainable: int
    frozen: int
    frozen_adapter: int = 0

    @property
    def total(self) -> int:
        return self.trainable + self.frozen + self.frozen_adapter

    @property
    def trainable_share(self) -> float:
        """Trainable parameters as a share of the frozen (base) ones, as the LoRA literature quotes it."""
        return self.trainable / self.frozen if self.frozen else float("nan")

    def __str__(self) -> str:
        adapter = f", {self.frozen_adapter:,} frozen adapter parameters" if self.frozen_adapter else ""
        return (
            f"{self.trainable:,} trainable of {self.frozen:,} frozen base parameters "
            f"({100 * self.trainable_share:.2f}%){adapter}; {self.total:,} in all"
        )


def count_parameters(model: nn.Module | Iterable[nn.Parameter]) -> ParameterCount:
    """Trainable and frozen parameter counts. Shared (tied) tensors count once. Works on meta tensors.

    Given a module, a frozen parameter of an adapter layer (LoRA-FA's A) counts as ``frozen_adapter``, not as a
    frozen base parameter."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    adapter: set[int] = set()
    if isinstance(model, nn.Module):
        for _, layer in adapter_layers(model):
            base = {id(p) for p in layer.base.parameters()}
            adapter.update(id(p) for p in layer.parameters() if id(p) not in base)
    seen: set[int] = set()
    trainable = frozen = frozen_adapter = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        elif id(p) in adapter:
            frozen_adapter += p.numel()
        else:
            frozen += p.numel()
    return ParameterCount(trainable, frozen, frozen_adapter)
