"""Time a mixture-of-experts layer (grouped multiply and loop over experts) against the dense MLP of the same active
parameters, forward and backward.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_experts`.
"""

import sys

from olmo.cli.benchmark_experts import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
