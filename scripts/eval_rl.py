"""Score a checkpoint's greedy answers to prepared RL prompts (exact-answer accuracy).

``--help`` shows the usage; the command is :mod:`olmo.cli.eval_rl`.
"""

import sys

from olmo.cli.eval_rl import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
