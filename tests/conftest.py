import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The built-in tiny Llama and its tokenizer (``create_tiny_model``, seed 0), written once per session."""
    from lit_offpolicy.models import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0))
