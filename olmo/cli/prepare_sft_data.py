"""Tokenize chat conversations into fixed-length SFT instances with a label mask (OLMo's Tulu format).

    python scripts/prepare_sft_data.py INPUT.jsonl[.gz] -o OUTPUT_DIR [--seq-len 2048]

Every line of INPUT is ``{"messages": [{"role": "user", "content": "..."}, ...]}``. An example is
``[eos]`` followed, for every message, by the tokens of ``"<|{role}|>\\n"`` and then of the content:
``content.strip() + eos`` plus ``"\\n"`` for the assistant, ``content.strip() + "\\n"`` for other roles.
Only the assistant's content and its eos are trained on (label mask True). Examples are truncated or
padded (``--pad``, mask False) to exactly ``--seq-len`` tokens, so instance ``i`` of the output is example
``i``; examples with no label token left are dropped. This is the format of OLMo's
``scripts/prepare_tulu_data.py``. Fine-tune on the output with::

    python scripts/train.py CFG --data.paths=[OUTPUT_DIR/input_ids.npy] \\
        --data.label_mask_paths=[OUTPUT_DIR/label_mask.npy] --load_path=CKPT --reset_trainer_state

``input_ids.npy`` (``--dtype``) and ``label_mask.npy`` (bool) are headerless memmaps; set
``model.max_sequence_length`` to ``--seq-len``.

A line that is not such an object (invalid JSON, not UTF-8, no ``messages`` list, a message without a
string ``role`` and ``content``, a role other than system, user and assistant), an input that cannot be
read or is not gzip though named ``.gz``, and an input without any example to train on each stop the run
with an error naming the file and line. Both files are written into a hidden folder next to OUTPUT_DIR
(inside it when it exists) and moved into place at the end, so a failed run leaves OUTPUT_DIR as it was
(a new one is not created; a killed run leaves a hidden ``.NAME.partial-*`` folder, safe to delete).
OUTPUT_DIR may not already hold these files unless ``--overwrite`` is passed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer
from olmo.util import nearest_existing, unwritable_reason
from olmo.util.json_lines import json_type, read_json_lines

log = logging.getLogger("prepare_sft_data")

BATCH_EXAMPLES = 256
"""Examples whose messages are tokenized in one ``encode_batch`` call."""

ROLES = ("system", "user", "assistant")
OUTPUT_FILES = ("input_ids.npy", "label_mask.npy")
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
    """(line number, messages) for every non-blank line, checking the shape of each message."""
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
            length = len(ids)
            ids, mask = ids[: self.seq_len], mask[: self.seq_len]
            padding = self.seq_len - len(ids)
            out.append((ids + [self.pad] * padding, mask + [False] * padding, length))
        return out


@dataclass
class Summary:
    kept: int = 0
    no_assistant: int = 0
    truncated_away: int = 0
    truncated: int = 0
    tokens: int = 0
    label_tokens: int = 0
    pad_tokens: int = 0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="JSON lines of conversations (.jsonl or .jsonl.gz)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    parser.add_argument(
        "-t", "--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer.json path or packaged name (%(default)s)"
    )
    parser.add_argument("-s", "--seq-len", type=int, default=2048, help="tokens per example (%(default)s)")
    parser.add_argument("--eos", type=int, default=50279, help="end-of-sequence token id (%(default)s)")
    parser.add_argument("--pad", type=int, default=1, help="padding token id (%(default)s)")
    parser.add_argument(
        "--dtype", default="uint16", choices=["uint16", "uint32"], help="token dtype (%(default)s)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the input_ids.npy and label_mask.npy in OUTPUT_DIR"
    )
    args = parser.parse_args(argv)
    problems = []
    if args.seq_len < 2:
        problems.append(f"--seq-len {args.seq_len} is too short; use the model's max_sequence_length")
    for flag, value in (("--eos", args.eos), ("--pad", args.pad)):
        if value < 0:
            problems.append(f"{flag} {value} is negative; pass a token id of the tokenizer")
    if problems:
        parser.error("; ".join(problems))
    return args


def check_output(out: Path, overwrite: bool) -> Path:
    """The existing folder to write the run in before it is moved to ``out``, checking that the output files
    of an earlier run are only replaced with ``--overwrite``."""
    reason = unwritable_reason(out)
    if reason is not None:
        raise OLMoCliError(f"-o/--output '{out}' cannot be written: {reason}. Pass a folder you can write to.")
    anchor = nearest_existing(out)
    existing = [name for name in OUTPUT_FILES if (out / name).exists()]
    if existing and not overwrite:
        raise OLMoCliError(
            f"-o/--output '{out}' already holds {' and '.join(existing)} of an earlier run. Pass --overwrite to "
            f"replace them, or choose a new output folder."
        )
    return anchor


def load_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer, checked against ``--eos``, ``--pad`` and ``--dtype``."""
    tokenizer = Tokenizer.from_file(args.tokenizer, eos_token_id=args.eos, pad_token_id=args.pad)
    for flag, value in (("--eos", args.eos), ("--pad", args.pad)):
        if value >= tokenizer.vocab_size:
            raise OLMoCliError(
                f"{flag} {value} is not a token id of {args.tokenizer} ({tokenizer.vocab_size} tokens); pass "
                f"the id of that token in this tokenizer."
            )
    if tokenizer.vocab_size - 1 > np.iinfo(np.dtype(args.dtype)).max:
        raise OLMoCliError(f"--dtype {args.dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")
    if tokenizer.base.id_to_token(args.eos) != "<|endoftext|>":
        log.warning(
            "--eos %d is %r in this tokenizer, not <|endoftext|>.", args.eos, tokenizer.base.id_to_token(args.eos)
        )
    return tokenizer


def write_examples(args: argparse.Namespace, formatter: Formatter, folder: Path) -> Summary:
    """Write the examples of ``args.input`` as ``OUTPUT_FILES`` in ``folder``; return what was kept and dropped."""
    summary, dtype = Summary(), np.dtype(args.dtype)

    def write(batch: list[list[dict[str, str]]], ids_file: Any, mask_file: Any) -> None:
        for messages, (ids, mask, length) in zip(batch, formatter.batch(batch)):
            n_labels = sum(mask)
            if n_labels == 0:
                if any(m["role"] == "assistant" for m in messages):
                    summary.truncated_away += 1
                else:
                    summary.no_assistant += 1
                continue
            np.asarray(ids, dtype=dtype).tofile(ids_file)
            np.asarray(mask, dtype=np.bool_).tofile(mask_file)
            summary.kept += 1
            summary.truncated += length > args.seq_len
            summary.tokens += min(length, args.seq_len)
            summary.pad_tokens += max(0, args.seq_len - length)
            summary.label_tokens += n_labels

    ids_path, mask_path = (folder / name for name in OUTPUT_FILES)
    with open(ids_path, "wb") as ids_file, open(mask_path, "wb") as mask_file:
        pending: list[list[dict[str, str]]] = []
        for _, messages in tqdm(read_conversations(args.input), desc="tokenizing", unit=" examples"):
            pending.append(messages)
            if len(pending) >= BATCH_EXAMPLES:
                write(pending, ids_file, mask_file)
                pending = []
        write(pending, ids_file, mask_file)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not args.input.is_file():
        raise OLMoCliError(
            f"INPUT '{args.input}' is not a file. Pass a .jsonl or .jsonl.gz file of conversations."
        )
    anchor = check_output(args.output, args.overwrite)
    formatter = Formatter(load_tokenizer(args), args.seq_len, args.eos, args.pad)
    start = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{args.output.resolve().name}.partial-", dir=anchor))
    try:
        summary = write_examples(args, formatter, staging)
        if summary.kept + summary.no_assistant + summary.truncated_away == 0:
            raise OLMoDataError(
                f"'{args.input}' holds no conversation (it is empty or blank), so nothing was written to "
                f"'{args.output}'. Write one conversation per line: {EXAMPLE}."
            )
        if summary.kept == 0:
            raise OLMoDataError(
                f"No example of '{args.input}' has an assistant token within --seq-len {args.seq_len}, so "
                f"nothing would be trained on. Check that conversations have 'assistant' messages, or raise "
                f"--seq-len."
            )
        args.output.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            os.replace(staging / name, args.output / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    dropped = summary.no_assistant + summary.truncated_away
    total = summary.kept * args.seq_len
    log.info(
        "Kept %s examples, dropped %s (%d without an assistant message, %d whose assistant tokens were all "
        "truncated away); %d kept examples were truncated to %d tokens.",
        f"{summary.kept:,}",
        f"{dropped:,}",
        summary.no_assistant,
        summary.truncated_away,
        summary.truncated,
        args.seq_len,
    )
    log.info(
        "%s tokens (%s content, %s padding), %s label tokens (%.1f%% of all tokens) in %.1f s.",
        f"{total:,}",
        f"{summary.tokens:,}",
        f"{summary.pad_tokens:,}",
        f"{summary.label_tokens:,}",
        100 * summary.label_tokens / total,
        time.monotonic() - start,
    )
    ids_path, mask_path = (args.output / name for name in OUTPUT_FILES)
    log.info("Wrote %s and %s (%s, seq_len %d).", ids_path, mask_path, args.dtype, args.seq_len)
    return 0
