"""Fixed-length training instances read from token memmaps.

A token file is a raw ``np.memmap`` dump as written by ``dolma tokens`` (no header, despite the usual
``.npy`` name). Instance ``l`` of file ``i`` is tokens ``[l*T, (l+1)*T)`` of that file, with
``T = chunk_size``; the tail of each file that does not fill an instance is dropped. Instances are
numbered globally over the files in order. A label mask is a bool memmap with one entry per token.

A file written by ``np.save`` instead starts with an npy header (magic ``\\x93NUMPY``). Read raw, that
header would become a few garbage tokens and shift every instance after it, so such a file is read from
after its header: the header must describe ``data.memmap_dtype`` values (bool for a label mask) in a 1-D
or C-ordered array (read flat), never objects, that exactly fill the rest of the file; anything else is
an :class:`OLMoDataError`, never a guess. The header is parsed once per file by numpy's header reader (a
Python literal, never a pickle) and its size cached with the file's length, so reading instances costs
the same as for headerless files, which are read exactly as before.

Paths may be URLs: ``http(s)://``, ``s3://``, ``r2://``, ``weka://`` and ``gs://`` files are read in place, by
byte range (:mod:`olmo.data.remote`): the sizes of all of them are requested at once (``len()`` of 1,000 files
costs about as long as a few dozen requests), and each instance costs one range read of exactly its bytes.
``file://`` URLs are local paths.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config.data_sections import MEMMAP_DTYPES, InstanceFilterConfig, RemoteDataConfig
from ..exceptions import OLMoConfigurationError, OLMoDataError
from ..util import local_path_of, redact_url
from .file_checks import FileChecks
from .instance_filter import is_repetitive
from .npy_files import (
    Layout,
    NpyHeader,
    read_npy_header,
)
from .read_ahead import fetch_pool, read_ahead
from .remote import (
    FetchStats,
    MetadataCache,
    RemoteArray,
    RemoteFile,
    is_remote,
)
from .remote_backends import remote_reader

__all__ = ["MemMapDataset"]

log = logging.getLogger(__name__)

PathOrStr = str | os.PathLike[str]
_logged_headers: set[str] = set()
"""Files whose npy header was logged in this process (a run builds several datasets over the same files)."""


class MemMapDataset(FileChecks, Dataset):
    """Instances of ``chunk_size`` tokens cut from one or more token memmaps.

    Memmaps are opened lazily, once per process, so the dataset pickles cheaply into DataLoader workers.

    :param paths: token files (local paths or URLs), in the order that defines global instance indices:
        headerless memmaps, or arrays written by ``np.save`` (read from after their npy header).
    :param chunk_size: tokens per instance (``model.max_sequence_length``; 1024 by default, as in OLMo).
    :param memmap_dtype: numpy dtype of the token files (``data.memmap_dtype``).
    :param metadata: a dict for every file, or one list entry per file; returned (with ``path``) in each
        instance's ``metadata``.
    :param include_instance_metadata: add ``metadata`` to every instance.
    :param generate_attention_mask: add ``attention_mask`` (1.0 where the token is not ``pad_token_id``).
    :param pad_token_id: the padding token id used for ``attention_mask``.
    :param label_mask_paths: one bool memmap (or ``np.save``'d bool array) per token file, of the same
        length; False means no loss.
    :param generate_doc_lengths: add ``doc_lens`` (a long tensor): the lengths of the documents in the
        instance, each including its trailing ``eos_token_id``; they sum to ``chunk_size``.
    :param eos_token_id: the token that ends a document (``model.eos_token_id``).
    :param instance_filter_config: add ``instance_mask``, False for an instance that repeats a short
        pattern too often (see :mod:`olmo.data.instance_filter`).
    :param vocab_size: check every instance read for token ids ``>= vocab_size`` (an :class:`OLMoDataError` naming
        the file and offset); None checks nothing.
    :param remote: how URLs are read (``data.remote``); None is the default settings.
    :param metadata_cache: the run's record of its remote files (``train_data/remote_files.json``): a file recorded
        there is checked against it with one metadata request instead of being probed again, and a file that
        changed is an error. None keeps the records in memory.
    :param reuse_metadata_cache: read what ``metadata_cache`` already holds; False (a new run replacing an old one)
        only writes it.
    """

    def __init__(
        self,
        *paths: PathOrStr,
        chunk_size: int = 1024,
        memmap_dtype: str | type | np.dtype = np.uint16,
        metadata: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        include_instance_metadata: bool = True,
        generate_attention_mask: bool = False,
        pad_token_id: int = 1,
        label_mask_paths: Sequence[PathOrStr] | None = None,
        generate_doc_lengths: bool = False,
        eos_token_id: int | None = None,
        instance_filter_config: InstanceFilterConfig | None = None,
        vocab_size: int | None = None,
        remote: RemoteDataConfig | None = None,
        metadata_cache: Union[str, os.PathLike[str], None] = None,
        reuse_metadata_cache: bool = True,
        config_key: str = "data",
    ):
        self.config_key = config_key  # where errors say the files come from: data, evaluators[0].data, ...
        if not paths:
            raise OLMoConfigurationError(f"No token files given; list at least one file in {config_key}.paths.")
        assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
        self.paths: list[str] = [str(p) for p in paths]
        self.chunk_size = chunk_size
        self.dtype = np.dtype(memmap_dtype)
        self.label_mask_paths = None if label_mask_paths is None else [str(p) for p in label_mask_paths]
        if self.label_mask_paths is not None and len(self.label_mask_paths) != len(self.paths):
            raise OLMoConfigurationError(
                f"{config_key}.label_mask_paths has {len(self.label_mask_paths)} entries for {len(self.paths)} token "
                f"files; give exactly one label mask per token file ({config_key}.paths), in the same order."
            )
        per_file = [metadata or {}] * len(self.paths) if not isinstance(metadata, Sequence) else list(metadata)
        assert len(per_file) == len(self.paths), "metadata needs one dict per path"
        self._metadata = [dict(m) for m in per_file]
        self.include_instance_metadata = include_instance_metadata
        self.generate_attention_mask = generate_attention_mask
        self.pad_token_id = pad_token_id
        if generate_doc_lengths and eos_token_id is None:
            raise OLMoConfigurationError(
                "data.generate_doc_lengths needs the EOS token id: set model.eos_token_id."
            )
        self.generate_doc_lengths = generate_doc_lengths
        self.eos_token_id = eos_token_id
        self.instance_filter_config = instance_filter_config
        self.vocab_size = vocab_size
        self.remote = remote if remote is not None else RemoteDataConfig()
        self._layouts: dict[tuple[str, bool], Layout] = {}  # (path, is label mask) -> layout; kept when pickled
        self._bounds: np.ndarray | None = None  # [0, end_0, end_1, ...] in instances
        self._memmaps: dict[tuple[str, bool], Any] = {}  # per process; dropped when pickled
        # Remote files: what their metadata requests said (kept when pickled), failures of the concurrent probe,
        # the run's record of them, and what reading them cost (shared with DataLoader workers).
        self._remote_files: dict[str, RemoteFile] = {}
        self._probe_errors: dict[tuple[str, bool], OLMoDataError] = {}
        self._mask_heads: dict[str, bytes] = {}  # the first bytes of remote label masks, read with their headers
        self._recorded_masks: set[str] = set()  # remote label masks found unchanged in the run's record
        self._cache_path = None if metadata_cache is None else Path(metadata_cache)
        self._reuse_cache = reuse_metadata_cache
        self._cache: Optional[MetadataCache] = None
        self.fetch_stats: Optional[FetchStats] = FetchStats() if self.has_remote_files else None
        self.selection: Any = None
        """For a mixture: instance ``i`` is instance ``selection[i]`` of the files taken together
        (:mod:`olmo.data.mixture`); None: every instance once, in file order."""
        self.mixture_plan: Any = None  # the MixturePlan the selection realizes
        self.path_keys: dict[str, str] = {}
        """Where a file was given in the config, when not ``{config_key}.paths`` (a mixture's source), for errors."""
        self.file_sources: Optional[np.ndarray] = None
        """For a mixture: the source (its position in ``mixture.sources``) of each file, given to every instance
        as ``source_id`` (the per-source losses are keyed by it)."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memmaps"], state["_mask_heads"] = {}, {}
        return state

    @property
    def has_remote_files(self) -> bool:
        """Whether any token file or label mask is read by byte range from a URL."""
        return any(is_remote(p) for p in self._all_paths())

    def _all_paths(self) -> list[str]:
        return [*self.paths, *(self.label_mask_paths or [])]

    def __len__(self) -> int:
        return len(self.selection) if self.selection is not None else int(self._instance_bounds()[-1])

    def __getitem__(self, index: Any) -> dict[str, Any]:
        file_index, local_index = self._locate(index)
        start = local_index * self.chunk_size
        stop = start + self.chunk_size
        tokens = self._memmap(self.paths[file_index], is_mask=False)[start:stop]
        if self.vocab_size is not None and len(tokens) and int(tokens.max()) >= self.vocab_size:
            self._bad_id(file_index, start, tokens)
        input_ids = torch.from_numpy(tokens.astype(np.int64))
        item: dict[str, Any] = {"input_ids": input_ids}
        if self.instance_filter_config is not None:
            item["instance_mask"] = not is_repetitive(np.asarray(tokens), self.instance_filter_config)
        if self.label_mask_paths is not None:
            mask = self._memmap(self.label_mask_paths[file_index], is_mask=True)[start:stop]
            item["label_mask"] = torch.from_numpy(np.array(mask, dtype=np.bool_))
        if self.generate_attention_mask:
            item["attention_mask"] = (input_ids != self.pad_token_id).float()
        if self.generate_doc_lengths and self.eos_token_id is not None:  # __init__ ensures both or neither
            item["doc_lens"] = document_lengths(input_ids, self.eos_token_id)
        if self.file_sources is not None:
            item["source_id"] = int(self.file_sources[file_index])
        if self.include_instance_metadata:
            item["metadata"] = {"path": self.paths[file_index], **self._metadata[file_index]}
        return item

    def _bad_id(self, file_index: int, start: int, tokens: np.ndarray) -> None:
        offset = int(np.argmax(tokens >= self.vocab_size))
        raise OLMoDataError(
            f"Token file '{redact_url(self.paths[file_index])}' holds token id {int(tokens[offset])} at token offset "
            f"{start + offset}, but model.vocab_size is {self.vocab_size}. The data was tokenized with another tokenizer than this run's (tokenizer.identifier), "
            f"model.vocab_size is too small for that tokenizer, or data.memmap_dtype={self.dtype.name} is not the "
            f"dtype the file was written with; fix whichever does not match."
        )

    def read_ahead(
        self, indices: Iterable[int], extra: Callable[[int], dict[str, Any]] = lambda i: {}
    ) -> Iterator[dict[str, Any]]:
        """``{**self[i], **extra(i)}`` for each of ``indices`` in order. With remote files, instances are fetched
        ahead on ``data.remote.max_concurrency`` threads, within ``data.remote.prefetch_bytes``; local files are
        read one by one, as a plain loop would."""

        def get(i: int) -> dict[str, Any]:
            return {**self[i], **extra(i)}

        if not self.has_remote_files:
            return map(get, indices)
        # An instance becomes int64 ids (+ a bool mask): that is what the window holds.
        instance_bytes = self.chunk_size * (8 + (1 if self.label_mask_paths is not None else 0))
        window = max(1, self.remote.prefetch_bytes // instance_bytes)
        return read_ahead(get, indices, window, fetch_pool(self.remote.max_concurrency))

    def instance_source(self, index: Any) -> Optional[str]:
        """The mixture source (``data.mixture``) or the ``data.datasets`` label of ``index``'s file, else None."""
        file_index, _ = self._locate(index)
        meta = self._metadata[file_index]
        return meta.get("source", meta.get("label"))

    def instance_location(self, index: Any) -> tuple[str, int]:
        """The token file (as given) and the offset, in tokens after any npy header, where ``index`` starts."""
        file_index, local_index = self._locate(index)
        return self.paths[file_index], local_index * self.chunk_size

    def tokens(self, i: int) -> np.ndarray:
        """Every token of file ``i``, read-only and memory-mapped (after its npy header, if it has one).

        :raises OLMoDataError: when the file cannot be read as ``memmap_dtype`` tokens.
        """
        return self._memmap(self.paths[i], is_mask=False)

    def label_mask(self, i: int) -> np.ndarray:
        """The label mask of file ``i``, like :meth:`tokens`."""
        assert self.label_mask_paths is not None, "this dataset has no label masks"
        return self._memmap(self.label_mask_paths[i], is_mask=True)

    def _locate(self, index: Any) -> tuple[int, int]:
        # operator.index turns numpy/torch integers into a Python int first, so a numpy uint32 from
        # global_indices.npy neither wraps around when negated nor overflows when offset.
        g = operator.index(index)
        bounds = self._instance_bounds()
        n = len(self)
        if g < 0:
            g += n
        if not 0 <= g < n:
            raise IndexError(f"Instance index {index} is out of range for a dataset of {n} instances.")
        if self.selection is not None:
            g = int(self.selection[g])
        file_index = int(np.searchsorted(bounds, g, side="right")) - 1
        return file_index, g - int(bounds[file_index])

    def instance_bounds(self) -> np.ndarray:
        """``[0, end_0, end_1, ...]``: where each file's instances end, counted over the files in order."""
        return self._instance_bounds()

    def _instance_bounds(self) -> np.ndarray:
        if self._bounds is None:
            self._probe_remote()
            counts = [self._file_tokens(i) // self.chunk_size for i in range(len(self.paths))]
            self._bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._bounds

    def _file_tokens(self, i: int) -> int:
        """Tokens in file ``i``, after checking that it is a whole number of tokens and its mask matches."""
        path = self.paths[i]
        n = self._layout(path, is_mask=False).n_items
        if self.label_mask_paths is not None:
            mask_path = self.label_mask_paths[i]
            n_mask = self._layout(mask_path, is_mask=True).n_items
            if n_mask != n:
                raise OLMoDataError(
                    f"Label mask '{mask_path}' has {n_mask} entries but its token file '{path}' has {n} tokens. "
                    f"A label mask must be a bool memmap of the same length as its token file: check the order "
                    f"of {self.config_key}.label_mask_paths against {self.config_key}.paths, or regenerate the mask."
                )
        return n

    @property
    def _tokens_key(self) -> str:
        return f"{self.config_key}.paths (or {self.config_key}.datasets)"

    @property
    def _masks_key(self) -> str:
        return f"{self.config_key}.label_mask_paths"

    def _layout(self, path: str, is_mask: bool) -> Layout:
        """Where the items of a token file (or label mask) lie, found and checked once per file.

        This is the only place that decides how many tokens a file holds and where they start.
        """
        if (path, is_mask) in self._probe_errors:
            raise self._probe_errors[path, is_mask]
        if (path, is_mask) not in self._layouts:
            kind, key = ("Label mask file", self._masks_key) if is_mask else ("Token file", self._tokens_key)
            key = self.path_keys.get(path, key)
            size, header = self._read_start(path, kind, key, is_mask)
            if header is not None:
                layout = self._header_layout(path, size, header, is_mask, f"{kind} '{path}' (an entry of {key})")
            elif not is_mask and size % self.dtype.itemsize != 0:
                fits = [d for d in MEMMAP_DTYPES if size % np.dtype(d).itemsize == 0]
                raise OLMoDataError(
                    f"Token file '{path}' is {size} bytes, not a multiple of {self.dtype.itemsize} bytes "
                    f"(data.memmap_dtype={self.dtype.name}), so it was written with another dtype or is "
                    f"truncated. Set --data.memmap_dtype to the dtype it was tokenized with (its size fits "
                    f"{', '.join(fits)}), or re-create the file."
                )
            else:
                layout = Layout(0, size // (1 if is_mask else self.dtype.itemsize))
            self._layouts[path, is_mask] = layout
        return self._layouts[path, is_mask]

    def _read_start(self, path: str, kind: str, key: str, is_mask: bool) -> tuple[int, NpyHeader | None]:
        """The size of a file in bytes and the npy header it starts with, if any."""
        if is_remote(path):
            return self._remote_start(path, kind, key, keep_head=is_mask)
        local = local_path_of(path)
        what = f"{kind} '{path}' (an entry of {key})"
        try:
            with open(local, "rb") as f:
                return os.fstat(f.fileno()).st_size, read_npy_header(f)
        except FileNotFoundError:
            raise OLMoDataError(
                f"{what} does not exist. Check the path in the config, or run the data preparation script "
                f"(e.g. `dolma tokens`) that writes it."
            ) from None
        except IsADirectoryError:
            raise OLMoDataError(
                f"{what} is a directory, not a file. List the files in it instead, e.g. with a glob such as "
                f"'{path.rstrip('/')}/*.npy' (matches are used in sorted order)."
            ) from None
        except PermissionError:
            raise OLMoDataError(
                f"{what} cannot be read: permission denied. Give the user that runs training read access "
                f"(e.g. `chmod a+r`, plus search access to its directories), or list a copy it can read."
            ) from None
        except OSError as e:
            raise OLMoDataError(
                f"{what} cannot be read: {e.strerror or e}. Check the file and its file system, or list a copy."
            ) from None
        except ValueError as e:
            raise OLMoDataError(
                f"{what} starts like an npy file (written by np.save) but its header cannot be read: {e}. "
                f"Re-save it with np.save, or write the array headerless with ndarray.tofile."
            ) from None

    def _header_layout(self, path: str, size: int, header: NpyHeader, is_mask: bool, what: str) -> Layout:
        expected = np.dtype(np.bool_) if is_mask else self.dtype
        save_as = f"np.save(path, np.ravel(values).astype('{expected.name}'))"
        where = f"{what} was written by np.save: its npy header"
        if header.dtype.hasobject:
            raise OLMoDataError(
                f"{where} holds Python objects (dtype object), which are stored as pickles and are never loaded. "
                f"Re-save it as {expected.name} values: {save_as}."
            )
        if header.dtype != expected:
            found = f"{where} has dtype {header.dtype.name}"
            if not header.dtype.isnative:
                found += f" in the non-native byte order '{header.dtype.byteorder}'"
            if is_mask:
                raise OLMoDataError(
                    f"{found}, but a label mask ({self._masks_key}) must be bool. Re-save it: {save_as}."
                )
            fix = f"re-save it as {self.dtype.name}: {save_as}"
            if header.dtype.isnative and header.dtype.name in MEMMAP_DTYPES:
                fix = f"set --data.memmap_dtype={header.dtype.name} if all files of the run have it, or {fix}"
            raise OLMoDataError(f"{found}, but --data.memmap_dtype is {self.dtype.name}: {fix}.")
        if header.fortran_order and len(header.shape) > 1:
            raise OLMoDataError(
                f"{where} describes a Fortran-ordered {header.shape} array, whose bytes are not in the order of "
                f"its rows. Re-save it flat in C order: {save_as}."
            )
        n_items = math.prod(header.shape)
        if size - header.size != n_items * expected.itemsize:
            raise OLMoDataError(
                f"{where} describes {n_items} items of {expected.itemsize} bytes, but {size - header.size} bytes "
                f"follow the header, so the file is truncated or was appended to. Re-create the file."
            )
        if path not in _logged_headers:
            _logged_headers.add(path)
            log.info(
                "%s starts with a %d-byte npy header (written by np.save); reading its %d items after it.",
                what,
                header.size,
                n_items,
            )
        return Layout(header.size, n_items)

    def _memmap(self, path: str, is_mask: bool) -> Any:
        """All items of a file: a read-only memmap, or for a remote file a :class:`RemoteArray` (slices of it are
        range reads)."""
        if (path, is_mask) not in self._memmaps:
            header_bytes, n_items = self._layout(path, is_mask)
            dtype = np.dtype(np.bool_) if is_mask else self.dtype
            if is_remote(path):
                reader = remote_reader(path, self.remote)
                assert self.fetch_stats is not None
                array: Any = RemoteArray(
                    reader, self._remote_files[path], header_bytes, n_items, dtype, self.fetch_stats
                )
            elif n_items == 0:  # np.memmap cannot map an empty file
                array = np.empty(0, dtype)
            else:
                mapped = np.memmap(
                    local_path_of(path), dtype=dtype, mode="r", offset=header_bytes, shape=(n_items,)
                )
                # A plain view of the mapping: slicing an np.memmap runs Python code (its __getitem__ and
                # __array_finalize__) for every instance, which costs more than reading the instance.
                array = mapped.view(np.ndarray)
            self._memmaps[path, is_mask] = array
        return self._memmaps[path, is_mask]


def document_lengths(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """The lengths of the documents in an instance, as OLMo computes them: a document ends after each EOS (which
    it includes), and the instance's end closes the last one. The lengths sum to ``len(input_ids)``."""
    ends = torch.nonzero(input_ids == eos_token_id).flatten()
    if len(ends) == 0 or int(ends[-1]) != len(input_ids) - 1:
        ends = torch.cat([ends, ends.new_tensor([len(input_ids) - 1])])
    return torch.diff(ends, prepend=ends.new_tensor([-1]))
