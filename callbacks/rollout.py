"""The Rollout callback: generates each training step's experience and evaluates the policy."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.distributed import gather_objects, max_over_ranks_each, reduce_metrics
from lit_offpolicy.core.records import RolloutHost, RolloutResult
from lit_offpolicy.core.tensorboard import tensorboard_experiments
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.data import batch_problems
from lit_offpolicy.environments import EpisodeConfig
from lit_offpolicy.rewards import RewardConfig, RewardFailure, RewardWorkersDied
from lit_offpolicy.rollout import ENGINES, EngineSpec, SamplingParams, ServersLostError
from lit_offpolicy.rollout.agents import AgentConfig
from lit_offpolicy.rollout.buffer import ProducerError, ProducerStalled
from lit_offpolicy.rollout.collapse import CollapseDetector
from lit_offpolicy.rollout.degenerate import DegenerateRewardDetector
from lit_offpolicy.rollout.evaluation import ValidationConfig
from lit_offpolicy.rollout.server import RequestFailed
from lit_offpolicy.rollout.vllm_engine import spec_from_vllm_kwargs
from lit_offpolicy.rollout.weight_sync import DEFAULT_BUCKET_MB
from lit_offpolicy.rollout.worker import RolloutWorker
from lit_offpolicy.training.checkpointing import PreemptionCheckpoint, _adopt_as_last


class Rollout(L.Callback):
    """Synchronous rollouts: sample ``sampling.n`` responses per prompt, score them, train.

    At each training batch a ``RolloutWorker`` samples and scores the batch's prompts and puts an
    ``Experience`` in ``batch["experience"]`` for the module's ``training_step``; this callback decides
    when the worker samples, pushes weights (version = RL steps done) and evaluates (also once before
    the first step). Under data parallelism every rank has its own engine and prompts, and the
    ``rollout/*`` and ``reward/*`` metrics are reduced over the ranks. Each option in full:
    docs/parameters.md, "Rollout and data".

    Args:
        engine: "hf" (transformers ``generate``), "vllm" (in-process ``vllm.LLM``) or an ``EngineSpec``.
        sampling: how to sample (``SamplingParams``); ``seed: null`` takes the run's ``seed_everything``.
        reward: the reward function and its isolation (``RewardConfig``).
        validation: when and how to evaluate, and when to stop (``ValidationConfig``).
        sync_every: RL steps between weight pushes to the engine; 1 keeps rollouts on-policy.
        colocate: put the engine to sleep while the trainer works (one GPU for both; an engine that sleeps).
        log_samples_every_n_steps: RL steps between sample generations written to TensorBoard as text.
        filter_groups: DAPO's dynamic sampling: drop the groups whose rewards are all equal (needs n ≥ 2).
        max_sampling_rounds: with ``filter_groups``, re-sample up to this many rounds in all (DAPO); 1: never.
        pre_rollout_filter: GRESO: a prompt after z uninformative groups is sampled w.p. this ** z; None: off.
        episodes: multi-turn episodes with an environment (``EpisodeConfig``; docs/multiturn.md); None: off.
        agent: episodes of your own agent program (``AgentConfig``; docs/agents.md); None: off.
        sync_bucket_mb: MiB per bucket of the weight sync (verl's update_weights_bucket_megabytes).
        vllm_kwargs: deprecated; ``VLLMEngineSpec`` arguments for ``engine="vllm"``.
    """

    def __init__(
        self,
        engine: str | EngineSpec = "hf",
        sampling: SamplingParams = SamplingParams(n=8),
        reward: RewardConfig = RewardConfig(),
        validation: ValidationConfig = ValidationConfig(),
        sync_every: int = 1,
        colocate: bool = False,
        log_samples_every_n_steps: int = 10,
        vllm_kwargs: dict | None = None,
        filter_groups: bool = False,
        max_sampling_rounds: int = 1,
        pre_rollout_filter: float | None = None,
        episodes: EpisodeConfig | None = None,
        sync_bucket_mb: int = DEFAULT_BUCKET_MB,
        agent: AgentConfig | None = None,
    ) -> None:
        spec = ENGINES.resolve(engine)
        if vllm_kwargs is not None:
            spec = spec_from_vllm_kwargs(spec, vllm_kwargs)
        if colocate and not spec.colocatable:
            able = ", ".join(repr(name) for name, cls in ENGINES.items() if cls.colocatable)
            raise ValueError(
                f"colocate=True needs an engine that frees its memory when asleep ({able}); "
                f"engine={type(spec).__name__} cannot"
            )
        self.colocate = colocate
        self.sync_every = check_range("sync_every", sync_every, low=1)
        if validation.every % self.sync_every:
            raise ValueError(
                f"validation.every_n_steps={validation.every_n_steps} must be a multiple of "
                f"sync_every={sync_every}: evaluation uses the engine, which holds the actor's weights "
                "only right after a sync"
            )
        self.log_samples_every_n_steps = check_range(
            "log_samples_every_n_steps", log_samples_every_n_steps, low=0
        )
        self.worker = RolloutWorker(
            spec,
            sampling,
            reward,
            validation,
            own_copy=self._engine_copies_actor(),
            filter_groups=filter_groups,
            max_sampling_rounds=max_sampling_rounds,
            pre_rollout_filter=pre_rollout_filter,
            episodes=episodes,
            sync_bucket_mb=sync_bucket_mb,
            agent=agent,
        )
        self.target = validation.target()
        self.collapse = CollapseDetector()
        self.degenerate = DegenerateRewardDetector()

    def state_dict(self) -> dict:
        state = {"target_held": self.target.held if self.target is not None else 0}
        if self.worker.history is not None:
            state["prompt_history"] = self.worker.history.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if self.target is not None:
            self.target.held = int(state_dict.get("target_held", 0))
        if self.worker.history is not None and "prompt_history" in state_dict:
            self.worker.history.load_state_dict(state_dict["prompt_history"])

    def _engine_copies_actor(self) -> bool:
        """Whether the engine must sample from its own copy of the actor (weights behind between syncs)."""
        return self.sync_every > 1

    # ----------------------------------------------------------------- lifecycle

    def most_stale(self) -> int:
        """The most weight versions a trained token may be behind the actor: sync_every − 1."""
        return self.sync_every - 1

    def on_fit_start(self, trainer: L.Trainer, pl_module: RolloutHost) -> None:
        self.worker.start(trainer, pl_module)
        note = stale_tokens_note(self.most_stale(), getattr(pl_module, "correction", None))
        if note is not None and trainer.is_global_zero:
            print(note, flush=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: RolloutHost) -> None:
        if self.worker.engine.policy_version != pl_module.policy_version:
            # a resumed run whose strategy restores the checkpoint after on_fit_start (FSDP2, DeepSpeed):
            # the engine was built on the weights from before it; every rank gets here alike
            with saves_last_when_stopped(trainer, self.worker.engine):  # awake: it sleeps below
                self.worker.sync(self.worker.weights(trainer, pl_module), pl_module.policy_version)
        if self.worker.validation.every:
            with saves_last_when_stopped(trainer, self.worker.engine):
                self._evaluate(trainer, pl_module)
        if self.colocate:
            self.worker.engine.sleep()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: RolloutHost, batch: dict, batch_idx: int):
        with self._engine_awake(), saves_last_when_stopped(trainer, self.worker.engine):
            problems = batch_problems(batch)
            result = self.worker.rollout(trainer, pl_module, problems, step=pl_module.policy_version)
        result = self.worker.equal_groups(result, pl_module.device)
        batch["experience"] = result.experience
        self._log_step(trainer, pl_module, result)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: RolloutHost, outputs, batch, batch_idx):
        version = pl_module.policy_version
        sync = version % self.sync_every == 0
        every = self.worker.validation.every
        evaluate = every and version % every == 0
        if not (sync or evaluate):
            return
        with self._engine_awake(), saves_last_when_stopped(trainer, self.worker.engine):
            if sync:
                seconds = self.worker.sync(self.worker.weights(trainer, pl_module), version)
                pl_module.log("timing/weight_sync", seconds, on_step=True, batch_size=1)
            if evaluate:
                self._evaluate(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: RolloutHost, exception: BaseException) -> None:
        self.worker.close()  # Lightning calls no teardown after an exception

    def teardown(self, trainer: L.Trainer, pl_module: RolloutHost, stage: str) -> None:
        self.worker.close()

    def _evaluate(self, trainer: L.Trainer, pl_module: RolloutHost) -> dict[str, float]:
        """Evaluate (the worker publishes the metrics); stop training once ``validation.stop_at`` has held,
        with one line saying so."""
        metrics = self.worker.evaluate(trainer, pl_module)
        if metrics and self.target is not None and self.target.reached(metrics["val/accuracy"]):
            trainer.should_stop = True
            pl_module.print(self.target.stop_line(metrics["val/accuracy"], trainer, "validation."))
        return metrics

    @contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """With ``colocate``: wake the engine for the block, put it back to sleep after."""
        if not self.colocate:
            yield
            return
        self.worker.engine.wake_up()
        try:
            yield
        finally:
            self.worker.engine.sleep()

    def _log_step(
        self, trainer: L.Trainer, pl_module: RolloutHost, result: RolloutResult, extra: dict | None = None
    ) -> None:
        """Log a step's rollout metrics (and ``extra``), reduced over the ranks, warn once if the reward
        collapsed (``CollapseDetector``) and once per metric if it is degenerate
        (``DegenerateRewardDetector``), and every ``log_samples_every_n_steps`` steps write a few
        sample generations as TensorBoard text."""
        metrics = {**result.metrics, **self.worker.engine_metrics(), **(extra or {})}
        metrics = reduce_metrics(metrics, pl_module.device)  # the same on every rank
        pl_module.log_dict(metrics, on_step=True, batch_size=len(result.experience))
        step = pl_module.policy_version
        warning = self.collapse.observe(
            step, metrics["reward/mean"], metrics.get("rollout/truncated_fraction")
        )
        warnings = [warning] if warning is not None else []
        warnings += self.degenerate.observe(step, metrics)
        if trainer.is_global_zero:
            for line in warnings:
                print(line, file=sys.stderr, flush=True)
        failure = self.worker.failed_rewards(metrics)
        if failure is not None:
            option = "reward.fn" if self.worker.agent is None else "agent.fn"
            raise RewardFailure(f"{failure}; saved {save_last(trainer)}", option)
        every = self.log_samples_every_n_steps
        if every and pl_module.policy_version % every == 0:
            for experiment in tensorboard_experiments(trainer):
                experiment.add_text("rollout/samples", "\n\n".join(result.texts[:8]), trainer.global_step)


def stale_tokens_note(most_stale: int, correction: RolloutCorrection | None) -> str | None:
    """The start-up line of a run that trains stale tokens with no rollout correction in its loss
    (``RolloutCorrection.changes_the_loss``); None where there is nothing to say."""
    if most_stale == 0 or (correction is not None and correction.changes_the_loss):
        return None
    return (
        f"lit-offpolicy: tokens up to {most_stale} weight version(s) old are trained with no rollout "
        "correction: their π_old is π_rollout, the policy that sampled them (the ratio PPO clips and "
        "TOPR tapers is π_θ / π_rollout), and no importance weight corrects the gap; for IS weights "
        "and rejection set model.rollout_correction (e.g. seq_is_rs; docs/async.md)"
    )


STOPPING_FAILURES = (ServersLostError, RequestFailed, RewardWorkersDied, ProducerStalled)
"""Failures outside the trainer that end the run: every rollout server lost, a request that fails on
servers that still answer, reward workers that die every time, an async producer that makes no progress."""


@contextmanager
def saves_last_when_stopped(trainer: L.Trainer, engine: object = None) -> Iterator[None]:
    """A ``STOPPING_FAILURES`` error (raised here, or the async producer's ``ProducerError`` from one):
    save ``last.ckpt``, then stop the run with the error, which the CLI prints as one line; after a
    signal (``PreemptionCheckpoint``) it ends the run as the signal asks instead.

    Under several ranks the block's end is where they meet, in the training thread: one ``all_reduce``
    (``agreed_failure``) tells every rank whether any failed, and which rollout servers any lost or
    brought back (``engine``'s ``server_states``, where it has one). Then every rank saves and stops,
    or none: a rank that stopped alone would leave the others waiting in a collective."""
    failure = None
    try:
        yield
    except (*STOPPING_FAILURES, ProducerError) as error:
        failure = error.__cause__ if isinstance(error, ProducerError) else error
        if not isinstance(failure, STOPPING_FAILURES):
            raise
    if trainer.world_size > 1:
        failure = agreed_failure(failure, engine, trainer.strategy.root_device)
    if failure is None:
        return
    signalled = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint) and c.requested_by]
    if signalled:  # the signal to the run's process group ended the servers too: a preemption
        signalled[0].stop_now(trainer, failure)
    stopped = type(failure)(f"{failure}; saved {save_last(trainer)}")
    stopped.agreed_by_ranks = trainer.world_size > 1  # the CLI prints it once (``exit_with_error``)
    raise stopped


def agreed_failure(failure: BaseException | None, engine: object, device) -> BaseException | None:
    """The ranks' failure, the same on every rank: ``failure`` where this rank failed, else the first
    failing rank's (named), else None. One ``all_reduce`` MAX of [failed, servers' states...]: the
    servers any rank lost are lost on every rank, those back serve on every rank
    (``engine.agree_on_servers``). A ``gather_objects`` more where one failed."""
    states = getattr(engine, "server_states", lambda: [])()
    agreed = max_over_ranks_each([int(failure is not None), *states], device)
    if states:
        engine.agree_on_servers(agreed[1:])
    if not agreed[0]:
        return None
    failures = gather_objects(None if failure is None else (type(failure), str(failure)))
    if failure is not None:
        return failure
    rank, (kind, message) = next((r, f) for r, f in enumerate(failures) if f is not None)
    return kind(f"on trainer rank {rank}: {message}")


def save_last(trainer: L.Trainer) -> str:
    """Save ``last.ckpt`` where ``PreemptionCheckpoint`` (else the first ``ModelCheckpoint``) keeps it;
    the path, or "no checkpoint (checkpointing is off)"."""
    if trainer.checkpoint_callback is None:
        return "no checkpoint (checkpointing is off)"
    savers = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    saver = savers[0] if savers else PreemptionCheckpoint()
    path = saver.checkpoint_path(trainer)
    _adopt_as_last(trainer, path)
    trainer.save_checkpoint(path)  # every rank: the failure is decided on metrics reduced over ranks
    return path
