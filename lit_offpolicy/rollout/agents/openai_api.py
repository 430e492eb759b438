"""The OpenAI API's request and response bodies, as far as the agents' endpoint serves them.

Requests are checked before anything is generated: a parameter the endpoint cannot honour exactly is
refused with a 4xx error naming it (the OpenAI error body), never ignored. Sampling must match the
run's (``sampling.temperature``, ``top_p``, ``top_k``): the trainer recomputes log-probs under the
run's temperature, so a request that sampled otherwise would train on the wrong π_rollout.
"""

from __future__ import annotations

import json
import time
import uuid

from lit_offpolicy.core.generation import Generation
from lit_offpolicy.environments.tools import TOOL_CALL_OPEN, parse_tool_calls
from lit_offpolicy.rollout.engine import SamplingParams

CHAT_PARAMETERS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
     "stream", "seed", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs", "user",
     "stop", "chat_template_kwargs", "metadata", "store", "presence_penalty", "frequency_penalty"}
)  # fmt: skip
"""What a chat request may name (others are refused as unsupported)."""
COMPLETION_PARAMETERS = frozenset(
    {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "seed", "logprobs",
     "user", "stop", "echo", "presence_penalty", "frequency_penalty"}
)  # fmt: skip


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, and a body naming the ``param`` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        return {
            "error": {
                "message": str(self),
                "type": kind.get(
                    self.status, "invalid_request_error" if self.status < 500 else "server_error"
                ),
                "param": self.param,
                "code": self.code,
            }
        }


def sampling_for(
    request: dict, run: SamplingParams, max_call_tokens: int, allowed: frozenset, strict: bool = True
) -> SamplingParams:
    """The request's sampling: the run's, with its ``max_tokens`` (at most ``max_call_tokens``) and
    ``seed``; an ``APIError`` naming any parameter that would sample otherwise (temperature, top_p and
    top_k only where ``strict``: samples that are trained on)."""
    for name in request:
        if name not in allowed:
            raise APIError(
                400,
                f"unsupported parameter {name!r}; the endpoint accepts: {', '.join(sorted(allowed))}",
                name,
            )
    if request.get("n", 1) != 1:
        raise APIError(
            400, f"n={request['n']} is not supported: an agent's call samples one reply (n=1)", "n"
        )
    if request.get("stream"):
        raise APIError(400, "stream=true is not supported: ask for the whole reply", "stream")
    if request.get("stop"):
        raise APIError(
            400, "stop sequences are not supported: a reply ends at the model's end-of-turn token", "stop"
        )
    if request.get("echo"):
        raise APIError(400, "echo=true is not supported", "echo")
    for name in ("presence_penalty", "frequency_penalty"):
        if request.get(name):
            raise APIError(
                400,
                f"{name}={request[name]} would sample from another distribution than the one trained on",
                name,
            )
    for name, value in (("temperature", run.temperature), ("top_p", run.top_p), ("top_k", run.top_k)):
        given = request.get(name)
        if strict and given is not None and not _same(name, given, value):
            raise APIError(
                400,
                f"{name}={given} differs from this run's sampling.{name}={value}: the trainer's log-probs "
                f"assume the run's sampling; leave {name} unset or set the run's",
                name,
            )
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or max_call_tokens
    if not isinstance(limit, int) or limit < 1:
        raise APIError(400, f"max_tokens={limit!r}: expected a positive integer", "max_tokens")
    seed = request.get("seed")
    return SamplingParams(
        n=1,
        temperature=run.temperature,
        top_p=run.top_p,
        top_k=run.top_k,
        max_tokens=min(limit, max_call_tokens),
        stop_token_ids=run.stop_token_ids,
        seed=seed if isinstance(seed, int) else run.seed,
    )


def _same(name: str, given, value) -> bool:
    if name == "top_k":
        return given == value or (given in (-1, 0) and value in (-1, 0))
    return isinstance(given, (int, float)) and abs(float(given) - float(value)) < 1e-9


def assistant_message(text: str, parse_tools: bool) -> tuple[dict, str]:
    """The reply as an OpenAI assistant message, and its finish reason's override ("tool_calls" where
    it calls tools). ``<tool_call>{json}</tool_call>`` blocks (the Qwen/Hermes format) become
    ``tool_calls`` where ``parse_tools`` (the request named tools) and every block parses; the text
    before the first block is the content."""
    calls = parse_tool_calls(text) if parse_tools and TOOL_CALL_OPEN in text else []
    if not calls or any(call.error for call in calls):
        return {"role": "assistant", "content": text}, ""
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
    ]
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


def chat_response(
    model: str,
    message: dict,
    finish: str,
    generation: Generation,
    prompt_tokens: int,
    logprobs: bool,
    tokenizer,
) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs:
        choice["logprobs"] = {"content": _token_logprobs(generation, tokenizer)}
    return _envelope("chat.completion", model, choice, generation, prompt_tokens)


def completion_response(
    model: str, text: str, generation: Generation, prompt_tokens: int, logprobs: bool, tokenizer
) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": generation.finish_reason, "logprobs": None}
    if logprobs:
        entries = _token_logprobs(generation, tokenizer)
        choice["logprobs"] = {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "token_ids": list(generation.token_ids),
        }
    return _envelope("text_completion", model, choice, generation, prompt_tokens)


def _token_logprobs(generation: Generation, tokenizer) -> list[dict]:
    return [
        {"token": tokenizer.decode([token]), "token_id": token, "logprob": log_prob, "top_logprobs": []}
        for token, log_prob in zip(generation.token_ids, generation.log_probs, strict=True)
    ]


def _envelope(kind: str, model: str, choice: dict, generation: Generation, prompt_tokens: int) -> dict:
    sampled = len(generation.token_ids)
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sampled,
            "total_tokens": prompt_tokens + sampled,
        },
    }
