"""Measure checkpoint size, save/load time and throughput for a model built from a config, on the CPU.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_checkpoint`.
"""

import sys

from olmo.cli.benchmark_checkpoint import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
