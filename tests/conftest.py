"""Shared fixtures and helpers. Test modules (and the scripts they start) import the helpers as
``from conftest import HashReward``; configs name them as ``conftest.HashReward``."""

import os
import zlib

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
_ENVIRONMENT_AT_START = dict(os.environ)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test starts: the session's environment as it was before any
    test ran (an in-process vLLM engine sets ``LD_PRELOAD`` to torch's libgomp, ``LOCAL_WORLD_SIZE``
    and more, which made later 2-process FSDP2 fits hang or abort at exit), without SLURM's
    variables or ``LOCAL_RANK``, with one OpenMP thread and unbuffered output; then ``extra``."""
    env = {k: v for k, v in _ENVIRONMENT_AT_START.items() if not k.startswith(("SLURM_", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


class HashReward:
    """A RewardFn whose scores (0, 0.25, ..., 1) are a hash of the response: varied and deterministic.

    An untrained tiny model never answers an addition right, so the exact-match reward would be 0
    everywhere, every advantage 0 and no gradient would flow.
    """

    def __call__(self, completions: list[str], **columns) -> list[float]:
        return [zlib.crc32(c.encode()) % 5 / 4 for c in completions]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The built-in tiny Llama and its tokenizer (``create_tiny_model``, seed 0), written once per session."""
    from lit_offpolicy.models import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0))
