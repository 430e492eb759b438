"""A rollout engine on HuggingFace ``generate``: simple, exact, and fast enough for small models."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import (
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.logprobs import token_log_probs
from lit_offpolicy.models import load_actor
from lit_offpolicy.models.lora import has_adapters
from lit_offpolicy.rollout.engine import (
    ENGINES,
    EngineContext,
    EngineSpec,
    PartialResponse,
    SamplingParams,
    Weights,
    WeightSyncHook,
    check_prompts,
    weight_items,
)


class HFEngine:
    """Serves a causal LM through ``model.generate``, all prompts × n in one left-padded batch.

    The prompts are encoded once each and their KV cache shared by their n samples.

    With ``copy_model=True`` the engine holds its own copy of ``model`` (never optimized) and
    ``load_weights`` copies new weights into it. With ``copy_model=False`` it samples from ``model``
    itself (the synchronous path where the actor generates) and ``load_weights`` only records the
    version.
    Only ``SamplingParams`` shape the sampling: the model's own ``generation_config`` defaults
    (repetition penalty, top-k, ...) are ignored.
    """

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int, copy_model: bool = True):
        if copy_model:
            # never optimized, but its parameters keep the source's requires_grad: CPU kernels differ
            # on it (a requires_grad=False copy's log-probs differ from the actor's by ~5e-7), and
            # generation runs under inference_mode, which records no graph either way
            model = copy.deepcopy(model).eval()
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.copy_model = copy_model
        self.policy_version = 0

    def load_weights(self, weights: Weights, version: int) -> None:
        """Copy ``weights`` (a state dict or streamed pairs, strict: exactly the model's names) into the
        engine's model, one tensor at a time, and serve them as ``version``. Without ``copy_model`` the
        engine samples from the trainer's model itself: the weights are not read."""
        if self.copy_model:
            targets = self.model.state_dict(keep_vars=True)
            loaded = set()
            with torch.no_grad():
                for name, tensor in weight_items(weights):
                    if name not in targets:
                        raise KeyError(f"load_weights: {name!r} is not a weight of the engine's model")
                    targets[name].copy_(tensor)
                    loaded.add(name)
            if missing := targets.keys() - loaded:
                example = sorted(missing)[:3]
                raise KeyError(f"load_weights: {len(missing)} of the model's weights missing, e.g. {example}")
        self.policy_version = version

    def sleep(self) -> None:
        """A no-op: the engine's model lives where the trainer put it."""

    def wake_up(self) -> None:
        """A no-op (see :meth:`sleep`)."""

    def close(self) -> None:
        """A no-op: the model is garbage like any module once the engine is dropped."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, sync: WeightSyncHook | None = None
    ) -> list[list[Generation]]:
        """``params.n`` generations per prompt, with log π_rollout of every sampled token.

        With ``sync`` (partial rollouts): after every sampled token, where ``sync.pending()``, the
        responses still running stop, ``sync.apply()`` loads the newer weights, and they resume from
        prompt + tokens so far under the new weights (the prefix re-encoded by them: no key/value
        computed by the old weights is kept). Each token then records the version that sampled it
        (``Generation.versions``) and its log-prob under that version.
        """
        if not prompts:
            return []
        check_prompts(prompts)
        stop_ids = [self.eos_token_id, *params.stop_token_ids]
        rows = [PartialResponse(list(prompt)) for prompt in prompts for _ in range(params.n)]
        stopping = StoppingCriteriaList([_Pending(sync.pending)]) if sync is not None else None
        with _serving(self.model), _seeded_rng(params.seed, self.model.device), torch.inference_mode():
            segment = self._segment(prompts, params, params.n, params.max_tokens, stop_ids, stopping)
            running = rows
            while True:
                for row, (tokens, token_lps) in zip(running, segment, strict=True):
                    row.extend(tokens, token_lps, self.policy_version, set(stop_ids), params.max_tokens)
                running = [row for row in running if row.finish_reason is None]
                if not running:
                    break
                sync.apply()  # cut by a pending sync: resume under the newer weights
                resumed = [row.prompt + row.tokens for row in running]
                remaining = params.max_tokens - len(running[0].tokens)
                segment = self._segment(resumed, params, 1, remaining, stop_ids, stopping)
        generations = [row.generation(recorded=sync is not None) for row in rows]
        return [generations[i : i + params.n] for i in range(0, len(generations), params.n)]

    def _segment(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        max_new_tokens: int,
        stop_ids: list[int],
        stopping: StoppingCriteriaList | None,
    ) -> list[tuple[list[int], list[float]]]:
        """One ``generate`` call: ``n`` samples per prompt (sharing each prompt's cache), their tokens
        and log-probs, padding included (``PartialResponse.extend`` cuts it)."""
        input_ids, attention_mask = self._left_pad(prompts)
        cache = _shared_prompt_cache(self.model, input_ids, attention_mask, n)
        input_ids = input_ids.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            **_sampling_kwargs(params),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            stopping_criteria=stopping,
            return_dict_in_generate=True,
            output_logits=True,
        )
        responses = out.sequences[:, input_ids.shape[1] :]
        log_probs = _response_log_probs(out.logits, responses, params.temperature)
        return list(zip(responses.tolist(), log_probs.tolist(), strict=True))

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
    copy of it where the actor is being optimized between syncs (``sync_every`` > 1, asynchronous
    rollouts) or sharded (FSDP2, ZeRO-3). A copy of a sharded or LoRA actor is the plain model loaded
    from ``model_path``, then given the gathered weights (a LoRA actor's merged into them)."""

    partial_rollouts = True

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
    """The KV cache of every prompt but its last token, computed once per prompt for its ``n`` samples.

    ``generate`` would run each prompt n times. None where there is nothing to share.

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


class _Pending(StoppingCriteria):
    """Stops every row of a ``generate`` call once ``pending()`` is True (checked after each token)."""

    def __init__(self, pending: Callable[[], bool]) -> None:
        self.pending = pending

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        return torch.full(
            (input_ids.shape[0],), bool(self.pending()), dtype=torch.bool, device=input_ids.device
        )


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
