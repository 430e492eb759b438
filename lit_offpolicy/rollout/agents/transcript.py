"""One agent episode's tokens: every call's exact prompt and sampled tokens, kept in branches.

Token in, token out. A call whose request extends an earlier call of the episode (the earlier call's
messages, its reply as the endpoint returned it, then messages the agent added) is prompted with the
earlier call's exact tokens, the tokens the engine sampled for it, and the added messages' tokens: the
engine's tokens are never decoded and re-encoded. A request that extends no earlier call (a template
that rewrites history, an agent that edits its context) starts a new branch from its own rendering.

Each branch becomes one training sample: its first call's prompt, then the sampled tokens (action
mask 1) and the tokens of what the agent added (0), each with the policy version that wrote it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from lit_offpolicy.core.generation import Generation

REPLY_SENTINEL = "LITOFFPOLICYREPLYSENTINEL"
"""Stands in for a reply's content while the template renders what follows it (``chat_suffix``)."""


class BudgetError(ValueError):
    """A call whose prompt does not fit the episode's token budget (an HTTP 400 naming the option)."""


def message_key(message: dict) -> tuple:
    """What a message must keep for a later request to extend it: role, text, tool calls (by name and
    parsed arguments; ids and formatting aside)."""
    calls = tuple(
        (call["function"]["name"], _arguments_key(call["function"].get("arguments")))
        for call in message.get("tool_calls") or ()
    )
    return message["role"], message_text(message.get("content")), calls


def chat_key(messages: list[dict], tools: list | None, reply: dict | None = None) -> tuple:
    """What a later chat request must repeat to extend a call: its messages, the reply as returned
    (``reply``), and its tools."""
    keys = tuple(message_key(m) for m in messages) + ((message_key(reply),) if reply else ())
    return keys, json.dumps(tools, sort_keys=True) if tools else ""


def message_text(content) -> str:
    """An OpenAI message's content as text: a string, the text parts of a list joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments_key(arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def chat_suffix(tokenizer, messages: list[dict], reply_index: int, end_of_turn: str, **render) -> str | None:
    """The text the chat template writes from the end of the assistant reply at ``reply_index`` to
    the end of ``messages`` with the generation prompt, starting with ``end_of_turn`` (the token that
    closes the reply); None where the template writes no ``end_of_turn`` after the reply.

    The reply's content is replaced by :data:`REPLY_SENTINEL`, so that a template that rewrites the
    reply (Qwen3 drops the ``<think>`` block of an earlier turn) cannot shift where it ends."""
    probe = [dict(message) for message in messages]
    probe[reply_index]["content"] = REPLY_SENTINEL
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **render)
    start = text.find(REPLY_SENTINEL)
    end = text.find(end_of_turn, start) if start >= 0 and end_of_turn else -1
    return None if end < 0 else text[end:]


@dataclass
class Branch:
    """One training sample of an episode: a prompt and the R tokens after it."""

    prompt: list[int]
    """The first call's prompt token ids."""
    tokens: list[int] = field(default_factory=list)
    """[R]: sampled tokens and the agent's added tokens, in order."""
    log_probs: list[float] = field(default_factory=list)
    """[R]: log π_rollout of each sampled token; 0 on added tokens."""
    versions: list[int] = field(default_factory=list)
    """[R]: the policy version of each token (an added token takes the version before it)."""
    actions: list[int] = field(default_factory=list)
    """[R]: 1 on sampled tokens, 0 on added tokens."""
    finish_reason: str = "stop"
    """The last call's finish reason ("stop" or "length")."""
    last_reply: list[int] = field(default_factory=list)
    """The last call's sampled token ids."""

    def generation(self) -> Generation:
        return Generation(
            list(self.tokens),
            list(self.log_probs),
            self.finish_reason,
            list(self.versions),
            list(self.actions),
        )


@dataclass
class Call:
    """A recorded call: what a later request repeats to extend it, and where its tokens end."""

    branch: Branch
    end: int
    """The branch's length (R) right after this call's sampled tokens."""
    kind: str
    """"chat", "text" or "ids": the request's form; only a request of the same form extends it."""
    key: tuple
    """Chat: the message keys with the reply's, and the tools; text: the prompt and reply as one
    string; ids: the prompt and sampled ids."""
    end_of_turn: str = ""
    """Chat: the text of the token that closed the reply (the tokenizer's eos when cut by length)."""


@dataclass
class Plan:
    """How one call is prompted: from a call it extends (``parent``) with ``added`` tokens after it,
    or afresh (``parent`` None) from ``prompt``."""

    prompt: list[int]
    """The whole prompt the engine is given."""
    parent: Call | None
    added: list[int]
    """Tokens after the parent's (the agent's added messages), or [] for a fresh branch."""

    def response_tokens(self) -> int:
        """R of the branch once the call's prompt is in it (before its sampled tokens)."""
        return (self.parent.end if self.parent else 0) + len(self.added)


class Transcript:
    """The branches and calls of one episode; its methods are safe to call from several threads."""

    def __init__(self, tokenizer, max_prompt_tokens: int, max_response_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.branches: list[Branch] = []
        self.calls: list[Call] = []
        self.last_reply_text = ""
        """The text of the episode's latest reply (what a reward function scores)."""
        self.lock = threading.Lock()

    # planning: which tokens a request is prompted with

    def plan_chat(self, messages: list[dict], tools: list | None, render: dict) -> Plan:
        keys, tools_key = chat_key(messages, tools)
        with self.lock:
            for call in reversed(self.calls):
                history, call_tools = call.key
                n = len(history)
                if (
                    call.kind != "chat"
                    or call_tools != tools_key
                    or len(keys) <= n
                    or keys[:n] != history
                    or any(m["role"] == "assistant" for m in messages[n:])
                ):
                    continue
                extra = dict(render, tools=tools) if tools else render
                suffix = chat_suffix(self.tokenizer, messages, n - 1, call.end_of_turn, **extra)
                if suffix is None:
                    continue
                added = self._encode(suffix)
                if call.branch.tokens[: call.end][-1:] == added[:1]:  # the sampled reply ends with it
                    added = added[1:]
                return self._checked(Plan(self._whole(call) + added, call, added))
        extra = dict(render, tools=tools) if tools else render
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
        return self._checked(Plan(self._encode(text), None, []))

    def plan_text(self, prompt: str) -> Plan:
        with self.lock:
            for call in (c for c in reversed(self.calls) if c.kind == "text"):
                (before,) = call.key
                if prompt.startswith(before) and len(prompt) > len(before):
                    added = self._encode(prompt[len(before) :])
                    return self._checked(Plan(self._whole(call) + added, call, added))
        return self._checked(Plan(self.tokenizer(prompt).input_ids, None, []))

    def plan_ids(self, prompt: Sequence[int]) -> Plan:
        prompt = list(prompt)
        with self.lock:
            for call in (c for c in reversed(self.calls) if c.kind == "ids"):
                (before,) = call.key
                if tuple(prompt[: len(before)]) == before and len(prompt) > len(before):
                    return self._checked(Plan(prompt, call, prompt[len(before) :]))
        return self._checked(Plan(prompt, None, []))

    def room(self, plan: Plan) -> int:
        """Tokens the call may sample within ``max_response_tokens``."""
        return self.max_response_tokens - plan.response_tokens()

    # recording: a call's sampled tokens, once the engine returns them

    def record(
        self, plan: Plan, generation: Generation, version: int, kind: str, key: tuple, reply_text: str
    ) -> None:
        """Append the call's added and sampled tokens to its branch (a new branch where the plan is
        fresh, or where the parent call is no longer its branch's end: another call went on from it)."""
        with self.lock:
            parent = plan.parent
            if parent is None:
                branch = Branch(prompt=list(plan.prompt))
                self.branches.append(branch)
            elif len(parent.branch.tokens) == parent.end:
                branch = parent.branch
            else:  # a fork: a copy of the parent branch up to the parent call
                old, end = parent.branch, parent.end
                branch = Branch(
                    old.prompt, old.tokens[:end], old.log_probs[:end], old.versions[:end], old.actions[:end]
                )
                self.branches.append(branch)
            before = branch.versions[-1] if branch.versions else version
            added = plan.added
            _append(branch, added, [0.0] * len(added), [before] * len(added), 0)
            versions = generation.versions or [version] * len(generation.token_ids)
            _append(branch, generation.token_ids, generation.log_probs, versions, 1)
            branch.finish_reason = generation.finish_reason
            branch.last_reply = list(generation.token_ids)
            end_of_turn = self.tokenizer.eos_token or ""
            if generation.finish_reason == "stop" and generation.token_ids:
                end_of_turn = self.tokenizer.decode(generation.token_ids[-1:])
            self.calls.append(Call(branch, len(branch.tokens), kind, key, end_of_turn))
            self.last_reply_text = reply_text

    # helpers

    def _whole(self, call: Call) -> list[int]:
        return call.branch.prompt + call.branch.tokens[: call.end]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _checked(self, plan: Plan) -> Plan:
        if plan.parent is None and len(plan.prompt) > self.max_prompt_tokens:
            raise BudgetError(
                f"the prompt is {len(plan.prompt)} tokens, over agent.max_prompt_tokens="
                f"{self.max_prompt_tokens}"
            )
        if self.room(plan) < 1:
            raise BudgetError(
                f"the episode's tokens after its first prompt would be {plan.response_tokens()}, leaving no "
                f"room to sample within agent.max_response_tokens={self.max_response_tokens}"
            )
        return plan


def _append(branch: Branch, tokens, log_probs, versions, action: int) -> None:
    branch.tokens += list(tokens)
    branch.log_probs += list(log_probs)
    branch.versions += list(versions)
    branch.actions += [action] * len(tokens)
