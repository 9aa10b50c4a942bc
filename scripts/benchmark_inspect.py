"""Measure how long inspect_batch.py --json takes to answer for a run over many token files (with dolma metadata).

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_inspect` (in the command layer, since it
times ``inspect_batch.py``'s own code).
"""

import sys

from olmo.cli.benchmark_inspect import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
