""":class:`BaseConfig`: what OLMo's config dataclasses share (``new``, ``load``, ``save``, ``asdict``), for code
written against the original's ``olmo.config.BaseConfig``. :class:`~olmo.config.TrainConfig`, ``ModelConfig`` and
``DataConfig`` derive from it (``TrainConfig`` with its own, stricter ``load`` and ``load_saved``)."""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from omegaconf import OmegaConf as om
from omegaconf.errors import OmegaConfBaseException

from .cli import config_error, load_structured
from .resolvers import register_resolvers

__all__ = ["BaseConfig"]

B = TypeVar("B", bound="BaseConfig")


class BaseConfig:
    """Methods for a config dataclass; the dataclass holds the fields."""

    @classmethod
    def new(cls: type[B], **kwargs: Any) -> B:
        """The config with its defaults and ``kwargs`` (checked as a YAML file's values are)."""
        register_resolvers()
        try:
            return om.to_object(om.merge(om.structured(cls), om.create(kwargs)))  # type: ignore[return-value]
        except OmegaConfBaseException as e:
            raise config_error(e, f"in {cls.__name__}.new(...)") from None

    @classmethod
    def load(cls: type[B], path: Union[str, Path], overrides: Optional[list[str]] = None) -> B:
        """The config in a YAML file, with ``key.path=value`` overrides, interpolations resolved (``${oc.env:...}``,
        ``${path.glob:...}``, ...).

        :raises OLMoConfigurationError: naming the key for unknown keys, wrong types and bad values.
        """
        register_resolvers()
        return load_structured(cls, path, overrides)

    def save(self, path: Union[str, Path]) -> None:
        """Write the config as YAML."""
        om.save(config=om.structured(self), f=str(path))

    def asdict(self, exclude: Optional[list[str]] = None) -> dict[str, Any]:
        """The config as plain values (enums as their strings), without the keys in ``exclude``."""
        out = _plain(asdict(self))  # type: ignore[call-overload]
        for key in exclude or []:
            out.pop(key, None)
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, Enum) else value
