"""The package's version, its one source: ``olmo.__version__`` and ``setup.py`` read it, and a test keeps it equal to
the latest release in CHANGELOG.md (``## [X.Y.Z] - date``; work since then is under ``[Unreleased]``)."""

VERSION = "0.4.0"
