"""The checks a dataset's files get before training: sizes, dtypes, label masks, and token ids below the vocabulary
(:class:`FileChecks`, which :class:`olmo.data.memmap_dataset.MemMapDataset` has). They read every file once, in
bounded chunks, and report every problem at once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..exceptions import OLMoDataError
from .memmap_remote import RemoteFileAccess
from .remote import RemoteUnreachable, is_remote

__all__ = ["FileChecks", "ChunkHook", "SCAN_CHUNK_TOKENS"]

log = logging.getLogger(__name__)

SCAN_CHUNK_TOKENS = 2**24
"""Tokens (or mask entries) read per step while scanning files (bounds the scans' memory)."""
ChunkHook = Callable[[int, int, np.ndarray], None]
"""``on_chunk(file index, token offset, ids)`` of :meth:`FileChecks.validate`."""


class FileChecks(RemoteFileAccess):
    """:meth:`validate` for a dataset of token files (and label masks) cut into ``chunk_size``-token instances
    (remote ones probed all at once first, :class:`olmo.data.memmap_remote.RemoteFileAccess`)."""

    chunk_size: int
    config_key: str

    def tokens(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def label_mask(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def _file_tokens(self, i: int) -> int:
        raise NotImplementedError

    def validate(
        self,
        vocab_size: int,
        scan_max_tokens: int = 2**31,
        on_chunk: ChunkHook | None = None,
        scan_remote: bool = False,
    ) -> None:
        """Check every file before training and raise one :class:`OLMoDataError` listing every problem.

        Finds missing, unreadable or unfetchable files and directories, sizes that are not a whole number of
        ``memmap_dtype`` tokens, npy headers that do not match, empty files, label masks of another length,
        label masks without a single True in the tokens cut into instances (each one is a warning; all of
        them, a problem), and token ids ``>= vocab_size``. Token files are scanned fully, in order, until
        ``scan_max_tokens`` tokens in total have been read; label masks are always checked. A file too short
        to hold one instance only gets a warning, unless no file holds one.

        Remote files are checked by their metadata (all at once) and npy headers: their ids are not read up front
        unless ``scan_remote`` (reading a remote corpus would take longer than training on it; give the dataset a
        ``vocab_size`` to check each instance's ids as it is read instead), and their label masks only until one
        shows a True (usually in the bytes read with its header), so that masks without one are refused as local
        ones are.

        :param on_chunk: called with (file index, token offset, ids) for every chunk of ids the scan reads, in
            order, so a caller can gather statistics in the same pass; files are then read to the end (within
            ``scan_max_tokens``) even after a bad id.
        """
        problems: list[str] = []
        n_tokens: dict[int, int] = {}
        self._probe_remote()
        for i, path in enumerate(self.paths):
            try:
                n_tokens[i] = self._file_tokens(i)
            except RemoteUnreachable as e:
                # The network or the credentials: stop at the first such file instead of waiting out the
                # retries of each of possibly hundreds of URLs.
                raise RemoteUnreachable(f"{e} ({len(self.paths) - i - 1} later paths were not checked.)") from None
            except OLMoDataError as e:
                problems.append(str(e))
                continue
            if n_tokens[i] == 0:
                problems.append(
                    f"Token file '{path}' is empty. Remove it from {self.config_key}.paths, or re-run the data preparation "
                    f"script that writes it."
                )
        short = {i: n for i, n in n_tokens.items() if 0 < n < self.chunk_size}
        if n_tokens and all(n < self.chunk_size for n in n_tokens.values()) and short:
            longest = max(short, key=short.__getitem__)
            problems.append(
                f"No token file holds a full instance of chunk_size={self.chunk_size} tokens "
                f"(model.max_sequence_length); the longest, '{self.paths[longest]}', has {short[longest]} "
                f"tokens. Lower --model.max_sequence_length or add more data to {self.config_key}.paths."
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
        remote = {i for i in n_tokens if is_remote(self.paths[i])}
        if remote and not scan_remote:
            log.info(
                "%d of %d token files are remote: their token ids are checked as each instance is read, not up front.",
                len(remote),
                len(self.paths),
            )
            n_local = {i: n for i, n in n_tokens.items() if i not in remote}
        else:
            n_local = n_tokens
        problems += self._label_problems(n_tokens, scan_remote)
        problems += self._vocab_problems(n_local, vocab_size, scan_max_tokens, on_chunk)
        if len(problems) == 1:
            raise OLMoDataError(problems[0])
        if problems:
            listing = "\n".join(f"  - {p}" for p in problems)
            raise OLMoDataError(f"The training data has {len(problems)} problems; fix them all:\n{listing}")

    def _label_problems(self, n_tokens: dict[int, int], scan_remote: bool) -> list[str]:
        """Warn about each label mask with no True in its instances; a problem when that is all of them (the run
        would train at loss 0.0).

        Local masks (every mask with ``scan_remote``) are all read: a usual mask answers within its first few
        kilobytes. Remote ones cost requests, so they are read only when no local mask holds a True, one after
        the other until one does.
        """
        if self.label_mask_paths is None:
            return []
        used = {i: n // self.chunk_size * self.chunk_size for i, n in n_tokens.items() if n >= self.chunk_size}
        local = [i for i in used if scan_remote or not is_remote(self.label_mask_paths[i])]
        unlabeled = [i for i in local if self._labels_nothing(i, used[i])]
        if not used or len(unlabeled) < len(local):
            return []
        for i in (i for i in used if i not in local):
            if not self._labels_nothing(i, used[i]):
                return []
        return [
            f"No label mask in {self.config_key}.label_mask_paths holds a True in the tokens cut into instances ({len(used)} "
            f"checked), so no token would be trained on and the loss would be 0.0 for the whole run. Regenerate "
            f"the masks (True marks a token to train on, such as an assistant reply), or remove "
            f"{self.config_key}.label_mask_paths to train on every token."
        ]

    def _labels_nothing(self, i: int, n: int) -> bool:
        """Whether the label mask of file ``i`` holds no True in its first ``n`` entries (warned about)."""
        assert self.label_mask_paths is not None
        path = self.label_mask_paths[i]
        header_bytes = self._layout(path, True).header_bytes  # probed: its first bytes, or the run's record of it
        if path in self._recorded_masks:
            return False  # checked with the others when the run began, and unchanged since: no read on a relaunch
        head = self._mask_heads.get(path, b"")[header_bytes:][:n]  # read already
        if any(head) or _holds_true(self.label_mask(i), n):
            return False
        log.warning(
            "Label mask '%s' holds no True in the tokens cut into instances: token file '%s' contributes no labels "
            "(none of its tokens is trained on).",
            self.label_mask_paths[i],
            self.paths[i],
        )
        return True

    def _vocab_problems(
        self, n_tokens: dict[int, int], vocab_size: int, budget: int, on_chunk: ChunkHook | None
    ) -> list[str]:
        problems: list[str] = []
        scanned = 0
        for i, n in n_tokens.items():
            if n == 0 or scanned >= budget:
                continue
            tokens = self.tokens(i)
            limit = min(n, budget - scanned)
            found = False
            for start in range(0, limit, SCAN_CHUNK_TOKENS):
                chunk = np.asarray(tokens[start : min(start + SCAN_CHUNK_TOKENS, limit)])
                if on_chunk is not None:
                    on_chunk(i, start, chunk)
                if not found and chunk.max() >= vocab_size:
                    found = True
                    offset = int(np.argmax(chunk >= vocab_size))
                    problems.append(
                        f"Token file '{self.paths[i]}' holds token id {int(chunk[offset])} at token offset "
                        f"{start + offset}, but model.vocab_size is {vocab_size}. The data was tokenized with "
                        f"another tokenizer than this run's (tokenizer.identifier), model.vocab_size is too "
                        f"small for that tokenizer, or data.memmap_dtype={self.dtype.name} is not the dtype "
                        f"the file was written with; fix whichever does not match."
                    )
                    if on_chunk is None:
                        break
            scanned += limit
        total = sum(n_tokens.values())
        if scanned < total:
            log.info("Scanned the first %d of %d tokens for ids >= vocab_size=%d.", scanned, total, vocab_size)
        return problems


def _holds_true(mask: Any, n: int) -> bool:
    """Whether the first ``n`` entries of ``mask`` (a memmap, or a remote file's array, read by slices) hold a True,
    read in growing chunks: a usual mask answers within its first few kilobytes, and an all-False one is read in
    bounded steps."""
    start, step = 0, 2**12
    while start < n:
        if np.asarray(mask[start : min(start + step, n)]).any():
            return True
        start += step
        step = min(2 * step, SCAN_CHUNK_TOKENS)
    return False
