"""Measure what the data order costs at OLMo-2 scale: launch time and the ranks' anonymous memory.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_data_order`.
"""

import sys

from olmo.cli.benchmark_data_order import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
