"""Pieces of ``scripts/benchmark.py`` that measure training as it runs: synthetic batches that cost nothing to
fetch, and a clock that splits a step into its phases with hooks on the model and the optimizer."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ..config import DataConfig, ModelConfig
from ..data import DataCollator, DataContext, IterableDataset
from ..distributed import ParallelLayout

__all__ = ["RandomTokens", "SyntheticBatches", "PhaseClock", "forever", "timed_step"]


class RandomTokens(torch.utils.data.Dataset):
    """``n`` instances of ``seq_len`` uniformly random token ids; instance ``i`` is the same on every call. With
    ``doc_length``, each instance is documents of ``doc_length / 2`` to ``3 * doc_length / 2`` tokens (uniform), each
    ending with ``eos_token_id`` (the instance's end closes its last), and carries their ``doc_lens``, as the memmap
    dataset gives them with ``data.generate_doc_lengths``."""

    def __init__(
        self,
        n: int,
        seq_len: int,
        vocab_size: int,
        seed: int,
        doc_length: Optional[int] = None,
        eos_token_id: int = 0,
    ):
        self.n, self.seq_len, self.vocab_size, self.seed = n, seq_len, vocab_size, seed
        self.doc_length, self.eos_token_id = doc_length, eos_token_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.seed + int(index))
        input_ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=gen)  # (T,)
        if self.doc_length is None:
            return {"input_ids": input_ids}
        input_ids[input_ids == self.eos_token_id] = (self.eos_token_id + 1) % self.vocab_size  # EOS only at ends
        low, high = max(1, self.doc_length // 2), max(1, 3 * self.doc_length // 2)
        drawn = torch.randint(low, high + 1, (self.seq_len // low + 1,), generator=gen)  # enough to fill T
        ends = drawn.cumsum(0)
        count = int(torch.searchsorted(ends, self.seq_len)) + 1  # the documents that start within T
        ends = ends[:count].clamp_(max=self.seq_len)  # the instance's end closes the last
        input_ids[ends - 1] = self.eos_token_id
        return {"input_ids": input_ids, "doc_lens": torch.diff(ends, prepend=ends.new_zeros(1))}


class SyntheticBatches:
    """The first few device batches of random tokens, made up front (pinned on CUDA) and cycled, so getting a
    batch costs nothing. Its ``dataset`` is a real :class:`olmo.data.IterableDataset`, as ``Trainer`` expects,
    holding as many instances as the benchmark consumes.

    :param context: the run's seed (of the tokens and their order), epoch and global batch size.
    :param layout: the launch's layout: which instances this rank reads, and its device.
    :param doc_length: documents of about this many tokens with their ``doc_lens`` (:class:`RandomTokens`), else
        one random run of tokens per instance.
    """

    def __init__(
        self,
        model: ModelConfig,
        data: DataConfig,
        context: DataContext,
        layout: ParallelLayout,
        n_steps: int,
        doc_length: Optional[int] = None,
    ):
        batch, seed = context.global_train_batch_size, context.seed
        tokens = RandomTokens(
            n_steps * batch, model.max_sequence_length, model.vocab_size, seed, doc_length, model.eos_token_id
        )
        self.dataset = IterableDataset(
            tokens,
            batch,
            seed=seed,
            epoch=context.epoch or 0,
            world_size=layout.data_parallel_size,
            rank=layout.data_parallel_rank,
        )
        collate = DataCollator(pad_direction=data.pad_direction, pad_token_id=model.pad_token_id)
        instances = iter(self.dataset)
        size = self.dataset.device_batch_size
        self.batches = [collate(list(itertools.islice(instances, size))) for _ in range(min(n_steps, 4))]
        if layout.device_type == "cuda":
            self.batches = [{k: v.pin_memory() for k, v in b.items()} for b in self.batches]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return itertools.cycle(self.batches)


class PhaseClock:
    """Boundaries of one step's phases, recorded by hooks on the model's forward and the optimizer's step.

    Each reading synchronizes the device first: without it, time spent by queued GPU kernels would land in
    whichever phase next waits for the GPU (usually the loss's host sync).
    """

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.device = device
        # A pipeline's forward is each of its stages' (every micro-batch's); the rest of its schedule counts as
        # backward (the backward passes, the sends and waits between stages, the bubble).
        modules = getattr(model, "stages", None) or [model]
        self.handles = [
            # prepend: FSDP's own pre-forward hook (the root all-gather) then counts as forward
            *(m.register_forward_pre_hook(self._forward_start, prepend=True) for m in modules),
            *(m.register_forward_hook(self._forward_end) for m in modules),
            optimizer.register_step_pre_hook(self._optimizer_start),
            optimizer.register_step_post_hook(self._optimizer_end),
        ]
        self.reset()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        self.first_forward: Optional[float] = None
        self.forward_seconds = 0.0
        self.optimizer_start = self.optimizer_end = 0.0
        self._started = 0.0

    def _forward_start(self, *_: Any) -> None:
        self._started = self.now()
        if self.first_forward is None:
            self.first_forward = self._started

    def _forward_end(self, *_: Any) -> None:
        self.forward_seconds += self.now() - self._started

    def _optimizer_start(self, *_: Any) -> None:
        self.optimizer_start = self.now()

    def _optimizer_end(self, *_: Any) -> None:
        self.optimizer_end = self.now()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def forever(loader: Any) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def timed_step(trainer: Any, batches: Iterator[dict[str, Any]], clock: PhaseClock) -> tuple[dict[str, float], Any]:
    """One training step as ``Trainer.fit`` runs it, split into its phases (seconds), and its metrics
    (read back from the device every ``metrics_collect_interval`` steps, as in training)."""
    clock.reset()
    start = clock.now()
    batch = next(batches)
    got_batch = clock.now()
    metrics = trainer.step(batch)
    end = clock.now()
    assert clock.first_forward is not None, "the model's forward hooks did not fire"
    return {
        "data": got_batch - start,
        "prepare": clock.first_forward - got_batch,
        "forward": clock.forward_seconds,
        "backward": clock.optimizer_start - clock.first_forward - clock.forward_seconds,
        "optimizer": clock.optimizer_end - clock.optimizer_start,
        "other": end - clock.optimizer_end,
        "step": end - start,
    }, metrics
