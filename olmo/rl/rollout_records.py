"""What each RL step sampled and how it was scored, kept with the run (issue 53): ``save_folder/rl_rollouts/
step{N}-rank{R}.jsonl``, one line per prompt of that rank (:func:`write_rollouts`), read back by
``scripts/inspect_batch.py`` (:func:`read_rollouts`), which shows a step's prompts with their completions and rewards.

A line: ``{"step", "prompt_index", "source" (FILE:LINE of the prompt), "ground_truth", "completions": [{"text",
"tokens", "truncated", "reward", "rewards": {name: value}}]}``. A step trained again (after a resume or a rollback)
writes its files again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..util.json_lines import read_json_lines

__all__ = ["ROLLOUTS_DIR", "read_rollouts", "rollout_record", "write_rollouts"]

ROLLOUTS_DIR = "rl_rollouts"


def rollout_record(
    step: int,
    prompt_index: int,
    source: str,
    ground_truth: str,
    tokens: Sequence[list[int]],
    truncated: Sequence[bool],
    rewards: Sequence[float],
    per_reward: Sequence[dict[str, float]],
    decode: Callable[[list[int]], str],
    eos: int,
) -> dict[str, Any]:
    """The line of one prompt's group (completions decoded without their end token)."""
    completions = []
    for t, cut, reward, each in zip(tokens, truncated, rewards, per_reward):
        text = decode(t[:-1] if t and t[-1] == eos and not cut else t)
        completions.append({"text": text, "tokens": len(t), "truncated": cut, "reward": reward, "rewards": each})
    return {
        "step": step,
        "prompt_index": prompt_index,
        "source": source,
        "ground_truth": ground_truth,
        "completions": completions,
    }


def write_rollouts(save_folder: str, step: int, rank: int, records: list[dict[str, Any]]) -> Path:
    """Write this rank's records of ``step`` (replacing an earlier attempt's)."""
    folder = Path(save_folder) / ROLLOUTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step{step}-rank{rank}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return path


def read_rollouts(run_dir: Path, step: int) -> dict[int, dict[str, Any]]:
    """Every rank's records of ``step`` in ``run_dir``, by prompt index (empty when the run kept none)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / ROLLOUTS_DIR).glob(f"step{step}-rank*.jsonl")):
        for _, line in read_json_lines(path, what="rollout"):
            out[int(line["prompt_index"])] = line
    return out
