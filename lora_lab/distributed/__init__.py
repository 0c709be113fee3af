"""LoRA on several GPUs with PyTorch's FSDP2: shard a model (:func:`shard_model`), build a big one on meta and fill
it shard by shard (:class:`MetaInit`), train with the one-process numbers (:func:`sharded_train_steps`), save and
load its adapter in PEFT's format (:func:`save_sharded_adapter`, :func:`load_sharded_adapter`), and start a job
on N processes from Python or a notebook (:func:`launch`). CPU runs use gloo; the same code runs on GPUs with NCCL.
"""
from lora_lab.distributed.adapters import gather_lora_state, load_sharded_adapter, save_sharded_adapter
from lora_lab.distributed.launch import LaunchError, launch
from lora_lab.distributed.meta_init import InitPlan, MetaInit, RandomFill, materialize_random
from lora_lab.distributed.sharding import LOSS_METHOD, decoder_layers, is_sharded, shard_model
from lora_lab.distributed.training import local_rows, sharded_train_steps, train_step

__all__ = [
    "LOSS_METHOD",
    "InitPlan",
    "LaunchError",
    "MetaInit",
    "RandomFill",
    "decoder_layers",
    "gather_lora_state",
    "is_sharded",
    "launch",
    "load_sharded_adapter",
    "local_rows",
    "materialize_random",
    "save_sharded_adapter",
    "shard_model",
    "sharded_train_steps",
    "train_step",
]
