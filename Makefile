# planetserve: everything goes through the project's own virtual environment.
VENV ?= .venv
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PS := $(VENV)/bin/planetserve

.PHONY: setup test faults soak lint localnet localnet-stop bench clean

setup:
	@bash scripts/setup.sh

# Two passes: every test but the timing-sensitive ones on TEST_WORKERS pytest-xdist workers (each test
# module on one worker, the modules that serve models one after another; tests/conftest.py), then the
# `serial` ones alone, whose assertions about block rates and epoch windows must not share the cores.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=15 -m "not soak and not serial" -n $(TEST_WORKERS)
	$(PY) -m pytest -q --durations=5 -m "serial and not soak"

faults: setup
	$(PY) -m pytest -q -m faults

soak: setup
	$(PY) -m pytest -q -s -m soak

lint: setup
	$(VENV)/bin/ruff check .

localnet: setup
	$(PS) localnet up

localnet-stop: setup
	$(PS) localnet down

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) localnet/build
