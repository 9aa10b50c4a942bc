"""Tokenize the prompts of reinforcement learning with verifiable rewards, with their ground truths.

``--help`` shows the usage; the command is :mod:`olmo.cli.prepare_rl_prompts`.
"""

import sys

from olmo.cli.prepare_rl_prompts import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
