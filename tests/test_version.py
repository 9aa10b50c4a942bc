"""The version has one source (olmo/version.py), equal to the latest release in CHANGELOG.md, and what pip
records for the installed package says the same."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import olmo
from olmo.version import VERSION

REPO = Path(__file__).resolve().parents[1]


def test_the_version_is_the_changelogs_latest_release() -> None:
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (REPO / "CHANGELOG.md").read_text(), re.M
    )
    assert releases and releases[0] == VERSION == olmo.__version__


def test_setup_py_reads_the_version_instead_of_repeating_it() -> None:
    setup = (REPO / "setup.py").read_text()
    assert VERSION not in setup and 'olmo").joinpath("version.py")' in setup
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == VERSION, out.stderr[-2000:]
