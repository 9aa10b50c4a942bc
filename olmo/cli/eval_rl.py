"""Score a checkpoint's answers to prepared RL prompts: the exact-answer accuracy of its greedy completions.

    python scripts/eval_rl.py CHECKPOINT PROMPTS_DIR [--max-new-tokens 32] [--batch-size 32] [--json]

PROMPTS_DIR is a folder of ``scripts/prepare_rl_prompts.py`` (prompts with their ground truths; held-out ones to
measure what RL taught). Each prompt is continued greedily (the most likely token each time, until the end-of-text
token or ``--max-new-tokens``) and scored by the ``exact_answer`` reward (the completion's last ``\\boxed{}`` or number
against the ground truth, normalised: :mod:`olmo.rl.rewards`). Prints the accuracy (``--json``: ``{"accuracy",
"correct", "prompts", "mean_completion_tokens", "checkpoint", "prompts_dir"}``). The checkpoint's ``config.yaml``
gives the model and the tokenizer (``--tokenizer`` replaces it).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from olmo.checkpoint import load_model
from olmo.cli.generate import checkpoint_tokenizer
from olmo.data.rl_prompts import RLPrompts
from olmo.exceptions import OLMoCliError
from olmo.model.generation import generate, left_padded, until_end
from olmo.rl.rewards import Completion, exact_answer

log = logging.getLogger("eval_rl")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory (config.yaml gives the model and tokenizer)")
    parser.add_argument("prompts", type=Path, help="a folder of scripts/prepare_rl_prompts.py")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the longest completion (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch (%(default)s)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise OLMoCliError("--max-new-tokens and --batch-size must be at least 1.")
    prompts = RLPrompts(args.prompts)  # every file checked, before the model loads
    model, cfg, _ = load_model(args.checkpoint, torch.device("cpu"), torch.float32)
    prompts.check_vocab(cfg.model.vocab_size, "PROMPTS_DIR")
    tokenizer = checkpoint_tokenizer(cfg, args.tokenizer)
    eos = cfg.model.eos_token_id
    correct, lengths = 0, []
    for start in range(0, len(prompts), args.batch_size):
        indices = range(start, min(start + args.batch_size, len(prompts)))
        ids, mask = left_padded([prompts.prompt(i).tolist() for i in indices], cfg.model.pad_token_id)
        out = generate(model, ids, attention_mask=mask, max_steps=args.max_new_tokens, end_index=eos)
        for i, tokens in zip(indices, out.token_ids[:, 0].tolist()):
            kept = until_end(tokens, eos)
            lengths.append(len(kept) + (1 if len(kept) < len(tokens) else 0))
            text = tokenizer.decode(kept)
            truth = prompts.ground_truths[i]
            correct += int(exact_answer(Completion("", text, truth, len(kept), len(kept) == len(tokens))) == 1.0)
    result = {
        "accuracy": correct / len(prompts),
        "correct": correct,
        "prompts": len(prompts),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "checkpoint": str(args.checkpoint),
        "prompts_dir": str(args.prompts),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"exact_answer accuracy {result['accuracy']:.3f} ({correct} of {len(prompts)} prompts, greedy, "
            f"{result['mean_completion_tokens']:.1f} tokens per completion on average)"
        )
    return 0
