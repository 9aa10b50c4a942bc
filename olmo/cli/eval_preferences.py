"""Score preference pairs with a DPO policy against its reference: reward accuracy and margin on held-out pairs.

    python scripts/eval_preferences.py POLICY REFERENCE DATA_DIR [--beta 0.1] [--batch-size 16] [--json]

``POLICY`` and ``REFERENCE`` are checkpoints (any kind ``scripts/generate.py`` loads); ``DATA_DIR`` holds the
``input_ids.npy`` and ``label_mask.npy`` that ``scripts/prepare_preference_data.py`` wrote (pair i at instances 2i and
2i + 1; the sequence length is the models'). Each answer's reward is ``beta * (log pi - log ref)`` of its log-probability
summed over its labelled tokens, as in training (``train/dpo/*``); the report gives the fraction of pairs whose chosen
reward is above the rejected one (chance: 0.5; ties count as wrong), the mean margin, and the mean rewards.
"""

from __future__ import annotations

import argparse
import json
import logging
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from olmo.checkpoint.model_loading import load_model
from olmo.config.dpo_sections import beta_problem
from olmo.exceptions import OLMoCliError
from olmo.model.loss import next_token_labels
from olmo.train.dpo import identical_pairs, sequence_log_probs

log = logging.getLogger("eval_preferences")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", help="the trained model's checkpoint")
    parser.add_argument("reference", help="the reference's checkpoint (the model DPO started from)")
    parser.add_argument("data", type=Path, help="a folder of prepare_preference_data.py's output")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta, for the rewards (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="instances per forward pass (%(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    if args.batch_size < 2 or args.batch_size % 2:
        parser.error(f"--batch-size {args.batch_size} must be even and at least 2 (whole pairs)")
    problem = beta_problem(args.beta, "--beta")
    if problem is not None:
        parser.error(problem)
    return args


def read_pairs(folder: Path, seq_len: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and label masks (2P, seq_len) of ``folder``'s pairs.

    :raises OLMoCliError: for a folder without both files, files that are not whole pairs of ``seq_len``, or a pair
        whose two sides are the same."""
    paths = [folder / "input_ids.npy", folder / "label_mask.npy"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise OLMoCliError(
            f"DATA_DIR '{folder}' lacks {' and '.join(missing)}; pass a folder scripts/prepare_preference_data.py wrote."
        )
    ids = np.memmap(paths[0], dtype=np.dtype(dtype), mode="r")
    mask = np.memmap(paths[1], dtype=np.bool_, mode="r")
    if len(ids) != len(mask) or len(ids) % (2 * seq_len) or not len(ids):
        raise OLMoCliError(
            f"'{folder}' holds {len(ids)} tokens and {len(mask)} mask entries: not whole pairs of the models' "
            f"sequence length {seq_len} (model.max_sequence_length). Prepare the pairs with --seq-len {seq_len}."
        )
    rows, labels = ids.reshape(-1, seq_len), mask.reshape(-1, seq_len)
    same = identical_pairs(rows, labels)
    if same.any():
        pair = int(same.nonzero()[0][0])
        raise OLMoCliError(
            f"'{folder}' holds {int(same.sum())} pair(s) whose two sides are the same tokens and labels (the first: "
            f"pair {pair}, instances {2 * pair} and {2 * pair + 1}), which no model can prefer. Prepare the pairs "
            f"again with scripts/prepare_preference_data.py, which names each such line of the input."
        )
    return rows, labels


def log_probs(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, batch_size: int) -> torch.Tensor:
    """Each row's summed log-probability of its labels."""
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            batch = {
                "input_ids": torch.from_numpy(ids[start : start + batch_size].astype(np.int64)),
                "label_mask": torch.from_numpy(np.array(mask[start : start + batch_size])),
            }
            labels = next_token_labels(batch)
            out.append(model(batch["input_ids"], head=partial(sequence_log_probs, labels=labels)).loss)
    return torch.cat(out)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    policy, cfg, step = load_model(args.policy)
    reference, ref_cfg, ref_step = load_model(args.reference)
    if ref_cfg.model.max_sequence_length != cfg.model.max_sequence_length:
        raise OLMoCliError(
            "POLICY and REFERENCE have different model.max_sequence_length; pass the DPO run's pair."
        )
    ids, mask = read_pairs(args.data, cfg.model.max_sequence_length, cfg.data.memmap_dtype)
    rewards = args.beta * (
        log_probs(policy, ids, mask, args.batch_size) - log_probs(reference, ids, mask, args.batch_size)
    )
    chosen, rejected = rewards[0::2], rewards[1::2]
    report = {
        "pairs": len(chosen),
        "reward_accuracy": float((chosen > rejected).float().mean()),
        "reward_margin": float((chosen - rejected).mean()),
        "rewards_chosen": float(chosen.mean()),
        "rewards_rejected": float(rejected.mean()),
        "policy_step": step,
        "reference_step": ref_step,
        "beta": args.beta,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['pairs']} pairs: reward accuracy {report['reward_accuracy']:.3f} (chance 0.5), margin "
            f"{report['reward_margin']:.4f}, rewards chosen {report['rewards_chosen']:.4f} / rejected "
            f"{report['rewards_rejected']:.4f} (policy step {step}, reference step {ref_step}, beta {args.beta:g})"
        )
    return 0
