"""The bounded-staleness bookkeeping of asynchronous rollouts (lit_offpolicy.rollout.buffer) and the
producer's prompt stream: pure logic, with real threads where the rule is about blocking."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from lit_offpolicy.callbacks.async_rollout import prompt_stream
from lit_offpolicy.data.prompts import collate_prompts
from lit_offpolicy.data.sampler import ResumableShuffleSampler
from lit_offpolicy.rollout.buffer import (
    Produced,
    ProducerError,
    ProducerStalled,
    PromptBatch,
    PromptLedger,
    StalenessGate,
    staleness,
)


def job(index: int) -> PromptBatch:
    return PromptBatch(index, [{"prompt": f"p{index}", "answer": f"a{index}"}])


def test_staleness_is_trainer_version_minus_sample_version():
    versions = torch.tensor([5, 4, 2, 5])
    assert staleness(5, versions).tolist() == [0, 1, 3, 0]


def acquire_in_thread(gate: StalenessGate) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(gate.acquire()))
    thread.start()
    return thread, result


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_gate_lets_the_producer_start_k_plus_one_batches_ahead(max_staleness):
    gate = StalenessGate(max_staleness)
    for _ in range(max_staleness + 1):
        assert gate.acquire()  # does not block
    thread, result = acquire_in_thread(gate)
    thread.join(timeout=0.2)
    assert thread.is_alive() and result == [], "the (k+2)-th batch must wait for the trainer"
    gate.release()
    thread.join(timeout=5)
    assert result == [True]
    assert gate.started == max_staleness + 2 and gate.producer_idle >= 0.15


def test_close_wakes_a_blocked_producer_and_a_waiting_trainer():
    gate = StalenessGate(0)
    assert gate.acquire()
    thread, result = acquire_in_thread(gate)
    trainer_error: list[BaseException] = []

    def take():
        try:
            gate.get()
        except ProducerError as error:
            trainer_error.append(error)

    trainer = threading.Thread(target=take)
    trainer.start()
    time.sleep(0.1)
    gate.close()
    thread.join(timeout=5)
    trainer.join(timeout=5)
    assert result == [False]
    assert len(trainer_error) == 1 and "stopped" in str(trainer_error[0])


def test_get_returns_in_order_then_raises_the_producers_error_with_its_cause():
    gate = StalenessGate(2)
    gate.put(Produced(job(0), result="a"))
    gate.put(Produced(job(1), result="b"))
    cause = ZeroDivisionError("reward crashed")
    gate.fail(cause)
    assert [gate.get().result, gate.get().result] == ["a", "b"], "ready batches still go to the trainer"
    with pytest.raises(ProducerError, match="reward crashed") as raised:
        gate.get()
    assert raised.value.__cause__ is cause


def test_trainer_idle_counts_the_wait_for_the_producer():
    gate = StalenessGate(1)
    threading.Timer(0.2, lambda: gate.put(Produced(job(0), None))).start()
    assert gate.get().job.index == 0
    assert 0.15 <= gate.trainer_idle < 5
    assert gate.depth == 0


def test_a_wait_without_progress_ends_at_the_stall_deadline_naming_the_option():
    """No batch and no generation finished for ``stall_timeout_s``: ``ProducerStalled``; progress
    (a generation finished) moves the deadline, and a batch that comes meanwhile is returned."""
    gate = StalenessGate(1)
    started = time.monotonic()
    with pytest.raises(
        ProducerStalled, match=r"no progress .* for (\d+\.\d) s .*\(stall_timeout_s=0.3\)"
    ) as raised:
        gate.get(stall_timeout_s=0.3)
    # the message gives the wait measured, which a busy machine's scheduler can make longer, never shorter
    assert float(re.search(r"for (\d+\.\d) s", str(raised.value)).group(1)) >= 0.3
    assert 0.3 <= time.monotonic() - started < 3

    # A generation finishes every 0.1 s for 1.5 s, then a batch is queued: the wait outlasts the 1 s
    # stall limit only because each progress moves its deadline (0.9 s of slack for a late tick).
    progress = [time.monotonic()]
    ticking = threading.Event()

    def tick() -> None:
        while time.monotonic() - started < 1.5:
            progress[0] = time.monotonic()
            time.sleep(0.1)
        ticking.set()

    started = time.monotonic()
    threading.Thread(target=tick, daemon=True).start()
    threading.Timer(1.6, lambda: gate.put(Produced(job(0), None))).start()
    assert gate.get(stall_timeout_s=1.0, progress=lambda: progress[0]).job.index == 0
    assert time.monotonic() - started >= 1.55 and ticking.wait(5)


def test_regenerate_releases_the_batch_and_hands_its_prompts_back_first():
    gate = StalenessGate(0)
    assert gate.acquire()
    assert gate.next_retry() is None
    gate.regenerate(job(3))
    assert gate.released == 1
    assert gate.acquire(), "regenerating frees the batch's slot"
    assert gate.next_retry() == job(3)
    assert gate.next_retry() is None


def test_ledger_watermark_advances_over_out_of_order_marks_and_round_trips():
    ledger = PromptLedger()
    for index in (1, 3):
        ledger.mark(index)
    assert ledger.watermark == 0 and ledger.is_done(1) and not ledger.is_done(0)
    ledger.mark(0)
    assert ledger.watermark == 2 and ledger.done_above == {3}
    restored = PromptLedger()
    restored.load_state_dict(ledger.state_dict())
    assert [restored.is_done(i) for i in range(5)] == [True, True, False, True, False]


def make_loader(size: int = 6, batch_size: int = 2, seed: int = 0) -> DataLoader:
    problems = [{"prompt": f"q{i}", "answer": str(i)} for i in range(size)]
    sampler = ResumableShuffleSampler(size, seed)
    return DataLoader(
        problems, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate_prompts
    )


def epoch_order(size: int, seed: int, epoch: int) -> list[str]:
    sampler = ResumableShuffleSampler(size, seed)
    sampler.set_epoch(epoch)
    return [f"q{i}" for i in sampler]


def test_prompt_stream_numbers_batches_across_epochs_in_the_samplers_order():
    stream = prompt_stream(make_loader(), PromptLedger())
    batches = [next(stream) for _ in range(7)]
    assert [b.index for b in batches] == list(range(7))
    prompts = [p for b in batches for p in b.prompts]
    expected = epoch_order(6, 0, 0) + epoch_order(6, 0, 1) + epoch_order(6, 0, 2)[:2]
    assert prompts == expected
    assert epoch_order(6, 0, 0) != epoch_order(6, 0, 1), "epochs must reshuffle or the check is vacuous"
    assert [p["answer"] for p in batches[0].problems] == [p[1:] for p in batches[0].prompts]


def test_prompt_stream_skips_the_batches_a_resumed_run_already_consumed():
    full = prompt_stream(make_loader(), PromptLedger())
    reference = [next(full) for _ in range(6)]
    done = PromptLedger()
    for index in (0, 1, 3):
        done.mark(index)
    resumed = prompt_stream(make_loader(), done)
    assert [next(resumed) for _ in range(3)] == [reference[2], reference[4], reference[5]]


def test_prompt_stream_shards_each_epoch_across_processes():
    """Two ranks: disjoint batches, together every batch of the epoch (a 7th, odd batch is left out)."""
    full = prompt_stream(make_loader(size=14), PromptLedger())
    reference = [next(full).prompts for _ in range(14)]  # 7 batches per epoch, 2 epochs
    ranks = [prompt_stream(make_loader(size=14), PromptLedger(), rank, world_size=2) for rank in (0, 1)]
    per_rank = [[next(stream) for _ in range(6)] for stream in ranks]  # 3 per epoch each
    assert [b.index for b in per_rank[1]] == list(range(6))
    assert [b.prompts for b in per_rank[0]] == [reference[i] for i in (0, 2, 4, 7, 9, 11)]
    assert [b.prompts for b in per_rank[1]] == [reference[i] for i in (1, 3, 5, 8, 10, 12)]


def test_prompt_stream_with_fewer_batches_than_processes_fails_clearly():
    with pytest.raises(ValueError, match="has 1 batches, fewer than the 2 processes"):
        next(prompt_stream(make_loader(size=2), PromptLedger(), rank=0, world_size=2))
