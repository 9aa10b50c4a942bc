"""Measure training throughput (tokens/s, step time and its phases, MFU, peak memory) for a config.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark`.
"""

import sys

from olmo.cli.benchmark import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
