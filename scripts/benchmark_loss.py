"""Time and memory of the output layer + loss alone, plain (logits, then cross entropy) against fused
(``olmo.model.loss.fused_output_loss``), at a model's real shapes.

``--help`` shows the usage; the command is :mod:`olmo.cli.benchmark_loss`.
"""

import sys

from olmo.cli.benchmark_loss import main

if __name__ == "__main__":
    sys.exit(main())
