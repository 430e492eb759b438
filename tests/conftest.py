"""Session fixtures. The shared helpers are the package ``helpers`` (tests/helpers/): test modules and the
scripts they start import them as ``from helpers import HashReward``; configs name them as
``helpers.HashReward``."""

import os
import signal
import tempfile
import time

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

# Each pytest-xdist worker has an Inductor cache of its own and computes on one torch thread.
# - The cache, per worker and ATen ISA (make test's suite, then test-numerics on the portable kernels):
#   in a shared one, test-numerics' two workers compiling the same blocks at once failed on its
#   precompiled header ("'at::vec' has not been declared").
# - One thread (the processes tests start get one through helpers.subprocess_env): 2 workers with
#   torch's default of a thread per core ask 4 threads of a 2-core machine, and a thread's barrier spins
#   while the other worker holds its core. The unit tests and in-process fits of tests/training,
#   tests/models, tests/losses, test_configs.py and test_trainer.py took 262 s on 2 workers with the
#   default, 154 s with one thread each (beside other work).
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor-{os.getuid()}-tests-{isa}-{worker}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    import torch

    torch.set_num_threads(1)

# The longest files first (worker-seconds in make test, most first): pytest-xdist hands whole files to
# the workers in collection order (make test passes --no-loadscope-reorder; its default puts the files
# with the most tests first), so a long file left for last runs alone while the other worker idles.
LONGEST_FILES = (
    "integration/test_rollout_servers_ranks.py",
    "integration/test_slurm.py",
    "integration/test_rollout_servers.py",
    "integration/test_sequence_parallel_fit.py",
    "integration/test_configs.py",
    "integration/test_reliability_sigkill.py",
    "integration/test_distributed.py",
    "integration/test_demo.py",
    "integration/test_rollout_servers_fit.py",
    "integration/test_reliability.py",
    "integration/test_model_families.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    def rank(item) -> int:
        path = item.path.as_posix()
        return next(
            (i for i, name in enumerate(LONGEST_FILES) if path.endswith("tests/" + name)), len(LONGEST_FILES)
        )

    items.sort(key=rank)  # stable: the files' own order, and their tests', is kept


# imported here, before any test runs: helpers keeps the session's environment as it starts (subprocess_env)
import helpers  # noqa: E402, F401


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The built-in tiny Llama and its tokenizer (``create_tiny_model``, seed 0), written once per session."""
    from lit_offpolicy.models import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0))


def _machine_busy_seconds() -> float | None:
    """CPU seconds every process of the machine has spent (``/proc/stat``, all CPUs, idle and iowait
    left out), or None where there is no ``/proc/stat``."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]  # noqa: SIM115
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session) -> None:
    session.config.stash[_MACHINE_AT_START] = (time.monotonic(), _machine_busy_seconds())


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The machine's busy CPU seconds over the run (servers, SLURM tasks and every other process
    included; from the pytest-xdist controller): on a 2-core machine kept busy, the run's wall seconds
    are about half of them. They count work rather than waits, yet vary with the machine's state too."""
    if hasattr(config, "workerinput") or _MACHINE_AT_START not in config.stash:
        return
    started, busy = config.stash[_MACHINE_AT_START]
    now = _machine_busy_seconds()
    if busy is not None and now is not None:
        wall = time.monotonic() - started
        terminalreporter.write_line(
            f"machine: {now - busy:.0f} busy CPU seconds in {wall:.0f} s on {os.cpu_count()} CPUs"
        )


_MACHINE_AT_START = pytest.StashKey[tuple[float, float | None]]()


def pytest_runtest_setup(item) -> None:
    item.stash[_CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds, its own process's and those of the processes it started and reaped,
    setup and teardown included (a module fixture's cost lands on its first test), as the JUnit
    property ``cpu_seconds``: on a loaded 2-core machine a test's wall seconds measure its neighbour too."""
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        item.user_properties.append(("cpu_seconds", round(_cpu_seconds() - item.stash[_CPU_AT_START], 2)))
    return (yield)


_CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
