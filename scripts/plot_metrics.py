"""Plot training and evaluation curves from runs' ``metrics.jsonl`` files, several runs overlaid.

``--help`` shows the usage; the command is :mod:`olmo.cli.plot_metrics`.
"""

import sys

from olmo.cli.plot_metrics import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
