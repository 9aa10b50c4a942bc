"""Speed against the original: the same model timed in olmo-trainer and in ai2-olmo 0.6.0, interleaved in one run.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_olmo`.
"""

import sys

from olmo.cli.benchmark_olmo import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
