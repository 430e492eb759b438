"""The model shapes the benchmarks share, built with random weights: the Qwen3 shape of 180M parameters
with the real vocabulary (the CPU benchmarks), a small one (sequence parallelism), Qwen2.5-1.5B's (CUDA)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import REPO, repo_env

SHAPES = {
    "qwen3-180m": {
        "arch": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "tie_word_embeddings": False,
        "dtype": "float32",
    },
    # benchmarks/pytorch/sequence_parallel.py: small weights, so that activations decide what fits
    "qwen3-sp": {
        "arch": "qwen3",
        "vocab_size": 32000,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "dtype": "float32",
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B's config.json
        "arch": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    },
}


def parts(shape_name: str):
    """A shape's family (``lit_offpolicy.models.tiny.FAMILIES``), torch dtype and other config fields."""
    import torch

    from lit_offpolicy.models.tiny import FAMILIES

    shape = dict(SHAPES[shape_name])
    return FAMILIES[shape.pop("arch")], getattr(torch, shape.pop("dtype")), shape


def build_model(path: str, shape_name: str, seed: int = 0) -> None:
    """Write ``SHAPES[shape_name]`` with random weights (in its dtype) and the family's tiny BPE tokenizer
    (its ids are a prefix of the vocabulary; the batch is made of ids, not text)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_offpolicy.models.tiny import build_bpe_tokenizer

    family, dtype, shape = parts(shape_name)
    tokenizer = build_bpe_tokenizer(family)
    config = family.config_class(
        **shape,
        max_position_embeddings=131072,  # room for memory_vs_trl's --find-max
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def build_in_child(path: str, shape_name: str) -> None:
    """``build_model`` in a child process, so that this one never holds the weights."""
    code = f"from benchmarks.shapes import build_model; build_model({path!r}, {shape_name!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=repo_env())
