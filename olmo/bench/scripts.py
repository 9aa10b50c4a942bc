"""The scripts a benchmark starts as a user does (``benchmark_ladder.py`` runs ``scripts/benchmark.py`` per rung,
``benchmark_olmo.py`` its two workers, ...): found beside the script the benchmark itself was started as, so that no
code of the package needs to know where the source checkout is."""

from __future__ import annotations

import sys
from pathlib import Path

from ..exceptions import OLMoCliError

__all__ = ["sibling_script"]


def sibling_script(name: str) -> Path:
    """``scripts/NAME``, beside the script this process was started as (``python scripts/benchmark_ladder.py``).

    :raises OLMoCliError: when there is no such file there, as when the benchmark's ``main`` is called in another
        program: start the benchmark as its script.
    """
    started_as = Path(sys.argv[0]).resolve()
    path = started_as.with_name(name)
    if not path.is_file():
        raise OLMoCliError(
            f"This benchmark runs {name} from the folder of the script it was started as, but this process was "
            f"started as '{sys.argv[0]}', and '{path}' does not exist. Start the benchmark as a script of the "
            f"checkout's scripts/ folder: python scripts/BENCHMARK.py."
        )
    return path
