"""Chat conversations as fixed-length SFT instances with a label mask, in OLMo's Tulu format (the code of
``scripts/prepare_sft_data.py``, whose docstring describes the format).

:func:`write_sft_dataset` reads the conversations of a JSON-lines file (:func:`read_conversations`), formats them
(:class:`Formatter`) and writes ``input_ids.npy`` and ``label_mask.npy`` into a hidden folder that is moved into
place once every example is written, so a failed run leaves the output folder as it was.
"""

from __future__ import annotations

import csv
import gzip
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

import numpy as np
from tqdm import tqdm

from ..exceptions import OLMoCliError, OLMoDataError
from ..util import nearest_existing, unwritable_reason
from ..util.json_lines import json_type, read_json_lines

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer
    from .chat_templates import ChatTemplate

__all__ = [
    "OUTPUT_FILES",
    "CONVERSATIONS_FILE",
    "ConversationLog",
    "Formatter",
    "Packer",
    "pack_problem",
    "SFTSummary",
    "check_sft_output",
    "check_sft_tokenizer",
    "ConversationError",
    "TemplateFormatter",
    "message_problem",
    "read_conversations",
    "fit",
    "write_batched",
    "write_sft_dataset",
    "write_staged",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

BATCH_EXAMPLES = 256
"""Examples whose messages are tokenized in one ``encode_batch`` call."""

ROLES = ("system", "user", "assistant")
OUTPUT_FILES = ("input_ids.npy", "label_mask.npy")
CONVERSATIONS_FILE = "input_ids.csv.gz"
"""Beside the token file, dolma's metadata layout (``start,end,id`` token offsets per document): which input line each
span of tokens came from, as ``inspect_batch.py`` and the provenance tools read it."""
EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


def message_problem(message: object) -> Optional[str]:
    """What is wrong with one element of a ``messages`` list, or None."""
    if not isinstance(message, dict):
        return f"is {json_type(message)}, not an object"
    for key in ("role", "content"):
        if key not in message:
            return f"has no '{key}' (its keys: {', '.join(repr(k) for k in message) or 'none'})"
        if not isinstance(message[key], str):
            return f"has a '{key}' that is {json_type(message[key])}, not a string"
    if message["role"] not in ROLES:
        return f"has the role {message['role']!r}, not one of {', '.join(ROLES)}"
    return None


def read_conversations(path: Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) for every non-blank line, checking the shape of each message.

    :raises OLMoDataError: naming the file and line of the first line that is not a conversation.
    """
    for line_no, line in read_json_lines(path):
        where = f"'{path}' line {line_no}"
        if "messages" not in line:
            raise OLMoDataError(
                f"{where} has no 'messages' key (its keys: {', '.join(repr(k) for k in line) or 'none'}). Every "
                f"line must look like {EXAMPLE}."
            )
        messages = line["messages"]
        if not isinstance(messages, list):
            raise OLMoDataError(
                f"{where}: 'messages' is {json_type(messages)}, not a list. Every line must look like {EXAMPLE}."
            )
        for i, message in enumerate(messages):
            problem = message_problem(message)
            if problem is not None:
                raise OLMoDataError(f"{where}: messages[{i}] {problem}. Every line must look like {EXAMPLE}.")
        yield line_no, messages


class Formatter:
    """Builds the token ids and label mask of one conversation, as OLMo's ``prepare_tulu_data.py`` does."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, eos: int, pad: int):
        self.tokenizer, self.seq_len, self.eos, self.pad = tokenizer, seq_len, eos, pad
        self.newline = tokenizer.encode("\n", add_special_tokens=False)
        self._role_tokens: dict[str, list[int]] = {}

    def role_tokens(self, role: str) -> list[int]:
        if role not in self._role_tokens:
            self._role_tokens[role] = self.tokenizer.encode(f"<|{role}|>\n", add_special_tokens=False)
        return self._role_tokens[role]

    def batch(self, conversations: list[list[dict[str, str]]]) -> list[tuple[list[int], list[bool], int]]:
        """(ids, mask, untruncated length) of each conversation; ids and mask are seq_len long."""
        texts = [
            m["content"].strip() + ("" if m["role"] == "assistant" else "\n") for c in conversations for m in c
        ]
        encoded = iter(self.tokenizer.encode_batch(texts, add_special_tokens=False))
        out = []
        for messages in conversations:
            ids, mask = [self.eos], [False]
            for message in messages:
                role = self.role_tokens(message["role"])
                ids += role
                mask += [False] * len(role)
                content = next(encoded)
                if message["role"] == "assistant":
                    # The model learns to answer and then to stop; the newline after eos is formatting.
                    ids += content + [self.eos] + self.newline
                    mask += [True] * (len(content) + 1) + [False] * len(self.newline)
                else:
                    ids += content
                    mask += [False] * len(content)
            out.append(fit(ids, mask, self.seq_len, self.pad))
        return out


def fit(ids: list[int], mask: list[bool], seq_len: int, pad: int) -> tuple[list[int], list[bool], int]:
    """``ids`` and ``mask`` truncated or padded (``pad``, no label) to ``seq_len``, and their length before."""
    ids, mask, length = ids[:seq_len], mask[:seq_len], len(ids)
    padding = seq_len - len(ids)
    return ids + [pad] * padding, mask + [False] * padding, length


def write_batched(
    records: Iterator[T],
    folder: Path,
    write: Callable[[list[T], Any, Any], None],
    unit: str,
    finish: Optional[Callable[[], None]] = None,
) -> None:
    """Open ``OUTPUT_FILES`` in ``folder`` and call ``write(batch, ids_file, mask_file)`` on ``records`` in batches of
    :data:`BATCH_EXAMPLES` (one tokenizer call each), with a progress bar counting ``unit``; then ``finish()``, before
    the files are closed."""
    ids_path, mask_path = (folder / name for name in OUTPUT_FILES)
    with open(ids_path, "wb") as ids_file, open(mask_path, "wb") as mask_file:
        pending: list[T] = []
        for record in tqdm(records, desc="tokenizing", unit=f" {unit}"):
            pending.append(record)
            if len(pending) >= BATCH_EXAMPLES:
                write(pending, ids_file, mask_file)
                pending = []
        write(pending, ids_file, mask_file)
        if finish is not None:
            finish()


class ConversationError(ValueError):
    """Conversation ``index`` of a batch could not be formatted (a chat template failed on it)."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index, self.reason = index, reason


class TemplateFormatter:
    """Builds the token ids and label mask of one conversation with a chat template (``--chat-template``,
    :mod:`olmo.data.chat_templates`): the tokens of the whole rendered text, the template's assistant tokens as
    labels; truncated and padded as :class:`Formatter` does."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, pad: int, template: ChatTemplate):
        self.tokenizer, self.seq_len, self.pad, self.template = tokenizer, seq_len, pad, template

    def batch(self, conversations: list[list[dict[str, str]]]) -> list[tuple[list[int], list[bool], int]]:
        """(ids, mask, untruncated length) of each conversation; ids and mask are seq_len long.

        :raises ConversationError: naming the conversation the template failed on.
        """
        out = []
        for index, messages in enumerate(conversations):
            try:
                ids, mask = self.template.tokenize(messages, self.tokenizer.base)
            except ValueError as e:  # the template's failure, or its budget's: one sentence, ended by the caller
                raise ConversationError(index, str(e).rstrip(".")) from None
            out.append(fit(ids, mask, self.seq_len, self.pad))
        return out


@dataclass
class SFTSummary:
    """What a run kept and dropped: examples, and the tokens of the kept ones."""

    kept: int = 0
    no_assistant: int = 0
    truncated_away: int = 0
    truncated: int = 0
    tokens: int = 0
    label_tokens: int = 0
    pad_tokens: int = 0
    instances: int = 0
    """Instances written: ``kept`` without packing, fewer with it."""
    unpacked_pad_tokens: int = 0
    """The padding one conversation per instance would have needed (equal to ``pad_tokens`` without packing)."""


class ConversationLog:
    """Writes :data:`CONVERSATIONS_FILE` in ``folder``: one row per conversation written, ``start,end,id`` (its tokens'
    offsets in the token file; ``id`` is ``{input file name}:{line}``, with the pair's side for preference data)."""

    def __init__(self, folder: Path, source: Path):
        self.name = source.name
        self.file = gzip.open(folder / CONVERSATIONS_FILE, "wt", newline="")
        self.rows = csv.writer(self.file)

    def add(self, start: int, length: int, line: int, side: str = "") -> None:
        self.rows.writerow([start, start + length, f"{self.name}:{line}{' ' + side if side else ''}"])

    def close(self) -> None:
        self.file.close()


class Packer:
    """Concatenates formatted conversations into instances of ``seq_len`` tokens, in order: a conversation that does
    not fit in the current instance's free tail starts the next instance, whose tail is padded (``pad``, no label).
    A truncated conversation fills an instance alone. Each conversation must end with its one EOS, which the trainer's
    document masking (``data.generate_doc_lengths``) splits instances at."""

    def __init__(
        self, seq_len: int, pad: int, eos: int, ids_file: Any, mask_file: Any, dtype: np.dtype, summary: SFTSummary
    ):
        self.seq_len, self.pad, self.eos, self.dtype, self.summary = seq_len, pad, eos, dtype, summary
        self.ids_file, self.mask_file = ids_file, mask_file
        self.ids: list[int] = []
        self.mask: list[bool] = []

    def add(self, ids: list[int], mask: list[bool]) -> int:
        """Add a conversation; return the offset of its first token in the token file."""
        if len(self.ids) + len(ids) > self.seq_len:
            self.flush()
        start = self.summary.instances * self.seq_len + len(self.ids)
        self.ids += ids
        self.mask += mask
        return start

    def flush(self) -> None:
        if not self.ids:
            return
        ids, mask, _ = fit(self.ids, self.mask, self.seq_len, self.pad)
        np.asarray(ids, dtype=self.dtype).tofile(self.ids_file)
        np.asarray(mask, dtype=np.bool_).tofile(self.mask_file)
        self.summary.instances += 1
        self.summary.pad_tokens += self.seq_len - len(self.ids)
        self.ids, self.mask = [], []


def check_sft_output(out: Path, overwrite: bool, names: tuple[str, ...] = OUTPUT_FILES) -> Path:
    """The existing folder to write the run in before it is moved to ``out``, checking that the output files
    (``names``) of an earlier run are only replaced with ``--overwrite``.

    :raises OLMoCliError: for an output that cannot be written, or that holds an earlier run's files.
    """
    reason = unwritable_reason(out)
    if reason is not None:
        raise OLMoCliError(f"-o/--output '{out}' cannot be written: {reason}. Pass a folder you can write to.")
    anchor = nearest_existing(out)
    existing = [name for name in names if (out / name).exists()]
    if existing and not overwrite:
        raise OLMoCliError(
            f"-o/--output '{out}' already holds {' and '.join(existing)} of an earlier run. Pass --overwrite to "
            f"replace them, or choose a new output folder."
        )
    return anchor


def check_sft_tokenizer(tokenizer: Tokenizer, name: str, eos: int, pad: int, dtype: str) -> None:
    """Check ``tokenizer`` (``--tokenizer name``) against ``--eos``, ``--pad`` and ``--dtype``; warn when ``eos`` is
    not ``<|endoftext|>``.

    :raises OLMoCliError: for an id the tokenizer does not have, or a dtype too small for its ids.
    """
    for flag, value in (("--eos", eos), ("--pad", pad)):
        if value >= tokenizer.vocab_size:
            raise OLMoCliError(
                f"{flag} {value} is not a token id of {name} ({tokenizer.vocab_size} tokens); pass "
                f"the id of that token in this tokenizer."
            )
    if tokenizer.vocab_size - 1 > np.iinfo(np.dtype(dtype)).max:
        raise OLMoCliError(f"--dtype {dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")
    if tokenizer.base.id_to_token(eos) != "<|endoftext|>":
        log.warning("--eos %d is %r in this tokenizer, not <|endoftext|>.", eos, tokenizer.base.id_to_token(eos))


def pack_problem(ids: list[int], length: int, seq_len: int, eos: int) -> Optional[str]:
    """Why a formatted conversation (``ids``, cut to ``seq_len`` from ``length`` tokens) cannot be packed, or None:
    its EOS must end it and appear nowhere else (a truncated one, alone in its instance, may hold none)."""
    kept = ids[: min(length, seq_len)]
    inner = kept.count(eos) - (1 if kept and kept[-1] == eos and length <= seq_len else 0)
    if inner:
        return f"holds the EOS token {eos} {inner} time(s) before its end"
    if length <= seq_len and (not kept or kept[-1] != eos):
        return f"does not end with the EOS token {eos}"
    return None


def write_examples(
    source: Path,
    formatter: Union[Formatter, TemplateFormatter],
    folder: Path,
    dtype: str,
    pack_eos: Optional[int] = None,
) -> SFTSummary:
    """Write the examples of ``source`` as ``OUTPUT_FILES`` in ``folder``; return what was kept and dropped.

    :param pack_eos: pack several conversations per instance (:class:`Packer`), each ending with this EOS token.
    :raises OLMoDataError: naming the file and line of a conversation the chat template failed on, or (packing) of
        one whose EOS tokens would not separate it from its neighbours.
    """
    summary, token_dtype, seq_len = SFTSummary(), np.dtype(dtype), formatter.seq_len
    packer: Optional[Packer] = None
    conversations = ConversationLog(folder, source)

    def write(numbered: list[tuple[int, list[dict[str, str]]]], ids_file: Any, mask_file: Any) -> None:
        nonlocal packer
        if pack_eos is not None and packer is None:
            packer = Packer(seq_len, formatter.pad, pack_eos, ids_file, mask_file, token_dtype, summary)
        batch = [messages for _, messages in numbered]
        try:
            formatted = formatter.batch(batch)
        except ConversationError as e:
            raise OLMoDataError(
                f"'{source}' line {numbered[e.index][0]}: {e.reason}. Fix the conversation, or pass another "
                f"--chat-template."
            ) from None
        for (line_no, messages), (ids, mask, length) in zip(numbered, formatted):
            n_labels = sum(mask)
            if n_labels == 0:
                if any(m["role"] == "assistant" for m in messages):
                    summary.truncated_away += 1
                else:
                    summary.no_assistant += 1
                continue
            summary.kept += 1
            summary.truncated += length > seq_len
            summary.tokens += min(length, seq_len)
            summary.unpacked_pad_tokens += max(0, seq_len - length)
            summary.label_tokens += n_labels
            if packer is not None:
                problem = pack_problem(ids, length, seq_len, packer.eos)
                if problem is not None:
                    raise OLMoDataError(
                        f"'{source}' line {line_no}: with --pack the conversation {problem}. Packed instances are "
                        f"split into documents at EOS (training's data.generate_doc_lengths), so each conversation "
                        f"must end with exactly one EOS: OLMo's Tulu layout starts each conversation with one and "
                        f"ends every assistant turn with one. Pass --chat-template olmo3 (one EOS, at the end), or "
                        f"drop --pack."
                    )
                kept = min(length, seq_len)
                conversations.add(packer.add(ids[:kept], mask[:kept]), kept, line_no)
                continue
            np.asarray(ids, dtype=token_dtype).tofile(ids_file)
            np.asarray(mask, dtype=np.bool_).tofile(mask_file)
            conversations.add(summary.instances * seq_len, min(length, seq_len), line_no)
            summary.instances += 1
            summary.pad_tokens += max(0, seq_len - length)

    def finish() -> None:
        if packer is not None:
            packer.flush()  # the last instance

    try:
        write_batched(read_conversations(source), folder, write, "examples", finish)
    finally:
        conversations.close()
    return summary


def write_staged(
    out: Path,
    anchor: Path,
    write: Callable[[Path], T],
    names: tuple[str, ...] = (*OUTPUT_FILES, CONVERSATIONS_FILE),
) -> T:
    """Call ``write(folder)``, which writes the files ``names`` into a hidden folder in ``anchor``
    (:func:`check_sft_output`'s) or raises to give up, then move them into ``out``: a failed run leaves ``out`` as it
    was."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.partial-", dir=anchor))
    try:
        result = write(staging)
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (staging / name).exists():
                os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def write_sft_dataset(
    source: Path,
    out: Path,
    formatter: Union[Formatter, TemplateFormatter],
    dtype: str,
    anchor: Path,
    pack_eos: Optional[int] = None,
) -> SFTSummary:
    """Write the examples of ``source`` as ``out/input_ids.npy`` and ``out/label_mask.npy`` (:func:`write_staged`),
    several per instance with ``pack_eos`` (the EOS token ending each conversation: :class:`Packer`).

    :raises OLMoDataError: for a source without a conversation, or without any label token within the length.
    """

    def write(staging: Path) -> SFTSummary:
        summary = write_examples(source, formatter, staging, dtype, pack_eos)
        if summary.kept + summary.no_assistant + summary.truncated_away == 0:
            raise OLMoDataError(
                f"'{source}' holds no conversation (it is empty or blank), so nothing was written to "
                f"'{out}'. Write one conversation per line: {EXAMPLE}."
            )
        if summary.kept == 0:
            raise OLMoDataError(
                f"No example of '{source}' has an assistant token within --seq-len {formatter.seq_len}, so "
                f"nothing would be trained on. Check that conversations have 'assistant' messages, or raise "
                f"--seq-len."
            )
        return summary

    return write_staged(out, anchor, write)
