"""A 2-process DDP fit (gloo, CPU) of a few RL steps on the tiny model, for
tests/integration/test_distributed.py.

    python tests/helpers/ddp_rl_fit.py MODEL_DIR OUT_DIR [STRATEGY [ACCELERATOR DEVICES]]
    python tests/helpers/ddp_rl_fit.py MODEL_DIR --runs RUNS.json

STRATEGY: ``ddp`` (default), ``fsdp`` (FSDP2: ``ModelParallelStrategy``) or any Lightning strategy
name (``deepspeed_stage_2``...); ACCELERATOR and DEVICES default to ``cpu 2`` (gloo), e.g.
``gpu 1`` for a GPU check. Lightning starts rank 1 by running
this same command again. ``--runs``: the fits of RUNS.json (a list of ``{"out", "strategy",
"options", "model"}``, options the ``DDP_FIT_*`` settings below, model a directory in place of
MODEL_DIR or null) one after another in the same 2 CPU
processes and process group (each a new Trainer, module and seed; rank 0's ``LOCAL_RANK`` keeps
Lightning from starting rank 1 again): 2 process start-ups in all, not 2 per fit. Each rank writes to
OUT_DIR: ``initial.pt`` (rank 0, the actor before training), ``rank{r}.pt`` (the actor after fit),
``rank{r}_steps.pt`` (per RL step: its prompts, group ids, scores, response mask, the
advantages ``prepare`` computed, the engine's log-probs of the samples and the actor's teacher-forced
ones) and ``rank{r}_collectives.pt`` (``gather_rows``, ``reduce_metrics`` and ``min_over_ranks``
on inputs that differ by rank, in the same process group after the fit) and
``rank{r}_val.pt`` (the rank's validation prompts, one per batch, and ``Rollout.evaluate``'s metrics
after the fit, scored by ``AnswerHashReward``).
With ``DDP_FIT_MAX_STALENESS=k`` in the environment (or a run's options) the rollouts come from
``AsyncRollout`` (a producer thread per rank, at most k weight versions behind), and each step also
records the samples' policy versions and the trainer's. With ``DDP_FIT_GRADIENT_CHECKPOINTING=1`` the actor
trains with ``gradient_checkpointing``. With ``DDP_FIT_LORA=1`` it trains LoRA adapters (r = 4 on
q_proj and v_proj) with a KL loss to the reference, the actor with its adapters disabled; the saved
weights are then the merged ones the engines receive, and ``HFExport`` writes OUT_DIR/actor.
The reward is a hash of the response text (``HashReward`` of tests/helpers/__init__.py): an
untrained model never answers right, and a zero reward would train nothing.
With ``DDP_FIT_FILTER=1`` the rollout filters uninformative groups (``filter_groups``, 2 sampling
rounds) and the reward is ``FirstGroupOnRankOne``: rank 1 finds one informative group per round, so
it ends with 2 groups where rank 0 holds 4; one optimizer step per RL step (no mini-batches), and
each step also records the rollout metrics logged for it (``callback_metrics``).
With ``DDP_FIT_TOKEN_BUDGET=N`` as well, the update is padding-free, per-sample rows (``shared_prefix``
off), with micro-batches of at most N tokens (``update.max_tokens_per_micro_batch``): rank 0's 16
samples make more micro-batches than rank 1's 8, and the ranks must still make as many backward passes
(DDP all-reduces in each).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import zlib
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from helpers import HashReward
from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.distributed import (
    destroy_process_group,
    gather_rows,
    min_over_ranks,
    reduce_metrics,
)
from lit_offpolicy.core.distributed import rank as distributed_rank
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.models.lora import LoraOptions
from lit_offpolicy.rewards import RewardConfig, WeightedRewards
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.evaluation import ValidationConfig
from lit_offpolicy.rollout.weight_sync import full_state_dict
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.micro_batches import by_token_budget
from lit_offpolicy.training.options import AdvantageShaping, KLOptions, OptimOptions, UpdateOptions
from lit_offpolicy.training.packing import sample_lengths

RL_STEPS = 3
LORA = {
    "lora": LoraOptions(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]),
    "kl": KLOptions(use_loss=True, loss_coef=0.1),
}


class FirstGroupOnRankOne:
    """``HashReward``'s scores, except on rank 1, where every response after the first ``n`` (the
    first prompt's group) scores 0: rank 1's rounds then hold one informative group each."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, completions: list[str], **columns) -> list[float]:
        scores = HashReward()(completions)
        return scores if distributed_rank() == 0 else scores[: self.n] + [0.0] * (len(scores) - self.n)


class AnswerHashReward:
    """For validation: a hash of response and answer, so that every problem scores differently."""

    def __call__(self, completions: list[str], answer: list[str], **columns) -> list[float]:
        return [zlib.crc32((c + "|" + a).encode()) % 5 / 4 for c, a in zip(completions, answer, strict=True)]


class RecordSteps(L.Callback):
    """After the Rollout callback: keep each step's prompts and, from ``prepare`` on a copy, advantages."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict] = []

    def on_fit_start(self, trainer, pl_module):
        initial = full_state_dict(trainer.strategy, pl_module)  # a collective under FSDP2
        if trainer.is_global_zero:
            torch.save({k: v.detach().cpu().clone() for k, v in initial.items()}, self.out / "initial.pt")
        self.sharded = any(isinstance(p, DTensor) for p in pl_module.actor.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        experience = copy.deepcopy(batch["experience"])
        pl_module.prepare(experience)  # a collective: every rank runs it at the same point
        # the trainer's teacher-forced log-probs of the samples, from the (sharded) actor: a collective too
        actor_log_probs = frozen_log_probs(pl_module.actor, experience, experience.temperature, 16)
        self.steps.append(
            {
                "prompts": list(batch["prompt"]),
                "group_ids": experience.group_ids,
                "scores": experience.scores,
                "response_mask": experience.response_mask,
                "advantages": experience.advantages,
                "rollout_log_probs": experience.rollout_log_probs,
                "actor_log_probs": actor_log_probs,
                "sample_versions": experience.policy_versions,
                "trainer_version": pl_module.policy_version,
            }
        )
        budget = pl_module.update_options.max_tokens_per_micro_batch
        if budget is not None:  # this rank's own micro-batch count, and the count agreed over ranks
            self.steps[-1]["own_micro_batches"] = len(by_token_budget(sample_lengths(experience), budget))
            self.steps[-1]["micro_batches"] = len(pl_module.micro_batches(experience))  # a collective

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = trainer.callback_metrics
        self.steps[-1]["metrics"] = {k: float(v) for k, v in logged.items() if k.startswith("rollout/")}
        self.steps[-1]["shared_prefix_saving"] = float(logged.get("perf/shared_prefix_saving", 0.0))


def main(model_dir: str, out: Path, strategy: str, accelerator: str, devices: int, options: dict) -> None:
    """One fit into ``out``; ``options``: the ``DDP_FIT_*`` settings."""
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    lora = options.get("DDP_FIT_LORA") == "1"
    filtered = options.get("DDP_FIT_FILTER") == "1"
    budget = options.get("DDP_FIT_TOKEN_BUDGET")
    micro = {"micro_batch_size": 4}
    if budget is not None:  # per-sample rows: in shared rows (the default) both ranks fit in as many
        micro = {"max_tokens_per_micro_batch": int(budget), "shared_prefix": False}
    module = OffPolicyModule(
        model_path=model_dir,
        optim=OptimOptions(lr=1e-2),
        advantage_shaping=AdvantageShaping(whiten=True),
        update=UpdateOptions(mini_batch_size=None if filtered else 8, **micro),
        padding_free=budget is not None,
        gradient_checkpointing=options.get("DDP_FIT_GRADIENT_CHECKPOINTING") == "1",
        **(LORA if lora else {}),
    )
    data = PromptDataModule(
        task="addition", batch_size=4, num_train_samples=32, num_val_samples=8, val_batch_size=1
    )
    data.set_tokenizer(module.tokenizer)
    rollout_options = {
        "sampling": SamplingParams(n=4, max_tokens=4, seed=0),
        "reward": RewardConfig(fn=FirstGroupOnRankOne(4) if filtered else HashReward(), timeout=None),
        "validation": ValidationConfig(every_n_steps=0),
        "log_samples_every_n_steps": 0,
    }
    if filtered:
        rollout_options.update(filter_groups=True, max_sampling_rounds=2)
    max_staleness = options.get("DDP_FIT_MAX_STALENESS")
    if max_staleness is None:
        rollout = callbacks.Rollout(**rollout_options)
    else:
        rollout = callbacks.AsyncRollout(max_staleness=int(max_staleness), **rollout_options)
    recorder = RecordSteps(out)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=ModelParallelStrategy() if strategy == "fsdp" else strategy,
        # two mini-batches of 8 of the 16 samples per rank: 2 optimizer steps per RL step (filtered: 1)
        max_steps=RL_STEPS if filtered else RL_STEPS * 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[rollout, recorder, *([callbacks.HFExport(str(out / "actor"))] if lora else [])],
    )
    trainer.fit(module, datamodule=data)
    rank = trainer.global_rank
    actor = full_state_dict(trainer.strategy, module)  # the gather the engine sync uses
    torch.save({k: v.detach().cpu().clone() for k, v in actor.items()}, out / f"rank{rank}.pt")
    torch.save({"steps": recorder.steps, "sharded": recorder.sharded}, out / f"rank{rank}_steps.pt")
    torch.save(collectives(rank), out / f"rank{rank}_collectives.pt")
    rollout.worker.reward_fn = WeightedRewards({"answer_hash": AnswerHashReward()})
    rollout.worker.start(trainer, module)  # a new engine (teardown closed the fit's) on the final weights
    validation = {
        "prompts": [p for batch in data.val_dataloader() for p in batch["prompt"]],
        "metrics": rollout.worker.evaluate(trainer, module),  # a collective: the counts are summed
    }
    torch.save(validation, out / f"rank{rank}_val.pt")
    torch.distributed.barrier()  # rank 0 leaves (or starts the next fit) once rank 1's files are written


def exit_without_finalising() -> None:
    """Leave with status 0 once every output is written, skipping the interpreter's finalisation.

    Under FSDP2 on CPU a rank at times still died with SIGABRT ("terminate called without an active
    exception") after ``destroy_process_group`` had returned, as gloo objects that the device mesh
    still referenced were torn down with the interpreter (seen once in CI, never in 20 local runs).
    This harness checks what training computed, all of it saved above; the exit is not its subject.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def collectives(rank: int) -> dict:
    """Rank 0 holds 2 rows of width 3, rank 1 3 rows of width 2; the metric sets differ too."""
    rows, width = (2, 3) if rank == 0 else (3, 2)
    values = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width) + 100 * rank
    ids = torch.arange(rows) + 10 * rank
    (gathered, gathered_ids, missing), mine = gather_rows(values, ids, None)
    metrics = {"a": float(rank), "len_max": float(rank + 5), "len_min": float(rank + 5)}
    metrics["perf/peak_rss"] = float(2 - rank)  # a peak-memory figure: the largest over the ranks
    if rank == 1:
        metrics["only_one"] = 7.0
    return {
        "gathered": gathered,
        "ids": gathered_ids,
        "missing": missing,
        "mine": (mine.start, mine.stop),
        "metrics": reduce_metrics(metrics),
        "fewest": min_over_ranks(7 if rank == 0 else 3),
    }


if __name__ == "__main__":
    if sys.argv[2] == "--runs":
        for run in json.loads(Path(sys.argv[3]).read_text()):
            model_dir = run.get("model") or sys.argv[1]
            main(model_dir, Path(run["out"]), run["strategy"], "cpu", 2, run["options"])
    else:
        strategy, accelerator, devices = (sys.argv[3:] + ["ddp", "cpu", "2"][len(sys.argv) - 3 :])[:3]
        main(sys.argv[1], Path(sys.argv[2]), strategy, accelerator, int(devices), dict(os.environ))
    destroy_process_group()  # as the CLI does: an open gloo group can abort the interpreter's exit
    exit_without_finalising()
