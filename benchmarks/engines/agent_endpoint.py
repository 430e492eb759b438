"""The agents' endpoint: generation tokens/s through it against the same requests straight to the engine.

32 episodes at once, each an OpenAI-client agent (``openai.AsyncOpenAI``) making two chat calls: the
question, then the question, its reply and a tool result. Ours: ``AgentRunner.run`` (HTTP, the
transcript's token bookkeeping, batching into the engine's ``generate``). Baseline: the very prompts
the endpoint recorded, given to the same ``HFEngine.generate`` directly, first calls in one batch,
second calls in another (the best batching the endpoint can reach). A Qwen3 shape of 4 layers, width
256 (byte-level tokenizer, ChatML), float32, up to ``--max-tokens`` per call, on one torch thread.

Also reported: the endpoint's seconds per call beyond generation ((ours − baseline seconds) / calls).
Medians over ``--repeats`` alternating runs after a warm-up.

    python -m benchmarks.engines.agent_endpoint [--repeats 5] [--episodes 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import entry, generated_tokens, median, timed
from benchmarks.results import record
from lit_offpolicy.models import load_actor, load_tokenizer
from lit_offpolicy.rollout import HFEngine, SamplingParams
from lit_offpolicy.rollout.agents import AgentConfig, AgentRunner

AGENT = "benchmarks.engines.agent_endpoint:two_calls"


async def two_calls(client, row):
    """The benchmark's agent: a question, then the question, the reply and a tool result."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "42"})
    await client.chat.completions.create(model="policy", messages=messages)
    return 0.0


def write_model(path: Path) -> str:
    """A Qwen3 of 4 layers and width 256 with the tiny family's byte-level tokenizer and ChatML."""
    from transformers import AutoModelForCausalLM

    from lit_offpolicy.models.tiny import FAMILIES, build_bpe_tokenizer, family_config

    family = FAMILIES["qwen3"]
    tokenizer = build_bpe_tokenizer(family)
    config = family_config(family, tokenizer)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 256, 768, 4
    config.num_attention_heads, config.num_key_value_heads = 8, 4
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def main(
    repeats: int = 5,
    episodes: int = 32,
    max_tokens: tuple[int, ...] = (64, 256),
    argv: list[str] | None = None,
) -> list[dict]:
    if argv is not None:
        parser = argparse.ArgumentParser(prog="python -m benchmarks.engines.agent_endpoint")
        parser.add_argument("--repeats", type=int, default=repeats)
        parser.add_argument("--episodes", type=int, default=episodes)
        parser.add_argument("--max-tokens", type=int, nargs="+", default=list(max_tokens))
        args = parser.parse_args(argv)
        repeats, episodes, max_tokens = args.repeats, args.episodes, tuple(args.max_tokens)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model(Path(root) / "qwen3")
        tokenizer = load_tokenizer(model_dir)
        actor = load_actor(model_dir, torch.float32)
        engine = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id)
        return [measure(engine, tokenizer, episodes, tokens, repeats) for tokens in max_tokens]


def measure(engine: HFEngine, tokenizer, episodes: int, max_tokens: int, repeats: int) -> dict:
    """The entry of ``episodes`` two-call episodes of up to ``max_tokens`` tokens a call."""
    params = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, seed=0)
    config = AgentConfig(
        fn=AGENT, concurrency=episodes, max_prompt_tokens=64, max_response_tokens=3 * max_tokens
    )
    runner = AgentRunner(config, tokenizer)
    rows = [{"prompt": f"{a}+{a + 7}=", "answer": ""} for a in range(episodes)]
    ours_rates, base_rates, overheads = [], [], []
    for repeat in range(repeats + 1):  # the first is the warm-up
        recorder = _Recorder(engine)
        ours_seconds, batch = timed(
            lambda recorder=recorder: runner.run(recorder, rows, params, reward_fn=None)
        )
        ours_tokens = sum(sum(g.action_mask) for g in batch.generations)
        firsts = {tuple(prompt) for prompt in batch.prompt_ids}
        calls = [[p for p in recorder.prompts if (tuple(p) in firsts) == first] for first in (True, False)]
        base_seconds, base_tokens = timed(
            lambda calls=calls: sum(generated_tokens(engine.generate(call, params)) for call in calls)
        )
        if repeat:
            ours_rates.append(ours_tokens / ours_seconds)
            base_rates.append(base_tokens / base_seconds)
            overheads.append((ours_seconds - base_seconds * ours_tokens / base_tokens) / (2 * episodes))
    runner.close()
    return entry(
        f"agent_endpoint_vs_engine_{max_tokens}",
        "tokens/s",
        median(ours_rates),
        median(base_rates),
        repeats,
        threads=1,
        episodes=episodes,
        calls_per_episode=2,
        max_tokens_per_call=max_tokens,
        endpoint_ms_per_call=round(1000 * median(overheads), 2),
        target=0.9,
        note="Qwen3 shape 4x256, HF engine, float32, CPU; baseline: the recorded prompts straight to "
        "HFEngine.generate, one batch per call index",
    )


class _Recorder:
    """The engine, keeping every prompt it is given."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.prompts = engine, []
        self.policy_version = engine.policy_version

    def generate(self, prompts, params):
        self.prompts += prompts
        return self.engine.generate(prompts, params)


if __name__ == "__main__":
    record(main(argv=__import__("sys").argv[1:]))
