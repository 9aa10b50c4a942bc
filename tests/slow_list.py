"""The tests that are left out of ``make test-quick``, chosen by measured duration: ``tests/slow_tests.txt`` lists
every test that took :data:`THRESHOLD` seconds or more (setup, call and teardown together) in a whole-suite run,
with its seconds and those of its setup (a fixture that its module's tests share is set up by the first of them).
``tests/conftest.py`` reads it to mark those tests ``slow`` and to start the longest first.

``make slow-list`` regenerates the list: ``python tests/slow_list.py`` runs the suite as ``make test`` does, with
``--durations=0``, and writes the list from its durations table; ``python tests/slow_list.py DURATIONS.txt`` writes it
from the saved output of such a run.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

PATH = Path(__file__).resolve().parent / "slow_tests.txt"
THRESHOLD = 1.0
"""Seconds: a test that takes this long or longer is ``slow``. At 1 s, the 10 % of the tests above it take 88 % of
the suite's time (2026-12-05): what is left runs in about 1.5 minutes on 2 cores."""

COMMAND = "pytest tests -q -n auto --dist worksteal --durations=0 -p no:cacheprovider"
_ROW = re.compile(r"^([\d.]+)s (setup|call|teardown) +(tests/\S.*?)\s*$", re.M)


def read(path: Path = PATH) -> dict[str, tuple[float, float]]:
    """{node id: (seconds, seconds of its setup)} of the tests the list names."""
    listed = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, setup, node_id = line.split(" ", 2)
            listed[node_id.strip()] = (float(seconds), float(setup))
    return listed


def durations(output: str) -> dict[str, tuple[float, float]]:
    """{node id: (seconds of setup, call and teardown together, seconds of setup)} from the output of a
    ``--durations=0`` run."""
    total: Counter[str] = Counter()
    setup: Counter[str] = Counter()
    for seconds, phase, node_id in _ROW.findall(output):
        total[node_id] += float(seconds)
        setup[node_id] += float(seconds) if phase == "setup" else 0.0
    return {node_id: (seconds, setup[node_id]) for node_id, seconds in total.items()}


def write(timed: dict[str, tuple[float, float]], measured_by: str, path: Path = PATH) -> int:
    """Write the tests of ``timed`` that took :data:`THRESHOLD` seconds or more to ``path``, longest first; return
    how many."""
    slow = sorted((-total, node_id, setup) for node_id, (total, setup) in timed.items() if total >= THRESHOLD)
    everything = sum(total for total, _ in timed.values())
    header = [
        f"# Tests that took {THRESHOLD:g} s or more (setup + call + teardown): tests/conftest.py marks them slow",
        "# (left out of make test-quick) and starts the longest first. Regenerate with make slow-list.",
        f"# Measured {datetime.date.today().isoformat()} by: {measured_by}",
        f"# {len(slow)} of {len(timed)} timed tests, {-sum(t for t, _, _ in slow):.0f} of {everything:.0f} s.",
        "# Columns: seconds, seconds of them in setup, node id.",
    ]
    rows = (f"{-total:.2f} {setup:.2f} {node_id}" for total, node_id, setup in slow)
    path.write_text("\n".join([*header, *rows]) + "\n")
    return len(slow)


def main(argv: list[str]) -> int:
    """Write the list from the durations file ``argv[0]``, or from a suite run of :data:`COMMAND` without one."""
    if argv:
        output, measured_by = Path(argv[0]).read_text(), f"{COMMAND} (saved as {argv[0]})"
    else:
        cmd = [sys.executable, "-m", *COMMAND.split()]
        result = subprocess.run(cmd, capture_output=True, text=True)
        output, measured_by = result.stdout, COMMAND
        if result.returncode != 0:
            print(output[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
            return result.returncode
    count = write(durations(output), measured_by)
    print(f"{PATH}: {count} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
