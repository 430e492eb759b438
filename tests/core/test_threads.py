"""Torch's CPU threads for the model's size (``lit_offpolicy.core.threads``)."""

from __future__ import annotations

import pytest
import torch

from lit_offpolicy.core.threads import ONE_THREAD_BELOW, choose_threads, threads_for


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 threads with ``OMP_NUM_THREADS`` unset, as a user's shell on 2 cores; restored after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_models_get_one_thread_and_larger_ones_keep_the_default():
    assert threads_for(1_080_000, default=16) == 1  # the built-in tiny Llama
    assert threads_for(ONE_THREAD_BELOW - 1, default=16) == 1
    assert threads_for(ONE_THREAD_BELOW, default=16) == 16
    assert threads_for(181_000_000, default=2) == 2  # the Qwen3 shape of the benchmarks


def test_a_small_model_is_set_to_one_thread_and_it_is_said(two_threads):
    line = choose_threads(torch.nn.Linear(100, 100))
    assert torch.get_num_threads() == 1
    assert line.startswith("torch runs on 1 CPU thread(s), not 2: a 0.01M-parameter model's")
    assert "OMP_NUM_THREADS=N chooses" in line


def test_omp_num_threads_is_the_users_choice(two_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(torch.nn.Linear(100, 100)) is None
    assert torch.get_num_threads() == 2


def test_a_large_model_keeps_torchs_default(two_threads, monkeypatch):
    monkeypatch.setattr("lit_offpolicy.core.threads.ONE_THREAD_BELOW", 100)
    assert choose_threads(torch.nn.Linear(100, 100)) is None
    assert torch.get_num_threads() == 2
