"""The exceptions olmo-trainer raises for problems a user can fix.

Every message names the config key, file or flag at fault and says what to change. Scripts print
these as one paragraph instead of a traceback (see :func:`olmo.util.install_excepthook`).
"""

from collections.abc import Callable
from typing import Any

__all__ = [
    "OLMoError",
    "OLMoConfigurationError",
    "OLMoCliError",
    "OLMoCheckpointError",
    "OLMoDataError",
    "OLMoTrainingError",
    "set_message_filter",
]


_message_filter: Callable[[str], str] = str
"""Applied to every message: :mod:`olmo.util.secrets` installs its masking of secrets (URL credentials, values read
from the environment) when imported, so no message of ours carries one, wherever it is printed."""


def set_message_filter(fn: Callable[[str], str]) -> None:
    """Install ``fn`` as the filter of every :class:`OLMoError`'s message."""
    global _message_filter
    _message_filter = fn


class OLMoError(Exception):
    """Base class for every error olmo-trainer raises on purpose."""

    def __init__(self, *args: Any):
        super().__init__(*(_message_filter(a) if isinstance(a, str) else a for a in args))


class OLMoConfigurationError(OLMoError):
    """A config key is unknown, has the wrong type, or holds a value that cannot work."""


class OLMoCliError(OLMoError):
    """The command line itself is malformed (missing config path, unparsable option)."""


class OLMoCheckpointError(OLMoError):
    """A checkpoint is missing, partial, or does not match the model being trained."""


class OLMoDataError(OLMoError):
    """A token or label-mask file is missing, malformed, or holds out-of-range token ids."""


class OLMoTrainingError(OLMoError):
    """Training cannot continue safely (for example a non-finite loss or gradient norm)."""
