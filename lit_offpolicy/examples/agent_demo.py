"""``python -m lit_offpolicy.examples.agent_demo``: an OpenAI-client agent with a tool, trained on the CPU.

The agent is ``calculator_agent.solve``: it asks the policy a ``multistep`` problem with the
``calculator`` tool, runs the calculator when the policy calls it, asks again, and pays 1.0 for the
right final answer. The policy is the tiny Llama (character tokenizer, 256 positions) with a compact
chat template of its own (``TEMPLATE``: the user's text, the assistant's text and ``<tool_call>``
blocks, ``<tool_response>`` blocks for tool results; it lists no tools, as a model tuned on one tool
needs none listed).

1. Warm-up: supervised traces of the same episodes (a call, the calculator's result, the answer),
   tokenized exactly as the endpoint tokenizes them (``Transcript``), loss on the policy's tokens.
2. RL: GRPO + PPO, ``Rollout(agent=...)``: every episode is the agent's, through the run's endpoint.

Writes under ``--out``: ``agent_demo_summary.json`` with the sampled ``reward/mean`` of every RL step
and greedy ``val/accuracy`` (the agent's episodes too) every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L

from lit_offpolicy.callbacks import Rollout
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.data.tasks import get_task
from lit_offpolicy.examples.calculator_agent import TOOLS, run_tool
from lit_offpolicy.examples.tool_demo import create_model, fit_rl, tool_call, warm_up
from lit_offpolicy.models import load_tokenizer
from lit_offpolicy.rewards import RewardConfig
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.agents import AgentConfig
from lit_offpolicy.rollout.agents.transcript import Transcript, chat_key
from lit_offpolicy.rollout.evaluation import ValidationConfig

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}"
    "{% else %}{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>\\n' }}{% endif %}"
    "{% endfor %}"
)
CALL_TOKENS = 96  # a call (about 80 characters) and its end-of-turn token
RESPONSE_TOKENS = 160  # a call, the tool's result and the answer


def create_agent_model(path: Path, seed: int) -> Path:
    """The tool demo's tiny Llama with :data:`TEMPLATE` as its chat template."""
    create_model(path, seed)
    tokenizer = load_tokenizer(str(path))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def traces(problems: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per problem: the episode the agent would record for a policy that calls
    the calculator with the problem and answers its result, as the endpoint tokenizes it."""
    examples = []
    for problem in problems:
        expression = problem["prompt"].removesuffix("=")
        text, arguments = tool_call(expression), json.dumps({"expression": expression})
        function = {"name": "calculator", "arguments": arguments}
        call = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": function}],
        }
        result = {"role": "tool", "tool_call_id": "c", "content": run_tool("calculator", arguments)}
        messages = [{"role": "user", "content": problem["prompt"]}]
        transcript = Transcript(tokenizer, max_prompt_tokens=64, max_response_tokens=RESPONSE_TOKENS)
        for reply, message in ((text, call), (problem["answer"], None)):
            plan = transcript.plan_chat(messages, TOOLS, {})
            ids = tokenizer(reply, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            key = chat_key(messages, TOOLS, message or {"role": "assistant", "content": reply})
            transcript.record(plan, Generation(ids, [0.0] * len(ids), "stop"), 0, "chat", key, reply)
            if message is not None:
                messages += [message, result]
        (branch,) = transcript.branches
        examples.append((branch.prompt + branch.tokens, [0] * len(branch.prompt) + branch.actions))
    return examples


def reinforce(model_dir: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    """RL from ``model_dir`` with the agent; the logged rows."""
    L.seed_everything(args.seed, verbose=False)
    rollout = Rollout(
        engine="hf",
        sampling=SamplingParams(n=args.group_size, temperature=1.0, max_tokens=CALL_TOKENS),
        reward=RewardConfig(fn="exact", timeout=None),  # the agent pays itself; unused
        validation=ValidationConfig(every_n_steps=args.eval_every),
        log_samples_every_n_steps=0,
        agent=AgentConfig(
            fn="lit_offpolicy.examples.calculator_agent:solve",
            concurrency=64,
            max_calls=3,
            max_prompt_tokens=32,
            max_response_tokens=RESPONSE_TOKENS,
        ),
    )
    return fit_rl(model_dir, out, rollout, args)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m lit_offpolicy.examples.agent_demo",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=0, help="model, warm-up, data and sampling seed")
    parser.add_argument("--out", type=Path, default=Path("outputs/agent_demo"), help="where it writes")
    parser.add_argument("--traces", type=int, default=256, help="training problems of the warm-up")
    parser.add_argument("--sft-steps", type=int, default=400, help="warm-up AdamW steps")
    parser.add_argument("--sft-batch", type=int, default=32, help="warm-up traces per step")
    parser.add_argument("--sft-lr", type=float, default=1e-3, help="warm-up learning rate")
    parser.add_argument("--rl-steps", type=int, default=40, help="RL steps")
    parser.add_argument("--rl-batch", type=int, default=16, help="rows per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per row (GRPO's group)")
    parser.add_argument("--rl-lr", type=float, default=2e-4, help="RL learning rate")
    parser.add_argument("--eval-every", type=int, default=10, help="RL steps between validations")
    parser.add_argument("--val", type=int, default=200, help="held-out problems of val/accuracy")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    init = create_agent_model(args.out / "init", args.seed)
    tokenizer = load_tokenizer(str(init))
    problems = get_task("multistep").train(args.traces, seed=args.seed)
    examples = traces(problems, tokenizer)
    loss = warm_up(init, args.out / "sft", examples, args.sft_steps, args.sft_batch, args.sft_lr, args.seed)
    sft_seconds = time.perf_counter() - started
    rows = reinforce(args.out / "sft", args.out, args)
    rewards = [round(float(r["reward/mean"]), 4) for r in rows if r.get("reward/mean")]
    window = max(1, min(10, len(rewards) // 2))  # the steps each end of the curve is averaged over
    summary = {
        "seed": args.seed,
        "sft_final_loss": round(loss, 4),
        "reward_mean_by_step": rewards,
        "val_accuracy": [(int(r["step"]), float(r["val/accuracy"])) for r in rows if r.get("val/accuracy")],
        "agent_calls_mean": [
            round(float(r["agent/calls_mean"]), 3) for r in rows if r.get("agent/calls_mean")
        ],
        "first_steps_mean": round(sum(rewards[:window]) / window, 4),
        "last_steps_mean": round(sum(rewards[-window:]) / window, 4),
        "sft_seconds": round(sft_seconds, 1),
        "rl_seconds": round(time.perf_counter() - started - sft_seconds, 1),
    }
    (args.out / "agent_demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"agent demo, seed {args.seed}: reward/mean over the first {window} RL steps "
        f"{summary['first_steps_mean']}, over the last {window} {summary['last_steps_mean']}; "
        f"val/accuracy {summary['val_accuracy']}",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
