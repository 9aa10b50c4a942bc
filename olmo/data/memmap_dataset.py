"""Fixed-length training instances read from headerless token memmaps.

A token file is a raw ``np.memmap`` dump (no npy header, despite the usual ``.npy`` name) as written
by ``dolma tokens``. Instance ``l`` of file ``i`` is tokens ``[l*T, (l+1)*T)`` of that file, with
``T = chunk_size``; the tail of each file that does not fill an instance is dropped. Instances are
numbered globally over the files in order.

Paths may be URLs (``http(s)://``, ``s3://``, ``file://`` ...). A remote file is downloaded whole into
the cached-path cache the first time it is needed (not range-read), then memory-mapped like a local
file, so the first ``len()`` of a dataset with remote files can take a while.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config_validation import MEMMAP_DTYPES
from ..exceptions import OLMoConfigurationError, OLMoDataError
from ..util import is_url

__all__ = ["MemMapDataset"]

log = logging.getLogger(__name__)

PathOrStr = str | os.PathLike[str]
SCAN_CHUNK_TOKENS = 2**24
"""Tokens read per step while scanning for out-of-vocabulary ids (bounds the scan's memory)."""


class MemMapDataset(Dataset):
    """Instances of ``chunk_size`` tokens cut from one or more token memmaps.

    Memmaps are opened lazily, once per process, so the dataset pickles cheaply into DataLoader workers.

    :param paths: token files (local paths or URLs), in the order that defines global instance indices.
    :param chunk_size: tokens per instance (``model.max_sequence_length``).
    :param memmap_dtype: numpy dtype of the token files (``data.memmap_dtype``).
    :param metadata: a dict for every file, or one list entry per file; returned (with ``path``) in each
        instance's ``metadata``.
    :param include_instance_metadata: add ``metadata`` to every instance.
    :param generate_attention_mask: add ``attention_mask`` (1.0 where the token is not ``pad_token_id``).
    :param pad_token_id: the padding token id used for ``attention_mask``.
    :param label_mask_paths: one bool memmap per token file, of the same length; False means no loss.
    """

    def __init__(
        self,
        *paths: PathOrStr,
        chunk_size: int,
        memmap_dtype: str | type | np.dtype = np.uint16,
        metadata: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        include_instance_metadata: bool = True,
        generate_attention_mask: bool = False,
        pad_token_id: int = 1,
        label_mask_paths: Sequence[PathOrStr] | None = None,
    ):
        if not paths:
            raise OLMoConfigurationError("No token files given; list at least one file in data.paths.")
        assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
        self.paths: list[str] = [str(p) for p in paths]
        self.chunk_size = chunk_size
        self.dtype = np.dtype(memmap_dtype)
        self.label_mask_paths = None if label_mask_paths is None else [str(p) for p in label_mask_paths]
        if self.label_mask_paths is not None and len(self.label_mask_paths) != len(self.paths):
            raise OLMoConfigurationError(
                f"data.label_mask_paths has {len(self.label_mask_paths)} entries for {len(self.paths)} token "
                f"files; give exactly one label mask per token file (data.paths), in the same order."
            )
        per_file = [metadata or {}] * len(self.paths) if not isinstance(metadata, Sequence) else list(metadata)
        assert len(per_file) == len(self.paths), "metadata needs one dict per path"
        self._metadata = [dict(m) for m in per_file]
        self.include_instance_metadata = include_instance_metadata
        self.generate_attention_mask = generate_attention_mask
        self.pad_token_id = pad_token_id
        self._local_paths: dict[str, str] = {}  # path or URL -> local file; kept when pickled
        self._bounds: np.ndarray | None = None  # [0, end_0, end_1, ...] in instances
        self._memmaps: dict[tuple[str, str], np.memmap] = {}  # per process; dropped when pickled

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memmaps"] = {}
        return state

    def __len__(self) -> int:
        return int(self._instance_bounds()[-1])

    def __getitem__(self, index: Any) -> dict[str, Any]:
        file_index, local_index = self._locate(index)
        start = local_index * self.chunk_size
        stop = start + self.chunk_size
        tokens = self._memmap(self.paths[file_index], self.dtype)[start:stop]
        input_ids = torch.from_numpy(tokens.astype(np.int64))
        item: dict[str, Any] = {"input_ids": input_ids}
        if self.label_mask_paths is not None:
            mask = self._memmap(self.label_mask_paths[file_index], np.dtype(np.bool_))[start:stop]
            item["label_mask"] = torch.from_numpy(np.array(mask, dtype=np.bool_))
        if self.generate_attention_mask:
            item["attention_mask"] = (input_ids != self.pad_token_id).float()
        if self.include_instance_metadata:
            item["metadata"] = {"path": self.paths[file_index], **self._metadata[file_index]}
        return item

    def instance_location(self, index: Any) -> tuple[str, int]:
        """The token file (as given) and the offset, in tokens, where instance ``index`` starts."""
        file_index, local_index = self._locate(index)
        return self.paths[file_index], local_index * self.chunk_size

    def validate(self, vocab_size: int, scan_max_tokens: int = 2**31) -> None:
        """Check every file before training and raise one :class:`OLMoDataError` listing every problem.

        Finds missing or unfetchable files, sizes that are not a whole number of ``memmap_dtype`` tokens,
        empty files, label masks of another length, and token ids ``>= vocab_size``. Files are scanned
        fully, in order, until ``scan_max_tokens`` tokens in total have been read. A file too short to hold
        one instance only gets a warning, unless no file holds one.
        """
        problems: list[str] = []
        n_tokens: dict[int, int] = {}
        for i, path in enumerate(self.paths):
            try:
                n_tokens[i] = self._file_tokens(i)
            except OLMoDataError as e:
                if is_url(path) and e.__cause__ is not None:
                    # A failed fetch is almost always the network or credentials: stop at the first one
                    # instead of waiting out a timeout for each of possibly hundreds of URLs.
                    raise OLMoDataError(f"{e} ({len(self.paths) - i - 1} later paths were not checked.)") from None
                problems.append(str(e))
                continue
            if n_tokens[i] == 0:
                problems.append(
                    f"Token file '{path}' is empty. Remove it from data.paths, or re-run the data preparation "
                    f"script that writes it."
                )
        short = {i: n for i, n in n_tokens.items() if 0 < n < self.chunk_size}
        if n_tokens and all(n < self.chunk_size for n in n_tokens.values()) and short:
            longest = max(short, key=short.__getitem__)
            problems.append(
                f"No token file holds a full instance of chunk_size={self.chunk_size} tokens "
                f"(model.max_sequence_length); the longest, '{self.paths[longest]}', has {short[longest]} "
                f"tokens. Lower --model.max_sequence_length or add more data to data.paths."
            )
        else:
            for i, n in short.items():
                log.warning(
                    "Token file '%s' has %d tokens, fewer than one instance of %d (model.max_sequence_length); "
                    "it contributes no training data.",
                    self.paths[i],
                    n,
                    self.chunk_size,
                )
        problems += self._vocab_problems(n_tokens, vocab_size, scan_max_tokens)
        if len(problems) == 1:
            raise OLMoDataError(problems[0])
        if problems:
            listing = "\n".join(f"  - {p}" for p in problems)
            raise OLMoDataError(f"The training data has {len(problems)} problems; fix them all:\n{listing}")

    def _vocab_problems(self, n_tokens: dict[int, int], vocab_size: int, budget: int) -> list[str]:
        problems: list[str] = []
        scanned = 0
        for i, n in n_tokens.items():
            if n == 0 or scanned >= budget:
                continue
            tokens = self._memmap(self.paths[i], self.dtype)
            limit = min(n, budget - scanned)
            for start in range(0, limit, SCAN_CHUNK_TOKENS):
                chunk = np.asarray(tokens[start : min(start + SCAN_CHUNK_TOKENS, limit)])
                if chunk.max() >= vocab_size:
                    offset = int(np.argmax(chunk >= vocab_size))
                    problems.append(
                        f"Token file '{self.paths[i]}' holds token id {int(chunk[offset])} at token offset "
                        f"{start + offset}, but model.vocab_size is {vocab_size}. The data was tokenized with "
                        f"another tokenizer than this run's (tokenizer.identifier), model.vocab_size is too "
                        f"small for that tokenizer, or data.memmap_dtype={self.dtype.name} is not the dtype "
                        f"the file was written with; fix whichever does not match."
                    )
                    break
            scanned += limit
        total = sum(n_tokens.values())
        if scanned < total:
            log.info("Scanned the first %d of %d tokens for ids >= vocab_size=%d.", scanned, total, vocab_size)
        return problems

    def _locate(self, index: Any) -> tuple[int, int]:
        # operator.index turns numpy/torch integers into a Python int first, so a numpy uint32 from
        # global_indices.npy neither wraps around when negated nor overflows when offset.
        g = operator.index(index)
        bounds = self._instance_bounds()
        n = int(bounds[-1])
        if g < 0:
            g += n
        if not 0 <= g < n:
            raise IndexError(f"Instance index {index} is out of range for a dataset of {n} instances.")
        file_index = int(np.searchsorted(bounds, g, side="right")) - 1
        return file_index, g - int(bounds[file_index])

    def _instance_bounds(self) -> np.ndarray:
        if self._bounds is None:
            counts = [self._file_tokens(i) // self.chunk_size for i in range(len(self.paths))]
            self._bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._bounds

    def _file_tokens(self, i: int) -> int:
        """Tokens in file ``i``, after checking that it is a whole number of tokens and its mask matches."""
        path = self.paths[i]
        size = self._size_bytes(path, "Token file", "data.paths (or data.datasets)")
        itemsize = self.dtype.itemsize
        if size % itemsize != 0:
            fits = [d for d in MEMMAP_DTYPES if size % np.dtype(d).itemsize == 0]
            raise OLMoDataError(
                f"Token file '{path}' is {size} bytes, not a multiple of {itemsize} bytes "
                f"(data.memmap_dtype={self.dtype.name}), so it was written with another dtype or is truncated. "
                f"Set --data.memmap_dtype to the dtype it was tokenized with (its size fits {', '.join(fits)}), "
                f"or re-create the file."
            )
        n = size // itemsize
        if self.label_mask_paths is not None:
            mask_path = self.label_mask_paths[i]
            n_mask = self._size_bytes(mask_path, "Label mask file", "data.label_mask_paths")
            if n_mask != n:
                raise OLMoDataError(
                    f"Label mask '{mask_path}' has {n_mask} entries but its token file '{path}' has {n} tokens. "
                    f"A label mask must be a bool memmap of the same length as its token file: check the order "
                    f"of data.label_mask_paths against data.paths, or regenerate the mask."
                )
        return n

    def _size_bytes(self, path: str, kind: str, key: str) -> int:
        local = self._local_path(path, kind, key)
        try:
            return os.path.getsize(local)
        except FileNotFoundError:
            raise OLMoDataError(
                f"{kind} '{path}' (an entry of {key}) does not exist. Check the path in the config, or run the "
                f"data preparation script (e.g. `dolma tokens`) that writes it."
            ) from None

    def _local_path(self, path: str, kind: str = "File", key: str = "data.paths") -> str:
        if path not in self._local_paths:
            if not is_url(path):
                self._local_paths[path] = path
            else:
                # Imported here: cached-path pulls in the cloud SDKs, which local-file runs never need.
                from cached_path import cached_path

                try:
                    self._local_paths[path] = str(cached_path(path))
                except FileNotFoundError:
                    raise OLMoDataError(
                        f"{kind} '{path}' (an entry of {key}) does not exist. Check the URL in the config, or "
                        f"run the data preparation script that writes it."
                    ) from None
                except Exception as e:
                    raise OLMoDataError(
                        f"Could not fetch {kind.lower()} '{path}' (an entry of {key}): {type(e).__name__}: {e}. "
                        f"Check the URL, the network and the credentials for that storage, or download the "
                        f"file and list its local path instead."
                    ) from e
        return self._local_paths[path]

    def _memmap(self, path: str, dtype: np.dtype) -> np.memmap:
        key = (path, dtype.str)
        if key not in self._memmaps:
            self._memmaps[key] = np.memmap(self._local_path(path), dtype=dtype, mode="r")
        return self._memmaps[key]
