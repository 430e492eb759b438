"""Torch's CPU threads for the model's size (``lit_offpolicy.core.threads``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lit_offpolicy.core.threads import ONE_THREAD_BELOW, threads_for


def in_fresh_process(code: str, **env: str) -> list[str]:
    """The lines ``code`` prints in a fresh interpreter whose torch runs 2 threads, ``OMP_NUM_THREADS``
    unset unless given: in a process where vLLM's CPU worker ran (another test of this pytest worker),
    ``torch.set_num_threads`` is a no-op."""
    environ = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"} | env
    prelude = "import torch\ntorch.set_num_threads(2)\nfrom lit_offpolicy.core import threads\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_small_models_get_one_thread_and_larger_ones_keep_the_default():
    assert threads_for(1_080_000, default=16) == 1  # the built-in tiny Llama
    assert threads_for(ONE_THREAD_BELOW - 1, default=16) == 1
    assert threads_for(ONE_THREAD_BELOW, default=16) == 16
    assert threads_for(181_000_000, default=2) == 2  # the Qwen3 shape of the benchmarks


@pytest.mark.slow  # a fresh interpreter each, not floats: test-numerics leaves it out
def test_a_small_model_is_set_to_one_thread_and_it_is_said():
    line, count = in_fresh_process(
        "print(threads.choose_threads(torch.nn.Linear(100, 100)))\nprint(torch.get_num_threads())"
    )
    assert count == "1"
    assert line.startswith("torch runs on 1 CPU thread(s), not 2: a 0.01M-parameter model's")
    assert "OMP_NUM_THREADS=N chooses" in line


@pytest.mark.slow  # a fresh interpreter each, not floats: test-numerics leaves it out
def test_omp_num_threads_is_the_users_choice():
    code = "print(threads.choose_threads(torch.nn.Linear(100, 100)))\nprint(torch.get_num_threads())"
    assert in_fresh_process(code, OMP_NUM_THREADS="2") == ["None", "2"]


@pytest.mark.slow  # a fresh interpreter each, not floats: test-numerics leaves it out
def test_a_large_model_keeps_torchs_default():
    code = (
        "threads.ONE_THREAD_BELOW = 100\n"
        "print(threads.choose_threads(torch.nn.Linear(100, 100)))\nprint(torch.get_num_threads())"
    )
    assert in_fresh_process(code) == ["None", "2"]
