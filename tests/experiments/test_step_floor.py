"""lora_lab.experiments.step_floor: the FLOP count of a LoRA step equals what torch's FlopCounterMode counts in a
real PEFT step on tiny models (eager attention and experts, whose products are plain matmuls), with and without
gradient checkpointing; the floor's arithmetic and its errors."""
import pytest
import torch

from lora_lab.experiments import step_floor

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROPE = 2 * 8 * 12  # the rotary embedding's frequency product (head_dim / 2 × seq), outside the count


def counted(cfg, targets, checkpointing, batch=2, seq=12, rank=4):
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    cfg.tie_word_embeddings, cfg.use_cache = False, False
    extra = {"experts_implementation": "eager"} if getattr(cfg, "num_experts", 0) else {}
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **extra)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=8, target_modules=targets,
                                                       lora_dropout=0.0))
    model.enable_input_require_grads()  # every layer's input gradient, as the count assumes
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


LLAMA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=128, num_hidden_layers=2)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_llama_step_matches_the_flop_counter(checkpointing):
    cfg = transformers.LlamaConfig(**LLAMA)
    got = counted(cfg, ATTN + ["gate_proj", "up_proj", "down_proj"], checkpointing)
    flops = step_floor.step_flops(step_floor.shape_of(cfg), 2, 12, rank=4, checkpointing=checkpointing,
                                  causal=False, attention_backward=2.0)
    # non-reentrant checkpointing stops recomputing once every saved tensor is back: the layer's last product, the
    # down projection's P Bᵀ (2·r·d per token), is never re-run
    skipped = 2 * cfg.num_hidden_layers * 4 * cfg.hidden_size * 24 if checkpointing else 0
    assert got - ROPE == flops["total"] - skipped


def test_moe_step_matches_the_flop_counter():
    cfg = transformers.Qwen3MoeConfig(**dict(LLAMA, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=True))
    got = counted(cfg, ATTN, False)  # adapters on attention: PEFT's expert adapters build the weight delta instead
    shape = step_floor.shape_of(cfg)
    assert (shape.experts, shape.top_k, shape.expert_intermediate, shape.intermediate) == (4, 2, 24, 0)
    flops = step_floor.step_flops(shape, 2, 12, rank=4, causal=False, attention_backward=2.0, lora_experts=False)
    assert flops["experts"] > 0 and flops["router"] > 0
    assert got - ROPE == flops["total"]


def test_parts_scale_as_stated():
    shape = step_floor.StepShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                                 vocab=128256)
    off = step_floor.step_flops(shape, 4, 4096)
    on = step_floor.step_flops(shape, 4, 4096, checkpointing=True)
    assert on["projections"] == pytest.approx(off["projections"] * 6 / 4)  # the forward again
    assert on["head"] == off["head"]  # the head is never recomputed
    full = step_floor.step_flops(shape, 4, 4096, causal=False)
    assert full["attention"] == pytest.approx(2 * off["attention"])
    # Llama-3-8B's projections: 6.98e9 parameters outside the embeddings and head, 4 FLOPs each per token
    assert off["projections"] / (4 * 4 * 4096) == pytest.approx(6.98e9, rel=1e-3)
    assert step_floor.floor_ms(790e12, 790.0) == pytest.approx(1000.0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="rate must be positive"):
        step_floor.floor_ms(1.0, 0.0)
    with pytest.raises(ValueError, match="batch and seq"):
        step_floor.step_flops(step_floor.StepShape(1, 8, 8, 1, 1, 8, 8), 0, 4)
    with pytest.raises(ValueError, match="lacks hidden_size"):
        step_floor.shape_of(object())
    mixed = transformers.Qwen3MoeConfig(**dict(LLAMA, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                               decoder_sparse_step=2))
    with pytest.raises(ValueError, match="dense MLP among the MoE layers"):
        step_floor.shape_of(mixed)
