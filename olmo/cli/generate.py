"""Generate text from a checkpoint: ours, the original OLMo's, or one imported from transformers.

    python scripts/generate.py CHECKPOINT --prompt "The capital of France is" [--prompt ...]
        [--max_new_tokens 64] [--temperature 0] [--top_k K | --top_p P] [--seed 0] [--num_beams 1]
        [--tokenizer TOKENIZER] [--device cpu|cuda] [--dtype float32|bfloat16] [--json]

CHECKPOINT is a checkpoint directory (``runs/x/step1000``, ``runs/x/step1000-unsharded``, an original OLMo
checkpoint) whose ``config.yaml`` gives the model and the tokenizer (``--tokenizer`` replaces it: a tokenizer.json
or a name OLMo knows). Decoding is greedy by default; ``--temperature`` > 0 samples (from the ``--top_k`` most likely
tokens or the ``--top_p`` nucleus when given), reproducibly for a ``--seed``; ``--num_beams`` > 1 is beam search
(with sampling: a sampled beam search). One prompt with one beam streams its tokens as they come; several prompts
run as one left-padded batch and print when done. Generation stops at the end-of-text token or after
``--max_new_tokens``. A ``--prompt`` must be UTF-8 text: one holding other bytes (``$'\\xff'`` in bash, Latin-1 text)
is refused, not guessed at. ``--json`` prints one JSON object per prompt instead (prompt, token ids, text, score).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from olmo.checkpoint import load_model
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCliError
from olmo.model.generation import build_sampler, generate, left_padded, until_end
from olmo.tokenizer import Tokenizer

log = logging.getLogger("generate")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_NEW_TOKENS = 1_000_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeatable)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="most tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling")
    parser.add_argument("--top_k", type=int, help="sample from the k most likely tokens")
    parser.add_argument("--top_p", type=float, help="sample from the nucleus of probability p")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--num_beams", type=int, default=1, help="beam search with this many beams")
    parser.add_argument("--tokenizer", help="tokenizer.json or OLMo tokenizer name (default: the checkpoint's)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights' dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt, nothing else")
    return parser.parse_args(argv)


def _check_args(args: argparse.Namespace) -> torch.device:
    """The device; every option checked first.

    :raises OLMoCliError: naming the flag and the fix.
    """
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise OLMoCliError(f"--max_new_tokens={args.max_new_tokens} must be between 1 and {MAX_NEW_TOKENS:,}.")
    if not 1 <= args.num_beams <= 64:
        raise OLMoCliError(f"--num_beams={args.num_beams} must be between 1 and 64.")
    try:
        build_sampler(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise OLMoCliError(str(e)) from None
    if any(not p for p in args.prompt):
        raise OLMoCliError("An empty --prompt has nothing to continue; give some text.")
    for number, prompt in enumerate(args.prompt, 1):
        _check_utf8(prompt, "--prompt" if len(args.prompt) == 1 else f"--prompt number {number}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise OLMoCliError(f"--device={args.device!r} is not a device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OLMoCliError(f"--device={args.device} but this machine has no CUDA GPU; use --device=cpu.")
    return device


def _check_utf8(prompt: str, flag: str) -> None:
    """Refuse a prompt that holds bytes that are not UTF-8 (Python keeps each as a lone surrogate, U+DC80-U+DCFF,
    which no tokenizer can encode).

    :raises OLMoCliError: naming ``flag``, the byte and where it is.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the code point U+{code:04X}"
        after = f" (after {prompt[: e.start][-20:]!r})" if e.start else ""
        raise OLMoCliError(
            f"{flag} is not UTF-8 text: it holds {what} at character {e.start}{after}. Pass the prompt as UTF-8 "
            f"(convert it, e.g. with iconv -f latin1 -t utf-8, or check the terminal's encoding)."
        ) from None


def checkpoint_tokenizer(cfg: TrainConfig, identifier: Optional[str]) -> Tokenizer:
    """The tokenizer of a checkpoint's config (or ``identifier``), checked against its model; an OLMoCliError naming
    ``--tokenizer`` when it does not load or fit."""
    name = identifier or cfg.tokenizer.identifier
    flag = "--tokenizer" if identifier else "the checkpoint's tokenizer.identifier"
    try:
        tokenizer = Tokenizer.from_file(name, cfg.model.eos_token_id, cfg.model.pad_token_id)
    except Exception as e:  # any failure to load is the same advice
        raise OLMoCliError(
            f"Cannot load the tokenizer {name!r} ({flag}): {e}. Pass --tokenizer=PATH/tokenizer.json (or a name "
            f"such as allenai_gpt-neox-olmo-dolma-v1_5.json)."
        ) from None
    if tokenizer.vocab_size > cfg.model.effective_embedding_size:
        raise OLMoCliError(
            f"The tokenizer {name!r} has {tokenizer.vocab_size:,} tokens but the model only "
            f"{cfg.model.effective_embedding_size:,} embeddings: it is another model's tokenizer. Pass the right one "
            f"with --tokenizer."
        )
    return tokenizer


class _Stream:
    """Prints one sequence's text as its tokens come (decoding the whole so far: multi-byte characters print once
    complete)."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.tokens: list[int] = []
        self.printed = ""
        self.ended = False

    def add(self, tokens: torch.Tensor) -> None:
        token = int(tokens[0])
        if self.ended:
            return
        if token == self.eos:
            self.ended = True
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text

    def finish(self, tokens: list[int]) -> None:
        """Print what the stream has not (the last token, which no later step reported)."""
        for token in tokens[len(self.tokens) :]:
            self.add(torch.tensor([token]))
        text = self.tokenizer.decode(self.tokens)
        sys.stdout.write(text[len(self.printed) :] + "\n")
        sys.stdout.flush()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    args = parse_args(argv)
    device = _check_args(args)
    model, cfg, step = load_model(args.checkpoint, device, DTYPES[args.dtype])
    tokenizer = checkpoint_tokenizer(cfg, args.tokenizer)
    eos = cfg.model.eos_token_id
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in args.prompt]
    longest = max(len(p) for p in prompts)
    limit = cfg.model.max_sequence_length
    if longest + args.max_new_tokens > limit:
        if not (cfg.model.rope or cfg.model.alibi or cfg.model.nope):
            raise OLMoCliError(
                f"The longest prompt ({longest} tokens) plus --max_new_tokens={args.max_new_tokens} is more than the "
                f"model's {limit} learned positions; shorten the prompt or lower --max_new_tokens."
            )
        log.warning(
            "The prompt plus --max_new_tokens (%d) is longer than the model's training context (%d tokens): "
            "expect it to degrade past that.",
            longest + args.max_new_tokens,
            limit,
        )
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    streaming = len(prompts) == 1 and args.num_beams == 1 and not args.json
    stream = _Stream(tokenizer, eos) if streaming else None
    if stream is not None:
        sys.stdout.write(args.prompt[0])
        sys.stdout.flush()
    start = time.perf_counter()
    out = generate(
        model,
        ids.to(device),
        attention_mask=None if mask is None else mask.to(device),
        max_steps=args.max_new_tokens,
        beam_size=args.num_beams,
        sampler=build_sampler(args.temperature, args.top_k, args.top_p),
        on_token=stream.add if stream is not None else None,
    )
    seconds = time.perf_counter() - start
    results: list[dict[str, Any]] = []
    for row, text in enumerate(args.prompt):
        tokens = until_end(out.token_ids[row, 0].tolist(), eos)
        results.append(
            {
                "prompt": text,
                "prompt_token_ids": prompts[row],
                "token_ids": tokens,
                "text": tokenizer.decode(tokens),
                "score": float(out.scores[row, 0]),
            }
        )
    if stream is not None:
        stream.finish(out.token_ids[0, 0].tolist())
    elif args.json:
        for result in results:
            print(json.dumps(result))
    else:
        for result in results:
            print(f"{result['prompt']}{result['text']}\n")
    generated = sum(len(r["token_ids"]) for r in results)
    log.info(
        "%s (step %d): %d token(s) in %.2f s (%.1f tokens/s) on %s.",
        Path(args.checkpoint).name,
        step,
        generated,
        seconds,
        generated / seconds if seconds else 0.0,
        device,
    )
    return 0
