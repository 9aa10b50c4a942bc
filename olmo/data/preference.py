"""Preference pairs for DPO (issue 40): ``{"chosen": messages, "rejected": messages}`` lines tokenized into the SFT
format (``input_ids.npy`` and ``label_mask.npy``, :mod:`olmo.data.sft`), pair ``i`` at instances ``2i`` (chosen) and
``2i + 1`` (rejected). A pair is dropped, both halves, when either has no label token left within the length, or
when its two sides are the same tokens within it.

A pair is refused, naming its file and line, unless both sides hold the same messages before their last one (the
assistant's answer) and the two sides tokenize differently; lines are read with their size and nesting bounded
(:mod:`olmo.util.json_lines`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ..exceptions import OLMoDataError
from ..util.json_lines import json_type, read_json_lines
from .sft import (
    ConversationError,
    ConversationLog,
    Formatter,
    TemplateFormatter,
    message_problem,
    write_batched,
    write_staged,
)

__all__ = ["PairSummary", "read_pairs", "write_preference_dataset"]

PAIR_EXAMPLE = (
    '{"chosen": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "good"}], '
    '"rejected": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "bad"}]}'
)


@dataclass
class PairSummary:
    """What a run kept and dropped: pairs, and the tokens of the kept ones."""

    kept: int = 0
    truncated_away: int = 0
    """Pairs dropped because a side had no label token within the length."""
    same_within_length: int = 0
    """Pairs dropped because their two sides were the same tokens within the length (they differ past it)."""
    truncated: int = 0
    """Kept pairs with a side cut to the length."""
    tokens: int = 0
    label_tokens: int = 0
    pad_tokens: int = 0


def _side_problem(side: Any) -> str | None:
    if not isinstance(side, list) or not side:
        return f"is {json_type(side)}, not a non-empty list of messages"
    for i, message in enumerate(side):
        problem = message_problem(message)
        if problem is not None:
            return f"[{i}] {problem}"
    last = side[-1]
    if last["role"] != "assistant":
        return f"ends with a {last['role']} message, not the assistant's answer"
    if not last["content"].strip():
        return "ends with an empty assistant answer"
    return None


def read_pairs(
    path: Path, max_line_bytes: Optional[int] = None
) -> Iterator[tuple[int, list[dict[str, str]], list[dict[str, str]]]]:
    """(line number, chosen, rejected) for every non-blank line: two conversations with the same messages before the
    last one, the assistant's answer, which must differ. Each line is read bounded (the file's type, each line's size
    and nesting: :func:`olmo.util.json_lines.read_json_lines`, whose limit ``max_line_bytes``
    overrides).

    :raises OLMoDataError: naming the file and line of the first line that is not such a pair.
    """
    for line_no, line in read_json_lines(path, max_line_bytes):
        where = f"'{path}' line {line_no}"
        missing = [key for key in ("chosen", "rejected") if key not in line]
        if missing:
            raise OLMoDataError(
                f"{where} has no {' or '.join(repr(k) for k in missing)} key (its keys: "
                f"{', '.join(repr(k) for k in line) or 'none'}). Every line must look like {PAIR_EXAMPLE}."
            )
        for key in ("chosen", "rejected"):
            problem = _side_problem(line[key])
            if problem is not None:
                raise OLMoDataError(f"{where}: '{key}' {problem}. Every line must look like {PAIR_EXAMPLE}.")
        chosen, rejected = line["chosen"], line["rejected"]
        if chosen == rejected:
            raise OLMoDataError(
                f"{where}: 'chosen' and 'rejected' are the same conversation, which teaches no preference. Remove "
                f"the line or fix one side."
            )
        problem = _prompt_problem(chosen[:-1], rejected[:-1])
        if problem is not None:
            raise OLMoDataError(
                f"{where}: 'chosen' and 'rejected' {problem}, so they are not two answers to one prompt: a preference "
                f"pair compares two assistant answers to the same conversation. Give both sides the same messages "
                f"before their last (assistant) message, or remove the line."
            )
        yield line_no, chosen, rejected


def _prompt_problem(chosen: list[dict[str, str]], rejected: list[dict[str, str]]) -> Optional[str]:
    """How the messages before the two answers differ, or None when they are the same."""
    for i, (a, b) in enumerate(zip(chosen, rejected)):
        if (a["role"], a["content"]) != (b["role"], b["content"]):
            return f"differ at message [{i}] ({a['role']} {_preview(a)} against {b['role']} {_preview(b)})"
        if a != b:
            return f"differ at message [{i}] in a key other than 'role' and 'content'"
    if len(chosen) != len(rejected):
        return f"have {len(chosen)} and {len(rejected)} messages before their answers"
    return None


def _preview(message: dict[str, str]) -> str:
    """The start of a message's content, for an error."""
    content = message["content"]
    return repr(content[:40] + ("..." if len(content) > 40 else ""))


def write_pairs(
    source: Path, formatter: Union[Formatter, TemplateFormatter], folder: Path, dtype: str
) -> PairSummary:
    """Write the pairs of ``source`` as ``OUTPUT_FILES`` in ``folder``, chosen then rejected; return the summary.

    :raises OLMoDataError: naming the file and line of a pair the chat template failed on.
    """
    summary, token_dtype, seq_len = PairSummary(), np.dtype(dtype), formatter.seq_len
    conversations = ConversationLog(folder, source)

    def write(
        batch: list[tuple[int, list[dict[str, str]], list[dict[str, str]]]], ids_file: Any, mask_file: Any
    ) -> None:
        sides = [chosen for _, chosen, _ in batch] + [rejected for _, _, rejected in batch]
        try:
            formatted = formatter.batch(sides)
        except ConversationError as e:
            line = batch[e.index % len(batch)][0]
            raise OLMoDataError(
                f"'{source}' line {line}: {e.reason}. Fix the pair, or pass another --chat-template."
            ) from None
        for (line_no, _, _), chosen, rejected in zip(batch, formatted[: len(batch)], formatted[len(batch) :]):
            if not any(chosen[1]) or not any(rejected[1]):
                summary.truncated_away += 1
                continue
            if chosen[:2] == rejected[:2]:  # the same ids and labels: the pair's loss has no gradient
                if max(chosen[2], rejected[2]) <= seq_len:
                    raise OLMoDataError(
                        f"'{source}' line {line_no}: 'chosen' and 'rejected' tokenize the same (their texts differ "
                        f"only where the format drops it, such as surrounding whitespace), which teaches no "
                        f"preference. Remove the line or make the answers differ."
                    )
                summary.same_within_length += 1
                continue
            for side, (ids, mask, length) in (("chosen", chosen), ("rejected", rejected)):
                instance = 2 * summary.kept + (side == "rejected")
                conversations.add(instance * seq_len, min(length, seq_len), line_no, side)
                np.asarray(ids, dtype=token_dtype).tofile(ids_file)
                np.asarray(mask, dtype=np.bool_).tofile(mask_file)
                summary.tokens += min(length, seq_len)
                summary.pad_tokens += max(0, seq_len - length)
                summary.label_tokens += sum(mask)
            summary.kept += 1
            summary.truncated += chosen[2] > seq_len or rejected[2] > seq_len

    try:
        write_batched(read_pairs(source), folder, write, "pairs")
    finally:
        conversations.close()
    return summary


def write_preference_dataset(
    source: Path, out: Path, formatter: Union[Formatter, TemplateFormatter], dtype: str, anchor: Path
) -> PairSummary:
    """Write the pairs of ``source`` as ``out/input_ids.npy`` and ``out/label_mask.npy`` (a staging folder moved into
    place at the end).

    :raises OLMoDataError: for a source without a pair, or without a pair left within the length.
    """

    def write(staging: Path) -> PairSummary:
        summary = write_pairs(source, formatter, staging, dtype)
        if summary.kept + summary.truncated_away + summary.same_within_length == 0:
            raise OLMoDataError(
                f"'{source}' holds no pair (it is empty or blank), so nothing was written to '{out}'. Write one pair "
                f"per line: {PAIR_EXAMPLE}."
            )
        if summary.kept == 0:
            raise OLMoDataError(
                f"No pair of '{source}' keeps an answer token on both sides, and two sides that differ, within "
                f"--seq-len {formatter.seq_len}; raise --seq-len."
            )
        return summary

    return write_staged(out, anchor, write)
