"""What the benchmarks share: the machine line, medians, a fixed Experience, and Lightning step timing."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import lightning as L
import torch

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.data.tasks import get_task

# The demo's RL batch (configs/base/data.yaml, configs/base/trainer.yaml) with longer responses.
NUM_PROMPTS, GROUP_SIZE, RESPONSE_LENGTH = 128, 4, 16


def machine(threads: int | None = None) -> str:
    """CPU, core count, torch threads (``threads``: the runs' own, where they ran in other processes;
    default this process's), the GPU if there is one, and versions: the line every entry carries."""
    import lightning

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (
        f"{platform.machine()} {os.cpu_count()} CPUs{gpu}, torch {torch.__version__} "
        f"({threads or torch.get_num_threads()} threads), lightning {lightning.__version__}, "
        f"Python {platform.python_version()}"
    )


def median(values: list[float]) -> float:
    return statistics.median(values)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def entry(
    name: str, unit: str, ours: float, baseline: float, repeats: int, threads: int | None = None, **fields
) -> dict:
    """One results.json entry. ``ratio`` is higher-is-better for us: baseline/ours for costs
    (seconds, MiB), ours/baseline for rates (tokens/s, accuracy); ``threads``: see ``machine``."""
    numerator, denominator = (baseline, ours) if unit in ("s", "MiB") else (ours, baseline)
    ratio = round(numerator / denominator, 3) if denominator else None
    return {
        "name": name,
        "unit": unit,
        "ours": _round(ours),
        "baseline": _round(baseline),
        "ratio": ratio,
        "repeats": repeats,
        "machine": machine(threads),
        **fields,
    }


def _round(value: float) -> float:
    """Four significant digits below 100, one decimal above."""
    return float(f"{value:.4g}") if abs(value) < 100 else round(value, 1)


def fixed_experience(
    tokenizer,
    num_prompts: int = NUM_PROMPTS,
    group_size: int = GROUP_SIZE,
    response_length: int = RESPONSE_LENGTH,
    seed: int = 0,
) -> Experience:
    """A realistic batch of rollouts built by hand: real addition prompts (left-padded), random response
    tokens of random length 4..``response_length`` ending in eos (right-padded to ``response_length``),
    rollout log-probs around −2, 0/1 scores, ``group_size`` samples per prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [p["prompt"] for p in get_task("addition").train(num_prompts, seed=seed)]
    prompt_ids = tokenizer(prompts).input_ids
    samples = num_prompts * group_size
    lengths = torch.randint(4, response_length + 1, (samples,), generator=generator)
    responses = torch.randint(4, len(tokenizer), (samples, response_length), generator=generator)
    mask = (torch.arange(response_length)[None, :] < lengths[:, None]).long()
    responses[torch.arange(samples), lengths - 1] = tokenizer.eos_token_id
    responses = torch.where(mask.bool(), responses, tokenizer.pad_token_id)
    width = max(len(p) for p in prompt_ids)
    prompt_tensor = torch.full((samples, width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((samples, width), dtype=torch.long)
    for row in range(samples):
        ids = prompt_ids[row // group_size]
        prompt_tensor[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    rollout_log_probs = (-2.0 + 0.5 * torch.randn((samples, response_length), generator=generator)) * mask
    return Experience(
        prompt_ids=prompt_tensor,
        prompt_mask=prompt_mask,
        response_ids=responses,
        response_mask=mask,
        rollout_log_probs=rollout_log_probs.clamp(max=0.0),
        scores=torch.randint(0, 2, (samples,), generator=generator).float(),
        group_ids=torch.arange(samples) // group_size,
        policy_versions=torch.zeros(samples, dtype=torch.long),
    )


def fresh(exp: Experience, version: int | None = None) -> Experience:
    """The rollout fields only, as the Rollout callback hands them over (the module fills the rest);
    ``version``: sampled by that policy version (the trainer's own: on-policy), else as ``exp`` says."""
    versions = exp.policy_versions if version is None else torch.full_like(exp.policy_versions, version)
    return Experience(
        prompt_ids=exp.prompt_ids,
        prompt_mask=exp.prompt_mask,
        response_ids=exp.response_ids,
        response_mask=exp.response_mask,
        rollout_log_probs=exp.rollout_log_probs,
        scores=exp.scores,
        group_ids=exp.group_ids,
        policy_versions=versions,
        temperature=exp.temperature,
    )


class FeedExperience(L.Callback):
    """Puts the same rollouts into every training batch, as the Rollout callback would put new ones."""

    def __init__(self, exp: Experience) -> None:
        self.exp = exp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        batch["experience"] = fresh(self.exp, pl_module.policy_version)


class StepTimer(L.Callback):
    """Seconds between consecutive ``on_train_batch_end`` calls: one whole step of the loop as Lightning
    runs it (data, batch hooks, rollout, training step, weight sync). Put it after the other callbacks.
    ``after_step`` (optional) runs after each measurement and is not timed."""

    def __init__(self, after_step: Callable[[], None] | None = None) -> None:
        self.seconds: list[float] = []
        self.after_step = after_step
        self._mark: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._mark)
        if self.after_step is not None:
            self.after_step()
        self._mark = time.perf_counter()


def dummy_batches(steps: int) -> torch.utils.data.DataLoader:
    """``steps`` empty prompt batches for a Trainer whose rollouts come from FeedExperience."""
    return torch.utils.data.DataLoader(
        [{"prompt": "", "answer": ""}] * steps, batch_size=1, collate_fn=lambda items: {"index": len(items)}
    )


def fit_on_fixed_experience(
    module, exp: Experience, steps: int, callbacks: list, root: str, accelerator: str = "cpu"
) -> None:
    """``steps`` training steps of ``module`` on ``exp`` under a quiet Trainer (``callbacks`` run last)."""
    trainer = quiet_trainer(steps, [FeedExperience(exp), *callbacks], root, accelerator)
    trainer.fit(module, train_dataloaders=dummy_batches(steps))


def quiet_trainer(max_steps: int, callbacks: list, root: str, accelerator: str = "cpu") -> L.Trainer:
    """A one-device Trainer (CPU unless ``accelerator`` says otherwise) without logger, checkpoints,
    progress bar or summary: only the loop is measured."""
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=root,
    )
