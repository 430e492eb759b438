"""End to end against TRL: seconds per GRPO step and val/accuracy after the same number of steps.

Both sides start from the same SFT warm-up of the built-in tiny Llama (the demo's first stage:
``configs/sft_tiny.yaml``, run through the CLI into a temporary directory) and train GRPO on the
built-in addition task on the CPU, HF ``generate`` for rollouts (no vLLM on either side), with the
settings in ``SETTINGS``: 128 prompts × 4 samples per step, responses of at most 5 tokens, the
exact-answer reward, group-normalized advantages, clipped loss averaged over tokens, no KL, AdamW at a
constant learning rate, grad-norm clip 1.0, seed 0, one update per batch with the sampler's
log-probs as π_old (TRL: π_θ detached; ours: bypass mode, no π_old recompute). Ours is
``Trainer.fit`` of OffPolicyModule with the Rollout callback; TRL's is ``GRPOTrainer``
(``benchmarks/peers/trl_grpo.py``, run by the interpreter of ``.venv-bench``, which ``make bench-env``
builds: TRL is not a project dependency). Each side runs in a fresh process without logger,
checkpoints or in-loop evaluation; a step is the time between the ends of two consecutive optimizer
steps (rollout, reward, update, weight sync; the first is a warm-up). After the last step both final
models are scored by the same code (``lit_offpolicy.rollout.evaluation.evaluate``: greedy, exact match on the
256 held-out problems).

    python -m benchmarks.peers.end_to_end_trl [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks import REPO, repo_env
from benchmarks.common import entry, median, medians, timed
from benchmarks.results import record

BENCH_PYTHON = REPO / ".venv-bench" / "bin" / "python"
SETTINGS = {
    "prompts_per_step": 128,
    "samples_per_prompt": 4,
    "max_response_length": 5,
    "max_prompt_length": 64,
    "temperature": 1.0,
    "lr": 1e-4,
    "clip": 0.2,
    "max_grad_norm": 1.0,
    "num_val_samples": 256,
    "seed": 0,
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def require_trl_python(python: Path | str = BENCH_PYTHON) -> None:
    """Stop, saying what builds it, where TRL's interpreter (``.venv-bench``) is missing."""
    if not Path(python).exists():
        raise FileNotFoundError(f"{python} does not exist: build TRL's environment with `make bench-env`")


def validation_accuracy(model, tokenizer) -> float:
    """Greedy exact-match accuracy of ``model`` on the task's held-out problems (as ``Rollout.evaluate``)."""
    from lit_offpolicy.data.tasks import get_task
    from lit_offpolicy.rewards import RewardConfig
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.evaluation import evaluate

    problems = get_task("addition").val(SETTINGS["num_val_samples"], seed=SETTINGS["seed"])
    batch = {"prompt": [p["prompt"] for p in problems], "answer": [p["answer"] for p in problems]}
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
    reward = RewardConfig("exact").build()
    metrics = evaluate(engine, tokenizer, [batch], reward, SETTINGS["max_response_length"])
    return metrics["val/accuracy"]


def run_ours(model_dir: str, steps: int, root: str) -> dict:
    """GRPO with OffPolicyModule + Rollout(engine="hf"), as ``configs/grpo.yaml`` without KL and logs,
    in bypass mode (the rollout log-probs serve as π_old)."""
    import lightning as L

    from benchmarks.common import StepTimer, quiet_trainer
    from benchmarks.step_profile import Regions, install_ours
    from lit_offpolicy import OffPolicyModule
    from lit_offpolicy.advantages import GRPO
    from lit_offpolicy.callbacks import Rollout
    from lit_offpolicy.correction import RolloutCorrection
    from lit_offpolicy.data import PromptDataModule
    from lit_offpolicy.losses import PPO
    from lit_offpolicy.rollout import SamplingParams
    from lit_offpolicy.rollout.evaluation import ValidationConfig
    from lit_offpolicy.training.options import OptimOptions

    s = SETTINGS
    L.seed_everything(s["seed"], verbose=False)
    module = OffPolicyModule(
        model_dir,
        policy_loss=PPO(pg_clip=s["clip"], loss_agg_mode="token-mean"),
        advantage=GRPO(norm_by_std=True),
        # on-policy with the HF engine the sampler *is* the actor: π_old := π_rollout, no recompute;
        # TRL does the same with one update per generation (π_old := π_θ detached)
        rollout_correction=RolloutCorrection(bypass_mode=True),
        optim=OptimOptions(lr=s["lr"], max_grad_norm=s["max_grad_norm"]),
    )
    data = PromptDataModule(
        task="addition",
        tokenizer_path=model_dir,
        batch_size=s["prompts_per_step"],
        max_prompt_length=s["max_prompt_length"],
        num_val_samples=s["num_val_samples"],
        seed=s["seed"],
    )
    sampling = SamplingParams(
        n=s["samples_per_prompt"],
        temperature=s["temperature"],
        max_tokens=s["max_response_length"],
        seed=s["seed"],
    )
    rollout = Rollout(
        engine="hf",
        sampling=sampling,
        validation=ValidationConfig(every_n_steps=0),
        log_samples_every_n_steps=0,
    )
    stages: list[dict[str, float]] = []
    regions = Regions()
    install_ours(regions)

    def after_step() -> None:
        stages.append(_timing(trainer.callback_metrics))
        regions.end_step(timer.seconds[-1])

    timer = StepTimer(after_step=after_step)
    trainer = quiet_trainer(steps, [rollout, timer], root)
    trainer.fit(module, datamodule=data)
    return {
        "step_seconds": timer.seconds,
        "stage_seconds": medians(stages[1:]),
        "profile": regions.medians(),
        "val_accuracy": validation_accuracy(module.actor, module.tokenizer),
    }


def _timing(metrics: dict) -> dict[str, float]:
    """The step's ``timing/*`` metrics (generate, reward, prepare, update) as floats."""
    return {name: float(value) for name, value in metrics.items() if name.startswith("timing/")}


def sft_warmup(root: Path) -> Path:
    """The demo's first stage, through the CLI: tiny model, then SFT with ``configs/sft_tiny.yaml``."""
    config = yaml.safe_load((REPO / "configs" / "sft_tiny.yaml").read_text())
    config["model"]["init_args"]["model_path"] = str(root / "tiny-init")
    config["trainer"]["logger"] = False
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("HFExport"):
            callback["init_args"]["dirpath"] = str(root / "sft-tiny")
    (root / "sft.yaml").write_text(yaml.safe_dump(config))
    cli, env = [sys.executable, "-m", "lit_offpolicy"], repo_env(**OFFLINE)
    subprocess.run([*cli, "create-tiny-model", str(root / "tiny-init")], check=True, env=env)
    subprocess.run([*cli, "fit", "--config", str(root / "sft.yaml")], check=True, env=env, cwd=root)
    return root / "sft-tiny"


def binomial_standard_error(*accuracies: float) -> float:
    """The larger standard error sqrt(p(1 − p)/n) of accuracies on the n held-out problems."""
    return max(math.sqrt(p * (1 - p) / SETTINGS["num_val_samples"]) for p in accuracies)


def _side(python: Path | str, module: str, model_dir: Path, steps: int, out: Path) -> dict:
    command = [str(python), "-m", module, "--model", str(model_dir), "--steps", str(steps), "--out", str(out)]

    def run() -> dict:
        subprocess.run(command, check=True, env=repo_env(**OFFLINE), cwd=out.parent)
        return json.loads(out.read_text())

    seconds, result = timed(run)
    return {**result, "wall_seconds": seconds}


def main(steps: int = 30) -> list[dict]:
    require_trl_python()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("[end_to_end_trl] SFT warm-up (configs/sft_tiny.yaml)", flush=True)
        model_dir = sft_warmup(root)
        from lit_offpolicy.models import load_actor, load_tokenizer

        before = validation_accuracy(load_actor(model_dir), load_tokenizer(model_dir))
        print(f"[end_to_end_trl] ours: {steps} GRPO steps", flush=True)
        ours = _side(sys.executable, "benchmarks.peers.end_to_end_trl", model_dir, steps, root / "ours.json")
        print(f"[end_to_end_trl] TRL GRPOTrainer: {steps} GRPO steps", flush=True)
        trl = _side(BENCH_PYTHON, "benchmarks.peers.trl_grpo", model_dir, steps, root / "trl.json")
    s = SETTINGS
    workload = (
        f"GRPO from the SFT warm-up (val/accuracy {before:.3f}), {steps} steps of {s['prompts_per_step']} "
        f"prompts x {s['samples_per_prompt']}, <= {s['max_response_length']} tokens, lr {s['lr']}, "
        "HF generate, CPU, tiny Llama float32"
    )
    step_seconds = {name: side["step_seconds"][1:] for name, side in (("ours", ours), ("trl", trl))}
    return [
        entry(
            "end_to_end_vs_trl",
            "s",
            median(step_seconds["ours"]),
            median(step_seconds["trl"]),
            len(step_seconds["ours"]),
            target=1.5,  # issue 17's goal
            baseline_is=f"trl {trl['trl_version']} GRPOTrainer",
            wall_seconds={"ours": round(ours["wall_seconds"], 1), "trl": round(trl["wall_seconds"], 1)},
            ours_stage_seconds={name: round(value, 4) for name, value in ours["stage_seconds"].items()},
            profile={"ours": ours["profile"], "trl": trl["profile"]},
            workload=workload,
            what="seconds per RL step (rollout + reward + update), median after the first step",
        ),
        entry(
            "end_to_end_vs_trl_accuracy",
            "accuracy",
            ours["val_accuracy"],
            trl["val_accuracy"],
            1,
            target=1.0,
            val_accuracy_before_rl=round(before, 4),
            standard_error=round(binomial_standard_error(ours["val_accuracy"], trl["val_accuracy"]), 4),
            baseline_is=f"trl {trl['trl_version']} GRPOTrainer",
            workload=workload,
            what=f"val/accuracy after {steps} steps, greedy, {s['num_val_samples']} held-out problems",
        ),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # with --out: run our side only (a child)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:
        Path(args.out).write_text(json.dumps(run_ours(args.model, args.steps, str(args.out.parent))))
    else:
        record(main(args.steps))
