# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test soak bench warm clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: this release is a CPU build on these machines (an unpinned one pulls a CUDA
	# build of several GB that a CPU-only test run does not need)
	$(PY) -m pip install --quiet 'torch==$(TORCH_VERSION)'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Compile every numba kernel into the on-disk cache (keyed on the kernel sources).
warm: install
	$(PY) -m shmbroker.cli warm

demo: warm
	$(VENV)/bin/shmbroker demo

test: warm
	$(PY) -m pytest -q

# The chaos tests for longer: SIGKILL every kind of broker process (and the supervisor) at random
# moments while producers submit, SOAK_ITERATIONS seeded rounds of each.
SOAK_ITERATIONS ?= 50
soak: warm
	SHMBROKER_SOAK_ITERATIONS=$(SOAK_ITERATIONS) $(PY) -m pytest -q -p no:cacheprovider tests/test_chaos.py

bench: warm
	$(VENV)/bin/shmbroker bench ring --json
	$(VENV)/bin/shmbroker bench backlog --json
	$(VENV)/bin/shmbroker bench pack --json
	$(VENV)/bin/shmbroker bench e2e --json
	$(VENV)/bin/shmbroker bench restart --json
	$(VENV)/bin/shmbroker bench gpu --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
