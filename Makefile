# planetserve: everything goes through the project's own virtual environment.
VENV ?= .venv
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PS := $(VENV)/bin/planetserve

.PHONY: setup test faults soak lint localnet localnet-stop bench clean

setup:
	@bash scripts/setup.sh

# Two passes: the tests that start no network on TEST_WORKERS pytest-xdist workers (each module whole on
# one worker), then the network tests one at a time, as they were written to run: their waits for
# blocks, epochs and shutdowns assume the cores are theirs.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=10 -m "not soak and not network" -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m pytest -q --durations=15 -m "network and not soak"

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
