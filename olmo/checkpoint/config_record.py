"""The run's config as a checkpoint records it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Union

__all__ = ["ConfigRecord"]


class ConfigRecord(Protocol):
    """The run's config, written into each checkpoint as ``config.yaml``: a :class:`olmo.config.TrainConfig`, or
    anything else that writes itself as YAML."""

    def save(self, path: Union[str, Path]) -> None:
        """Write the config to ``path``."""
