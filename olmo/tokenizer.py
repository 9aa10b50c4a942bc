"""Tokenizer encoding and decoding, as OLMo's ``Tokenizer`` does.

Where a ``tokenizer.identifier`` is looked up (local files, OLMo's names, hub ids) is
:mod:`olmo.util.tokenizer_files`; config validation reports a tokenizer that cannot work before any model or
data is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from tokenizers import Tokenizer as HFTokenizer

from .config import TokenizerConfig, TruncationDirection
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
    from .config import ModelConfig, TrainConfig

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
    :param truncate_to: cut every encoding to this many ids (the EOS included), or None.
    :param truncate_direction: ``right`` keeps the first ids, ``left`` the last ones.
    """

    def __init__(
        self,
        base: HFTokenizer,
        eos_token_id: int,
        pad_token_id: Optional[int] = None,
        truncate_to: Optional[int] = None,
        truncate_direction: Union[str, TruncationDirection] = TruncationDirection.right,
    ):
        self.base = base
        self.base.no_truncation()
        self.base.no_padding()
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self.truncate_to = truncate_to
        self.truncate_direction = TruncationDirection(truncate_direction)

    @property
    def base_tokenizer(self) -> HFTokenizer:
        """OLMo's name for :attr:`base`."""
        return self.base

    @property
    def eos_token(self) -> str:
        return self.base.decode([self.eos_token_id], skip_special_tokens=False)

    @property
    def pad_token(self) -> str:
        return self.base.decode([self.pad_token_id], skip_special_tokens=False)

    @classmethod
    def from_pretrained(cls, identifier: str, **kwargs: Any) -> Tokenizer:
        """OLMo's constructor by name: a hub id (needs the network or the Hugging Face cache), a tokenizer.json
        path or a tokenizer OLMo ships. ``eos_token_id`` defaults to the last id, as in OLMo; the other keyword
        arguments are the constructor's."""
        base = load_base_tokenizer(identifier)
        eos = kwargs.pop("eos_token_id", base.get_vocab_size() - 1)
        return cls(base, eos, **kwargs)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path]) -> Tokenizer:
        """The tokenizer of the run that wrote ``checkpoint_dir`` (its ``config.yaml``: ``tokenizer.identifier``,
        ``model.eos_token_id`` and ``model.pad_token_id``).

        :raises OLMoConfigurationError: when the folder has no config.yaml, or its tokenizer cannot be loaded.
        """
        from .config import TrainConfig

        config = Path(checkpoint_dir) / "config.yaml"
        if not config.is_file():
            raise OLMoConfigurationError(
                f"{checkpoint_dir} has no config.yaml: give a checkpoint directory written by a training run."
            )
        return cls.from_train_config(TrainConfig.load_saved(config))

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
        """Load ``cfg.tokenizer`` for ``cfg.model`` (:meth:`for_model`)."""
        return cls.for_model(cfg.tokenizer, cfg.model)

    @classmethod
    def for_model(cls, cfg: TokenizerConfig, model: ModelConfig) -> Tokenizer:
        """Load ``cfg`` with the model's EOS and pad ids and check its vocabulary against ``model.vocab_size``."""
        tok = cls.from_config(cfg, model.eos_token_id, model.pad_token_id)
        tok.truncate_direction = TruncationDirection(cfg.truncate_direction)
        if tok.vocab_size != model.vocab_size:
            raise OLMoConfigurationError(
                f"The tokenizer {cfg.identifier!r} has {tok.vocab_size} tokens but "
                f"model.vocab_size={model.vocab_size}; they must match."
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

    def add_special_tokens(self, input_ids: list[int]) -> list[int]:
        """Append EOS to ``input_ids`` (in place) unless it already ends with it; returns it."""
        if not input_ids or input_ids[-1] != self.eos_token_id:
            input_ids.append(self.eos_token_id)
        return input_ids

    def num_special_tokens_to_add(self, is_pair: bool = False) -> int:
        """Ids :meth:`add_special_tokens` adds: one EOS per sequence."""
        return 2 if is_pair else 1

    def _truncate(self, ids: list[int], limit: Optional[int]) -> list[int]:
        if limit is None or len(ids) <= limit:
            return ids
        return ids[len(ids) - limit :] if self.truncate_direction == TruncationDirection.left else ids[:limit]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, followed by EOS when ``add_special_tokens`` (OLMo has no BOS), cut to
        ``truncate_to`` ids (EOS included) when set."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        limit = self.truncate_to
        if limit is not None and add_special_tokens:
            limit -= self.num_special_tokens_to_add(False)  # room for the EOS
        out = []
        for enc in self.base.encode_batch(texts, add_special_tokens=False):
            ids = self._truncate(enc.ids, limit)
            out.append(self.add_special_tokens(ids) if add_special_tokens else ids)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.base.decode(ids, skip_special_tokens=skip_special_tokens)
