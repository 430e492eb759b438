"""An agent as users write them: the OpenAI client, a tool the agent runs itself, two or more calls.

``lit_offpolicy.examples.calculator_agent:solve`` is given to the rollout callbacks as
``agent: {fn: lit_offpolicy.examples.calculator_agent:solve}`` (docs/agents.md); nothing in it knows
about the trainer but the ``base_url`` and key of the client it is handed.
"""

from __future__ import annotations

import json

import openai

from lit_offpolicy.environments.calculator import calculator

TOOL_CALL = "<tool_call>"
"""How the model opens a call; a reply holding one that the endpoint could not parse gets an error."""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer, or an error the model reads as the tool's result."""
    try:
        if name != "calculator":
            return f"error: unknown tool {name!r}"
        return str(calculator(**json.loads(arguments)))
    except Exception as error:  # the model's call was malformed: it sees why
        return f"error: {error}"


async def solve(client: openai.AsyncOpenAI, row: dict) -> float:
    """Ask, run the calculator when the model calls it (or say its call was malformed), ask again; 1.0
    for the right final answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls and TOOL_CALL in (message.content or ""):  # a call that did not parse
            messages.append({"role": "tool", "tool_call_id": "", "content": "error: malformed tool call"})
            continue
        if not message.tool_calls:
            return float((message.content or "").strip() == str(row["answer"]))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
