"""Plan, train, track and fit a scaling ladder: a family of model sizes trained with one recipe from one YAML.

``--help`` shows the usage; the command is :mod:`olmo.cli.ladder`.
"""

import sys

from olmo.cli.ladder import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
