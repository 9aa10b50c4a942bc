"""Tokenize chat conversations into fixed-length SFT instances with a label mask (OLMo's Tulu format).

    python scripts/prepare_sft_data.py INPUT.{jsonl[.gz],parquet} -o OUTPUT_DIR [--seq-len 2048]
        [--chat-template NAME|PATH]

Every line of INPUT is ``{"messages": [{"role": "user", "content": "..."}, ...]}``. An example is
``[eos]`` followed, for every message, by the tokens of ``"<|{role}|>\\n"`` and then of the content:
``content.strip() + eos`` plus ``"\\n"`` for the assistant, ``content.strip() + "\\n"`` for other roles.
Only the assistant's content and its eos are trained on (label mask True). Examples are truncated or
padded (``--pad``, mask False) to exactly ``--seq-len`` tokens, so instance ``i`` of the output is example
``i`` (without ``--pack``); examples with no label token left are dropped. This is the format of OLMo's
``scripts/prepare_tulu_data.py``. With ``--chat-template`` each conversation is rendered by a Jinja chat template
instead (built-in ``tulu`` or ``olmo3``, or the tokenizer's own: ``olmo/data/chat_templates.py``; sandboxed, within a
budget of memory and time: ``olmo/data/template_budget.py``) and the
tokens of the whole text are kept, the template's assistant tokens as labels: the ids and mask transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives; a conversation the template fails on stops
the run naming its line. ``--pack`` puts several conversations in each instance, in order, padding only the tails;
train such data with ``--data.generate_doc_lengths=true`` (attention split at each EOS), which needs a format with one
EOS per conversation, at its end (``--chat-template olmo3``; the Tulu layout is refused, naming the line). Fine-tune
on the output with::

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
from typing import Any, Optional, Union

from olmo.data.chat_templates import ChatTemplate, load_chat_template
from olmo.data.sft import (
    OUTPUT_FILES,
    Formatter,
    TemplateFormatter,
    check_sft_output,
    check_sft_tokenizer,
    write_sft_dataset,
)
from olmo.exceptions import OLMoCliError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

log = logging.getLogger("prepare_sft_data")


def parse_args(
    argv: Optional[list[str]], description: str = __doc__, what: str = "conversations", packs: bool = True
) -> argparse.Namespace:
    """The arguments of this command, and of ``prepare_preference_data.py`` (``what``: the input's lines; ``packs``:
    offer ``--pack``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "input", type=Path, help=f"JSON lines of {what} (.jsonl, .jsonl.gz, or .parquet: row N is line N)"
    )
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
    parser.add_argument(
        "--chat-template",
        default=None,
        help="render each conversation with a chat template: a built-in (tulu, olmo3), a .jinja file, a "
        "tokenizer_config.json with a chat_template, or a folder holding one (chat_template.jinja first); default: "
        "OLMo's Tulu layout, tokenized piece by piece as OLMo's prepare_tulu_data.py does",
    )
    if packs:
        parser.add_argument(
            "--pack",
            action="store_true",
            help="several conversations per instance, in order, each ending with its one EOS (train with "
            "--data.generate_doc_lengths=true so that attention stays within each); needs a format with one EOS per "
            "conversation, at its end, such as --chat-template olmo3",
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


def prepare(args: argparse.Namespace, what: str) -> tuple[Path, Union[Formatter, TemplateFormatter]]:
    """Check the input, the output and the tokenizer before any work; return the output's anchor (its nearest
    existing folder) and the formatter of ``--chat-template`` (OLMo's Tulu format without it)."""
    if not args.input.is_file():
        raise OLMoCliError(
            f"INPUT '{args.input}' is not a file. Pass a .jsonl, .jsonl.gz or .parquet file of {what}."
        )
    anchor = check_sft_output(args.output, args.overwrite)
    tokenizer = Tokenizer.from_file(args.tokenizer, eos_token_id=args.eos, pad_token_id=args.pad)
    check_sft_tokenizer(tokenizer, args.tokenizer, args.eos, args.pad, args.dtype)
    formatter: Union[Formatter, TemplateFormatter] = Formatter(tokenizer, args.seq_len, args.eos, args.pad)
    template = chat_template(args, tokenizer)
    if template is not None:
        formatter = TemplateFormatter(tokenizer, args.seq_len, args.pad, template)
    return anchor, formatter


def chat_template(args: argparse.Namespace, tokenizer: Tokenizer) -> Optional[ChatTemplate]:
    """The chat template of ``--chat-template`` (None without it), checked to end turns with ``--eos``."""
    if args.chat_template is None:
        return None
    eos_text = tokenizer.base.id_to_token(args.eos)
    template = load_chat_template(args.chat_template, eos_token=eos_text or "<|endoftext|>")
    if tokenizer.base.token_to_id(template.eos_token) != args.eos:
        raise OLMoCliError(
            f"The chat template {template.name} ends turns with eos_token {template.eos_token!r}, which is not "
            f"token --eos {args.eos} of the tokenizer '{args.tokenizer}' (it is "
            f"{tokenizer.base.token_to_id(template.eos_token)}). Pass the tokenizer the template was written for, "
            f"or --eos with that token's id."
        )
    log.info("Chat template: %s.", template.name)
    return template


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    anchor, formatter = prepare(args, "conversations")
    start = time.monotonic()
    pack_eos = args.eos if args.pack else None
    summary = write_sft_dataset(args.input, args.output, formatter, args.dtype, anchor, pack_eos)

    dropped = summary.no_assistant + summary.truncated_away
    total = summary.instances * args.seq_len
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
    report_totals(args, total, summary, start)
    if args.pack:
        unpacked = summary.kept * args.seq_len
        log.info(
            "Packed %s conversations into %s instances: padding %.1f%% of all tokens (%.1f%% one conversation per "
            "instance). Train with --data.generate_doc_lengths=true: attention stays within each conversation.",
            f"{summary.kept:,}",
            f"{summary.instances:,}",
            100 * summary.pad_tokens / total,
            100 * summary.unpacked_pad_tokens / unpacked,
        )
    return 0


def report_totals(args: argparse.Namespace, total: int, summary: Any, start: float) -> None:
    """Log the tokens written (``summary``'s ``tokens``, ``pad_tokens``, ``label_tokens`` of ``total``) and where."""
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
