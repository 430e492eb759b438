"""The rollout engine contract: sampling parameters, the engine protocol, its spec and registry.

What an engine returns is a ``core.generation.Generation``; its log-probs follow
``core.logprobs.token_log_probs``, the convention the trainer shares.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.registry import Registry

Weights = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
"""Full weights with Hugging Face names: a state dict, or ``(name, tensor)`` pairs streamed one at a
time (``weight_sync.stream_full_weights``), which an engine consumes once, in order."""


def weight_items(weights: Weights) -> Iterable[tuple[str, Tensor]]:
    """``weights`` as ``(name, tensor)`` pairs."""
    return weights.items() if isinstance(weights, Mapping) else weights


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the fields map one to one onto ``vllm.SamplingParams``.

    ``temperature=0`` is greedy decoding; ``top_k`` of -1 or 0 and ``top_p=1`` switch truncation off.
    A ``seed`` makes sampling reproducible for the same prompts and parameters.
    """

    n: int = 1
    """Responses per prompt (the group size of GRPO/RLOO)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 switches it off."""
    top_k: int = -1
    """Most likely tokens kept; -1 or 0 switch it off."""
    max_tokens: int = 16
    """Longest response, in tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response besides the tokenizer's eos."""
    seed: int | None = None
    """Seed of the request; the rollout callbacks draw step s on rank r with seed + s + r·1_000_003
    (and round k of a step + k·100_003). None: unseeded."""

    def __post_init__(self) -> None:
        # named as a config writes them (the rollout callbacks' `sampling:` option)
        check_range("sampling.n", self.n, low=1)
        check_range("sampling.temperature", self.temperature, low=0.0)
        check_range("sampling.top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False)
        check_range("sampling.top_k", self.top_k, low=-1)
        check_range("sampling.max_tokens", self.max_tokens, low=1)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class WeightSyncHook:
    """Partial rollouts: how a generation in progress meets a weight sync.

    The engine asks ``pending()`` as it generates (the HF engine after every token, the vLLM engine
    between segments); where it is True, it stops the responses still running, calls ``apply()`` and
    resumes them from their prefix with the new weights."""

    pending: Callable[[], bool]
    """Whether newer weights wait to be loaded."""
    apply: Callable[[], None]
    """Load the newer weights into the engine (by its ``load_weights``)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses with a copy of the policy that the trainer refreshes by ``load_weights``."""

    policy_version: int
    """The version of the weights the engine serves (RL steps done when they were loaded)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` generations for each prompt (token ids), in prompt order."""
        ...

    def load_weights(self, weights: Weights, version: int) -> None:
        """Copy the trainer's weights in (every one of the model's; streamed pairs are consumed to the
        end) and serve them as policy ``version``."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory while the trainer works (colocated training); a no-op if none is held."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before generating or loading weights."""
        ...

    def close(self) -> None:
        """Release the engine's resources (models, caches, processes); it is not used afterwards."""
        ...


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built from; known only once the trainer has set the module up (``on_fit_start``)."""

    model_path: str
    """The directory the actor was loaded from."""
    dtype: str
    """The actor's parameter dtype by name ("float32", "bfloat16")."""
    tokenizer: Any
    """The actor's tokenizer."""
    actor: torch.nn.Module
    """The policy being trained (an engine without its own copy samples from it in place)."""
    device: torch.device
    """The trainer's device on this rank."""
    policy_version: int
    """The version of the actor's current weights."""
    weights: Callable[[], Weights]
    """The actor's full weights with Hugging Face names, gathered over the ranks where they are sharded
    (streamed: ``weight_sync.stream_full_weights``)."""
    sharded: bool
    """The strategy shards the actor's parameters (FSDP2, ZeRO-3): it cannot generate in place."""
    own_copy: bool
    """The engine must not sample from the parameters being optimized (weights behind between syncs)."""
    log_file: str | None = None
    """Where an engine with logs of its own (vLLM) writes them; None: where it would anyway."""
    bucket_bytes: int = 512 * 2**20
    """Bytes per bucket of a weight push (``Rollout(sync_bucket_mb=...)``)."""
    world_size: int = 1
    """The trainer's processes (data-parallel ranks), each building an engine of its own."""
    rank: int = 0
    """This process's global rank among them."""


class PartialResponse:
    """One response being sampled over one or more ``generate`` calls (partial rollouts)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        """The prompt's token ids."""
        self.tokens: list[int] = []
        """[T]: the tokens sampled so far."""
        self.log_probs: list[float] = []
        """[T]: their log π_rollout, each under the version that sampled it."""
        self.versions: list[int] = []
        """[T]: the policy version that sampled each token."""
        self.finish_reason: str | None = None
        """Why it ended, "stop" or "length"; None while it runs."""

    def extend(
        self, tokens: list[int], log_probs: list[float], version: int, stop_ids: set[int], max_tokens: int
    ) -> None:
        """Append a segment up to and including its first stop token (what follows is padding); the
        row is finished at a stop token or at ``max_tokens``, and otherwise was cut by a sync."""
        stop = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
        if stop is not None:
            tokens, log_probs = tokens[: stop + 1], log_probs[: stop + 1]
        self.tokens += tokens
        self.log_probs += log_probs
        self.versions += [version] * len(tokens)
        if stop is not None:
            self.finish_reason = "stop"
        elif len(self.tokens) >= max_tokens:
            self.finish_reason = "length"

    def generation(self, recorded: bool) -> Generation:
        versions = self.versions if recorded else None
        return Generation(self.tokens, self.log_probs, self.finish_reason, versions)


class EngineSpec(ABC):
    """How to build one kind of engine: its construction arguments, given in a config as the rollout
    callbacks' ``engine`` (a short name from :data:`ENGINES`, or ``class_path`` and ``init_args``)."""

    colocatable: ClassVar[bool] = False
    """Whether :meth:`RolloutEngine.sleep` frees the memory the trainer needs (``colocate``)."""
    partial_rollouts: ClassVar[bool] = False
    """Whether the engine's ``generate`` takes ``sync`` (a ``WeightSyncHook``): partial rollouts."""

    def sized(
        self,
        prompt_tokens: int | None,
        response_tokens: int,
        model_path: str,
        response_option: str = "sampling.max_tokens",
    ) -> EngineSpec:
        """This spec with its length limit fitted to the run, or a ValueError naming what cannot fit.

        ``prompt_tokens``: the data's ``max_prompt_length`` (None: unknown); ``response_tokens``: the
        longest response, the option ``response_option`` (``sampling.max_tokens``, or
        ``episodes.max_response_tokens``). Called before :meth:`build`, at start-up; an engine without
        a length limit of its own returns itself.
        """
        return self

    @abstractmethod
    def build(self, context: EngineContext) -> RolloutEngine:
        """A ready engine serving the actor's current weights as ``context.policy_version``."""


ENGINES: Registry[type[EngineSpec]] = Registry("engine", EngineSpec)
"""Short names of the engine specs (``@ENGINES.register("name")`` on the class)."""


class EngineLimitError(ValueError):
    """A request the engine cannot serve as configured (a prompt longer than its limit); the message
    is one line naming the options to change."""


class EngineRefused(RuntimeError):
    """An engine that loaded the model but cannot run it (an attention configuration its kernels lack,
    a dtype the device cannot serve), found at start-up; the message is one line."""


def check_prompts(prompts: list[list[int]]) -> None:
    """Raise on an empty prompt: generation needs at least one token to condition on."""
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts must not be empty: generation needs at least one token to condition on")
