"""Bounded-staleness hand-off between a rollout producer thread and the trainer.

Pure bookkeeping, no Lightning and no engine, so that every rule is unit-testable on its own:

- ``staleness(v, versions)`` = v − version, per sample: how many weight updates the trainer (at
  policy version v) has made since the sample's weights were served; ``token_staleness`` per
  response token (partial rollouts: a response's tokens can come from several versions).
- ``StalenessGate``: backpressure, the queue of finished batches, and error/close signalling.
  A producer may *start* a batch only while ``started − released ≤ max_staleness``; why that
  bounds staleness, and where the trainer's check at consumption is needed: docs/async.md,
  "Backpressure, and what happens to stale batches".
- ``PromptLedger``: which prompt batches were consumed (trained or dropped), so that a resumed run
  neither replays nor loses prompts although the producer ran ahead of the checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.records import RolloutResult

STALE_POLICIES = ("drop", "regenerate")


def staleness(trainer_version: int, sample_versions: Tensor) -> Tensor:
    """Per-sample staleness ``trainer_version − sample_version`` (0 = on-policy), as a long tensor."""
    return trainer_version - sample_versions.long()


def token_staleness(trainer_version: int, experience: Experience) -> Tensor:
    """Staleness of every valid response token, ``trainer_version − the version that sampled it``
    (``Experience.token_versions``, or the sample's ``policy_versions`` where those are not recorded)."""
    return trainer_version - experience.response_versions[experience.response_mask.bool()]


@dataclass
class PromptBatch:
    """The ``index``-th batch of the producer's prompt stream (0, 1, 2, ... over epochs)."""

    index: int
    """Its position in the stream (what ``PromptLedger`` records)."""
    problems: list[dict]
    """The batch's problems (``data.batch_problems``)."""

    @property
    def prompts(self) -> list[str]:
        return [problem["prompt"] for problem in self.problems]


@dataclass
class Produced:
    """A generated batch, as the producer queues it."""

    job: PromptBatch
    """The prompt batch it sampled."""
    result: RolloutResult
    """The rollout; its experience records, per sample, the engine version that sampled it."""


class ProducerError(RuntimeError):
    """Raised in the trainer when the producer failed; ``__cause__`` is the producer's exception."""


class ProducerStalled(RuntimeError):
    """The trainer waited for a batch while the producer made no progress for ``stall_timeout_s``."""


class StalenessGate:
    """Thread-safe queue of ``Produced`` batches with version-bounded backpressure.

    Producer side: ``acquire()`` (blocks while k + 1 batches are already ahead), then ``put()``;
    on an error ``fail(exc)``. Trainer side: ``get()``, then ``release()`` once the batch is trained
    (weights pushed) or dropped; ``regenerate(job)`` hands dropped prompts back to the producer,
    which takes them before new ones (``next_retry()``). ``close()`` wakes and stops both sides.
    Idle seconds accumulate in ``producer_idle`` (blocked in acquire) and ``trainer_idle`` (in get).
    """

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.started = 0
        self.released = 0
        self.producer_idle = 0.0
        self.trainer_idle = 0.0
        self._ready: deque[Produced] = deque()
        self._retry: deque[PromptBatch] = deque()
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()

    @property
    def depth(self) -> int:
        """Batches generated and waiting for the trainer."""
        with self._cond:
            return len(self._ready)

    def acquire(self) -> bool:
        """Producer: wait until a new batch may start; False once closed (the producer should return)."""
        with self._cond:
            waited = time.perf_counter()
            self._cond.wait_for(lambda: self._closed or self.started - self.released <= self.max_staleness)
            self.producer_idle += time.perf_counter() - waited
            if self._closed:
                return False
            self.started += 1
            return True

    def put(self, item: Produced) -> None:
        with self._cond:
            self._ready.append(item)
            self._cond.notify_all()

    def next_retry(self) -> PromptBatch | None:
        """Producer: prompts handed back by ``regenerate``, oldest first; None when there are none."""
        with self._cond:
            return self._retry.popleft() if self._retry else None

    def fail(self, error: BaseException) -> None:
        """Producer: record the error that stopped it; the trainer's next ``get`` raises it."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def get(
        self, stall_timeout_s: float | None = None, progress: Callable[[], float] = lambda: 0.0
    ) -> Produced:
        """Trainer: the oldest generated batch (waits for one); ``ProducerError`` if the producer failed.

        With ``stall_timeout_s``: ``ProducerStalled`` once the wait has gone that long since the later
        of its start and ``progress()`` (``time.monotonic`` of the producer's last progress)."""
        with self._cond:
            waited = time.perf_counter()
            started = time.monotonic()
            while not (self._ready or self._error is not None or self._closed):
                if stall_timeout_s is None:
                    self._cond.wait()
                    continue
                idle = time.monotonic() - max(started, progress())
                if idle >= stall_timeout_s:
                    self.trainer_idle += time.perf_counter() - waited
                    raise ProducerStalled(
                        f"the rollout producer made no progress (no generation finished) for {idle:.1f} s "
                        f"while the trainer waited for a batch (stall_timeout_s={stall_timeout_s:g}); a "
                        "generation that takes longer needs a larger stall_timeout_s (null: no limit)"
                    )
                self._cond.wait(timeout=min(stall_timeout_s - idle, 1.0))
            self.trainer_idle += time.perf_counter() - waited
            if self._ready:
                return self._ready.popleft()
            if self._error is not None:
                raise ProducerError(f"the rollout producer failed: {self._error!r}") from self._error
            raise ProducerError("the rollout producer was stopped")

    def release(self) -> None:
        """Trainer: one batch is finished (trained with its weights pushed, or dropped)."""
        with self._cond:
            self.released += 1
            self._cond.notify_all()

    def regenerate(self, job: PromptBatch) -> None:
        """Trainer: a dropped batch's prompts go back to the producer (and the batch is released)."""
        with self._cond:
            self._retry.append(job)
            self.released += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class PromptLedger:
    """The prompt batches consumed by the trainer (trained or dropped for good), by stream index.

    Kept as a watermark (every index below it is done) plus the done indices above it, which the
    producer's look-ahead and regeneration leave out of order (at most k + 1 of them).
    """

    def __init__(self) -> None:
        self.watermark = 0
        self.done_above: set[int] = set()

    def mark(self, index: int) -> None:
        if index >= self.watermark:
            self.done_above.add(index)
        while self.watermark in self.done_above:
            self.done_above.remove(self.watermark)
            self.watermark += 1

    def is_done(self, index: int) -> bool:
        return index < self.watermark or index in self.done_above

    def state_dict(self) -> dict:
        return {"watermark": self.watermark, "done_above": sorted(self.done_above)}

    def load_state_dict(self, state: dict) -> None:
        self.watermark = int(state["watermark"])
        self.done_above = {int(i) for i in state["done_above"]}
