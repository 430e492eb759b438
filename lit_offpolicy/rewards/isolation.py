"""Isolated, time-limited scoring: a reward function that raises or hangs costs its samples, not the run."""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import signal
import sys
import time
from multiprocessing.pool import Pool

from lit_offpolicy.checks import check_choice, check_range
from lit_offpolicy.rewards.verifiers import RewardFn, RewardOutput

log = logging.getLogger(__name__)
START_METHODS = ("fork", "forkserver", "spawn")
CHUNKS_PER_WORKER = 8  # tasks per worker and batch: few messages, and a hang costs 1/8 of a worker's share
_worker_reward_fn: RewardFn | None = None


class IsolatedReward:
    """Runs ``reward_fn`` one sample at a time in a pool of worker processes, under a deadline.

    A sample whose call raises (or returns other than one finite score) scores 0 and counts in
    ``num_errors`` (the first message of a batch is logged); samples not scored within ``timeout``
    seconds of the batch's start score 0 and count in ``num_timeouts``. When any timed out, the pool
    is terminated (a hung worker is killed, which a thread could not be) and started afresh at the
    next call. A batch travels to the workers in ``CHUNKS_PER_WORKER × num_workers`` chunks rather
    than one message per sample (fewer, larger messages; docs/reliability.md has the measured cost); a
    worker still calls ``reward_fn`` sample by sample, so an error costs only its sample, while a
    hang costs its whole chunk (the chunk's other samples time out with it; the other workers go on).

    Processes rather than threads: a thread stuck in a loop cannot be stopped, keeps its CPU share
    for the rest of the run, and a stuck C extension holding the GIL would stall the trainer too.
    The price is that ``reward_fn`` must pickle (a module-level class or function) and that each
    call pays inter-process transfers, small next to generation. Workers are forked (Linux) at the
    first call, as PyTorch's DataLoader workers are; they run plain Python, never CUDA.

    Args:
        reward_fn: a RewardFn (``__call__(responses, answers) -> RewardOutput``).
        timeout: seconds one batch may take in all (> 0).
        num_workers: worker processes (≥ 1); samples of a batch are scored in parallel.
        start_method: multiprocessing start method ("fork", "forkserver" or "spawn").
    """

    def __init__(
        self, reward_fn: RewardFn, timeout: float = 60.0, num_workers: int = 1, start_method: str = "fork"
    ) -> None:
        self.reward_fn = reward_fn
        self.timeout = check_range("timeout", timeout, low=0.0, low_inclusive=False)
        self.num_workers = check_range("num_workers", num_workers, low=1)
        self.start_method = check_choice("start_method", start_method, START_METHODS)
        self._pool: Pool | None = None

    def __call__(self, responses: list[str], answers: list[str]) -> RewardOutput:
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        deadline = time.monotonic() + self.timeout
        pool = self._ensure_pool()
        size = max(1, math.ceil(len(responses) / (CHUNKS_PER_WORKER * self.num_workers)))
        starts = range(0, len(responses), size)
        pending = [
            pool.apply_async(_score_chunk, (responses[i : i + size], answers[i : i + size])) for i in starts
        ]
        scores, num_malformed, errors, num_timeouts = [], 0, [], 0
        for start, result in zip(starts, pending, strict=True):
            result.wait(max(0.0, deadline - time.monotonic()))
            if not result.ready():
                chunk_len = min(size, len(responses) - start)
                scores.extend([0.0] * chunk_len)
                num_timeouts += chunk_len
                continue
            for score, malformed, error in result.get():
                scores.append(score)
                num_malformed += malformed
                if error is not None:
                    errors.append(error)
        if errors:
            log.warning(f"reward function failed on {len(errors)} of {len(responses)} samples: {errors[0]}")
        if num_timeouts:
            log.warning(f"{num_timeouts} of {len(responses)} samples not scored within {self.timeout} s")
            self.close()  # kills the hung workers
        return RewardOutput(scores, num_malformed, num_errors=len(errors), num_timeouts=num_timeouts)

    def _ensure_pool(self) -> Pool:
        if self._pool is None:
            context = multiprocessing.get_context(self.start_method)
            self._pool = context.Pool(self.num_workers, initializer=_install, initargs=(self.reward_fn,))
        return self._pool

    def close(self) -> None:
        """Terminate the workers (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.terminate()


def _install(reward_fn: RewardFn) -> None:
    """Worker set-up: the reward function, default signal handling, one torch thread, death with the trainer.

    A forked worker inherits the trainer's Python signal handlers; Lightning's SIGTERM handler
    only records the signal, so the worker would survive ``Pool.terminate``. Ctrl+C reaches the
    whole process group: workers ignore it and the trainer shuts them down.
    """
    global _worker_reward_fn
    _worker_reward_fn = reward_fn
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "torch" in sys.modules:
        # OpenMP's thread pool does not survive fork: a forked child entering a parallel region can
        # hang forever. One thread keeps torch (a reward model, a tensor op) out of such regions.
        sys.modules["torch"].set_num_threads(1)
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: a SIGKILLed trainer takes a hung worker with it
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _score_chunk(responses: list[str], answers: list[str]) -> list[tuple[float, int, str | None]]:
    """``_score_one`` of each sample of a chunk, in a worker."""
    return [_score_one(response, answer) for response, answer in zip(responses, answers, strict=True)]


def _score_one(response: str, answer: str) -> tuple[float, int, str | None]:
    """(score, malformed, None) of one sample in a worker, or (0, 0, error message) on failure."""
    try:
        output = _worker_reward_fn([response], [answer])
        (score,) = output.scores
        score = float(score)
        if not math.isfinite(score):
            raise ValueError(f"non-finite score {score}")
        return score, int(output.num_malformed), None
    except Exception as error:
        return 0.0, 0, f"{type(error).__name__}: {error}"
