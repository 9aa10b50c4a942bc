"""Score preference pairs with a DPO policy against its reference: reward accuracy and margin on held-out pairs.

``--help`` shows the usage; the command is :mod:`olmo.cli.eval_preferences`.
"""

import sys

from olmo.cli.eval_preferences import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
