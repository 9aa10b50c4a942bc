"""Tokenize preference pairs for DPO into the SFT format: pair i at instances 2i (chosen) and 2i + 1 (rejected).

``--help`` shows the usage; the command is :mod:`olmo.cli.prepare_preference_data`.
"""

import sys

from olmo.cli.prepare_preference_data import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
