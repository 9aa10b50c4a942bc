"""Time and memory of Gated DeltaNet's delta rule (the pure-PyTorch chunked path, the step-by-step recurrence and,
on a GPU, flash-linear-attention's kernels) against full attention of the same heads, forward and backward.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_linear_attention`.
"""

import sys

from olmo.cli.benchmark_linear_attention import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
