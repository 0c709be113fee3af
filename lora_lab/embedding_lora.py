"""LoRA on an ``nn.Embedding``, in PEFT 0.21's formulation (its ``lora.Embedding``).

An embedding of V tokens into d dimensions holds W (V x d). Its LoRA update is the rank-r product of
``lora_embedding_A`` (r x V) and ``lora_embedding_B`` (d x r):

    h = W[x] + s * A^T[x] @ B^T          (the rows of A^T picked by the token ids, then one r x d matmul)

so the merged weight is W + s (B A)^T. The init is the reverse of a linear layer's: A starts at zero and B from
N(0, 1), so a fresh layer computes what the embedding does. PEFT builds no dropout into this branch (its
``lora_dropout`` is ignored for embeddings); the value is kept so that a saved config carries it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.adapter_layer import AdapterLinear, check_flags, check_rank_alpha, resolve_adapter_dtype
from lora_lab.dtypes import as_float_dtype

__all__ = ["LoRAEmbedding", "embedding_lora_layers"]

# what LoRAEmbedding can start from, in PEFT's meanings: True and "gaussian" (A zero, B ~ N(0, 1)), False (A and B
# both the N(0, 1) draws PEFT creates them with: the fresh layer changes the output)
EMBEDDING_INITS = (True, False, "gaussian")


class LoRAEmbedding(AdapterLinear):
    """``h = base(x) + s * F.embedding(x, A^T) @ B^T`` around a frozen ``nn.Embedding`` ``base``, s = alpha / r
    (alpha / sqrt(r) with ``use_rslora``).

    ``lora_embedding_A`` (r x num_embeddings) and ``lora_embedding_B`` (embedding_dim x r) are drawn as PEFT draws
    them: both N(0, 1) on the CPU in fp32 from torch's global generator, A then B; then (the default init) A is
    zeroed and B drawn again from N(0, 1). They are rounded to the base weight's dtype, then kept in
    ``adapter_dtype`` (by default fp32 on a bf16/fp16 model, as PEFT's ``autocast_adapter_dtype``). The branch
    uses the base embedding's ``padding_idx``, ``max_norm``, ... and its ``embed_scale`` when it has one (scaled
    word embeddings), as PEFT does. ``in_features``/``out_features`` are V and d, the shapes of A and B being those
    of a LoRALinear with V inputs and d outputs.
    """

    kind = "LoRA"

    def __init__(self, base: nn.Embedding, r: int, alpha: float, dropout: float = 0.0, *,
                 use_rslora: bool = False, use_dora: bool = False, init_lora_weights: bool | str = True,
                 adapter_dtype: torch.dtype | str | None = None):
        super().__init__()
        if not isinstance(base, nn.Embedding):
            raise TypeError(f"LoRAEmbedding wraps an nn.Embedding, got {type(base).__name__}")
        check_rank_alpha(r, alpha)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        check_flags(use_rslora=use_rslora, use_dora=use_dora)
        if use_dora:
            raise ValueError("use_dora=True on an nn.Embedding is not implemented in lora_lab (LoRA on embeddings "
                             "is plain LoRA or rsLoRA)")
        if not any(init_lora_weights is i or (isinstance(init_lora_weights, str) and init_lora_weights == i)
                   for i in EMBEDDING_INITS):
            raise ValueError(f"init_lora_weights={init_lora_weights!r} is not supported for an nn.Embedding; "
                             f"lora_lab implements {EMBEDDING_INITS!r} there")
        self.base = base
        self.r, self.alpha, self.use_rslora, self.use_dora = r, alpha, use_rslora, False
        self.init_lora_weights = init_lora_weights
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.dropout_p = float(dropout)
        self.lora_fa = False
        self.magnitude = None
        self.in_features, self.out_features = base.num_embeddings, base.embedding_dim
        w = base.weight
        dtype = resolve_adapter_dtype(w.dtype, adapter_dtype)
        a = torch.randn((r, self.in_features))  # PEFT's draws, in its order, on the CPU in fp32
        b = torch.randn((self.out_features, r))
        if init_lora_weights is not False:
            nn.init.zeros_(a)
            nn.init.normal_(b)
        self.lora_embedding_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype).to(dtype))
        self.lora_embedding_B = nn.Parameter(b.to(device=w.device, dtype=w.dtype).to(dtype))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.train(base.training)

    @property
    def weight(self) -> torch.Tensor:
        """The base embedding's weight (as PEFT's layers expose it), for code that reads ``embed_tokens.weight``."""
        return self.base.weight

    def freeze_A(self) -> None:
        raise ValueError("LoRA-FA (A frozen) on an nn.Embedding would freeze A at zero, so B gets no gradient; "
                         "leave embedding targets out of lora_fa")

    def _embed_scale(self, like: torch.Tensor) -> torch.Tensor | None:
        scale = getattr(self.base, "embed_scale", None)
        if scale is None:
            return None
        if not isinstance(scale, torch.Tensor):
            return torch.tensor(scale, device=like.device, dtype=self.base.weight.dtype).to(like.dtype)
        if scale.numel() != 1:
            raise ValueError(f"embed_scale of {type(self.base).__name__} has {scale.numel()} elements, not one")
        return scale.to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base lookup plus ``s * F.embedding(x, A^T) @ B^T``, in PEFT's order of operations (no dropout)."""
        result = self.base(x)
        base = self.base
        after_a = F.embedding(x, self.lora_embedding_A.T, padding_idx=base.padding_idx, max_norm=base.max_norm,
                              norm_type=base.norm_type, scale_grad_by_freq=base.scale_grad_by_freq, sparse=base.sparse)
        out = (after_a @ self.lora_embedding_B.T) * self.scaling
        scale = self._embed_scale(out)
        if scale is not None:
            out = out * scale
        return (result + out).to(result.dtype)

    def delta_weight(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """s (B A)^T, the V x d matrix a merge adds to W (computed in ``dtype``, fp32 by default)."""
        B, A = self.lora_embedding_B, self.lora_embedding_A
        if dtype is not None:
            B, A = B.to(dtype), A.to(dtype)
        return (B @ A).T * self.scaling

    @torch.no_grad()
    def merged_weight(self, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.base.weight.to(compute_dtype) + self.delta_weight(compute_dtype)

    @torch.no_grad()
    def merge(self, compute_dtype: torch.dtype | str = torch.float32) -> nn.Embedding:
        """A plain ``nn.Embedding`` (the base's settings) with weight W + s (B A)^T, formed in ``compute_dtype`` and
        rounded once to W's dtype. Raises if the merged weight is not finite (nothing is modified then)."""
        compute_dtype = as_float_dtype(compute_dtype, "compute_dtype")
        base, w = self.base, self.base.weight
        merged = self.merged_weight(compute_dtype).to(w.dtype)
        if not torch.isfinite(merged).all():
            raise FloatingPointError(f"merging LoRA into a {tuple(w.shape)} embedding produced non-finite values")
        out = nn.Embedding(base.num_embeddings, base.embedding_dim, padding_idx=base.padding_idx,
                           max_norm=base.max_norm, norm_type=base.norm_type,
                           scale_grad_by_freq=base.scale_grad_by_freq, sparse=base.sparse,
                           device=w.device, dtype=w.dtype)
        out.weight.copy_(merged)
        out.weight.requires_grad_(w.requires_grad)
        if type(base) is not nn.Embedding:  # a subclass (a scaled word embedding, ...): keep its class and extras
            import copy

            kept = copy.copy(base)  # a new module dict, sharing buffers such as embed_scale
            kept._parameters, kept._buffers, kept._modules = (dict(base._parameters), dict(base._buffers),
                                                              dict(base._modules))
            kept.weight = out.weight
            return kept
        return out

    def extra_repr(self) -> str:
        extra = ", use_rslora=True" if self.use_rslora else ""
        if self.lora_embedding_A.dtype != self.base.weight.dtype:
            extra += f", adapter_dtype={self.lora_embedding_A.dtype}"
        return (f"num_embeddings={self.in_features}, embedding_dim={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, scaling={self.scaling:g}{extra}")


def embedding_lora_layers(model: nn.Module) -> list[tuple[str, LoRAEmbedding]]:
    """All LoRA layers on embeddings of a model, with their module names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAEmbedding)]
