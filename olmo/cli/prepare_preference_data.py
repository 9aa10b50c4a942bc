"""Tokenize preference pairs for DPO into the SFT format: pair i at instances 2i (chosen) and 2i + 1 (rejected).

    python scripts/prepare_preference_data.py INPUT.{jsonl[.gz],parquet} -o DIR --seq-len N
        [--chat-template NAME|PATH]

Every line of INPUT is ``{"chosen": messages, "rejected": messages}``, each a conversation that ends with the
assistant's answer (messages as ``prepare_sft_data.py`` takes them). Each side is formatted as
``prepare_sft_data.py`` formats a conversation (OLMo's Tulu format, or ``--chat-template``), truncated or padded to
``--seq-len``; only the assistant's tokens are labels. ``DIR/input_ids.npy`` and ``DIR/label_mask.npy`` hold the
chosen side of pair i at instance 2i and the rejected side at 2i + 1; a pair with a side whose answer is truncated
away, or whose two sides are the same tokens within ``--seq-len``, is dropped whole, so pairs stay aligned. Train with ``--data.paths=[DIR/input_ids.npy]
--data.label_mask_paths=[DIR/label_mask.npy]`` and an even ``global_train_batch_size``.

A line that is not such a pair (invalid JSON, a missing side, a side that is not a list of messages or does not end
with a non-empty assistant answer, the same conversation on both sides, sides whose messages before the answer
differ, sides that tokenize the same), a line longer than 8 MiB or nested deeper than 64 arrays and objects
(``olmo/util/json_lines.py``), an INPUT that is not a regular file, or a conversation the chat template fails
on stops the run naming the file and line, before anything is written to DIR. The other flags and checks are
``prepare_sft_data.py``'s.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from olmo.cli.prepare_sft_data import parse_args, prepare, report_totals
from olmo.data.preference import write_preference_dataset

log = logging.getLogger("prepare_preference_data")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv, __doc__, "preference pairs", packs=False)  # pairs stay one per instance
    anchor, formatter = prepare(args, "preference pairs")
    start = time.monotonic()
    summary = write_preference_dataset(args.input, args.output, formatter, args.dtype, anchor)
    total = 2 * summary.kept * args.seq_len
    log.info(
        "Kept %s pairs (%s instances), dropped %d whose answer on one side was truncated away and %d whose sides "
        "differ only past the length; %d kept pairs were truncated to %d tokens.",
        f"{summary.kept:,}",
        f"{2 * summary.kept:,}",
        summary.truncated_away,
        summary.same_within_length,
        summary.truncated,
        args.seq_len,
    )
    report_totals(args, total, summary, start)
    return 0
