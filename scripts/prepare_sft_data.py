"""Tokenize chat conversations into fixed-length SFT instances with a label mask (OLMo's Tulu format).

``--help`` shows the usage; the command is :mod:`olmo.cli.prepare_sft_data`.
"""

import sys

from olmo.cli.prepare_sft_data import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
