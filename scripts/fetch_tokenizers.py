"""Fetch OLMo's tokenizer files (OLMo-2's ``allenai_dolma2.json`` among them) into the tokenizer cache.

``--help`` shows the usage; the command is :mod:`olmo.cli.fetch_tokenizers`.
"""

import sys

from olmo.cli.fetch_tokenizers import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
