"""Show the instances of the global batch a run trained on at step N (as OLMo's inspect_train_data.py).

``--help`` shows the usage; the command is :mod:`olmo.cli.inspect_batch`.
"""

from olmo.cli.inspect_batch import main
from olmo.util import prepare_cli_environment

if __name__ == "__main__":
    prepare_cli_environment()
    main()  # returns the rows it printed (for tests and notebooks); the exit status is 0
