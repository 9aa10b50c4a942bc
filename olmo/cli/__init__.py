"""The commands behind ``scripts/``: each module is the implementation of one command ``scripts/NAME.py``.

Each module has ``main(argv)``, and ``scripts/NAME.py`` only calls it (after ``prepare_cli_environment()``),
so tests and other code run a command in this process by importing ``olmo.cli.NAME``
(:func:`olmo.testing.run_main`). Errors are raised as :class:`olmo.exceptions.OLMoError` naming the fix. Two
signatures exist:

* ``main(argv: list[str]) -> int`` takes ``sys.argv`` itself, program name first, and returns the exit status:
  ``train``, ``eval``, ``unshard``, ``convert_olmo_checkpoint``, ``fetch_tokenizers``, ``ladder`` and ``benchmark*``.
* ``main(argv: Optional[list[str]] = None)`` takes the arguments without the program name, as ``argparse`` does
  (None: ``sys.argv[1:]``), and exits 0 unless it raises: ``prepare_memmap_dataset``, ``prepare_sft_data``,
  ``validate_data``, ``inspect_batch`` (which returns the rows it printed) and ``plot_metrics``.

The scripts import this package, so they need it installed (``pip install -e .``, which ``make install`` runs);
they never edit ``sys.path``. :mod:`olmo.bench.olmo_worker` is the one module that is not a command: the
worker code that ``benchmark_olmo`` shares with ``scripts/olmo_original_worker.py``, which runs in the original
OLMo's virtualenv and loads that one file by its path.

This package is the top layer: it may import any module of ``olmo``, and nothing else in ``olmo`` imports it
(:func:`olmo.testing.run_main` looks a command up by its name when a test calls it).
"""

from ..util import REPO

__all__ = ["REPO"]
