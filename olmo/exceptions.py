"""The exceptions olmo-trainer raises for problems a user can fix.

Every message names the config key, file or flag at fault and says what to change. Scripts print
these as one paragraph instead of a traceback (see :func:`olmo.util.install_excepthook`).
"""

__all__ = [
    "OLMoError",
    "OLMoConfigurationError",
    "OLMoCliError",
    "OLMoCheckpointError",
    "OLMoDataError",
    "OLMoTrainingError",
]


class OLMoError(Exception):
    """Base class for every error olmo-trainer raises on purpose."""


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
