"""Settings for the whole test session."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one xdist worker per core, and every subprocess a test starts gets OMP_NUM_THREADS=1; torch's
    # default of one intra-op thread per core in each worker would put two busy threads on every core.
    torch.set_num_threads(1)
