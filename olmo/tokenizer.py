"""Tokenizer encoding and decoding, as OLMo's ``Tokenizer`` does.

Where a ``tokenizer.identifier`` is looked up (local files, OLMo's names, hub ids) is
:mod:`olmo.util.tokenizer_files`; config validation reports a tokenizer that cannot work before any model or
data is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tokenizers import Tokenizer as HFTokenizer

from .config import TokenizerConfig
from .config.validation import tokenizer_problems
from .exceptions import OLMoConfigurationError
from .util.tokenizer_files import (
    DEFAULT_TOKENIZER,
    TOKENIZER_CACHE_ENV,
    load_base_tokenizer,
    packaged_tokenizer_dir,
    resolve_tokenizer_path,
    tokenizer_cache_dir,
)

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = [
    "DEFAULT_TOKENIZER",
    "TOKENIZER_CACHE_ENV",
    "Tokenizer",
    "packaged_tokenizer_dir",
    "tokenizer_cache_dir",
    "resolve_tokenizer_path",
    "load_base_tokenizer",
    "tokenizer_problems",
]


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
