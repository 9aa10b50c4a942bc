"""Samples during training (``type: generate``): at every evaluation, the model continues each of ``prompts`` and the
texts are logged (``metrics.jsonl`` as ``eval/{label}/samples``, the console, a wandb table).

Every rank generates the same texts together: with FSDP each forward pass is a collective, so all ranks must make
the same passes. They run the same prompts, on the same weights, with the same seed (the evaluator's, restored each
time: a sampled evaluation draws the same way at every step, so the texts change only as the model does), so they
choose the same tokens; rank 0 logs them. The RNG of training is saved and restored around the draw, so samples do
not change the training run. The cost: a prompt's forward pass plus one pass of the whole batch per new token, with
the KV cache (RESEARCH_LOG.md has the measurement). Blocks compiled for training run eagerly while generating
(:func:`olmo.model.generation.generate`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..model.beams import Sampler
from ..model.generation import generate, left_padded, until_end
from ..tokenizer import Tokenizer
from .evaluator import EvalTarget, Evaluator

__all__ = ["GenerationEvaluator"]

log = logging.getLogger(__name__)


class GenerationEvaluator(Evaluator):
    """Continues ``prompts`` by up to ``max_new_tokens`` tokens with ``sampler`` (greedy by default).

    Returns ``eval/{label}/new_tokens`` (mean tokens generated per prompt) and ``eval/{label}/tokens_per_second``;
    the texts are in :attr:`records` as ``eval/{label}/samples``: ``[{"prompt", "completion", "tokens"}]``.

    :param prompts: texts to continue.
    :param tokenizer: encodes the prompts (without an end token) and decodes the completions.
    :param max_sequence_length: the model's context; longer prompts keep their last tokens.
    """

    def __init__(
        self,
        label: str,
        prompts: list[str],
        tokenizer: Tokenizer,
        *,
        max_new_tokens: int,
        sampler: Sampler,
        end_index: int,
        max_sequence_length: int,
        seed: int = 0,
        world_size: int = 1,
        rank: int = 0,
    ):
        super().__init__(label, batch_size=max(1, len(prompts)), world_size=world_size, rank=rank, seed=seed)
        self.prompts = list(prompts)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.end_index = end_index
        keep = max(1, max_sequence_length - max_new_tokens)
        self.prompt_ids = [tokenizer.encode(p, add_special_tokens=False)[-keep:] for p in self.prompts]
        self.records: dict[str, Any] = {}

    def _evaluate(self, target: EvalTarget, device: torch.device) -> dict[str, float]:
        ids, mask = left_padded(self.prompt_ids, self.tokenizer.pad_token_id)
        dtype = getattr(target, "autocast_dtype", None)
        devices = [device] if device.type == "cuda" else []
        start = time.perf_counter()
        with torch.random.fork_rng(devices=devices), torch.autocast(device.type, dtype, enabled=dtype is not None):
            torch.manual_seed(self.seed)
            out = generate(
                target.model,  # type: ignore[arg-type]
                ids.to(device),
                attention_mask=None if mask is None else mask.to(device),
                max_steps=self.max_new_tokens,
                sampler=self.sampler,
                end_index=self.end_index,
            )
        seconds = time.perf_counter() - start
        samples, total = [], 0
        for row, text in enumerate(self.prompts):
            tokens = until_end(out.token_ids[row, 0].tolist(), self.end_index)
            total += len(tokens)
            samples.append({"prompt": text, "completion": self.tokenizer.decode(tokens), "tokens": len(tokens)})
        self.records = {f"eval/{self.label}/samples": samples}
        return {
            f"eval/{self.label}/new_tokens": total / len(samples),
            f"eval/{self.label}/tokens_per_second": total / seconds if seconds > 0 else 0.0,
        }
