"""tools/loss_dw_accumulation.py: its plain-torch model of the op's dW arithmetic gives the op's own errors where both
run on a CPU (fp16: the interpreter rounds to nearest there), per accumulation mode, over several chunks; the reason
the model exists (Triton's interpreter truncates fp32 to bf16 on store) holds; and bf16 on a CPU through the op is
refused with that reason."""

import pytest
import torch
import triton
import triton.language as tl

from lora_lab.experiments.loss_block import loss_inputs
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("loss_dw_accumulation")


@pytest.mark.parametrize("mode", ["upcast", "partial", "input_dtype"])
def test_the_model_is_the_op_in_fp16(tool, mode):
    h, w, y = loss_inputs(3 * 32 + 7, 24, 300, torch.float16, DEVICE, weight_scale=0.1, ignored=(5,))
    ref = tool.reference_dw(h, w, y)
    op, model = tool.op_dw(h, w, y, 32, mode), tool.model_dw(h, w, y, 32, mode)
    # the same roundings in the same places: the two errors agree far closer than either is to the reference
    assert abs(rel_l2(op, ref) - rel_l2(model, ref)) <= 0.05 * rel_l2(op, ref)
    assert rel_l2(model, op) <= 0.1 * rel_l2(op, ref)


def test_accumulating_in_the_input_dtype_costs_accuracy_over_chunks(tool):
    h, w, y = loss_inputs(8 * 64, 32, 512, torch.bfloat16, DEVICE, weight_scale=0.1, ignored=())
    ref = tool.reference_dw(h, w, y)
    one = {m: rel_l2(tool.model_dw(h, w, y, 8 * 64, m), ref) for m in ("upcast", "input_dtype")}
    eight = {m: rel_l2(tool.model_dw(h, w, y, 64, m), ref) for m in ("upcast", "input_dtype")}
    assert one["upcast"] == one["input_dtype"]  # one chunk: the same single rounding
    assert abs(eight["upcast"] - one["upcast"]) <= 0.05 * one["upcast"]  # an fp32 sum: the chunk count is free
    assert eight["input_dtype"] > 1.2 * eight["upcast"]  # eight roundings of the running sum


def test_the_interpreter_truncates_to_bf16():
    if DEVICE != "cpu":
        pytest.skip("a property of Triton's CPU interpreter")

    @triton.jit
    def cast(x, y, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(y + o, tl.load(x + o, mask=o < n).to(tl.bfloat16), mask=o < n)

    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    y = torch.empty(512, dtype=torch.bfloat16)
    cast[(1,)](x, y, 512, BLOCK=512)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    # if this fails, the interpreter rounds now: the tool's refusal of bf16 through the op on a CPU (and the CPU
    # bf16 tolerances elsewhere) can be revisited
    assert torch.equal(y, truncated), f"triton {triton.__version__}'s interpreter no longer truncates to bf16"
    assert rel_l2(y, x) > 1.5 * rel_l2(x.to(torch.bfloat16), x)


def test_bf16_through_the_op_on_a_cpu_is_refused(tool):
    if DEVICE != "cpu":
        pytest.skip("CPU only")
    h, w, y = loss_inputs(16, 8, 32, torch.bfloat16, "cpu", ignored=())
    with pytest.raises(ValueError, match="truncates fp32 to bf16"):
        tool.op_dw(h, w, y, 8, "upcast")
    with pytest.raises(SystemExit):
        tool.main(["--sources", "op", "--dtype", "bf16", "--chunks", "1"])


def test_main_writes_its_table(tool, tmp_path):
    assert tool.main(["--chunks", "1", "2", "--rows", "16", "--hidden", "8", "--vocab", "40",
                      "--sources", "model", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "dw_accumulation.md").read_text()
    assert "| 2 | 32 |" in text and "input_dtype" in text
    assert len((tmp_path / "dw_accumulation.csv").read_text().splitlines()) == 1 + 2 * 3
