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
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from olmo.exceptions import OLMoCliError, OLMoDataError  # noqa: E402
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer  # noqa: E402
from olmo.util import prepare_cli_environment  # noqa: E402

log = logging.getLogger("prepare_sft_data")

BATCH_EXAMPLES = 256
"""Examples whose messages are tokenized in one ``encode_batch`` call."""


def read_conversations(path: Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) for every non-blank line, checking the shape of each message."""
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"'{path}' line {line_no}"
            try:
                messages = json.loads(line).get("messages")
            except (json.JSONDecodeError, AttributeError) as e:
                raise OLMoDataError(
                    f"{where} is not a JSON object ({e}). Write one conversation per line."
                ) from None
            ok = isinstance(messages, list) and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
            if not ok:
                raise OLMoDataError(
                    f"{where} has no valid 'messages' list. Every line must look like "
                    f'{{"messages": [{{"role": "user", "content": "..."}}, {{"role": "assistant", ...}}]}}, '
                    f"with string roles and contents."
                )
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


def main(argv: Optional[list[str]] = None) -> None:
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
    args = parser.parse_args(argv)

    if not args.input.is_file():
        raise OLMoCliError(
            f"INPUT '{args.input}' is not a file. Pass a .jsonl or .jsonl.gz file of conversations."
        )
    if args.seq_len < 2:
        raise OLMoCliError(f"--seq-len {args.seq_len} is too short; use the model's max_sequence_length.")
    tokenizer = Tokenizer.from_file(args.tokenizer, eos_token_id=args.eos, pad_token_id=args.pad)
    dtype = np.dtype(args.dtype)
    for flag, value in (("--eos", args.eos), ("--pad", args.pad)):
        if not 0 <= value < tokenizer.vocab_size:
            raise OLMoCliError(
                f"{flag} {value} is not a token id of {args.tokenizer} ({tokenizer.vocab_size} tokens); pass "
                f"the id of that token in this tokenizer."
            )
    if tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise OLMoCliError(f"--dtype {args.dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")
    if tokenizer.base.id_to_token(args.eos) != "<|endoftext|>":
        log.warning(
            "--eos %d is %r in this tokenizer, not <|endoftext|>.", args.eos, tokenizer.base.id_to_token(args.eos)
        )

    args.output.mkdir(parents=True, exist_ok=True)
    final = {"ids": args.output / "input_ids.npy", "mask": args.output / "label_mask.npy"}
    # Written next to the targets and renamed at the end, so a failed run leaves no half-written pair.
    partial = {k: p.with_name(f".{p.name}.partial") for k, p in final.items()}
    formatter = Formatter(tokenizer, args.seq_len, args.eos, args.pad)
    summary, start = Summary(), time.monotonic()

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

    try:
        with open(partial["ids"], "wb") as ids_file, open(partial["mask"], "wb") as mask_file:
            pending: list[list[dict[str, str]]] = []
            for _, messages in tqdm(read_conversations(args.input), desc="tokenizing", unit=" examples"):
                pending.append(messages)
                if len(pending) >= BATCH_EXAMPLES:
                    write(pending, ids_file, mask_file)
                    pending = []
            write(pending, ids_file, mask_file)
        if summary.kept == 0:
            raise OLMoDataError(
                f"No example of '{args.input}' has an assistant token within --seq-len {args.seq_len}, so "
                f"nothing would be trained on. Check that conversations have 'assistant' messages, or raise "
                f"--seq-len."
            )
        for key in final:
            os.replace(partial[key], final[key])
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)

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
    log.info("Wrote %s and %s (%s, seq_len %d).", final["ids"], final["mask"], args.dtype, args.seq_len)


if __name__ == "__main__":
    prepare_cli_environment()
    main()
