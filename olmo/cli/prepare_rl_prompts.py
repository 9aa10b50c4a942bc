"""Tokenize the prompts of reinforcement learning with verifiable rewards, with their ground truths.

    python scripts/prepare_rl_prompts.py INPUT.{jsonl[.gz],parquet} -o DIR --seq-len N [--max-prompt-tokens M]
        [-t TOKENIZER] [--chat-template NAME|PATH]

Every line of INPUT is ``{"prompt": "...", "ground_truth": "..."}`` (the prompt's text, tokenized as it is) or
``{"messages": [...], "ground_truth": "..."}`` (a conversation ending with the user's turn, as
``prepare_sft_data.py`` takes messages: OLMo's Tulu layout up to ``<|assistant|>\\n``, or ``--chat-template``'s
rendering with its generation prompt, so that a model fine-tuned on ``prepare_sft_data.py``'s output with the same
format answers it). A published dataset that holds both keys is read with ``--prompt-field messages`` (or
``prompt``), and ``--keep KEY=VALUE`` keeps only its lines whose KEY is VALUE or a list holding it (Ai2's RL sets
name each row's verifier in ``dataset``: ``--keep dataset=math``). A ground truth is a string or a number (or a list
of exactly one); the rewards (``exact_answer``: the completion's last
``\\boxed{}`` or number) score completions against it. ``--seq-len`` is the model's ``max_sequence_length``;
prompts longer than ``--max-prompt-tokens`` (by default ``--seq-len``) are dropped and counted. A run checks that its
longest prompt and ``rl.max_new_tokens`` fit in ``model.max_sequence_length``.

DIR receives ``prompt_ids.npy`` (the prompts' tokens one after another), ``prompt_offsets.npy`` (int64: where each
starts), ``ground_truths.jsonl`` (each prompt's ``{"id": "FILE:LINE", "ground_truth": ...}``) and ``prompts.json``
(the record: tokenizer, EOS, dtype, chat template, counts), and ``input_ids.npy``: prompt ``i`` as instance ``i``
of ``--seq-len`` tokens padded on the left with ``--pad``, the token file whose order (``global_indices.npy``) says
which prompts each step trained on. A run reads DIR as ``rl.prompts``.

A line that is not such an object (invalid JSON, both or neither of ``prompt`` and ``messages``, an empty prompt, a
message without a string ``role`` and ``content``, a conversation ending with the assistant, no string or number
``ground_truth``), a prompt the chat template fails on, and an input without a prompt that fits stop the run naming
the file and line, before anything is written to DIR (the files are written into a hidden folder and moved into
place at the end). DIR may not already hold these files unless ``--overwrite`` is passed.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Optional

from olmo.cli.prepare_sft_data import chat_template
from olmo.data.rl_prompts import PROMPT_FILES, PromptFormatter, write_rl_prompts
from olmo.data.sft import check_sft_output, check_sft_tokenizer
from olmo.exceptions import OLMoCliError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

log = logging.getLogger("prepare_rl_prompts")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "input",
        type=Path,
        help="JSON lines of prompts with ground truths (.jsonl, .jsonl.gz, or .parquet: row N is line N)",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    parser.add_argument(
        "-t", "--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer.json path or packaged name (%(default)s)"
    )
    parser.add_argument(
        "-s", "--seq-len", type=int, required=True, help="tokens per instance: the model's max_sequence_length"
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="drop prompts longer than this (default: --seq-len); leave room for rl.max_new_tokens",
    )
    parser.add_argument("--eos", type=int, default=50279, help="end-of-sequence token id (%(default)s)")
    parser.add_argument(
        "--pad", type=int, default=1, help="the padding token id of input_ids.npy's instances (%(default)s)"
    )
    parser.add_argument(
        "--dtype", default="uint16", choices=["uint16", "uint32"], help="token dtype (%(default)s)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the prompt files in OUTPUT_DIR")
    parser.add_argument(
        "--chat-template",
        default=None,
        help="render each conversation with a chat template and its generation prompt: a built-in (tulu, olmo3), a "
        ".jinja file, a tokenizer_config.json with a chat_template, or a folder holding one; default: OLMo's Tulu "
        "layout, as prepare_sft_data.py writes it",
    )
    parser.add_argument(
        "--prompt-field",
        choices=["prompt", "messages"],
        default=None,
        help="read each prompt from this key alone, the other ignored (a published dataset may hold both; "
        "default: each line holds exactly one)",
    )
    parser.add_argument(
        "--keep",
        default=None,
        metavar="KEY=VALUE",
        help="only the lines whose KEY is VALUE, or a list holding it (e.g. --keep dataset=math: the rows of Ai2's "
        "RL sets that an exact answer scores); the others are counted and skipped",
    )
    args = parser.parse_args(argv)
    if args.keep is not None:
        key, sep, value = args.keep.partition("=")
        if not (sep and key and value):
            parser.error(f"--keep {args.keep!r} must be KEY=VALUE, e.g. --keep dataset=math")
        args.keep = (key, value)
    if args.seq_len < 1:
        parser.error(f"--seq-len {args.seq_len} is not a length; pass the model's max_sequence_length (e.g. 2048)")
    if args.max_prompt_tokens is not None and not 1 <= args.max_prompt_tokens <= args.seq_len:
        parser.error(
            f"--max-prompt-tokens {args.max_prompt_tokens} must be in [1, --seq-len {args.seq_len}]: a prompt and its "
            f"completion share the model's max_sequence_length"
        )
    for flag, value in (("--eos", args.eos), ("--pad", args.pad)):
        if value < 0:
            parser.error(f"{flag} {value} is negative; pass a token id of the tokenizer")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not args.input.is_file():
        raise OLMoCliError(
            f"INPUT '{args.input}' is not a file. Pass a .jsonl, .jsonl.gz or .parquet file of prompts."
        )
    anchor = check_sft_output(args.output, args.overwrite, PROMPT_FILES)
    tokenizer = Tokenizer.from_file(args.tokenizer, eos_token_id=args.eos, pad_token_id=args.pad)
    check_sft_tokenizer(tokenizer, args.tokenizer, args.eos, args.pad, args.dtype)
    template = chat_template(args, tokenizer)
    formatter = PromptFormatter(tokenizer, args.eos, template)
    record = {
        "tokenizer": str(args.tokenizer),
        "eos_token_id": args.eos,
        "chat_template": None if template is None else template.name,
    }
    start = time.monotonic()
    summary = write_rl_prompts(
        args.input,
        args.output,
        formatter,
        args.dtype,
        anchor,
        args.seq_len,
        record,
        args.pad,
        args.max_prompt_tokens,
        args.prompt_field,
        args.keep,
    )
    log.info(
        "Wrote %s prompts (%s tokens, the longest %d) to %s in %.1f s.",
        f"{summary.kept:,}",
        f"{summary.tokens:,}",
        summary.longest,
        args.output,
        time.monotonic() - start,
    )
    if args.keep is not None:
        log.info("Skipped %s lines without %s=%s (--keep).", f"{len(summary.skipped):,}", *args.keep)
    if summary.too_long:
        log.warning(
            "Dropped %s prompts longer than %d tokens (input lines %s%s).",
            f"{summary.too_long:,}",
            args.seq_len if args.max_prompt_tokens is None else args.max_prompt_tokens,
            ", ".join(map(str, summary.too_long_lines)),
            ", ..." if summary.too_long > len(summary.too_long_lines) else "",
        )
    return 0
