"""Tiny random-initialized models of the Qwen2, Qwen3 and Mistral families, with a byte-level BPE tokenizer.

Tests (and users trying the trainer on another architecture) need the real model classes of each
family, their tokenizer conventions and a chat template, offline. :func:`write_family_model` writes
one: a ~0.5M-parameter model of the family's transformers class, and a byte-level BPE tokenizer
trained on the fly (the ``tokenizers`` library) on text generated here (arithmetic problems and a
few sentences), with the family's special tokens and a Jinja chat template. The built-in Llama with
its character tokenizer (``lit_offpolicy.models.create_tiny_model``, ``arch="llama"``) is the demo's
model and is written there, unchanged.

Each family keeps what sets it apart in transformers and vLLM alike: Qwen2 has biases on the q/k/v
projections and tied embeddings, Qwen3 q/k RMS norms, an explicit head size and tied embeddings,
Mistral untied embeddings and a Mistral-style ``[INST]`` template. All use grouped-query attention
(4 query heads, 2 key/value heads of size 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from lit_offpolicy.core.files import give_default_mode

VOCAB_SIZE = 384  # 256 bytes, the special tokens and about a hundred merges: a multiple of 64
MAX_LENGTH = 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral's turns: the assistant's answer follows [/INST] directly, so a conversation that ends with
# a user turn already ends with the generation prompt; add_generation_prompt adds nothing.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    """How one family's tiny model and tokenizer are written."""

    config_class: type[PretrainedConfig]
    """The transformers config of the family."""
    pad: str
    """The padding token."""
    eos: str
    """The end-of-sequence token (also what ends an assistant turn)."""
    bos: str | None
    """Prepended by the tokenizer (``add_special_tokens=True``) and by the chat template; None: none."""
    chat_template: str
    """The tokenizer's Jinja chat template."""
    extra_special: tuple[str, ...] = ()
    """Further special tokens (the chat template's markers)."""
    config_options: dict = field(default_factory=dict)
    """Config arguments beyond the shared tiny sizes."""


FAMILIES = {
    "qwen2": Family(
        Qwen2Config,
        pad="<|endoftext|>",
        eos="<|im_end|>",
        bos=None,
        chat_template=CHATML_TEMPLATE,
        extra_special=("<|im_start|>",),
        config_options={"tie_word_embeddings": True},  # Qwen2's q/k/v biases come with the class
    ),
    "qwen3": Family(
        Qwen3Config,
        pad="<|endoftext|>",
        eos="<|im_end|>",
        bos=None,
        chat_template=CHATML_TEMPLATE,
        extra_special=("<|im_start|>",),
        config_options={"tie_word_embeddings": True, "head_dim": 32},  # q/k norms come with the class
    ),
    "mistral": Family(
        MistralConfig,
        pad="<pad>",
        eos="</s>",
        bos="<s>",
        chat_template=MISTRAL_TEMPLATE,
        extra_special=("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        config_options={"tie_word_embeddings": False, "sliding_window": None, "head_dim": 32},
    ),
}


def training_text() -> list[str]:
    """The tokenizer's training corpus, made here: additions with their answers, a few sentences, the
    role names of the chat templates and the ``\\boxed{}`` of math answers."""
    problems = [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "What is the sum of these two numbers? The answer is \\boxed{42}.",
        "A language model learns to answer questions from rewards.",
        "Please add the numbers and write only the result.",
        "system user assistant",
    ]
    return problems + sentences * 4


def build_bpe_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` tokens trained on :func:`training_text`.

    Digits are split one per token before the byte-level step (as Qwen and Llama 3 do), so numbers
    never merge into multi-digit tokens. Special tokens come first: the pad token has id 0.
    """
    specials = [family.pad, *([family.bos] if family.bos else []), family.eos, *family.extra_special]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the BPE tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    if family.bos:
        bos_id = tokenizer.token_to_id(family.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A $B", special_tokens=[(family.bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=family.pad,
        eos_token=family.eos,
        bos_token=family.bos,
        additional_special_tokens=list(family.extra_special),
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_LENGTH,
    )


def family_config(family: Family, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The family's config at tiny size: 2 layers of width 128, 4 query and 2 key/value heads."""
    return family.config_class(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **family.config_options,
    )


def write_family_model(path: Path, seed: int, arch: str) -> Path:
    """Write a freshly initialized tiny model of ``arch`` (a key of ``FAMILIES``) and its tokenizer."""
    family = FAMILIES[arch]
    tokenizer = build_bpe_tokenizer(family)
    config = family_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    give_default_mode(path)
    return path
