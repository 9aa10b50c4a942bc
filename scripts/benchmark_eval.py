"""Measure evaluation throughput on tiny models (not a test).

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_eval`.
"""

import sys

from olmo.cli.benchmark_eval import main

if __name__ == "__main__":
    sys.exit(main())
