"""Grading examples for the judge of configs/recipes/judge_grpo_cpu.yaml, on the built-in addition task.

Each row is the judge's prompt (``TEMPLATE`` filled with a problem, a candidate answer and the right
one) and the rating it should give: ``9`` when the candidate is the sum, ``0`` otherwise. Candidates
are what a policy on the task writes: half right, the rest a near miss (the sum ± 1..10), another
sum, or characters of the task that are not a number. A model SFT-trained on them
(configs/recipes/judge_sft_cpu.yaml) answers one digit, the judge's parser ``(\\d)``::

    python -m lit_offpolicy.examples.judge_data outputs/judge-data    # train.jsonl, val.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = "Rate {prompt}{completion} (the sum is {answer}) from 0 to 9: "
"""The judge's prompt: JudgeReward.template in configs/recipes/judge_grpo_cpu.yaml, the same text."""
RIGHT, WRONG = "9", "0"


def candidate(total: int, rng: random.Random) -> str:
    """An answer to a problem whose sum is ``total``: right half the time, else one kind of wrong."""
    kind = rng.random()
    if kind < 0.5:
        return str(total)
    if kind < 0.75:
        return str(max(0, total + rng.choice([-1, 1]) * rng.randint(1, 10)))
    if kind < 0.9:
        return str(rng.randint(0, 198))
    return "".join(rng.choice("0123456789+=") for _ in range(rng.randint(1, 4)))


def examples(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": judge prompt, "answer": rating}`` for random a+b= problems."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        completion = candidate(a + b, rng)
        prompt = TEMPLATE.format(prompt=f"{a}+{b}=", completion=completion, answer=a + b)
        rows.append({"prompt": prompt, "answer": RIGHT if completion == str(a + b) else WRONG})
    return rows


def write(directory: Path, train: int = 20000, val: int = 256, seed: int = 0) -> None:
    """``directory/train.jsonl`` and ``directory/val.jsonl``, drawn with different seeds."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, count, split_seed in (("train", train, seed), ("val", val, seed + 1)):
        lines = [json.dumps(row) for row in examples(count, split_seed)]
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where train.jsonl and val.jsonl go")
    parser.add_argument("--train", type=int, default=20000, help="training rows")
    parser.add_argument("--val", type=int, default=256, help="validation rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.directory, args.train, args.val, args.seed)
    print(f"wrote {args.directory / 'train.jsonl'} ({args.train} rows) and {args.directory / 'val.jsonl'}")


if __name__ == "__main__":
    main()
