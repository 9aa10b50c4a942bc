"""Every GPU check in one prepared command for a lent machine with no network: installs the wheels `make gpu-wheels`
gathered, runs each part under its own time limit and prints one table for RESEARCH_LOG; ``--dry-run`` lists the
parts and checks the wheel folder. On a machine where the package is not installed, run it from the checkout as
``PYTHONPATH=. python3 scripts/gpu_checks.py``. ``--help`` shows the usage; the command is :mod:`olmo.cli.gpu_checks`.
"""

import sys

from olmo.cli.gpu_checks import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
