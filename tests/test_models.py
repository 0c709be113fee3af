import pytest
import torch

import lora_lab
from lora_lab.models import ModelNotFoundError


def test_random_models_are_seeded_and_dtype_is_a_rounding():
    a = lora_lab.load_model("random:tiny-qwen2", seed=3)
    b = lora_lab.load_model("random:tiny-qwen2", seed=3)
    c = lora_lab.load_model("random:tiny-qwen2", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pa[k], pb[k]) and not torch.equal(pa[k], pc[k])
    h = lora_lab.load_model("random:tiny-qwen2", seed=3, dtype=torch.bfloat16)
    assert torch.equal(dict(h.named_parameters())[k], pa[k].to(torch.bfloat16))
    assert not a.training


def test_qwen_shape_config():
    cfg = lora_lab.model_config("random:qwen2.5-0.5b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (24, 896, 4864)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (14, 2, 151936)
    assert cfg.tie_word_embeddings


def test_unknown_random_name_lists_known():
    with pytest.raises(ModelNotFoundError, match=r"random:tiny-qwen2"):
        lora_lab.load_model("random:gpt-17")


def test_from_pretrained_local_directory(tmp_path):
    model = lora_lab.load_model("random:tiny-qwen2", seed=5)
    model.save_pretrained(tmp_path)
    again = lora_lab.load_model(str(tmp_path))
    ids = torch.randint(3, 500, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    # no tokenizer saved there: the byte-level fallback, with a warning that says so
    with pytest.warns(UserWarning, match="ByteTokenizer"):
        assert isinstance(lora_lab.load_tokenizer(str(tmp_path)), lora_lab.ByteTokenizer)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        lora_lab.load_model(str(tmp_path))


def test_offline_hub_id_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"offline.*random:qwen2\.5-0\.5b"):
        lora_lab.load_model("Qwen/Qwen2.5-0.5B-Instruct")


def test_byte_tokenizer_round_trip_and_padding():
    tok = lora_lab.load_tokenizer("random:tiny-qwen2")
    batch = tok(["hi", "안녕하세요"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape == (2, 1 + 15)
    assert batch["attention_mask"][0].sum() == 3
    assert tok.decode(batch["input_ids"][1]) == "안녕하세요"
    assert int(batch["input_ids"].max()) < lora_lab.model_config("tiny-qwen2").vocab_size


def test_deterministic_settings():
    s = lora_lab.deterministic(7)
    assert s["tf32_matmul"] is False and s["float32_matmul_precision"] == "highest"
    torch.use_deterministic_algorithms(False)
