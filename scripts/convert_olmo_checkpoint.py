"""Convert a checkpoint written by the original OLMo trainer (ai2-olmo) into this trainer's unsharded layout.

``--help`` shows the usage; the command is :mod:`olmo.cli.convert_olmo_checkpoint`.
"""

import sys

from olmo.cli.convert_olmo_checkpoint import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
