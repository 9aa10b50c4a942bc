"""The commands behind ``scripts/``: each module is one command ``scripts/NAME.py``, thin: it parses the arguments,
wires library calls together and shows progress. The benchmarks' code is in :mod:`olmo.bench`, and
``olmo.cli.benchmark*`` only hand it over.

Every command has one signature, ``main(argv: Optional[list[str]] = None) -> int``: the arguments without the
program name, as ``argparse`` takes them (None: ``sys.argv[1:]``), and the exit status back (``inspect_batch``
returns the rows it printed instead, for tests and notebooks). ``scripts/NAME.py`` only calls it, after
``prepare_cli_environment()``, so tests and other code run a command in this process by importing
``olmo.cli.NAME`` (:func:`olmo.testing.run_main`). Errors are raised as :class:`olmo.exceptions.OLMoError` naming
the fix.

The scripts import this package, so they need it installed (``pip install -e .``, which ``make install`` runs);
they never edit ``sys.path``. :mod:`olmo.bench.olmo_worker` is loaded by its path into the original OLMo's
virtualenv by ``scripts/olmo_original_worker.py``.

The top layer: it may import any package of ``olmo``, and nothing else in ``olmo`` imports it
(:func:`olmo.testing.run_main` looks a command up by its name when a test calls it).
"""
