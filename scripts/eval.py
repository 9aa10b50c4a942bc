"""Run the in-loop evaluators on a saved checkpoint.

``--help`` shows the usage; the command is :mod:`olmo.cli.eval`.
"""

import sys

from olmo.cli.eval import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
