"""LoRA on embeddings, modules_to_save and the base weights PEFT saves beside them: both ways against PEFT, exact."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

import lora_lab
from lora_lab import AdapterError, add_lora, load_adapter, merge_lora, remove_lora, save_adapter
from lora_lab.embedding_lora import LoRAEmbedding
from lora_lab.modules_to_save import TrainedCopy

peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = [pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
              pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning")]

# (target_modules, modules_to_save): the tiny Qwen2 ties lm_head to embed_tokens
CASES = [
    (["embed_tokens", "q_proj"], None),
    (["lm_head"], None),
    (["q_proj"], ["lm_head"]),
    (["q_proj"], ["embed_tokens"]),
    (["embed_tokens", "v_proj"], ["lm_head"]),
]


def _ids():
    return torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(0))


def _perturb(model, seed):
    """Move every trainable tensor (LoRA factors, trained copies) off its start, the same way in PEFT and here."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))


def _peft_saved(path, targets, modules_to_save, seed=1, dtype="fp32", **save_kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about the tied embeddings
        pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2", dtype=dtype),
                                 peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 modules_to_save=modules_to_save))
        _perturb(pm, seed)
        pm.save_pretrained(str(path), **save_kwargs)
    return pm


def _keys(path):
    return sorted(safetensors_torch.load_file(str(path / "adapter_model.safetensors")))


def _untied_model():
    from transformers import AutoModelForCausalLM

    config = lora_lab.model_config("random:tiny-qwen2")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("targets, modules_to_save", CASES)
def test_peft_to_ours_exact(tmp_path, targets, modules_to_save):
    pm = _peft_saved(tmp_path, targets, modules_to_save)
    if "embed_tokens" in targets or "lm_head" in targets:  # PEFT's default save holds the base weight
        assert any(k.endswith(".base_layer.weight") for k in _keys(tmp_path))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    if "embed_tokens" in targets:
        assert isinstance(ours.model.embed_tokens, LoRAEmbedding)
    if modules_to_save:
        assert isinstance(ours.get_submodule(dict(lm_head="lm_head").get(modules_to_save[0], "model.embed_tokens")),
                          TrainedCopy)
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)


@pytest.mark.parametrize("targets, modules_to_save", CASES)
def test_ours_to_peft_exact_with_peft_keys(tmp_path, targets, modules_to_save):
    _peft_saved(tmp_path / "peft", targets, modules_to_save)
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=targets,
                    modules_to_save=modules_to_save)
    _perturb(ours, 7)
    save_adapter(ours, tmp_path / "ours")
    assert _keys(tmp_path / "ours") == _keys(tmp_path / "peft")
    cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == modules_to_save
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)


def test_fresh_embedding_lora_draws_peft_init(tmp_path):
    """A zero, B ~ N(0, 1) (reversed from a linear layer), drawn from torch's generator as PEFT draws them."""
    for init in (True, False):
        a, b = lora_lab.load_model("random:tiny-qwen2"), lora_lab.load_model("random:tiny-qwen2")
        torch.manual_seed(5)
        pm = peft.get_peft_model(a, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"],
                                                    init_lora_weights=init))
        torch.manual_seed(5)
        ours = add_lora(b, r=4, alpha=8, targets=["embed_tokens"], init_lora_weights=init)
        theirs, mine = pm.base_model.model.model.embed_tokens, ours.model.embed_tokens
        assert torch.equal(theirs.lora_embedding_A["default"], mine.lora_embedding_A)
        assert torch.equal(theirs.lora_embedding_B["default"], mine.lora_embedding_B)
        assert bool(torch.count_nonzero(mine.lora_embedding_A)) == (init is False)
        with torch.no_grad():
            assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)


def test_merge_matches_peft_on_untied_model_and_remove_gives_the_base_back(tmp_path):
    base_logits = _untied_model()(_ids()).logits.detach()
    pm = peft.get_peft_model(_untied_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens",
                                                               "q_proj"], modules_to_save=["lm_head"]))
    _perturb(pm, 3)
    pm.save_pretrained(str(tmp_path))
    ours = load_adapter(_untied_model(), tmp_path)
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, pm(_ids()).logits)
        merged_peft = pm.merge_and_unload()(_ids()).logits
        merged = merge_lora(ours)
        assert torch.equal(merged(_ids()).logits, merged_peft)
    assert type(merged.model.embed_tokens) is nn.Embedding and type(merged.lm_head) is nn.Linear
    assert not lora_lab.adapter_layers(merged)
    again = add_lora(_untied_model(), r=4, alpha=8, targets=["embed_tokens"], modules_to_save=["lm_head"])
    _perturb(again, 4)
    remove_lora(again)
    assert type(again.lm_head) is nn.Linear and type(again.model.embed_tokens) is nn.Embedding
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, base_logits)


def test_merge_on_tied_embeddings_keeps_what_the_model_computes():
    """PEFT merges into the shared weight in place (and warns): the tied head moves too. merge_lora gives each
    merged layer its own weight, so the merged model computes what the adapted one does."""
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["embed_tokens", "lm_head"])
    _perturb(ours, 2)
    with torch.no_grad():
        before = ours(_ids()).logits
        after = merge_lora(ours)(_ids()).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_a_saved_base_weight_is_checked_and_loaded_as_peft_does(tmp_path):
    _peft_saved(tmp_path, ["lm_head"], None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal base weight: nothing to say
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    other = lora_lab.load_model("random:tiny-qwen2", seed=1)  # another base: the file's weight replaces its own
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2", seed=1), str(tmp_path))
    with pytest.warns(UserWarning, match=r"base_model\.model\.lm_head\.base_layer\.weight.*loaded into the model"):
        ours = load_adapter(other, tmp_path)
    saved = safetensors_torch.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert torch.equal(ours.lm_head.base.weight, saved["base_model.model.lm_head.base_layer.weight"])
    assert ours.model.embed_tokens.weight is ours.lm_head.base.weight  # still tied, as in PEFT
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)


def test_whole_embedding_layers_saved_by_peft_load(tmp_path):
    """save_embedding_layers=True on untargeted embeddings writes them whole under their own keys."""
    pm = _peft_saved(tmp_path, ["q_proj"], None, save_embedding_layers=True)
    assert "base_model.model.model.embed_tokens.weight" in _keys(tmp_path)
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)
    save_adapter(ours, tmp_path / "ours", save_embedding_layers=True)
    assert _keys(tmp_path / "ours") == _keys(tmp_path)


def test_save_embedding_layers_false_leaves_the_base_weight_out(tmp_path):
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["embed_tokens"])
    _perturb(ours, 1)
    save_adapter(ours, tmp_path, save_embedding_layers=False)
    assert _keys(tmp_path) == ["base_model.model.model.embed_tokens.lora_embedding_A",
                               "base_model.model.model.embed_tokens.lora_embedding_B"]
    back = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, ours(_ids()).logits)
    with pytest.raises(ValueError, match="save_embedding_layers"):
        save_adapter(ours, tmp_path / "x", save_embedding_layers="yes")


def test_trained_copy_trains_alone_and_leaves_the_tied_embedding():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["q_proj"],
                     modules_to_save=["lm_head"])
    embed = model.model.embed_tokens.weight.detach().clone()
    head = model.lm_head
    assert head.trained.weight.requires_grad and not head.base.weight.requires_grad
    assert head.trained.weight is not model.model.embed_tokens.weight
    assert head.weight is head.trained.weight  # attributes read through to the copy, as in PEFT
    assert isinstance(copy.deepcopy(model).lm_head, TrainedCopy)
    model(_ids()).logits.sum().backward()
    assert head.trained.weight.grad is not None and model.model.embed_tokens.weight.grad is None
    assert torch.equal(model.model.embed_tokens.weight, embed)
    counts = lora_lab.count_parameters(model)
    assert counts.trainable == 512 * 64 + sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(targets=["q_proj"], modules_to_save=["no_such_head"]), r"'no_such_head' matches no module"),
    (dict(targets=["lm_head"], modules_to_save=["lm_head"]), r"lm_head.*trained in full or given LoRA"),
    (dict(targets=["q_proj"], modules_to_save=["self_attn"]), r"self_attn.*adapter layer"),
    (dict(targets=["q_proj"], modules_to_save=[3]), r"non-empty module names"),
    (dict(targets=["embed_tokens"], use_dora=True), r"embed_tokens is a Embedding, not an nn.Linear"),
    (dict(targets=["embed_tokens"], init_lora_weights="pissa"), r"embed_tokens is an nn.Embedding"),
    (dict(targets=["embed_tokens"], lora_fa=True), r"embed_tokens is an nn.Embedding"),
])
def test_bad_embedding_or_modules_to_save_requests_are_refused_up_front(kwargs, problem):
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises((ValueError, TypeError), match=problem):
        add_lora(model, r=4, alpha=8, **kwargs)
    assert not lora_lab.adapter_layers(model)


def test_a_second_modules_to_save_request_on_the_same_module_is_refused():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="already"):
        add_lora(model, targets=["v_proj"], modules_to_save=["lm_head"])


def test_loading_into_a_model_that_already_has_the_layers(tmp_path):
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["embed_tokens", "q_proj"],
                 modules_to_save=["lm_head"])
    _perturb(a, 5)
    save_adapter(a, tmp_path)
    b = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["embed_tokens", "q_proj"],
                 modules_to_save=["lm_head"])
    load_adapter(b, tmp_path)
    with torch.no_grad():
        assert torch.equal(a(_ids()).logits, b(_ids()).logits)
    c = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=["embed_tokens", "q_proj"])
    load_adapter(c, tmp_path)  # the trained copy is added, as PEFT adds it
    with torch.no_grad():
        assert torch.equal(a(_ids()).logits, c(_ids()).logits)
    remove_lora(a)
    add_lora(a, r=4, alpha=8, targets=["embed_tokens", "q_proj"])
    save_adapter(a, tmp_path / "plain")
    with pytest.raises(AdapterError, match="lm_head is in the model's modules_to_save, but the adapter has none"):
        load_adapter(b, tmp_path / "plain")


def test_a_modules_to_save_file_missing_a_tensor_is_refused(tmp_path):
    _peft_saved(tmp_path, ["q_proj"], ["lm_head"])
    f = tmp_path / "adapter_model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    del sd["base_model.model.lm_head.weight"]
    safetensors_torch.save_file(sd, str(f))
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=r"no base_model\.model\.lm_head\.weight for modules_to_save"):
        load_adapter(model, tmp_path)
    assert not lora_lab.adapter_layers(model)


def test_bf16_embedding_lora_and_modules_to_save_load_exactly(tmp_path):
    pm = _peft_saved(tmp_path, ["embed_tokens", "q_proj"], ["lm_head"], dtype="bf16")
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), tmp_path)
    assert ours.model.embed_tokens.lora_embedding_A.dtype == torch.float32  # PEFT's autocast_adapter_dtype
    assert ours.lm_head.trained.weight.dtype == torch.bfloat16  # a copy of the module, in its dtype
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)


def test_adapter_dtype_saved_reloads_a_bf16_adapter_as_it_was(tmp_path):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), targets=["q_proj", "embed_tokens"],
                     adapter_dtype="bf16")
    _perturb(model, 6)
    save_adapter(model, tmp_path)
    default = load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), tmp_path)
    assert default.model.layers[0].self_attn.q_proj.lora_A.dtype == torch.float32  # PEFT's default: fp32
    kept = load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), tmp_path, adapter_dtype="saved")
    assert kept.model.layers[0].self_attn.q_proj.lora_A.dtype == torch.bfloat16
    assert kept.model.embed_tokens.lora_embedding_B.dtype == torch.bfloat16
    with torch.no_grad():
        want = model(_ids()).logits
        assert torch.equal(kept(_ids()).logits, want)
        assert not torch.equal(default(_ids()).logits, want)  # the fp32 reload computes something else
    forced = load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), tmp_path, adapter_dtype="bf16")
    with torch.no_grad():
        assert torch.equal(forced(_ids()).logits, want)
    with pytest.raises(ValueError, match="adapter_dtype"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path, adapter_dtype="int8")
    with pytest.raises(AdapterError, match="adapter_dtype.*already carries LoRA"):
        load_adapter(kept, tmp_path, adapter_dtype="saved")


class _ScaledEmbedding(nn.Embedding):
    """An embedding that scales its output, as Gemma's word embeddings do."""

    def __init__(self, *args, scale=3.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.embed_scale.to(self.weight.dtype)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = _ScaledEmbedding(40, 8, padding_idx=0)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.embed(x))


def test_scaled_embedding_matches_peft_and_merge_keeps_its_class():
    x = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    pm = peft.get_peft_model(_Toy(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed"],
                                                      modules_to_save=["head"]))
    ours = add_lora(_Toy(), r=2, alpha=4, targets=["embed"], modules_to_save=["head"])
    _perturb(pm, 9)
    _perturb(ours, 9)
    with torch.no_grad():
        assert torch.equal(pm(x), ours(x))
        merged = merge_lora(ours)
        assert type(merged.embed) is _ScaledEmbedding and merged.embed.padding_idx == 0
        torch.testing.assert_close(merged(x), pm(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(merged(x), pm.merge_and_unload()(x))


def test_sharded_save_refuses_embedding_lora_and_modules_to_save_by_name(tmp_path):
    from lora_lab.distributed.adapters import save_sharded_adapter

    for kwargs, name in ((dict(targets=["embed_tokens"]), "model.embed_tokens is a LoRAEmbedding"),
                         (dict(targets=["q_proj"], modules_to_save=["lm_head"]), "lm_head is a TrainedCopy")):
        model = add_lora(lora_lab.load_model("random:tiny-qwen2"), **kwargs)
        with pytest.raises(AdapterError, match=name):
            save_sharded_adapter(model, tmp_path / "a")


def test_rslora_rank_pattern_and_dropout_on_embeddings_both_ways(tmp_path):
    cfg = dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], use_rslora=True, lora_dropout=0.1,
               rank_pattern={"embed_tokens": 2}, alpha_pattern={"embed_tokens": 5})
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(**cfg))
    _perturb(pm, 11)
    pm.save_pretrained(str(tmp_path / "peft"))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "peft")
    emb = ours.model.embed_tokens
    assert (emb.r, emb.alpha, emb.scaling) == (2, 5, 5 / 2 ** 0.5)
    ours.train()  # PEFT applies no dropout to an embedding's branch: the embedding output stays deterministic
    ids = _ids()
    assert torch.equal(emb(ids), emb(ids))
    ours.eval()
    pm.eval()
    with torch.no_grad():
        assert torch.equal(pm(ids).logits, ours(ids).logits)
    save_adapter(ours, tmp_path / "ours")
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


@pytest.mark.parametrize("field, value", [("ensure_weight_tying", True), ("trainable_token_indices", [1, 2])])
def test_tying_and_token_fields_are_refused_by_name(tmp_path, field, value):
    _peft_saved(tmp_path, ["embed_tokens"], None)
    cfg_file = tmp_path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[field] = value
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=rf"adapter uses {field}="):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


def _classifier():
    from transformers import AutoModelForSequenceClassification

    config = lora_lab.model_config("random:tiny-qwen2")
    config.num_labels, config.pad_token_id = 3, 0
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config).eval()


def test_sequence_classification_head_saved_by_peft_loads_and_goes_back(tmp_path):
    """task_type SEQ_CLS: PEFT adds its head names ("classifier", "score") to modules_to_save; the one the model has
    is trained in full and saved as base_model.model.score.weight."""
    pm = peft.get_peft_model(_classifier(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             task_type="SEQ_CLS"))
    _perturb(pm, 12)
    pm.save_pretrained(str(tmp_path / "peft"))
    assert "base_model.model.score.weight" in _keys(tmp_path / "peft")
    ours = load_adapter(_classifier(), tmp_path / "peft")
    assert isinstance(ours.score, TrainedCopy) and ours.score.trained.weight.requires_grad
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)
    save_adapter(ours, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    theirs = peft.PeftModel.from_pretrained(_classifier(), str(tmp_path / "ours"))
    with torch.no_grad():
        assert torch.equal(theirs(_ids()).logits, ours(_ids()).logits)
