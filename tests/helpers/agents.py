"""Agents for the endpoint's tests, importable by path (``helpers.agents:two_calls``), and the tiny
Qwen3 that serves them with Qwen3's real chat template (tests/fixtures/qwen3_chat_template.jinja, as
the Qwen3 models ship it: it drops the ``<think>`` block of an assistant turn before the last user
turn)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import openai

QWEN3_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_chat_template.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def qwen3_agent_model(path: Path, seed: int = 0) -> str:
    """The tiny Qwen3 of ``create_tiny_model`` with Qwen3's real chat template and 1,024 positions (the
    template's tool block alone is about 500 of its byte-level tokens)."""
    from lit_offpolicy.models import create_tiny_model

    create_tiny_model(path, seed=seed, arch="qwen3")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["model_max_length"] = 1024
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return str(path)


def user_text(row: dict) -> str:
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


async def two_calls(client, row):
    """A question, the model's reply echoed back as the client returned it, a tool result, a second
    call; the reward function scores the last reply (returns None)."""
    messages = [{"role": "user", "content": user_text(row)}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "42"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return None


async def tool_caller(client, row):
    """Calls with tools, runs the one the model calls, calls again: 1.0 where both replies were a
    ``tool_calls`` message naming ``add`` with its arguments."""
    messages = [{"role": "user", "content": user_text(row)}]
    right = 0
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=32
        )
        message = reply.choices[0].message
        call = (message.tool_calls or [None])[0]
        if reply.choices[0].finish_reason == "tool_calls" and call and call.function.name == "add":
            arguments = json.loads(call.function.arguments)
            right += arguments == {"a": 3, "b": 4}
            messages.append(message.model_dump(exclude_none=True))
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}
            )
    return right / 2


async def edits_history(client, row):
    """Two calls, the second with the first reply rewritten: two branches."""
    messages = [{"role": "user", "content": user_text(row)}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages.append(
        {"role": "assistant", "content": "(summarised) " + (first.choices[0].message.content or "")}
    )
    messages.append({"role": "user", "content": "go on"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 1.0


async def completions_agent(client, row):
    """Text completions: the second prompt is the first prompt, the reply and "=" (token in, token out)."""
    first = await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
    second = await client.completions.create(
        model="policy", prompt=row["prompt"] + first.choices[0].text + "=", max_tokens=4
    )
    return float(second.choices[0].text.strip() == row["answer"])


async def completions_scored_by_reward(client, row):
    """``completions_agent``'s two calls; the reward function scores the last reply."""
    await completions_agent(client, row)
    return None


async def asks_temperature_one(client, row):
    """One call at temperature 1.0 (a run sampling at 1.0 accepts it); 1.0 when it went through."""
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2, temperature=1.0)
    return 1.0


def plain_http(base_url, api_key, row):
    """A synchronous agent on plain HTTP (no OpenAI client)."""
    reply = httpx.post(
        f"{base_url}/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"model": "policy", "prompt": row["prompt"], "max_tokens": 3},
        timeout=30,
    )
    reply.raise_for_status()
    return 0.25


async def raises(client, row):
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    raise ValueError("the agent's own bug")


async def hangs(client, row):
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    await asyncio.sleep(3600)


async def hangs_after_two_calls(client, row):
    """Two calls (the second may fail), then a long wait: only cancelling ends it."""
    for _ in range(2):
        with contextlib.suppress(openai.APIError):
            await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    await asyncio.sleep(3600)


def hangs_sync(base_url, api_key, row):
    time.sleep(3600)


async def returns_text(client, row):
    return "yes"


async def never_calls(client, row):
    raise RuntimeError("no model needed")
