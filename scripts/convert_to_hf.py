"""Export one of our checkpoints (unsharded or sharded) as a Hugging Face transformers model directory.

``--help`` shows the usage; the command is :mod:`olmo.cli.convert_to_hf`.
"""

import sys

from olmo.cli.convert_to_hf import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
