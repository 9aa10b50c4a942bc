"""Import a Hugging Face transformers model directory of the OLMo family (OLMo 1-3, OLMoE, FlexOlmo, OLMo Hybrid) as
one of our unsharded checkpoints.

``--help`` shows the usage; the command is :mod:`olmo.cli.convert_from_hf`.
"""

import sys

from olmo.cli.convert_from_hf import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
