"""Measure the training data loader's throughput (tokens/s) from a warm page cache, on the CPU.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_dataloader`.
"""

import sys

from olmo.cli.benchmark_dataloader import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
