"""The peers people pick instead of lora_lab, loaded from their own packages, as one callable per benchmark op.

Nothing here is a copy of a peer: each adapter imports the peer's module by its own import path and calls its
public function, mapping lora_lab's benchmark inputs onto that function's arguments. :func:`load` returns a
:class:`PeerOp` (the callable, where it came from, the installed version) or a :class:`PeerSkip` (why not: the
exact error text and every step that was tried), never raises for a peer that is missing or broken.

Ops and their uniform signatures (``x`` is ``[M, K]``; LoRA holders are PEFT-wrapped modules, built by the caller):

* ``lora_linear`` — ``fn(proj, x) -> y``: ``proj`` a PEFT ``lora.Linear``;
* ``lora_qkv``    — ``fn(attn, x) -> (q, k, v)``: ``attn`` has PEFT-wrapped ``q_proj``, ``k_proj``, ``v_proj``;
* ``lora_mlp``    — ``fn(mlp, x) -> y``: ``mlp`` has PEFT-wrapped ``gate_proj``, ``up_proj``, ``down_proj`` and
  ``act_fn`` (SiLU-gated);
* ``moe_full``    — ``fn(x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> y``: transformers' experts
  layout, ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows), ``down_proj`` ``[E, H, I]``, SwiGLU;
* ``moe_lora``    — the same plus ``lora``, an :class:`ExpertLoRAFactors` (per-expert factors, frozen experts);
* ``loss``        — ``fn(h, w, y) -> loss``: mean cross-entropy of ``h @ w.T`` against ``y`` (ignore index -100);
* ``model``       — axolotl: ``fn(peft_model) -> peft_model`` (its LoRA-kernel monkeypatches); unsloth:
  ``fn(checkpoint_dir, r, max_seq_length, dtype, gradient_checkpointing) -> peft_model`` (its loader).

axolotl 0.21 and unsloth take 3-D activations ``[batch, seq, hidden]`` (unsloth's backward reshapes to three
dimensions): their adapters pass ``x[None]`` and return the leading dimension removed.

On the GPU image the peers install with ``pip install --no-deps`` (extras ``peers-lora``, ``peers-moe``,
``peers-loss`` in pyproject.toml): their torch pins disagree with the image's torch.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from lora_lab import gpu_arch

OPS = ("lora_linear", "lora_qkv", "lora_mlp", "moe_full", "moe_lora", "loss", "model")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Peer:
    """One peer package: its distribution name and pinned version, the Python and GPU it needs."""

    name: str
    distribution: str
    version: str
    extra: str
    min_python: tuple[int, int] = (3, 10)
    min_capability: tuple[int, int] | None = None  # lowest CUDA compute capability its kernels target
    needs_cuda: bool = True


PEERS = {
    "peft": Peer("peft", "peft", "", "", needs_cuda=False),
    "liger": Peer("liger", "liger-kernel", "", "liger"),
    "axolotl": Peer("axolotl", "axolotl", "0.21.0", "peers-lora", min_python=(3, 12)),
    "unsloth": Peer("unsloth", "unsloth", "2026.10.9", "peers-lora"),
    "llamafactory": Peer("llamafactory", "llamafactory", "0.9.5", "peers-moe"),
    "veomni": Peer("veomni", "veomni", "0.1.12", "peers-moe"),
    "sonicmoe": Peer("sonicmoe", "sonic-moe", "0.1.2.post1", "peers-moe", min_python=(3, 12),
                     min_capability=(9, 0)),
    "quack": Peer("quack", "quack-kernels", "0.6.5", "peers-loss", min_capability=(9, 0)),
}


@dataclass
class PeerOp:
    """A peer's op, ready to time: ``fn`` has the op's uniform signature (module docstring)."""

    peer: str
    op: str
    fn: Callable
    source: str  # the peer's module and function that ``fn`` calls
    version: str  # the installed distribution's version ("" when not found)
    note: str = ""


@dataclass
class PeerSkip:
    """A peer that cannot run an op here: ``error`` is the first failing step's exact text, ``tried`` every step."""

    peer: str
    op: str
    error: str
    tried: list[str] = field(default_factory=list)

    def row(self) -> dict:
        """The fields a benchmark's ``skipped`` row records."""
        return {"impl": self.peer, "op": self.op, "status": "skipped", "error": self.error,
                "tried": "; ".join(self.tried)}


@dataclass
class ExpertLoRAFactors:
    """Per-expert LoRA factors in VeOmni's layout (``veomni.lora.ops.moe_group_gemm``, independent mode): a pair on
    the gate half, one on the up half of ``gate_up_proj`` and one on ``down_proj``, each of rank r."""

    a_gate: torch.Tensor  # [E, r, H]
    b_gate: torch.Tensor  # [E, I, r]
    a_up: torch.Tensor  # [E, r, H]
    b_up: torch.Tensor  # [E, I, r]
    a_down: torch.Tensor  # [E, r, I]
    b_down: torch.Tensor  # [E, H, r]
    scale: float

    @classmethod
    def random(cls, E: int, H: int, I: int, r: int, device, dtype, seed: int = 0, b_std: float = 0.01):
        """Trainable factors: A ~ N(0, 1/fan_in), B ~ N(0, b_std²) (B ≠ 0, so the LoRA path is exercised);
        scale = alpha / r with alpha = 2r."""
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def draw(*shape, std):
            return (torch.randn(*shape, generator=gen) * std).to(device, dtype).requires_grad_(True)

        return cls(draw(E, r, H, std=H**-0.5), draw(E, I, r, std=b_std), draw(E, r, H, std=H**-0.5),
                   draw(E, I, r, std=b_std), draw(E, r, I, std=I**-0.5), draw(E, H, r, std=b_std), 2.0)

    def parameters(self) -> list[torch.Tensor]:
        return [self.a_gate, self.b_gate, self.a_up, self.b_up, self.a_down, self.b_down]


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _batched(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 2 else x


def _unbatched(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y.squeeze(0) if like.dim() == 2 else y


def _holder(module, **children):
    """The ``self`` the peers' ``apply_lora_*`` functions read: the named children and ``training``."""
    return SimpleNamespace(training=module.training if module is not None else True, **children)


# --- the adapters: each returns (fn, "module.function") from the peer's imported module -----------------------------

def _fast_lora(module_path: str, op: str):
    """axolotl (``axolotl.kernels.lora``) and unsloth (``unsloth.kernels.fast_lora``) share the functions' names
    and the ``self`` they read: ``apply_lora_o(self, X)`` (``self.o_proj``), ``apply_lora_qkv(self, X)``
    (``self.q_proj`` / ``k_proj`` / ``v_proj``, returns Q, K, V) and ``apply_lora_mlp_swiglu(self, X)``
    (``self.gate_proj`` / ``up_proj`` / ``down_proj``), each a PEFT ``lora.Linear`` whose weights they read."""
    mod = importlib.import_module(module_path)
    if op == "lora_linear":
        apply_o = mod.apply_lora_o

        def lora_linear(proj, x):
            return _unbatched(apply_o(_holder(proj, o_proj=proj), _batched(x)), x)

        return lora_linear, f"{module_path}.apply_lora_o"
    if op == "lora_qkv":
        apply_qkv = mod.apply_lora_qkv

        def lora_qkv(attn, x):
            q, k, v = apply_qkv(attn, _batched(x))
            return tuple(_unbatched(t, x) for t in (q, k, v))

        return lora_qkv, f"{module_path}.apply_lora_qkv"
    if op == "lora_mlp":
        apply_mlp = mod.apply_lora_mlp_swiglu

        def lora_mlp(mlp, x):
            return _unbatched(apply_mlp(mlp, _batched(x)), x)

        return lora_mlp, f"{module_path}.apply_lora_mlp_swiglu"
    raise LookupError(f"{module_path} has no {op} op")


# Loggers a peer's module imports at its top although its kernels never call them: where one is not installed, an
# empty module stands in for it, and the op's ``source`` says so. axolotl's LoRA-kernel patch imports
# ``axolotl.utils.callbacks`` (for one helper), which imports wandb (20 MB with its service binary).
IMPORT_STUBS = {"axolotl": ("wandb",)}


def stub_missing(names) -> list[str]:
    """Put an empty module in ``sys.modules`` for each of ``names`` that is neither imported nor installed; the names
    stubbed (an installed module is never replaced)."""
    import importlib.machinery
    import importlib.util
    import types

    stubbed = []
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def _axolotl(op: str):
    if op != "model":
        return _fast_lora("axolotl.kernels.lora", op)
    stubbed = stub_missing(IMPORT_STUBS["axolotl"])
    patches = importlib.import_module("axolotl.monkeypatch.lora_kernels")
    DictDefault = importlib.import_module("axolotl.utils.dict").DictDefault

    def patch(model):
        """axolotl's two steps with its QKV / O / MLP LoRA kernels on: ``patch_self_attn_lora(cfg)`` rewrites the
        attention class's forward to call ``self.apply_qkv`` / ``self.apply_o``, ``apply_lora_kernel_patches(model,
        cfg)`` binds its kernels to the model's layers. The rewritten forward is bound to this model's attention
        modules only and the class keeps its own, so models built later in the process stay plain."""
        import tempfile

        config = model.get_base_model().config
        with tempfile.TemporaryDirectory() as base_model:  # get_attention_cls_from_config reads a config.json
            config.save_pretrained(base_model)
            cfg = DictDefault({"base_model": base_model, "model_config_type": config.model_type,
                               "lora_qkv_kernel": True, "lora_o_kernel": True, "lora_mlp_kernel": True})
            attention_cls = patches.get_attention_cls_from_config(cfg)
            original = attention_cls.forward
            patches.patch_self_attn_lora(cfg)
            rewritten = attention_cls.forward
            attention_cls.forward = original
            if hasattr(attention_cls, "_original_forward"):
                del attention_cls._original_forward  # its "already patched" mark
            model = patches.apply_lora_kernel_patches(model, cfg)
        for module in model.modules():
            if isinstance(module, attention_cls):
                module.forward = rewritten.__get__(module)
        return model

    stub_note = f" (empty stand-in modules for {', '.join(stubbed)}: not installed)" if stubbed else ""
    return patch, ("axolotl.monkeypatch.lora_kernels.patch_self_attn_lora + apply_lora_kernel_patches "
                   "(lora_qkv_kernel, lora_o_kernel, lora_mlp_kernel)" + stub_note)


def _unsloth(op: str):
    if op == "moe_full":
        return _unsloth_moe()
    if op != "model":
        return _fast_lora("unsloth.kernels.fast_lora", op)
    FastLanguageModel = importlib.import_module("unsloth").FastLanguageModel
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def load_model(checkpoint_dir, r, max_seq_length, dtype, gradient_checkpointing=False):
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(checkpoint_dir), max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=False)
        return FastLanguageModel.get_peft_model(
            model, r=r, target_modules=targets, lora_alpha=2 * r, lora_dropout=0.0, bias="none",
            use_gradient_checkpointing="unsloth" if gradient_checkpointing else False)

    return load_model, "unsloth.FastLanguageModel.from_pretrained + get_peft_model"


def _unsloth_moe():
    """unsloth's Triton grouped GEMM (``unsloth.kernels.moe``), composed as its own Qwen3-MoE block composes it: the
    tokens sorted by expert with its ``get_routing_indices``, the gate/up GEMM gathering rows in its prologue
    (``permute_x``), SiLU(gate)·up in torch, the down GEMM scattering rows back in its epilogue (``permute_y``), and
    the routing weights' top-k sum in torch. Its kernels autotune on their first call."""
    path = "unsloth.kernels.moe.grouped_gemm"
    grouped_gemm = importlib.import_module(f"{path}.interface").grouped_gemm
    routing = importlib.import_module(f"{path}.reference.moe_ops").get_routing_indices

    def moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        tokens, k = top_k_index.shape
        experts, two_i, _ = gate_up_proj.shape
        counts, gather = routing(top_k_index, experts)
        h = grouped_gemm(X=x, W=gate_up_proj, m_sizes=counts, topk=k, gather_indices=gather, permute_x=True,
                         permute_y=False, autotune=True, is_first_gemm=True)
        h = torch.nn.functional.silu(h[:, : two_i // 2]) * h[:, two_i // 2:]  # gate rows first, transformers' order
        y = grouped_gemm(X=h, W=down_proj, m_sizes=counts, topk=k, gather_indices=gather, permute_x=False,
                         permute_y=True, autotune=True, is_first_gemm=False)
        return (y.view(tokens, k, -1) * top_k_weights.to(y.dtype)[..., None]).sum(dim=1)

    return moe, f"{path}.interface.grouped_gemm (gate/up and down, autotuned; SiLU·up and the top-k sum in torch)"


def _llamafactory(op: str):
    if op != "moe_full":
        raise LookupError("LlamaFactory's cuda_fused_moe computes plain experts: no LoRA on experts")
    path = "llamafactory.v1.plugins.model_plugins.kernels.ops.mlp.cuda_fused_moe"
    function = importlib.import_module(path).TritonFusedMoeFunction

    def moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        # (num_experts, gate_weights, expert_index, hidden_states, fc1 [E, 2I, H], fc2 [E, H, I])
        return function.apply(gate_up_proj.shape[0], top_k_weights.to(x.dtype), top_k_index, x, gate_up_proj,
                              down_proj)

    return moe, f"{path}.TritonFusedMoeFunction.apply"


def _veomni(op: str):
    if op == "moe_full":
        path = "veomni.ops.kernels.moe.group_gemm"
        forward = importlib.import_module(path).group_gemm_fused_moe_forward

        def moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
            # split fc1 weights None, the merged [E, 2I, H] one by keyword
            return forward(gate_up_proj.shape[0], top_k_weights.to(x.dtype), top_k_index, x, None, None, down_proj,
                           fc1_1_2_weight=gate_up_proj)

        return moe, f"{path}.group_gemm_fused_moe_forward"
    if op == "moe_lora":
        path = "veomni.lora.ops.moe_group_gemm"
        forward = importlib.import_module(path).group_gemm_fused_independent_lora_moe_forward

        def moe_lora(x, top_k_index, top_k_weights, gate_up_proj, down_proj, lora: ExpertLoRAFactors):
            s = lora.scale
            return forward(gate_up_proj.shape[0], top_k_weights.to(x.dtype), top_k_index, x, gate_up_proj, down_proj,
                           lora.a_gate, lora.b_gate, lora.a_up, lora.b_up, lora.a_down, lora.b_down, s, s, s)

        return moe_lora, f"{path}.group_gemm_fused_independent_lora_moe_forward"
    raise LookupError(f"VeOmni has no {op} op here")


def _sonicmoe(op: str):
    if op != "moe_full":
        raise LookupError("SonicMoE computes plain experts: no LoRA on experts")
    swiglu = importlib.import_module("sonicmoe.enums").ActivationType.SWIGLU
    routed = importlib.import_module("sonicmoe").moe_general_routing_inputs

    def moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        # moe_general_routing_inputs takes flat, token-sorted assignments and its weights expert-last:
        # w1 [2I, H, E] (concat_layout=True: gate rows then up rows, transformers' order), w2 [H, I, E]
        T, k = top_k_index.shape
        tokens = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(k)
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        out, _frequency = routed(
            x, top_k_weights.reshape(-1), tokens, top_k_index.reshape(-1).to(torch.int32),
            gate_up_proj.permute(1, 2, 0), None, down_proj.permute(1, 2, 0), None, gate_up_proj.shape[0], stream,
            swiglu, False, concat_layout=True)
        return out

    return moe, "sonicmoe.moe_general_routing_inputs"


def _quack(op: str):
    if op != "loss":
        raise LookupError(f"QuACK has no {op} op here")
    path = "quack.linear_cross_entropy"
    lce = importlib.import_module(path).chunked_linear_cross_entropy

    def loss(h, w, y):
        return lce(h, w, y, chunk_size=4096, ignore_index=IGNORE_INDEX, reduction="mean")

    return loss, f"{path}.chunked_linear_cross_entropy(chunk_size=4096)"


def _peft(op: str):
    """PEFT's own forward on the holder the benchmark builds (PEFT is a lora_lab dependency)."""
    if op == "lora_linear":
        return (lambda proj, x: proj(x)), "peft.tuners.lora.Linear.forward"
    if op == "lora_qkv":
        return (lambda attn, x: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))), "peft.tuners.lora.Linear.forward x3"
    if op == "lora_mlp":
        def mlp(m, x):
            return m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))

        return mlp, "peft.tuners.lora.Linear.forward (gate, up, down)"
    raise LookupError(f"PEFT has no {op} op here")


def _liger(op: str):
    if op == "loss":
        criterion = importlib.import_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss(
            ignore_index=IGNORE_INDEX)
        return (lambda h, w, y: criterion(w, h, y)), "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss"
    if op == "moe_full":
        function = importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction

        def moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
            return function.apply(x, gate_up_proj, down_proj, top_k_index.to(torch.int32), top_k_weights)

        return moe, "liger_kernel.ops.fused_moe.LigerFusedMoEFunction.apply"
    raise LookupError(f"Liger has no {op} op here")


ADAPTERS: dict[str, Callable] = {
    "peft": _peft, "liger": _liger, "axolotl": _axolotl, "unsloth": _unsloth, "llamafactory": _llamafactory,
    "veomni": _veomni, "sonicmoe": _sonicmoe, "quack": _quack,
}
# which peers have which op (the benchmark's columns)
PEER_OPS = {
    "lora_linear": ("peft", "axolotl", "unsloth"),
    "lora_qkv": ("peft", "axolotl", "unsloth"),
    "lora_mlp": ("peft", "axolotl", "unsloth"),
    "moe_full": ("liger", "llamafactory", "veomni", "sonicmoe", "unsloth"),
    "moe_lora": ("veomni",),
    "loss": ("liger", "quack"),
    "model": ("axolotl", "unsloth"),
}


def device_problem(peer: Peer, device: torch.device | None) -> str | None:
    """Why ``peer`` cannot run on ``device`` (no CUDA, a GPU older than its kernels target), or None."""
    if not peer.needs_cuda:
        return None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return f"{peer.name} runs CUDA kernels only; the device here is {device if device is not None else 'none'}"
    if peer.min_capability is not None:
        found = gpu_arch.capability(device)  # the device's, or an older one forced by $LORA_LAB_ARCH
        if tuple(found) < peer.min_capability:
            need = ".".join(map(str, peer.min_capability))
            forced = f" (${gpu_arch.ARCH_ENV} forces it)" if gpu_arch.arch_override() is not None else ""
            return f"{peer.name} targets compute capability >= {need}; this GPU is {found[0]}.{found[1]}{forced}"
    return None


def load(name: str, op: str, device: torch.device | None = None, check_device: bool = True) -> PeerOp | PeerSkip:
    """``name``'s ``op`` as a :class:`PeerOp`, or a :class:`PeerSkip` saying why not (never raises for a peer that is
    missing or fails to import). Steps, each recorded in ``tried``: the Python version, the import of the peer's
    module (any exception, with its exact text), then (``check_device``) CUDA and the GPU's compute capability."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    peer = PEERS[name]
    version = installed_version(peer.distribution)
    pin = f"=={peer.version}" if peer.version else ""
    tried = [f"Python {sys.version_info[0]}.{sys.version_info[1]}",
             f"installed {peer.distribution}: {version or 'none'} (pinned{pin or ': none'})"]
    if op not in PEER_OPS or name not in PEER_OPS[op]:
        return PeerSkip(name, op, f"{name} has no {op} op", tried)
    if sys.version_info[:2] < peer.min_python:
        need = ".".join(map(str, peer.min_python))
        tried.append(f"{peer.distribution}{pin} requires Python >= {need}")
    try:
        fn, source = ADAPTERS[name](op)
    except Exception as err:  # ImportError, or anything the peer's import raises (no GPU, a torch mismatch)
        text = f"{type(err).__name__}: {err}"
        tried.append(f"import for {op}: {text}")
        if peer.extra:
            tried.append(f"install: pip install --no-deps '{peer.distribution}{pin}' (extra {peer.extra})")
        return PeerSkip(name, op, text, tried)
    tried.append(f"imported {source}")
    if check_device:
        problem = device_problem(peer, device)
        if problem is not None:
            tried.append(problem)
            return PeerSkip(name, op, problem, tried)
    note = "" if not peer.version or version == peer.version else f"installed {version or 'unknown'}, pinned {pin}"
    return PeerOp(name, op, fn, source, version, note)


def load_all(op: str, device: torch.device | None = None, check_device: bool = True) -> dict[str, PeerOp | PeerSkip]:
    """Every peer of ``op`` (``PEER_OPS``), loaded or skipped."""
    return {name: load(name, op, device, check_device) for name in PEER_OPS[op]}
