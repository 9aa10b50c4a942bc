"""Train an OLMo model.

``--help`` shows the usage; the command is :mod:`olmo.cli.train`.
"""

from olmo.cli.train import main
from olmo.util import exit_process, prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    exit_process(main())
