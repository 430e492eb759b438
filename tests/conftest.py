"""Session fixtures. The shared helpers are the package ``helpers`` (tests/helpers/): test modules and the
scripts they start import them as ``from helpers import HashReward``; configs name them as
``helpers.HashReward``."""

import os
import signal

import pytest

# the helpers' own asserts (helpers.loss_checks, ...) report their operands as the tests' do
pytest.register_assert_rewrite("helpers")

# A shell that starts a command in the background (`make test &`, nohup) leaves it ignoring Ctrl-C
# (SIGINT), and the runs the tests start inherit that. Our Ctrl-C handling keeps an ignored SIGINT
# ignored, as it should; its tests are about the terminal's case, so the session starts from it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# imported here, before any test runs: helpers keeps the session's environment as it starts (subprocess_env)
import helpers  # noqa: E402, F401


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The built-in tiny Llama and its tokenizer (``create_tiny_model``, seed 0), written once per session."""
    from lit_offpolicy.models import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0))
