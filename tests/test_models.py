import json
import os

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


def test_hub_id_fails_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    """Offline, an uncached hub id is refused after the cache lookup: transformers is never asked to download
    (which would sit through huggingface_hub's retries)."""
    import socket

    import transformers

    def no_network(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "no network in this test")

    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        return real(*args, **kwargs)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    with pytest.raises(ModelNotFoundError, match=r"not in the Hugging Face cache, and the hub cannot be reached"):
        lora_lab.load_model("lora-lab-tests/no-such-model")
    assert calls == [True]  # the cache lookup only


def test_cached_hub_model_loads_without_any_network_call(tmp_path):
    """A model in the Hugging Face cache loads without opening a connection or resolving a name: every socket
    call is recorded and refused (a fresh process: huggingface_hub reads its cache paths at import)."""
    import subprocess
    import sys

    snapshot = "0" * 40
    repo = tmp_path / "cache" / "models--lora-lab-tests--cached-tiny"
    lora_lab.load_model("random:tiny-qwen2", seed=5).save_pretrained(repo / "snapshots" / snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot)
    script = (
        "import json, socket, torch\n"
        "calls = []\n"
        "def refuse(what):\n"
        "    def call(*args, **kwargs):\n"
        "        calls.append(what)\n"
        "        raise OSError(f'{what}: no network in this test')\n"
        "    return call\n"
        "socket.getaddrinfo = refuse('getaddrinfo')\n"
        "socket.create_connection = refuse('create_connection')\n"
        "socket.socket.connect = refuse('connect')\n"
        "import lora_lab\n"
        "model = lora_lab.load_model('lora-lab-tests/cached-tiny')\n"
        "ref = lora_lab.load_model('random:tiny-qwen2', seed=5)\n"
        "ids = torch.randint(3, 500, (1, 7))\n"
        "with torch.no_grad():\n"
        "    same = torch.equal(model(ids).logits, ref(ids).logits)\n"
        "print(json.dumps({'same': same, 'calls': calls}))\n"
    )
    # a fresh HF_HOME: no agent registry cached there from an earlier run (fetching it is one of the calls)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"same": True, "calls": []}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.complex64, "int8", 16])
def test_unsupported_dtype_is_refused_up_front(dtype):
    with pytest.raises(ValueError, match=r"unsupported dtype .*torch\.float32, torch\.bfloat16, torch\.float16"):
        lora_lab.load_model("random:tiny-qwen2", dtype=dtype)


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but no CUDA device is available here.*use device='cpu'"):
        lora_lab.load_model("random:tiny-qwen2", device="cuda")


def test_english_sentences_are_distinct_and_sliced_with_clear_errors():
    assert len(set(lora_lab.ENGLISH_SENTENCES)) == len(lora_lab.ENGLISH_SENTENCES) >= 48
    assert all(s.isascii() and s.strip() == s for s in lora_lab.ENGLISH_SENTENCES)
    assert lora_lab.english_sentences(3) == lora_lab.ENGLISH_SENTENCES[:3]
    assert lora_lab.english_sentences(2, start=5) == lora_lab.ENGLISH_SENTENCES[5:7]
    total = len(lora_lab.ENGLISH_SENTENCES)
    with pytest.raises(ValueError, match=f"holds {total}"):
        lora_lab.english_sentences(total + 1)
    with pytest.raises(ValueError, match="positive integer"):
        lora_lab.english_sentences(0)
    with pytest.raises(ValueError, match="non-negative"):
        lora_lab.english_sentences(1, start=-1)
    batch = lora_lab.text_batch(lora_lab.ByteTokenizer(), lora_lab.english_sentences(4))
    assert batch["input_ids"].shape[0] == 4 and bool((batch["labels"][batch["attention_mask"] == 0] == -100).all())
    with pytest.raises(ValueError, match=r"text_batch: the list of sentences \(texts\) is empty"):
        lora_lab.text_batch(lora_lab.ByteTokenizer(), [])


def test_english_sentences_begin_with_distinct_words():
    # a shared first word would give two different next tokens after the same context: a loss floor that
    # keeps the batch from being memorised
    first = [s.split()[0].lower() for s in lora_lab.ENGLISH_SENTENCES]
    assert len(set(first)) == len(first), sorted(w for w in first if first.count(w) > 1)
