"""Models: loading actor, critic, reference and tokenizer from a local Hugging Face directory
(``loading.py``), the built-in tiny models (``tiny.py``) and LoRA (``lora.py``)."""

from lit_offpolicy.models.loading import (
    ATTN_IMPLEMENTATIONS,
    SPECIAL_TOKENS,
    TINY_ARCHS,
    Critic,
    build_tokenizer,
    check_attn_implementation,
    create_tiny_model,
    enable_checkpointing,
    load_actor,
    load_critic,
    load_reference,
    load_tokenizer,
    require_model_dir,
    tiny_llama_config,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "Critic",
    "build_tokenizer",
    "check_attn_implementation",
    "create_tiny_model",
    "enable_checkpointing",
    "load_actor",
    "load_critic",
    "load_reference",
    "load_tokenizer",
    "require_model_dir",
    "tiny_llama_config",
]
