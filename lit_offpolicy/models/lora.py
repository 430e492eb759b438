"""LoRA adapters on the actor through peft.

The options, the wrapped actor, and the merged weights that the engines and the export receive.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen linear
layer W (out × in) gets a trainable low-rank update, h = W x + (α / r) · B A x with A (r × in) and
B (out × r); peft starts B at zero, so the adapted model starts as the base model. Merged, the layer
is W' = W + (α / r) · B A, a plain linear layer of the base model's shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor, nn
from transformers import PreTrainedModel

from lit_offpolicy.core.checks import check_range

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # HFExport's subfolder for peft's adapter files
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the Hugging Face model


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters on the actor's linear layers (``model.init_args.lora``; null: full fine-tuning)."""

    r: int = 8
    """Rank of each adapter (A is r × in, B is out × r)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / r) · B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in every train-mode forward of the actor (π_old's recompute
    too); 0 keeps the actor's log-probs deterministic."""
    target_modules: list[str] | str = ALL_LINEAR
    """Names of the linear layers to adapt (the last part of a module's name: q_proj, v_proj, ...), or
    "all-linear": every linear layer but the LM head."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r={self.r!r} is not a rank; allowed values: an integer ≥ 1")
        check_range("lora.alpha", self.alpha, low=0.0, low_inclusive=False)
        check_range("lora.dropout", self.dropout, low=0.0, high=1.0, high_inclusive=False)
        names = self.target_modules
        if isinstance(names, str) and names != ALL_LINEAR or not isinstance(names, str) and not names:
            raise ValueError(
                f"lora.target_modules={names!r} is not supported; allowed values: {ALL_LINEAR!r} or a "
                "non-empty list of linear layer names (q_proj, v_proj, ...)"
            )


def linear_layer_names(model: PreTrainedModel) -> list[str]:
    """The names (last part) of ``model``'s linear layers that LoRA may adapt: all but the LM head."""
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head
        }
    )


def add_lora(model: PreTrainedModel, options: LoraOptions) -> PeftModel:
    """``model`` with LoRA adapters (peft): only the adapters require grad, the base weights are frozen
    and shared (no copy). The adapters take the base model's dtype."""
    allowed = linear_layer_names(model)
    targets = allowed if options.target_modules == ALL_LINEAR else list(options.target_modules)
    unknown = [name for name in targets if name not in allowed]
    if unknown:
        raise ValueError(
            f"lora.target_modules={options.target_modules!r} names {', '.join(unknown)}, not a linear layer "
            f"of {type(model).__name__} (the LM head excluded); allowed values: {ALL_LINEAR!r} or names "
            f"among {', '.join(allowed)}"
        )
    config = LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` is an actor with LoRA adapters (``add_lora``)."""
    return isinstance(model, PeftModel)


def merged_weights(model: PeftModel, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``merge_lora`` of ``state_dict`` (``model``'s own, possibly gathered from shards) with
    ``model``'s scaling α / r."""
    return merge_lora(state_dict, lora_scaling(model))


def lora_scaling(model: PeftModel) -> float:
    """The scaling α / r of ``model``'s adapter."""
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def merge_lora(state_dict: Mapping[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """A LoRA-wrapped model's state dict as the base model's, adapters merged: W' = W + scaling · B A
    (``merge_lora_stream`` over its items)."""
    return dict(merge_lora_stream(state_dict.items(), scaling))


def merge_lora_stream(items: Iterable[tuple[str, Tensor]], scaling: float) -> Iterator[tuple[str, Tensor]]:
    """A LoRA-wrapped model's weights as the base model's, adapters merged: W' = W + scaling · B A.

    One tensor at a time: the engine sync streams them, and nothing holds a second copy of the model.

    Keys lose peft's ``base_model.model.`` prefix and ``.base_layer``; the ``lora_A``/``lora_B`` entries
    are folded into their layer's weight (computed in float32, or float64 for float64 weights, and
    cast back to the weight's dtype) and dropped. Every other tensor is passed through as it is. A
    layer's weight is yielded once its weight, A and B have all arrived (peft's state dict keeps them
    together, so one layer is held at a time); a layer still missing one of them at the end raises.
    """
    pending: dict[str, dict[str, Tensor]] = {}  # layer -> {"weight" | "A" | "B": tensor}
    for key, tensor in items:
        key = key.removeprefix(_PEFT_PREFIX)
        if ".lora_" in key:
            layer, _, rest = key.partition(".lora_")
            if rest in (f"A.{ADAPTER}.weight", f"B.{ADAPTER}.weight"):
                pending.setdefault(layer, {})[rest[0]] = tensor
                yield from _take_merged(pending, layer, scaling)
            continue
        layer, found, leaf = key.partition(".base_layer.")
        if found and leaf == "weight":
            pending.setdefault(layer, {})["weight"] = tensor
            yield from _take_merged(pending, layer, scaling)
            continue
        yield (f"{layer}.{leaf}" if found else key), tensor
    if pending:
        layer, parts = next(iter(pending.items()))
        missing = sorted({"weight", "A", "B"} - parts.keys())
        raise KeyError(f"LoRA layer {layer} lacks its {missing} among the weights")


def _take_merged(
    pending: dict[str, dict[str, Tensor]], layer: str, scaling: float
) -> Iterator[tuple[str, Tensor]]:
    parts = pending[layer]
    if parts.keys() == {"weight", "A", "B"}:
        del pending[layer]
        yield f"{layer}.weight", _merged_weight(parts["weight"], parts["A"], parts["B"], scaling)


def _merged_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    delta = lora_b.to(weight.device, dtype) @ lora_a.to(weight.device, dtype)
    return (weight.to(dtype) + scaling * delta).to(weight.dtype)
