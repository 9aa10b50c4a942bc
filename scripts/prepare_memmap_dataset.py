"""Tokenize documents into headerless token memmaps that training reads directly.

``--help`` shows the usage; the command is :mod:`olmo.cli.prepare_memmap_dataset`.
"""

import sys

from olmo.cli.prepare_memmap_dataset import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    sys.exit(main())
