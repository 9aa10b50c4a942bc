"""Generate text from a checkpoint.

``--help`` shows the usage; the command is :mod:`olmo.cli.generate`.
"""

import sys

from olmo.cli.generate import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
