"""``python -m lit_offpolicy.examples.tool_demo``: does a calculator tool pay on the ``multistep`` task?

Two arms from the same freshly initialized tiny Llama (the character tokenizer; 256 positions, since a
tool-use episode is about 130 tokens), on the same training problems, with the same step budgets:

- **without the tool**: a supervised warm-up on direct answers (``3+4*5=`` → ``23``), then RL on
  single responses;
- **with the tool**: a warm-up on tool-use traces we write ourselves (``3+4*5=`` →
  ``<tool_call>{"name":"calculator","arguments":{"expression":"3+4*5"}}</tool_call>``, the
  calculator's observation, then ``23``), trained on the policy's tokens only, then RL on episodes of
  ``ToolEnvironment(calculator)`` (``Rollout(episodes=...)``).

RL is GRPO + PPO with the exact-match reward on the last turn, greedy ``val/accuracy`` on held-out
problems before the first step and every ``--eval-every`` steps. Everything runs in this process on
the CPU and writes under ``--out``; the figures of a run are printed and written to
``<out>/tool_demo_summary.json`` (docs/multiturn.md records one).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from transformers import LlamaForCausalLM

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.callbacks import Rollout
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.data.tasks import get_task
from lit_offpolicy.environments import EpisodeConfig, ToolEnvironment, calculator
from lit_offpolicy.models import build_tokenizer, load_tokenizer, tiny_llama_config
from lit_offpolicy.rewards import RewardConfig
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.episodes import PLAIN_OBSERVATION
from lit_offpolicy.rollout.evaluation import ValidationConfig
from lit_offpolicy.training.options import OptimOptions

TASK = "multistep"
ANSWER_TOKENS = 5  # "-81" and eos fit: a direct answer, and the tool arm's last turn
CALL_TOKENS = 96  # a tool call (about 80 characters) and its eos
RESPONSE_TOKENS = 160  # a call, its observation (about 40 tokens) and the answer


def tool_call(expression: str) -> str:
    """The call the traces teach, in the Qwen/Hermes format ``ToolEnvironment`` parses."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def traces(problems: list[dict], tokenizer, with_tool: bool) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per problem: prompt, then the direct answer or the tool-use episode; the
    mask is 1 on the policy's tokens (the prompt and the calculator's observation are context)."""
    examples = []
    for problem in problems:
        prompt, answer = problem["prompt"], problem["answer"]
        ids = tokenizer(prompt).input_ids
        mask = [0] * len(ids)
        turns = [answer]
        if with_tool:
            expression = prompt.removesuffix("=")
            observation = PLAIN_OBSERVATION.format(calculator(expression))
            turns = [tool_call(expression), observation, answer]
        for index, text in enumerate(turns):
            tokens = tokenizer(text, add_special_tokens=False).input_ids
            policy = index % 2 == 0
            if policy:
                tokens = tokens + [tokenizer.eos_token_id]
            ids += tokens
            mask += [int(policy)] * len(tokens)
        examples.append((ids, mask))
    return examples


def create_model(path: Path, seed: int) -> Path:
    """The built-in tiny Llama with 256 positions instead of 128."""
    tokenizer = build_tokenizer()
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.model_max_length = 256
    tokenizer.save_pretrained(path)
    return path


def warm_up(
    init: Path, out: Path, examples: list, steps: int, batch_size: int, lr: float, seed: int
) -> float:
    """Masked next-token cross-entropy on ``examples`` for ``steps`` AdamW steps; the final loss."""
    model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32, local_files_only=True)
    tokenizer = load_tokenizer(str(init))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch]).bool()
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        target = mask[:, 1:]
        loss = F.cross_entropy(logits[target], ids[:, 1:][target])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return loss.item()


def fit_rl(model_dir: Path, out: Path, rollout: Rollout, args: argparse.Namespace) -> list[dict]:
    """GRPO + PPO from ``model_dir`` on ``multistep`` with ``rollout`` for ``args.rl_steps`` steps, in
    this process on the CPU; the rows of its ``metrics.csv`` (under ``out/rl``)."""
    module = OffPolicyModule(model_path=str(model_dir), advantage="grpo", optim=OptimOptions(lr=args.rl_lr))
    data = PromptDataModule(
        task=TASK,
        tokenizer_path=str(model_dir),
        batch_size=args.rl_batch,
        num_val_samples=args.val,
        seed=args.seed,
    )
    logger = CSVLogger(out, name="rl")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.rl_steps,
        logger=logger,
        callbacks=[rollout],
        log_every_n_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        return list(csv.DictReader(file))


def reinforce(
    model_dir: Path, out: Path, with_tool: bool, args: argparse.Namespace
) -> list[tuple[int, float]]:
    """RL from ``model_dir``: the (step, val/accuracy) curve."""
    L.seed_everything(args.seed, verbose=False)
    episodes = None
    if with_tool:
        episodes = EpisodeConfig(
            environment=ToolEnvironment(["calculator"]),
            max_turns=3,
            max_turn_tokens=CALL_TOKENS,
            max_response_tokens=RESPONSE_TOKENS,
        )
    rollout = Rollout(
        engine="hf",
        sampling=SamplingParams(n=4, temperature=args.temperature, max_tokens=ANSWER_TOKENS),
        reward=RewardConfig(fn="exact", timeout=None),
        validation=ValidationConfig(every_n_steps=args.eval_every),
        log_samples_every_n_steps=0,
        episodes=episodes,
    )
    rows = fit_rl(model_dir, out, rollout, args)
    curve = [(int(row["step"]), float(row["val/accuracy"])) for row in rows if row.get("val/accuracy")]
    steps = [row for row in rows if row.get("reward/mean")]
    keys = ["reward/mean", *sorted(key for key in rows[0] if key.startswith("env/"))]
    sampled = {
        when: {key: round(float(row[key]), 3) for key in keys if row.get(key)}
        for when, row in (("first_step", steps[0]), ("last_step", steps[-1]))
    }
    return curve, sampled


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m lit_offpolicy.examples.tool_demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/tool_demo"))
    parser.add_argument("--traces", type=int, default=256, help="training problems of the warm-ups")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-batch", type=int, default=32)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--rl-batch", type=int, default=16, help="prompts per RL step (x 4 samples)")
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--val", type=int, default=200, help="held-out problems of val/accuracy")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    init = create_model(args.out / "init", args.seed)
    tokenizer = load_tokenizer(str(init))
    problems = get_task(TASK).train(args.traces, seed=args.seed)
    summary = {"seed": args.seed, "arguments": {k: str(v) for k, v in vars(args).items()}}
    for arm, with_tool in (("without_tool", False), ("with_tool", True)):
        started = time.perf_counter()
        sft_dir = args.out / arm / "sft"
        examples = traces(problems, tokenizer, with_tool)
        loss = warm_up(init, sft_dir, examples, args.sft_steps, args.sft_batch, args.sft_lr, args.seed)
        sft_seconds = time.perf_counter() - started
        curve, sampled = reinforce(sft_dir, args.out / arm, with_tool, args)
        summary[arm] = {
            "sft_final_loss": round(loss, 4),
            "val_accuracy": curve,
            **sampled,
            "sft_seconds": round(sft_seconds, 1),
            "rl_seconds": round(time.perf_counter() - started - sft_seconds, 1),
        }
        print(
            f"=== {arm}: val/accuracy by RL step {curve} (SFT loss {loss:.4f}); sampled {sampled}", flush=True
        )
    (args.out / "tool_demo_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
