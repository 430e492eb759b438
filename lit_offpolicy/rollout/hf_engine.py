"""A rollout engine on HuggingFace ``generate``: simple, exact, and fast enough for small models."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from lit_offpolicy.lora import has_adapters
from lit_offpolicy.models import load_actor
from lit_offpolicy.rollout.engine import (
    ENGINES,
    EngineContext,
    EngineSpec,
    Generation,
    SamplingParams,
    check_prompts,
    token_log_probs,
)


class HFEngine:
    """Serves a causal LM through ``model.generate``, batching all prompts × n with left padding; the
    prompts are encoded once each and their KV cache shared by their n samples.

    With ``copy_model=True`` the engine holds its own copy of ``model`` (never optimised) and
    ``load_weights`` copies new weights into it. With ``copy_model=False`` it samples from ``model``
    itself (the synchronous path where the actor generates) and ``load_weights`` only records the
    version.
    Only ``SamplingParams`` shape the sampling: the model's own ``generation_config`` defaults
    (repetition penalty, top-k, ...) are ignored.
    """

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int, copy_model: bool = True):
        if copy_model:
            # never optimised, but its parameters keep the source's requires_grad: CPU kernels differ
            # on it (a requires_grad=False copy's log-probs differ from the actor's by ~5e-7), and
            # generation runs under inference_mode, which records no graph either way
            model = copy.deepcopy(model).eval()
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.copy_model = copy_model
        self.policy_version = 0

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` (strict) into the engine's model and serve it as ``version``."""
        if self.copy_model:
            with torch.no_grad():
                self.model.load_state_dict(state_dict, strict=True)
        self.policy_version = version

    def sleep(self) -> None:
        """A no-op: the engine's model lives where the trainer put it."""

    def wake_up(self) -> None:
        """A no-op (see :meth:`sleep`)."""

    def close(self) -> None:
        """A no-op: the model is garbage like any module once the engine is dropped."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` generations per prompt, with log π_rollout of every sampled token."""
        if not prompts:
            return []
        check_prompts(prompts)
        input_ids, attention_mask = self._left_pad(prompts)
        stop_ids = [self.eos_token_id, *params.stop_token_ids]
        with _serving(self.model), _seeded_rng(params.seed, self.model.device), torch.inference_mode():
            cache = _shared_prompt_cache(self.model, input_ids, attention_mask, params.n)
            input_ids = input_ids.repeat_interleave(params.n, dim=0)
            attention_mask = attention_mask.repeat_interleave(params.n, dim=0)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                **_sampling_kwargs(params),
                max_new_tokens=params.max_tokens,
                eos_token_id=stop_ids,
                pad_token_id=self.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
            responses = out.sequences[:, input_ids.shape[1] :]
            log_probs = _response_log_probs(out.logits, responses, params.temperature)
        generations = [
            _cut_at_stop(tokens, token_lps, set(stop_ids))
            for tokens, token_lps in zip(responses.tolist(), log_probs.tolist(), strict=True)
        ]
        return [generations[i : i + params.n] for i in range(0, len(generations), params.n)]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        device = self.model.device
        return input_ids.to(device), attention_mask.to(device)


@ENGINES.register("hf")
class HFEngineSpec(EngineSpec):
    """The HF engine: samples with the actor itself (a LoRA actor with its adapters active), or with a
    copy of it where the actor is being optimised between syncs (``sync_every`` > 1, asynchronous
    rollouts) or sharded (FSDP2, ZeRO-3). A copy of a sharded or LoRA actor is the plain model loaded
    from ``model_path``, then given the gathered weights (a LoRA actor's merged into them)."""

    def build(self, context: EngineContext) -> HFEngine:
        tokenizer = context.tokenizer
        copy_model = context.own_copy or context.sharded
        from_directory = context.sharded or (copy_model and has_adapters(context.actor))
        if from_directory:
            model = load_actor(context.model_path, getattr(torch, context.dtype)).to(context.device)
        else:
            model = context.actor
        engine = HFEngine(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            copy_model=copy_model,
        )
        if from_directory:
            engine.load_weights(context.weights(), context.policy_version)
        engine.policy_version = context.policy_version
        return engine


def _shared_prompt_cache(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, n: int):
    """The KV cache of every prompt but its last token, computed once per prompt and repeated for its
    ``n`` samples (``generate`` would run each prompt n times); None where there is nothing to share.

    Positions are those ``generate`` gives left-padded rows (the attention mask's running count), so
    the samples and their log-probs are the ones an unshared ``generate`` draws.
    """
    if n == 1 or input_ids.shape[1] < 2:
        return None
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=positions[:, :-1],
        past_key_values=cache,
        use_cache=True,
    )
    cache.batch_repeat_interleave(n)
    return cache


def _sampling_kwargs(params: SamplingParams) -> dict:
    """``generate`` arguments for greedy or for sampling; HF reads top_k=0 as "off"."""
    if params.greedy:
        return {"do_sample": False}
    return {
        "do_sample": True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(params.top_k, 0),
    }


def _response_log_probs(step_logits: tuple[Tensor, ...], responses: Tensor, temperature: float) -> Tensor:
    """(batch, steps) log-probs of the sampled tokens from ``generate``'s raw per-step logits."""
    per_step = [token_log_probs(logits, responses[:, t], temperature) for t, logits in enumerate(step_logits)]
    return torch.stack(per_step, dim=1)


def _cut_at_stop(tokens: list[int], log_probs: list[float], stop_ids: set[int]) -> Generation:
    """Keep a response up to and including its first stop token; what follows is padding."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return Generation(tokens[: i + 1], log_probs[: i + 1], "stop")
    return Generation(tokens, log_probs, "length")


@contextmanager
def _serving(model: PreTrainedModel) -> Iterator[None]:
    """Eval mode and a blank generation config while generating; the model's own are restored after."""
    was_training, generation_config = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = generation_config
        model.train(was_training)


@contextmanager
def _seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the RNG for the block and restore the caller's RNG state after; no-op without a seed."""
    if seed is None:
        yield
        return
    accelerators = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=accelerators, device_type=device.type):
        torch.manual_seed(seed)
        yield
