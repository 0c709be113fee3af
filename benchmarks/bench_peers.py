"""Benchmark: lora_lab's ops beside the peers people pick instead, side by side in one process, bf16.

Per op, on the same inputs and the same weights (every implementation reads the same tensors):

* ``lora_linear`` / ``lora_qkv`` / ``lora_mlp`` — notebook 05's grid: tokens M ∈ {8192, 32768}, rank r ∈ {16, 64};
  the linear at (K, N) ∈ {4096×4096, 4096×12288, 12288×4096}; QKV as three 4096-wide projections of one 4096-wide
  input (05's 4096×12288); the SiLU-gated MLP at hidden 4096, intermediate 12288 (05's 4096×12288 and 12288×4096).
  ``ours``: ``fused_lora_linear`` / ``fused_shared_input_lora`` (the MLP: gate and up in one shared-input op, SiLU·up
  by ``silu_mul``, one kernel each way as in axolotl's and unsloth's MLPs, down by ``fused_lora_linear``); peers:
  PEFT, axolotl (``axolotl.kernels.lora``), unsloth (``unsloth.kernels.fast_lora``), each on one PEFT-wrapped module
  holding the weights and the adapters.
  Dtype policy: frozen weights, adapters and activations all bf16 (PEFT's input cast off), alpha = 2r, B ≠ 0.
* ``moe_full`` / ``moe_lora`` — notebook 06's fine-grained shapes (``--moe-shapes``), T ∈ {8192, 32768}, routing
  from a random softmax router. ``ours``: lora_lab's patched transformers experts module (``moe_lora``: PEFT
  ``target_parameters`` LoRA r=16 on both expert weights); peers: Liger, LlamaFactory's ``cuda_fused_moe``, VeOmni's
  group GEMM and SonicMoE on the same expert weights (full); VeOmni's per-expert LoRA (its own layout: a rank-16
  pair on each of gate, up and down) with LoRA.
* ``loss`` — the Llama-3-8B head (d 4096, V 128,256), 16,384 tokens, trainable and frozen: ours
  (``linear_cross_entropy``), Liger and QuACK's chunked linear cross-entropy.

One step = forward, then ``torch.autograd.grad`` of a fixed upstream gradient (the loss: of the loss itself) for
the input and every trainable tensor. Each repetition times every implementation once, the order rotating
(``measure.rotation``); the figure is the user's loop (``measure.loop_ms``, synchronised after each call). A peer that
cannot load is one ``skipped`` row per cell with the exact error and what was tried (``peers.load``); a peer that
loads but fails in a cell is an ``error`` row. Each peer's first output is compared with ours (``out_rel_err``).

Writes into --out: peers_ops.csv (one row per cell, implementation and repetition; ``first_call_s``: the seconds of
its first forward and step, compiling and autotuning included).

    python benchmarks/bench_peers.py --out DIR                               # every op, every peer that loads
    python benchmarks/bench_peers.py --out DIR --ops loss moe_full --sessions 2
    TRITON_INTERPRET=1 python benchmarks/bench_peers.py --out DIR --smoke    # CPU: tiny shapes, peers skip
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import peers as peer_loader
import torch
from bench_common import check_device, device_line, error_text, is_oom, without_options
from torch import nn

from lora_lab.lab import measure
from lora_lab.layer import fill_lora_B

CSV = "peers_ops.csv"
LORA_OPS = ("lora_linear", "lora_qkv", "lora_mlp")
MOE_OPS = ("moe_full", "moe_lora")
ALL_OPS = (*LORA_OPS, *MOE_OPS, "loss")
GRID = {"tokens": [8192, 32768], "ranks": [16, 64], "linear": ["4096x4096", "4096x12288", "12288x4096"]}
SMOKE_GRID = {"tokens": [8192], "ranks": [16], "linear": ["4096x4096"]}
SMOKE_DIVISORS = {"M": 512, "KN": 128, "r": 4}  # bench_lora_linear's: every dimension divided
HIDDEN, QKV_SPLITS, MLP_INTERMEDIATE = 4096, (4096, 4096, 4096), 12288
FINE_GRAINED = ("qwen3_30b_a3b", "qwen1_5_moe_a2_7b", "olmoe_1b_7b", "deepseek_v2_lite", "gpt_oss_20b")
MOE_TOKENS, MOE_RANK = [8192, 32768], 16
LOSS_SHAPE, LOSS_TOKENS, LOSS_HEADS = "llama3-8b", 16384, ("trainable", "frozen")
LOOP = {False: dict(calls=10, warmup=3), True: dict(calls=2, warmup=0)}  # measure.loop_ms per impl and repetition


# --- LoRA projections ------------------------------------------------------------------------------------------------

class _Projections(nn.Module):
    """The children the peers' ``apply_lora_*`` read: ``o_proj``; ``q_proj``/``k_proj``/``v_proj``; or
    ``gate_proj``/``up_proj``/``down_proj`` and ``act_fn``."""

    def __init__(self, op: str, K: int, N: int, device, dtype):
        super().__init__()
        def linear(i, o):
            return nn.Linear(i, o, bias=False, device=device, dtype=dtype)

        if op == "lora_linear":
            self.o_proj = linear(K, N)
        elif op == "lora_qkv":
            n = N // 3
            self.q_proj, self.k_proj, self.v_proj = linear(K, n), linear(K, n), linear(K, n)
        else:
            self.gate_proj, self.up_proj, self.down_proj = linear(K, N), linear(K, N), linear(N, K)
            self.act_fn = nn.SiLU()
        for p in self.parameters():
            nn.init.normal_(p, std=K**-0.5)
            p.requires_grad_(False)


TARGETS = {"lora_linear": ["o_proj"], "lora_qkv": ["q_proj", "k_proj", "v_proj"],
           "lora_mlp": ["gate_proj", "up_proj", "down_proj"]}


def lora_holder(op: str, K: int, N: int, r: int, device, dtype):
    """(module with PEFT-wrapped children, trainable adapter parameters): bf16 adapters, input cast off."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS[op], lora_dropout=0.0)
    model = get_peft_model(_Projections(op, K, N, device, dtype), config, autocast_adapter_dtype=False)
    fill_lora_B(model, 0.02)
    inner = model.base_model.model
    for name in TARGETS[op]:
        layer = getattr(inner, name)
        layer.lora_A.to(dtype)
        layer.lora_B.to(dtype)
        layer.cast_input_dtype_enabled = False
    inner.train()
    return inner, [p for p in model.parameters() if p.requires_grad]


def _factors(layer):
    return layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight, \
        layer.scaling["default"]


def ours_lora(op: str, holder):
    """lora_lab's op on the holder's tensors (the same ones the peers read)."""
    from lora_lab.kernels import fused_lora_linear, fused_shared_input_lora, silu_mul

    parts = [_factors(getattr(holder, name)) for name in TARGETS[op]]
    if op == "lora_linear":
        (W, A, B, s), = parts
        return lambda x: fused_lora_linear(x, W, None, A, B, s)
    if op == "lora_qkv":
        W = torch.cat([p[0] for p in parts])  # the frozen weights side by side, once
        splits = [p[0].shape[0] for p in parts]
        return lambda x: tuple(fused_shared_input_lora(x, W, None, splits, [p[1] for p in parts],
                                                       [p[2] for p in parts], [p[3] for p in parts]))
    gate, up, (Wd, Ad, Bd, sd) = parts
    W_gu = torch.cat([gate[0], up[0]])
    splits = [gate[0].shape[0], up[0].shape[0]]

    def mlp(x):
        g, u = fused_shared_input_lora(x, W_gu, None, splits, [gate[1], up[1]], [gate[2], up[2]], [gate[3], up[3]])
        return fused_lora_linear(silu_mul(g, u), Wd, None, Ad, Bd, sd)  # SiLU·up fused, as axolotl's and unsloth's

    return mlp


def lora_cells(smoke: bool):
    grid = SMOKE_GRID if smoke else GRID
    d = SMOKE_DIVISORS if smoke else {"M": 1, "KN": 1, "r": 1}
    for op in LORA_OPS:
        shapes = ([tuple(map(int, s.split("x"))) for s in grid["linear"]] if op == "lora_linear"
                  else [(HIDDEN, sum(QKV_SPLITS))] if op == "lora_qkv" else [(HIDDEN, MLP_INTERMEDIATE)])
        for M in grid["tokens"]:
            for K, N in shapes:
                for r in grid["ranks"]:
                    cell = f"{op}_{M // 1024}k_{K}x{N}_r{r}"
                    yield op, cell, (M // d["M"], K // d["KN"], N // d["KN"], max(1, r // d["r"]))


def lora_cell(op, cell, dims, impls, args, device, dtype):
    M, K, N, r = dims
    holder, params = lora_holder(op, K, N, r, device, dtype)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    fns = {"ours": ours_lora(op, holder)}
    module = holder.o_proj if op == "lora_linear" else holder  # the linear op takes the PEFT layer itself
    fns.update({name: (lambda x, fn=loaded.fn: fn(module, x)) for name, loaded in impls.items()})
    base = dict(op=op, cell=cell, M=M, K=K, N=N, r=r)
    return time_cell(fns, x, [x, *params], base, args, device)


# --- MoE layer -------------------------------------------------------------------------------------------------------

def moe_cells(args):
    from bench_moe import SMOKE_SHAPES, SMOKE_TOKEN_DIVISOR

    from lora_lab.experiments.fused_moe import LAYER_SHAPES

    for op in (o for o in MOE_OPS if o in args.ops):
        for name in args.moe_shapes:
            shape = LAYER_SHAPES[name].scaled(**SMOKE_SHAPES[name]) if args.smoke else LAYER_SHAPES[name]
            for label in MOE_TOKENS[:1] if args.smoke else MOE_TOKENS:
                tokens = max(1, label // SMOKE_TOKEN_DIVISOR) if args.smoke else label
                yield op, f"{op}_{name}_t{label}", shape, tokens


def moe_cell(op, cell, shape, tokens, impls, args, device, dtype):
    from lora_lab.experiments.fused_moe import layer_holder, random_routing, set_implementation

    mode = "full" if op == "moe_full" else "lora"
    holder, experts, params = layer_holder(shape, mode, device, dtype, seed=0, rank=MOE_RANK)
    set_implementation(holder, experts, "ours")
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    index, weights = random_routing(tokens, shape, device, dtype, seed=0)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    fns, inputs = {"ours": lambda x: holder(x, index, weights)}, {"ours": [x, weights, *params]}
    for name, loaded in impls.items():
        if mode == "full":
            fns[name] = lambda x, fn=loaded.fn: fn(x, index, weights, gate_up, down)
            inputs[name] = [x, weights, gate_up, down]
        else:
            lora = peer_loader.ExpertLoRAFactors.random(shape.num_experts, shape.hidden, shape.intermediate,
                                                        MOE_RANK, device, dtype)
            fns[name] = lambda x, fn=loaded.fn, lora=lora: fn(x, index, weights, gate_up, down, lora)
            inputs[name] = [x, weights, *lora.parameters()]
    base = dict(op=op, cell=cell, shape=shape.name, tokens=tokens, hidden=shape.hidden, experts=shape.num_experts,
                top_k=shape.top_k, intermediate=shape.intermediate, r=MOE_RANK if mode == "lora" else None)
    return time_cell(fns, x, inputs, base, args, device)


# --- loss ------------------------------------------------------------------------------------------------------------

def loss_cells(args):
    from bench_loss import SHAPES, SMOKE_SHAPES

    hidden, vocab = (SMOKE_SHAPES if args.smoke else SHAPES)[LOSS_SHAPE]
    tokens = LOSS_TOKENS // 1024 if args.smoke else LOSS_TOKENS
    for head in LOSS_HEADS:
        yield f"loss_{LOSS_SHAPE}_{LOSS_TOKENS}_{head}", hidden, vocab, tokens, head


def loss_cell(cell, hidden, vocab, tokens, head, impls, args, device, dtype):
    from bench_loss import make_inputs

    from lora_lab.kernels import linear_cross_entropy

    h, w, y, _ = make_inputs(hidden, vocab, tokens, device, dtype, seed=0)
    h.requires_grad_(True)
    w.requires_grad_(head == "trainable")
    fns = {"ours": lambda h: linear_cross_entropy(h, w, y, ignore_index=peer_loader.IGNORE_INDEX)}
    fns.update({name: (lambda h, fn=loaded.fn: fn(h, w, y)) for name, loaded in impls.items()})
    base = dict(op="loss", cell=cell, shape=LOSS_SHAPE, hidden=hidden, vocab=vocab, tokens=tokens, head=head)
    return time_cell(fns, h, [h, w] if head == "trainable" else [h], base, args, device)


# --- timing ----------------------------------------------------------------------------------------------------------

def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _rel_err(out, ref) -> float:
    num = sum(float((o.detach().float() - r.float()).norm()) ** 2 for o, r in zip(_outputs(out), _outputs(ref)))
    den = sum(float(r.float().norm()) ** 2 for r in _outputs(ref))
    return (num / max(den, 1e-30)) ** 0.5


def _upstream(out, shared):
    """The upstream gradients of ``out``: ``shared`` (ours') where the shapes agree, the same for every
    implementation; else drawn (seeded). A scalar (the loss) gets 1."""
    outs = _outputs(out)
    if shared is not None and [g.shape for g in shared] == [o.shape for o in outs]:
        return shared
    gen = torch.Generator(device=outs[0].device).manual_seed(5)
    return [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) if o.dim() else torch.ones_like(o)
            for o in outs]


def time_cell(fns: dict, x, inputs, base: dict, args, device) -> list[dict]:
    """Rows of one cell: first call of each implementation (compile, tuning, its output against ours; its seconds,
    first forward and first step together, as ``first_call_s``), peak memory once, then ``args.repetitions``
    side-by-side loops. ``inputs``: what the step differentiates (one list, or a dict per implementation)."""
    cuda = device.type == "cuda"
    ref = ref_grads = None
    steps, once = {}, {}
    for name, fn in fns.items():
        wrt = inputs[name] if isinstance(inputs, dict) else inputs
        try:
            started = time.perf_counter()
            out = fn(x)  # the first call: compile, tuning
            grads = _upstream(out, ref_grads)
            if name == "ours":
                ref_grads = grads

            def step(fn=fn, wrt=wrt, grads=grads):
                return torch.autograd.grad(_outputs(fn(x)), wrt, grads, allow_unused=True)

            step()
            if cuda:
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - started  # first forward + first step, with what they compile or tune
            if name == "ours":
                ref = [o.detach() for o in _outputs(out)]
            err = None if ref is None or name == "ours" else _rel_err(out, ref)
            del out
            peak = measure.peak_bytes(step) if cuda else (None, None)
            once[name] = dict(status="ok", out_rel_err=err, peak_bytes=peak[0], resident_bytes=peak[1],
                              first_call_s=first_s)
            steps[name] = step
        except Exception as err:  # a peer that loads but cannot run this cell is a recorded row
            if name == "ours":
                raise
            once[name] = dict(status="oom" if is_oom(err) else "error", error=error_text(err))
            print(f"   {base['cell']}: {name} failed: {once[name]['error'][:200]}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    rows = [dict(base, impl=name, rep=0, ms=None, **info) for name, info in once.items() if info["status"] != "ok"]
    for rep in range(args.repetitions):
        for name in measure.rotation(steps, rep):
            times = measure.loop_ms(steps[name], **LOOP[args.smoke])
            rows.append(dict(base, impl=name, rep=rep, ms=statistics.median(times), timing="loop",
                             ms_each=" ".join(f"{t:.4f}" for t in times), **once[name]))
    return rows


def skip_rows(skips: dict, base: dict) -> list[dict]:
    return [dict(base, **skip.row(), rep=0, ms=None) for skip in skips.values()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory for the CSV")
    ap.add_argument("--ops", nargs="+", default=list(ALL_OPS), choices=list(ALL_OPS))
    ap.add_argument("--peers", nargs="+", default=list(peer_loader.PEERS), choices=list(peer_loader.PEERS),
                    help="which peers to try (each op times those of them that have it)")
    ap.add_argument("--moe-shapes", nargs="+", default=list(FINE_GRAINED), choices=list(FINE_GRAINED))
    ap.add_argument("--repetitions", type=int, default=measure.MIN_REPETITIONS)
    ap.add_argument("--sessions", type=int, default=1, help="separate processes (this script again, one after "
                                                           "another), their CSVs pooled: speed ratios are graded "
                                                           f"on >= {measure.MIN_SESSIONS}")
    ap.add_argument("--smoke", action="store_true", help="tiny stand-in shapes, fp32 (CPU: set TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.sessions > 1:
        raw = sys.argv[1:] if argv is None else list(argv)
        measure.run_script_sessions(Path(__file__), without_options(raw, ("--out", "--sessions")), args.out, [CSV],
                                    sessions=args.sessions)
        return
    if args.repetitions < 1:
        ap.error("--repetitions must be >= 1")
    device = check_device(args.smoke)
    dtype = torch.float32 if device.type != "cuda" else torch.bfloat16
    print(device_line(device, dtype, args.repetitions), flush=True)
    loaded = {}
    for op in args.ops:
        results = {name: peer_loader.load(name, op, device) for name in peer_loader.PEER_OPS[op] if name in args.peers}
        loaded[op] = ({n: r for n, r in results.items() if isinstance(r, peer_loader.PeerOp)},
                      {n: r for n, r in results.items() if isinstance(r, peer_loader.PeerSkip)})
        for name, result in results.items():
            said = (f"{result.source} {result.version} {result.note}" if isinstance(result, peer_loader.PeerOp)
                    else f"skipped: {result.error}")
            print(f"   {op}: {name}: {said}", flush=True)
    rows = []

    def add(cell_rows, op, base):
        runs, skips = loaded[op]
        for row in cell_rows:
            if row["impl"] in runs:
                row.update(source=runs[row["impl"]].source, version=runs[row["impl"]].version)
        rows.extend(cell_rows + skip_rows(skips, base))
        measure.write_csv([dict(r, smoke=args.smoke) for r in rows], Path(args.out) / CSV)  # after every cell

    for op, cell, dims in lora_cells(args.smoke):
        if op in args.ops:
            print(f"{cell}", flush=True)
            add(lora_cell(op, cell, dims, loaded[op][0], args, device, dtype), op, dict(op=op, cell=cell))
    for op, cell, shape, tokens in moe_cells(args):
        print(f"{cell}", flush=True)
        add(moe_cell(op, cell, shape, tokens, loaded[op][0], args, device, dtype), op, dict(op=op, cell=cell))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "loss" in args.ops:
        for cell, hidden, vocab, tokens, head in loss_cells(args):
            print(f"{cell}", flush=True)
            add(loss_cell(cell, hidden, vocab, tokens, head, loaded["loss"][0], args, device, dtype), "loss",
                dict(op="loss", cell=cell))
    print(f"wrote {Path(args.out) / CSV}: {len(rows)} rows", flush=True)


if __name__ == "__main__":
    main()
