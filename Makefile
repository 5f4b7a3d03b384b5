# planetserve: everything goes through the project's own virtual environment.
VENV ?= .venv
PY := $(VENV)/bin/python
PS := $(VENV)/bin/planetserve

.PHONY: setup test faults soak lint localnet localnet-stop bench clean

setup:
	@bash scripts/setup.sh

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=15 -m "not soak"

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
