"""A config's memory per rank and step time on a cluster (the configured mesh and the others its world size allows),
before renting it.

``--help`` shows the usage; the command is :mod:`olmo.cli.plan`.
"""

import sys

from olmo.cli.plan import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
