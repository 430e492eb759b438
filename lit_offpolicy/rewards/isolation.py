"""Isolated, time-limited scoring: a reward function that raises or hangs costs its samples, not the run."""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401  (its exit hook is registered before ours, so runs after it)
import signal
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.rewards.contract import (
    RewardContractError,
    RewardInputs,
    RewardOutput,
    RewardWorkersDied,
    WeightedRewards,
)

Rewards = Callable[[RewardInputs], RewardOutput]

log = logging.getLogger(__name__)
START_METHODS = ("fork", "forkserver", "spawn")
CHUNKS_PER_WORKER = 8  # tasks per worker and batch: few messages, and a hang costs 1/8 of a worker's share
_worker_rewards: Rewards | None = None


class IsolatedReward:
    """Runs ``rewards`` (``WeightedRewards``) one sample at a time in worker processes, under a deadline.

    - A sample whose scoring raises (or gives a non-finite score) scores 0 and counts in
      ``num_errors`` (the first message of a batch is logged).
    - A function that breaks the contract (``RewardContractError``: a wrong count, not a number)
      stops the run.
    - Samples not scored ``timeout`` seconds after the batch's start score 0 and count in
      ``num_timeouts``; the workers still busy are killed (SIGKILL) and replaced at the next call.
    - A worker that dies while scoring is replaced at once and its chunk scored again
      (``worker_restarts``); a second death scores the chunk 0 as errors; ``max_restarts`` deaths in
      a row, nothing scored between them, raise ``RewardWorkersDied``.
    - A batch travels in ``CHUNKS_PER_WORKER × num_workers`` chunks, each to a free worker: an error
      costs its sample, a hang its chunk.

    Workers start at the first call, ignore the signals sent to the process group (the trainer acts
    on them) and die with the trainer. Why processes, not threads: docs/reliability.md, "Reward
    isolation: processes, not threads".

    Args:
        rewards: scores a ``RewardInputs`` batch (``contract.WeightedRewards``).
        timeout: seconds one batch may take in all (> 0).
        num_workers: worker processes (≥ 1); samples of a batch are scored in parallel.
        start_method: multiprocessing start method ("fork", "forkserver" or "spawn").
        max_restarts: worker deaths in a row (≥ 0) after which the run stops.
    """

    def __init__(
        self,
        rewards: Rewards,
        timeout: float = 60.0,
        num_workers: int = 1,
        start_method: str = "fork",
        max_restarts: int = 3,
    ) -> None:
        self.rewards = rewards
        self.timeout = check_range("timeout", timeout, low=0.0, low_inclusive=False)
        self.num_workers = check_range("num_workers", num_workers, low=1)
        self.start_method = check_choice("start_method", start_method, START_METHODS)
        self.max_restarts = check_range("max_restarts", max_restarts, low=0)
        self._workers: list[_Worker] = []
        self._deaths_in_a_row = 0
        self._restarts = 0  # in the current batch
        _LIVE.add(self)

    def __call__(self, inputs: RewardInputs) -> RewardOutput:
        deadline = time.monotonic() + self.timeout
        total = len(inputs)
        size = max(1, math.ceil(total / (CHUNKS_PER_WORKER * self.num_workers)))
        chunks = [inputs.select(range(i, min(i + size, total))) for i in range(0, total, size)]
        self._restarts = 0
        results = self._score_chunks(chunks, deadline)
        scores, num_malformed, errors, num_timeouts = [], 0, [], 0
        counts: dict[str, int] = {}
        by_function: dict[str, list[float | None]] = {name: [] for name in self.names}
        errors_by_function = dict.fromkeys(self.names, 0)
        for chunk, result in zip(chunks, results, strict=True):
            if result is None:
                result = [_Scored(0.0, {}, 0, None)] * len(chunk)
                num_timeouts += len(chunk)
            for scored in result:
                if scored.contract_error is not None:
                    raise RewardContractError(scored.contract_error)
                scores.append(scored.score)
                num_malformed += scored.malformed
                if scored.error is not None:
                    errors.append(scored.error)
                for name in scored.failed:
                    errors_by_function[name] = errors_by_function.get(name, 0) + 1
                for name, count in scored.counts.items():
                    counts[name] = counts.get(name, 0) + count
                for name in self.names:
                    by_function[name].append(scored.values.get(name))
        if errors:
            log.warning(f"reward function failed on {len(errors)} of {total} samples: {errors[0]}")
        if num_timeouts:
            log.warning(
                f"reward {', '.join(map(repr, self.names))}: {num_timeouts} of {total} samples not scored "
                f"within reward.timeout={self.timeout} s"
            )
        return RewardOutput(
            scores,
            num_malformed,
            num_errors=len(errors),
            num_timeouts=num_timeouts,
            worker_restarts=self._restarts,
            by_function=by_function,
            errors_by_function={name: count for name, count in errors_by_function.items() if count},
            first_error=errors[0] if errors else None,
            counts=counts,
        )

    @property
    def names(self) -> list[str]:
        """The functions' names (``WeightedRewards.functions``), for ``RewardOutput.by_function``."""
        return list(getattr(self.rewards, "functions", {}))

    def _score_chunks(self, chunks: list[RewardInputs], deadline: float) -> list[list | None]:
        """Each chunk's ``_score_chunk`` result, sent to free workers as they come free; None for the
        chunks not back by ``deadline`` (their workers are killed)."""
        self._workers = [worker for worker in self._workers if worker.process.is_alive()]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker.start(self.rewards, self.start_method))
        results: list[list | None] = [None] * len(chunks)
        attempts = [0] * len(chunks)
        waiting = list(range(len(chunks)))
        free = list(self._workers)
        busy: dict[Connection, tuple[_Worker, int]] = {}

        def died(worker: _Worker, index: int) -> None:  # replace the worker; re-score the chunk once
            free.append(self._replace(worker))
            if attempts[index] < ATTEMPTS_PER_CHUNK:
                waiting.insert(0, index)
            else:
                results[index] = _died(chunks[index], self.names)

        while waiting or busy:
            while waiting and free:
                worker, index = free.pop(), waiting.pop(0)
                attempts[index] += 1
                try:
                    worker.connection.send(chunks[index])
                except OSError:  # it died while idle
                    died(worker, index)
                    continue
                busy[worker.connection] = (worker, index)
            remaining = deadline - time.monotonic()
            ready = wait(list(busy), timeout=remaining) if remaining > 0 else []
            if not ready:
                break
            for connection in ready:
                worker, index = busy.pop(connection)
                try:
                    results[index] = connection.recv()
                except EOFError:  # the worker died while scoring
                    died(worker, index)
                    continue
                self._deaths_in_a_row = 0
                free.append(worker)
        for worker, _ in busy.values():
            worker.kill()
        return results

    def _replace(self, dead: _Worker) -> _Worker:
        """A new worker in the place of ``dead``; ``RewardWorkersDied`` after more than
        ``max_restarts`` deaths in a row."""
        dead.process.join(EXIT_WAIT)  # its own exit status, not the SIGKILL of ``kill``
        status = dead.process.exitcode
        dead.kill()
        self._deaths_in_a_row += 1
        if self._deaths_in_a_row > self.max_restarts:
            self.close()
            names = ", ".join(map(repr, self.names)) or "the reward function"
            raise RewardWorkersDied(
                f"reward {names}: its worker process died {self._deaths_in_a_row} times in a row "
                f"({describe_exit(status)} the last time), more than reward.max_worker_restarts="
                f"{self.max_restarts}; the function ends the process it runs in (a crash in C code, "
                "os._exit, the kernel's OOM killer): call it on one sample in a Python shell to see how"
            )
        self._restarts += 1
        fresh = _Worker.start(self.rewards, self.start_method)
        self._workers = [fresh if worker is dead else worker for worker in self._workers]
        return fresh

    def close(self) -> None:
        """Kill the workers (a later call starts new ones); returns within a second or so."""
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_workers": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            self.close()


@dataclass(frozen=True)
class _Scored:
    """One sample's scoring in a worker."""

    score: float
    """The weighted total (0 where it failed)."""
    values: dict[str, float | None]
    """Each function's value by name (None where it did not apply)."""
    malformed: int
    """The malformed count (0 or 1)."""
    error: str | None
    """The exception's message where the scoring raised (then it scored 0)."""
    contract_error: str | None = None
    """The message where a function broke the contract (it stops the run)."""
    failed: tuple[str, ...] = ()
    """The functions that raised on it (all of them where its worker died)."""
    counts: dict[str, int] = field(default_factory=dict)
    """The functions' named counts for it (``RewardOutput.counts``)."""


def describe_exit(status: int | None) -> str:
    """A process's exit status in words: "killed by SIGKILL", "exit status 1"."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def _died(chunk: RewardInputs, names: list[str]) -> list[_Scored]:
    """The result of a chunk whose worker died: every sample scores 0 and counts as an error."""
    return [_Scored(0.0, {}, 0, "reward worker died", failed=tuple(names))] * len(chunk)


@dataclass
class _Worker:
    """One worker process and the trainer's end of its pipe."""

    # a pipe of its own, no lock shared with the other workers: killing one can never block the trainer
    # (as tearing down a multiprocessing.Pool whose worker died holding the task queue's lock can)
    process: BaseProcess
    """The worker (a daemon process)."""
    connection: Connection
    """The trainer's end of the worker's pipe."""

    @classmethod
    def start(cls, rewards: Rewards, start_method: str) -> _Worker:
        context = multiprocessing.get_context(start_method)
        mine, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs, rewards), daemon=True)
        process.start()
        theirs.close()
        return cls(process, mine)

    def kill(self) -> None:
        """SIGKILL and reap, waiting at most ``KILL_WAIT`` seconds."""
        self.connection.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(KILL_WAIT)


KILL_WAIT = 5.0
EXIT_WAIT = 1.0  # seconds a worker whose pipe closed gets to finish dying, so its exit status is its own
ATTEMPTS_PER_CHUNK = 2  # a chunk whose worker died is scored once more, by a new worker
_LIVE: weakref.WeakSet[IsolatedReward] = weakref.WeakSet()


@atexit.register
def _kill_workers_at_exit() -> None:
    """Registered after ``multiprocessing.util``'s exit hook, so it runs first: that hook SIGTERMs
    and joins daemonic children, which would wait forever on workers that ignore SIGTERM."""
    for reward in list(_LIVE):
        reward.close()


def _serve(connection: Connection, rewards: Rewards) -> None:
    """A worker's loop: score each chunk it receives until the trainer closes the pipe."""
    _install(rewards)
    while True:
        try:
            chunk = connection.recv()
        except (EOFError, OSError):
            return
        connection.send([_score_one(chunk.select([i])) for i in range(len(chunk))])


def _install(rewards: Rewards) -> None:
    """Worker set-up: the reward function, signals left to the trainer, one torch thread, death with
    the trainer. Signals sent to the process group (Ctrl+C, ``timeout``, SLURM) are ignored: the
    trainer decides, and kills the workers with SIGKILL."""
    global _worker_rewards
    _worker_rewards = rewards
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    if "torch" in sys.modules:
        # OpenMP's thread pool does not survive fork: a forked child entering a parallel region can
        # hang forever. One thread keeps torch (a reward model, a tensor op) out of such regions.
        sys.modules["torch"].set_num_threads(1)
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: a SIGKILLed trainer takes its workers with it
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _score_one(sample: RewardInputs) -> _Scored:
    """One sample's scoring in a worker; a failure scores 0 with its message."""
    try:
        if isinstance(_worker_rewards, WeightedRewards):  # a failure is put down to its function
            output = _worker_rewards(sample, catch_errors=True)
        else:
            output = _worker_rewards(sample)
        values = {name: values[0] for name, values in output.by_function.items()}
        failed = tuple(output.errors_by_function)
        return _Scored(
            output.scores[0],
            values,
            int(output.num_malformed),
            output.first_error,
            failed=failed,
            counts=output.counts,
        )
    except RewardContractError as error:
        return _Scored(0.0, {}, 0, None, contract_error=str(error))
    except Exception as error:
        return _Scored(0.0, {}, 0, f"{type(error).__name__}: {error}")
