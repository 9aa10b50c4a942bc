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
import time
from pathlib import Path
from typing import Optional

from olmo.data.sft import OUTPUT_FILES, Formatter, check_sft_output, check_sft_tokenizer, write_sft_dataset
from olmo.exceptions import OLMoCliError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

log = logging.getLogger("prepare_sft_data")


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


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not args.input.is_file():
        raise OLMoCliError(
            f"INPUT '{args.input}' is not a file. Pass a .jsonl or .jsonl.gz file of conversations."
        )
    anchor = check_sft_output(args.output, args.overwrite)
    tokenizer = Tokenizer.from_file(args.tokenizer, eos_token_id=args.eos, pad_token_id=args.pad)
    check_sft_tokenizer(tokenizer, args.tokenizer, args.eos, args.pad, args.dtype)
    formatter = Formatter(tokenizer, args.seq_len, args.eos, args.pad)
    start = time.monotonic()
    summary = write_sft_dataset(args.input, args.output, formatter, args.dtype, anchor)

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
