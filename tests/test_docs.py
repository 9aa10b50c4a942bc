"""The documentation tells the truth about the checkout: every script README.md or docs/*.md runs or names
exists and answers ``--help``, every relative link and every ``configs/...yaml`` named there exists, and the index
at the top of RESEARCH_LOG.md lists every entry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from olmo.testing import run_main

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESEARCH_LOG = REPO / "RESEARCH_LOG.md"


def _scripts_the_docs_name() -> dict[str, list[str]]:
    """``{script name: [page, ...]}`` for every ``scripts/name.py`` or ``.sh`` a page names, in its command blocks
    (```bash) or its text (``scripts/NAME.py`` in capitals is a placeholder, not a script)."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in re.findall(r"\bscripts/([a-z][\w-]*\.(?:py|sh))\b", page.read_text()):
            found.setdefault(name, []).append(str(page.relative_to(REPO)))
    return found


SCRIPTS = _scripts_the_docs_name()


def test_the_docs_have_pages_and_commands():
    # Guards the scans below: an empty docs/ or a moved page would make every other check pass vacuously.
    assert (REPO / "docs/architecture.md") in PAGES and len(PAGES) > 10
    assert {"train.py", "eval.py", "generate.py", "ladder.py", "inspect_batch.py", "convert_to_hf.py"} <= set(
        SCRIPTS
    )


def test_every_script_the_docs_name_exists():
    missing = {name: pages for name, pages in SCRIPTS.items() if not (REPO / "scripts" / name).is_file()}
    assert not missing, f"the docs name scripts that do not exist: {missing}"


@pytest.mark.parametrize("script", sorted(name for name in SCRIPTS if name.endswith(".py")))
def test_every_python_script_the_docs_name_answers_help(script, capsys):
    try:
        status = run_main(script, "--help")
    except SystemExit as exit:  # argparse's --help exits; the commands with their own help return
        status = exit.code
    assert status in (0, None), f"scripts/{script} --help exited {status}"
    assert capsys.readouterr().out.strip(), f"scripts/{script} --help printed nothing"


def test_every_relative_link_points_to_a_file():
    broken = []
    for page in [*PAGES, REPO / "CHANGELOG.md", RESEARCH_LOG]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor on the same page, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: ({target})")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_config_the_docs_name_exists():
    missing = sorted(
        f"{page.relative_to(REPO)}: {path}"
        for page in PAGES
        for path in set(re.findall(r"(?<![\w/])configs/[\w./-]+\.yaml\b", page.read_text()))
        if not (REPO / path).is_file()
    )
    assert not missing, "configs named in the docs that do not exist:\n" + "\n".join(missing)


def github_anchor(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes, ``-N`` on repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


def test_the_research_log_index_lists_every_entry():
    text = RESEARCH_LOG.read_text()
    head, _, body = text.partition("\n## ")
    seen: dict[str, int] = {}
    headings = re.findall(r"^## (.+)$", "## " + body, flags=re.MULTILINE)
    expected = [f"- [{heading}](#{github_anchor(heading, seen)})" for heading in headings]
    listed = [line for line in head.splitlines() if line.startswith("- [")]
    assert listed == expected, (
        "the index at the top of RESEARCH_LOG.md must list every `## ` entry in order, as:\n"
        + "\n".join(line for line in expected if line not in listed)
    )
