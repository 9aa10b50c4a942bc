"""Convert a sharded checkpoint (``stepN/``, saved by any number of ranks) into OLMo's unsharded layout.

``--help`` shows the usage; the command is :mod:`olmo.cli.unshard`.
"""

import sys

from olmo.cli.unshard import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
