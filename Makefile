# One entry point for humans and CI (.ci/run calls these).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install checks test quickstart clean

$(PY):
	python3 -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
	$(VENV)/bin/pip install -q "torch==2.13.0"

install: $(PY)
	$(VENV)/bin/pip install -q -e ".[dev]"

checks: install
	$(VENV)/bin/ruff check olmo scripts tests
	$(VENV)/bin/ruff format --check olmo scripts tests
	$(VENV)/bin/mypy

test: install
	WANDB_MODE=disabled $(PY) -m pytest tests -q

quickstart: install
	bash scripts/quickstart.sh

clean:
	rm -rf runs data/quickstart .pytest_cache .mypy_cache .ruff_cache
