"""lora_lab.memory: fixed memory from tensors, saved-activation accounting, the byte model, the sweep."""
import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import lora_lab
from lora_lab import memory as mem
from lora_lab.experiments import memory_breakdown as mb
from lora_lab.loss import causal_lm_loss

# ----------------------------------------------------------------------------- fixed memory


def test_fixed_memory_from_tensors(tiny_fp32, random_ids):
    model = copy.deepcopy(tiny_fp32)
    lora_lab.add_lora(model, r=4, alpha=8)
    counts = lora_lab.count_parameters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = mem.fixed_memory_by_category(model, opt)
    assert before.weights == counts.total * 4  # tied embedding counted once
    assert before.gradients == 0 and before.optimizer_states == 0
    causal_lm_loss(model, random_ids(model), chunked=False).backward()
    opt.step()
    after = mem.fixed_memory_by_category(model, opt)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    assert after.gradients == counts.trainable * 4
    # exp_avg + exp_avg_sq, plus one scalar step counter per parameter tensor
    assert 2 * counts.trainable * 4 <= after.optimizer_states <= 2 * counts.trainable * 4 + 8 * n_tensors
    assert after.total == after.weights + after.gradients + after.optimizer_states + after.buffers


def test_byte_model_parameter_counts():
    shape = mem.ModelShape.from_config(lora_lab.model_config("qwen2.5-0.5b"))
    assert shape.parameter_count() == 494_032_768
    assert shape.lora_parameter_count(8, ("q_proj", "v_proj")) == 540_672
    tiny = lora_lab.load_model("random:tiny-qwen2", device="meta")
    tiny_shape = mem.ModelShape.from_config(tiny.config)
    assert tiny_shape.parameter_count() == lora_lab.count_parameters(tiny).total
    with pytest.raises(ValueError, match="unknown LoRA target"):
        shape.lora_parameter_count(8, ("qproj",))


def test_byte_model_fixed_part_matches_tensors(tiny_fp32, random_ids):
    model = copy.deepcopy(tiny_fp32)
    lora_lab.add_lora(model, r=8, alpha=16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    causal_lm_loss(model, random_ids(model), chunked=False).backward()
    opt.step()
    measured = mem.fixed_memory_by_category(model, opt)
    predicted = mem.analytic_memory(mem.ModelShape.from_config(model.config),
                                    mem.TrainingSetup(batch=2, seq_len=24, dtype="fp32", method="lora",
                                                      attention="cpu_flash"))
    assert predicted.weights == measured.weights
    assert predicted.gradients == measured.gradients
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    assert 0 <= measured.optimizer_states - predicted.optimizer_states <= 8 * n_tensors


# ----------------------------------------------------------------------------- accounting


def test_accounting_dedups_storages_and_skips_parameters():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with mem.SavedTensorAccounting(lin, labels={lin: "lin"}) as acc:
        y = x * x  # saves x twice: one storage
        z = lin(y.view(4, 8))  # saves y (a view: same storage) and the weight (a parameter)
        w = z[:2] * z[2:]  # saves two views of z's storage
    report = acc.report
    assert report.by_label == {"loss": 4 * 8 * 4 + 4 * 8 * 4, "lin": 4 * 8 * 4}
    assert report.tensors_by_label == {"loss": 2, "lin": 1}
    assert report.parameter_tensors_skipped >= 1
    w.sum().backward()


def test_gradients_unchanged_by_accounting(tiny_fp32, random_ids):
    model = copy.deepcopy(tiny_fp32)
    ids = random_ids(model)
    causal_lm_loss(model, ids, chunked=False).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with mem.SavedTensorAccounting(model):
        loss = causal_lm_loss(model, ids, chunked=False)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n]), n


def test_accounting_ignores_discarded_branches():
    x = torch.randn(64, 64, requires_grad=True)
    with mem.SavedTensorAccounting(nn.Identity()) as acc:
        _ = (x.exp() * 2).sin()  # saves tensors, then the graph is dropped
        del _
        kept = x.tanh()  # saves its output
    assert acc.report.total == 64 * 64 * 4
    kept.sum().backward()


def test_accounting_attributes_to_modules():
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    x = torch.randn(11, 5)
    with mem.SavedTensorAccounting(model, labels={model[0]: "first", model[2]: "last"}) as acc:
        out = model(x).sum()
    # first saves its input x (needed for its weight grad); ReLU (unlabelled -> outside) saves its
    # output; last saves its input, which *is* ReLU's output storage: counted once, where first saved
    assert acc.report.by_label == {"first": 11 * 5 * 4, "loss": 11 * 7 * 4}
    out.backward()


CASES = [
    # dtype, method, attn_implementation, forced SDPA backend, byte-model kernel, LoRA targets, loss
    ("fp32", "full", "sdpa", None, "cpu_flash", ("q_proj", "v_proj"), "standard"),
    ("fp32", "lora", "sdpa", None, "cpu_flash", ("q_proj", "v_proj"), "standard"),
    ("bf16", "full", "sdpa", None, "cpu_flash", ("q_proj", "v_proj"), "standard"),
    ("bf16", "lora", "sdpa", None, "cpu_flash", ("q_proj", "v_proj"), "chunked"),
    ("fp32", "full", "sdpa", SDPBackend.MATH, "math", ("q_proj", "v_proj"), "standard"),
    ("bf16", "lora", "sdpa", SDPBackend.MATH, "math", ("q_proj", "v_proj"), "standard"),
    ("fp32", "lora", "eager", None, "eager", ("q_proj", "v_proj"), "standard"),
    ("bf16", "full", "eager", None, "eager", ("q_proj", "v_proj"), "chunked"),
    ("fp32", "lora", "sdpa", None, "cpu_flash", ("o_proj", "down_proj"), "standard"),
    ("fp32", "lora", "sdpa", None, "cpu_flash", ("gate_proj",), "standard"),
    ("bf16", "lora", "sdpa", None, "cpu_flash", mem.LINEARS, "standard"),
    # bf16 adapters (add_lora's option; the default on a bf16 model is fp32 factors)
    ("bf16", "lora", "sdpa", None, "cpu_flash", mem.LINEARS, "standard", "bf16"),
    ("bf16", "lora", "sdpa", SDPBackend.MATH, "math", ("q_proj", "v_proj"), "standard", "bf16"),
    ("bf16", "lora", "sdpa", None, "cpu_flash", ("o_proj", "down_proj"), "standard", None),
]


@pytest.mark.parametrize("dtype, method, attn, backend, kernel, targets, loss, adapter_dtype",
                         [c if len(c) == 8 else (*c, None) for c in CASES])
def test_accounting_matches_byte_model_exactly(dtype, method, attn, backend, kernel, targets, loss, adapter_dtype,
                                               random_ids):
    model = lora_lab.load_model("random:tiny-qwen2", dtype=dtype, attn_implementation=attn).train()
    if method == "lora":
        lora_lab.add_lora(model, r=4, alpha=8, targets=targets, adapter_dtype=adapter_dtype)
    batch, seq = 2, 40
    ids = random_ids(model, batch, seq)
    with (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()):
        with mem.SavedTensorAccounting(model) as acc:
            out = causal_lm_loss(model, ids, chunked=(loss == "chunked"), chunk_size=16)
    setup = mem.TrainingSetup(batch=batch, seq_len=seq, dtype=dtype, method=method, lora_r=4,
                              lora_targets=tuple(targets), attention=kernel, loss=loss, adapter_dtype=adapter_dtype)
    predicted = mem.analytic_memory(mem.ModelShape.from_config(model.config), setup)
    report = acc.report
    assert report.per_layer == predicted.saved_per_layer
    assert report.by_label.get("final_norm", 0) == predicted.final_norm_saved
    assert report.by_label.get("lm_head", 0) == predicted.lm_head_saved
    assert report.by_label.get("loss", 0) == predicted.loss_saved
    assert report.by_label.get("embed", 0) == predicted.embed_saved
    out.backward()


def test_math_kernel_saves_quadratic_memory_flash_linear(random_ids):
    model = lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa").train()

    def layer_bytes(seq, backend):
        with sdpa_kernel(backend), mem.SavedTensorAccounting(model) as acc:
            out = model.model(input_ids=random_ids(model, 1, seq)).last_hidden_state  # keep the graph alive
        del out
        return acc.report.per_layer[1]

    flash = [layer_bytes(t, SDPBackend.FLASH_ATTENTION) for t in (32, 64, 128)]
    math_ = [layer_bytes(t, SDPBackend.MATH) for t in (32, 64, 128)]
    assert flash[1] == 2 * flash[0] and flash[2] == 2 * flash[1]
    # T x T softmax per head: the ratio per doubling exceeds 2 and climbs towards 4
    r1, r2 = math_[1] / math_[0], math_[2] / math_[1]
    assert 2.05 < r1 < r2 < 4


# ----------------------------------------------------------------------------- SDPA probe


def test_sdpa_probe_names_the_kernel(tiny_fp32, random_ids):
    ids = random_ids(tiny_fp32, 1, 16)
    def run():
        return tiny_fp32(input_ids=ids, labels=ids).loss.backward()

    assert mem.sdpa_kernels_used(run)["kernels"] == ["cpu_flash"]
    with sdpa_kernel(SDPBackend.MATH):
        assert mem.sdpa_kernels_used(run)["kernels"] == ["math"]
    eager = lora_lab.load_model("random:tiny-qwen2", attn_implementation="eager").train()
    assert mem.sdpa_kernels_used(lambda: eager(input_ids=ids, labels=ids).loss.backward())["kernels"] == []


# ----------------------------------------------------------------------------- byte model


def test_byte_model_reproduces_the_articles_fp32_peaks():
    shape = mem.ModelShape.from_config(lora_lab.model_config("qwen2.5-0.5b"))
    full = mem.analytic_memory(shape, mem.TrainingSetup(4, 512, "fp32", "full", attention="math"))
    lora = mem.analytic_memory(shape, mem.TrainingSetup(4, 512, "fp32", "lora", attention="math"))
    # article: 15.56 and 10.31 GiB measured; fixed part after backward 7.40 and 1.87 GiB
    assert abs(full.peak / mem.GIB - 15.56) < 0.2 and abs(lora.peak / mem.GIB - 10.31) < 0.2
    assert abs((full.weights + full.gradients + full.optimizer_states) / mem.GIB - 7.36) < 0.01


def test_byte_model_phases_and_chunked_loss():
    shape = mem.ModelShape.from_config(lora_lab.model_config("qwen2.5-0.5b"))
    std = mem.analytic_memory(shape, mem.TrainingSetup(4, 4096, "bf16", "lora", checkpointing=True))
    chk = mem.analytic_memory(shape, mem.TrainingSetup(4, 4096, "bf16", "lora", checkpointing=True, loss="chunked"))
    assert std.peak_phase == "loss_backward"
    assert std.head_loss >= 3 * 4 * 4 * 4096 * shape.vocab_size  # 12 bytes per token x vocab
    assert chk.peak < std.peak / 5
    assert chk.body_held == std.body_held - 4 * 4096 * shape.hidden_size * 2 + 4 * 4096 * shape.hidden_size * 2
    bars = chk.bars()
    assert abs(sum(bars.values()) - chk.peak / mem.GIB) < 1e-9


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="qlora"), "method"), (dict(attention="flash3"), "attention"),
    (dict(loss="liger"), "loss"), (dict(batch=0), "batch"), (dict(dtype="int8"), "dtype"),
])
def test_byte_model_rejects_bad_setup(kwargs, match):
    args = dict(batch=1, seq_len=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        mem.TrainingSetup(**args)


# ----------------------------------------------------------------------------- peaks and the sweep


def test_peak_memory_needs_cuda(tiny_fp32, random_ids):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mem.peak_memory(tiny_fp32, random_ids(tiny_fp32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_accounting_matches_byte_model_on_cuda(dtype):
    # the CUDA kernels' saved tensors (flash / efficient / math, whichever runs) as the byte model has them
    model = lora_lab.load_model("random:tiny-qwen2", dtype=dtype, device="cuda", attn_implementation="sdpa").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    kernel = mb.byte_model_kernel(
        mem.sdpa_kernels_used(lambda: model(input_ids=ids, labels=ids).loss.backward())["kernels"])
    with mem.SavedTensorAccounting(model) as acc:
        out = causal_lm_loss(model, ids, chunked=False)
    predicted = mem.analytic_memory(mem.ModelShape.from_config(model.config),
                                    mem.TrainingSetup(2, 64, dtype, "full", attention=kernel))
    for got, want in zip(acc.report.per_layer, predicted.saved_per_layer):
        assert abs(got - want) <= 0.01 * want, (kernel, got, want)
    out.backward()


def test_saved_bytes_excluding_counts_each_storage_once_and_skips_the_excluded():
    from lora_lab.memory import saved_bytes_excluding

    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    # linear saves x and its weight (excluded); relu saves its output (3 x 4 fp32); the view adds nothing new
    got = saved_bytes_excluding(lambda: torch.relu(lin(x)).view(12).exp(), [x, *lin.parameters()])
    assert got == 3 * 4 * 4 + 12 * 4  # relu output + exp output
    assert saved_bytes_excluding(lambda: torch.relu(lin(x)), []) == 3 * 8 * 4 + 4 * 8 * 4 + 3 * 4 * 4  # x, W, relu out


def test_byte_model_fused_loss_holds_no_logits():
    from lora_lab.memory.byte_model import ModelShape, TrainingSetup, analytic_memory
    from lora_lab.models import model_config

    shape = ModelShape.from_config(model_config("random:qwen2.5-0.5b"))
    runs = {loss: analytic_memory(shape, TrainingSetup(batch=4, seq_len=4096, method="lora", checkpointing=True,
                                                       loss=loss)) for loss in ("standard", "chunked", "fused")}
    for phase in ("forward", "loss_backward"):
        assert runs["fused"].phases[phase] < runs["chunked"].phases[phase] < runs["standard"].phases[phase]
    n, d = 4 * 4096, shape.hidden_size
    # backward of the loss: dH (bf16) and its fp32 row-chunk accumulator above what the forward left
    extra = runs["fused"].phases["loss_backward"] - (runs["fused"].fixed + runs["fused"].body_held)
    assert extra == n * 4 + n * d * 2 + n * d * 2 + 512 * d * 4
    full = analytic_memory(shape, TrainingSetup(batch=1, seq_len=1024, loss="fused"))
    assert full.phases["loss_backward"] > full.phases["forward"]  # dW, its slab and the fp32 dH when it trains
