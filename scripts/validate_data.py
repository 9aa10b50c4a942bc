"""Scan token files fully, report their statistics, and exit non-zero if training would reject them.

``--help`` shows the usage; the command is :mod:`olmo.cli.validate_data`.
"""

import sys

from olmo.cli.validate_data import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
