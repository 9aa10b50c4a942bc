"""Time of an RL step's parts at a model's real shapes: sampling with and without the KV cache, training on a group,
and the frozen reference's forward and memory.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_rl`.
"""

import sys

from olmo.cli.benchmark_rl import main

if __name__ == "__main__":
    sys.exit(main())
