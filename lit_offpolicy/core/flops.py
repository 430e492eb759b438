"""Model FLOPs of a step's stages against the device's peak: ``perf/tokens_per_s/<stage>`` and
``perf/mfu/<stage>`` for ``generate``, ``frozen`` (the no-grad passes) and ``update``.

Model FLOPs of one forward of a causal LM over a sequence of P prompt and R response tokens,
T = P + R, a multiply-add counted as 2 FLOPs (Kaplan et al. 2020, section 2.1; PaLM, Chowdhery et
al. 2022, appendix B, with the causal mask's T(T+1)/2 query-key pairs instead of T²):

    forward = 2·N_body·T + 2·N_head·R + 2·L·d_attn·T·(T+1)

- N_body: the weights of every matrix multiplication (each ``nn.Linear``, LoRA's included) but the
  LM head's; N_head: the LM head's, counted on the R positions whose log-probs (or samples) are used;
- the last term: L layers of attention, QKᵀ and AV each 2·d_attn FLOPs per pair (d_attn = query
  heads × head dim);
- left out: embedding look-ups, norms, activations, softmax (under 1% at the shapes we train).

A backward is twice the forward, so the update is 3 forwards; the extra forward of gradient
checkpointing is not counted (model FLOPs, not hardware FLOPs). Generation is counted as one forward
over its samples. MFU = model FLOPs / (seconds × peak): the peak of a CUDA device from its data sheet
(``CUDA_PEAK_TFLOPS``, dense), elsewhere measured here by a matrix product (``measured_peak_flops``).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lit_offpolicy.core.experience import Experience

CUDA_PEAK_TFLOPS = {  # name fragment: {dtype: dense TFLOPS}, from the vendors' data sheets
    "H200": {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
    "H100 PCIe": {torch.bfloat16: 756.0, torch.float16: 756.0, torch.float32: 51.2},
    "H100": {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},  # SXM
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "L4": {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3},
}
"""Checked in this order (``H100 PCIe`` before ``H100``); float32 without TF32 (torch's default)."""
MATMUL_SIZE = 1024
Lengths = tuple[list[int], list[int]]
"""Prompt lengths and response lengths of a batch's samples."""
_counted: weakref.WeakKeyDictionary[nn.Module, ModelFlops] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ModelFlops:
    """What a causal LM's FLOPs depend on (see the module's formula)."""

    body_params: int
    head_params: int
    layers: int
    attention_width: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelFlops:
        """Read off a Hugging Face causal LM (or a model wrapping one in ``.model``, as the critic)."""
        config = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
        if config is None:
            raise ValueError(f"{type(model).__name__} has no Hugging Face config to count its FLOPs")
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
        head_params = _numel(head.weight) if isinstance(head, nn.Linear) else 0
        body_params = sum(_numel(m.weight) for m in linear if m is not head)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(body_params, head_params, config.num_hidden_layers, config.num_attention_heads * head_dim)

    def forward(self, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> float:
        """FLOPs of one forward over each sample (lengths per sample, padding excluded), summed."""
        total = 0.0
        for prompt, response in zip(prompt_lengths, response_lengths, strict=True):
            length = prompt + response
            total += 2 * self.body_params * length + 2 * self.head_params * response
            total += 2 * self.layers * self.attention_width * length * (length + 1)
        return total


def _numel(weight: Tensor) -> int:
    """The weight's elements, also where ZeRO-3 partitioned it (an empty tensor with ``ds_numel``);
    a DTensor (FSDP2) counts its global shape."""
    return getattr(weight, "ds_numel", weight.numel())


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOPs per second the device can do in ``dtype``: its data sheet's (CUDA), else measured."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in CUDA_PEAK_TFLOPS.items():
            if fragment in name and dtype in peaks:
                return peaks[dtype] * 1e12
    return measured_peak_flops(device.type, dtype)


def model_peak_flops(model: nn.Module) -> float:
    """``peak_flops`` of the device and dtype of ``model``'s (first) weights."""
    weight = next(model.parameters())
    return peak_flops(weight.device, weight.dtype)


@functools.cache
def measured_peak_flops(device_type: str, dtype: torch.dtype, size: int = MATMUL_SIZE) -> float:
    """The fastest of 6 ``size``² matrix products in ``dtype`` on this device, with torch's threads as
    they are (the step's): 2·size³ FLOPs over its seconds. Measured once per process."""
    a = torch.randn(size, size, device=device_type).to(dtype)
    b = torch.randn(size, size, device=device_type).to(dtype)
    best = float("inf")
    for _ in range(6):  # the first warms up
        if device_type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch.mm(a, b)
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def stage_metrics(
    stage: str,
    forwards: Iterable[tuple[nn.Module, int]],
    lengths: Lengths,
    seconds: float,
    share: float = 1.0,
    shared_prompts: Sequence[int] = (),
) -> dict[str, float]:
    """``perf/tokens_per_s/<stage>`` (prompt + response tokens of the samples per second) and
    ``perf/mfu/<stage>`` of a stage that ran ``count`` forwards of each ``(model, count)`` over samples
    of ``lengths`` (``sequence_lengths``) in ``seconds``, against the peak of the first model's device
    and dtype; ``share`` of that work on this rank (1/N of each row under sequence parallelism).
    ``shared_prompts``: the lengths of prompts computed once for several samples, each listed once per
    sample beyond the first (shared-prefix rows): their forward(P, 0) is not counted again.
    Nothing for a stage that ran no forward."""
    forwards = [(model, count) for model, count in forwards if count]
    if not forwards or seconds <= 0:
        return {}
    repeated = (list(shared_prompts), [0] * len(shared_prompts))
    flops = sum(
        count * (model_flops(model).forward(*lengths) - model_flops(model).forward(*repeated))
        for model, count in forwards
    )
    peak = model_peak_flops(forwards[0][0])
    tokens = (sum(lengths[0]) + sum(lengths[1])) * share
    return {
        f"perf/tokens_per_s/{stage}": tokens / seconds,
        f"perf/mfu/{stage}": flops * share / seconds / peak,
    }


def rl_stage_metrics(
    exp: Experience,
    frozen: tuple[Iterable[tuple[nn.Module, int]], float, Sequence[int] | None],
    trained: Iterable[nn.Module | None],
    epochs: int,
    update_seconds: float,
    share: float = 1.0,
) -> dict[str, float]:
    """``timing/frozen`` and ``stage_metrics`` of an RL step's two stages over ``exp``: the frozen passes
    (``frozen``: their (model, forwards), seconds and shared prompts) and the update, ``epochs``
    forwards and backwards of each ``trained`` model (None skipped), 3 forwards each (a backward is
    twice the forward), counting the frozen passes' shared prompts (``perf/shared_prefix_saving``: the
    share of the samples' tokens they did not compute again)."""
    lengths, (forwards, frozen_seconds, shared) = sequence_lengths(exp), frozen
    update = [(model, 3 * epochs) for model in trained if model is not None]
    metrics = {"timing/frozen": frozen_seconds}
    if shared is not None:  # shared-prefix rows on (0 where the actor runs per-sample rows)
        metrics["perf/shared_prefix_saving"] = sum(shared) / max(sum(lengths[0]) + sum(lengths[1]), 1)
    return (
        metrics
        | stage_metrics("frozen", forwards, lengths, frozen_seconds, share, shared or ())
        | stage_metrics("update", update, lengths, update_seconds, share, shared or ())
    )


def sequence_lengths(*experiences: Experience) -> Lengths:
    """The prompt and the response length of every sample, as lists: one device-to-host transfer."""
    masks = [torch.stack((e.prompt_mask.sum(-1), e.response_mask.sum(-1))) for e in experiences]
    prompts, responses = torch.cat(masks, dim=1).tolist()
    return prompts, responses


def seconds_since(started: float, device: torch.device) -> float:
    """``time.perf_counter()`` seconds since ``started``, once the work queued on a CUDA ``device`` is
    done (its kernels run after the host returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def model_flops(model: nn.Module) -> ModelFlops:
    """``ModelFlops.of(model)``, counted once per model."""
    if model not in _counted:
        _counted[model] = ModelFlops.of(model)
    return _counted[model]
