"""What the benchmarks share: the machine line, timing (one call, alternating sides, steps), medians,
memory readings, fixed batches as an Experience, and Lightning step timing."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import lightning as L
import torch

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.data.tasks import get_task

T = TypeVar("T")

# The demo's RL batch (configs/base/data.yaml, configs/base/trainer.yaml) with longer responses.
NUM_PROMPTS, GROUP_SIZE, RESPONSE_LENGTH = 128, 4, 16
GB, MiB = 1e9, 2**20


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


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's median over ``rows`` (the keys of the last row)."""
    return {name: median([row[name] for row in rows]) for name in rows[-1]}


def timed(fn: Callable[[], T], sync: Callable[[], object] | None = None) -> tuple[float, T]:
    """(seconds, result) of one call; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock
    starts and before it stops, so that the device's queued work is counted."""
    if sync is not None:
        sync()
    started = time.perf_counter()
    result = fn()
    if sync is not None:
        sync()
    return time.perf_counter() - started, result


def alternate(sides: dict[str, Callable[[], T]], repeats: int, warmups: int = 1) -> dict[str, list[T]]:
    """Each side's figures (what its call returns) over ``repeats`` rounds after ``warmups`` rounds whose
    figures are dropped; the sides take turns within a round, so drift on a shared machine hits all alike."""
    figures: dict[str, list[T]] = {name: [] for name in sides}
    for round_ in range(warmups + repeats):
        for name, measure in sides.items():
            figure = measure()
            if round_ >= warmups:
                figures[name].append(figure)
    return figures


def generated_tokens(groups) -> int:
    """The tokens that came back from an engine's ``generate`` (per prompt, its samples), stop tokens
    included."""
    return sum(len(sample.token_ids) for group in groups for sample in group)


def within(context: Callable[[], contextlib.AbstractContextManager], fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` run inside a fresh ``context()`` at each call: a side of ``alternate`` that is another side
    with a switch turned."""

    def call() -> T:
        with context():
            return fn()

    return call


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: peak of this process image) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def process_peak_rss_mib() -> float:
    """The process's peak RSS since it started, across OffPolicyModule's per-step resets, in MiB."""
    from lit_offpolicy.core.memory import process_peak_rss_bytes

    return process_peak_rss_bytes() / MiB


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors hold (a state dict's ``values()``: a weight sync's size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


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


def as_experience(batch: dict[str, torch.Tensor]) -> Experience:
    """A fixed batch of tensors (``memory_vs_trl.fixed_batch``, ``update_throughput_vs_trl.fixed_batch``)
    as the rollouts of policy version 0; its ``advantages``, which the module computes, left out."""
    fields = {name: tensor for name, tensor in batch.items() if name != "advantages"}
    return Experience(**fields, policy_versions=torch.zeros(len(batch["scores"]), dtype=torch.long))


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


class StepClock:
    """Seconds between the ends of consecutive steps (``step_end``), the first from ``start``;
    ``after_step`` (optional) runs after each measurement and is not timed."""

    def __init__(self, after_step: Callable[[], None] | None = None) -> None:
        self.seconds: list[float] = []
        self.after_step = after_step
        self._mark: float | None = None

    def start(self) -> None:
        self._mark = time.perf_counter()

    def step_end(self) -> None:
        self.seconds.append(time.perf_counter() - self._mark)
        if self.after_step is not None:
            self.after_step()
        self._mark = time.perf_counter()


class StepTimer(StepClock, L.Callback):
    """``StepClock`` between consecutive ``on_train_batch_end`` calls: one whole step of the loop as
    Lightning runs it (data, batch hooks, rollout, training step, weight sync). Put it after the other
    callbacks."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_end()


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
