"""Measure throughput one change at a time: eager fp32 -> TF32 -> bf16 -> flash attention -> compile ->
larger micro-batch -> fused loss -> metrics read back every 10 steps. Each rung keeps the changes of the rungs
run before it.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_ladder`.
"""

import sys

from olmo.cli.benchmark_ladder import main

if __name__ == "__main__":
    sys.exit(main())
