"""The original OLMo (ai2-olmo 0.6.0) as a long-lived worker of ``scripts/benchmark_olmo.py``.

    .venv-olmo/bin/python -I scripts/olmo_original_worker.py      (started by the driver, from a temporary directory)

The original's top-level package is also called ``olmo``, so this file never imports ours: the driver runs it
with the original's interpreter, in isolated mode (``-I``: no ``PYTHONPATH``, no script directory on the
module search path) and with a working directory outside the repository, and the worker refuses to start if
``import olmo`` resolved to anything but an installed package.

What both sides share (the line protocol, the round timer and :class:`Side`, which runs measurement (a) and the
bit-identity dump) is ``olmo/bench/olmo_worker.py``, which imports only torch: this worker loads that one
file by its path, and our side (``benchmark_olmo.py --worker``) imports it, so that the two models are timed by
the same code around them. Only the model and its training step (measurement (b)) are :class:`OriginalSide`'s.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
from itertools import cycle
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F


def _load_shared() -> ModuleType:
    """``olmo/bench/olmo_worker.py`` by its path: ``import olmo`` would find the original package."""
    path = Path(__file__).resolve().parents[1] / "olmo" / "bench" / "olmo_worker.py"
    spec = importlib.util.spec_from_file_location("benchmark_olmo_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load_shared()


class OriginalSide(shared.Side):
    """The original OLMo, built from the model config fields both implementations share, with our weights."""

    def __init__(self) -> None:
        # Imported when the worker starts, while our worker imports too.
        import olmo
        from olmo.config import ModelConfig, TrainConfig
        from olmo.model import OLMo
        from olmo.optim import build_optimizer

        location = os.path.dirname(olmo.__file__)
        if "site-packages" not in location:
            raise RuntimeError(
                f"`import olmo` found {location}, not the installed ai2-olmo: run this worker with the original's "
                f"python (make olmo-env), with -I and from a directory outside the repository."
            )
        self.location = location
        self.api = (ModelConfig, TrainConfig, OLMo, build_optimizer)

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        ModelConfig, TrainConfig, OLMo, build_optimizer = self.api
        shared = torch.load(request["exchange_file"], weights_only=True)
        self.model = OLMo(ModelConfig.new(**request["model"]), init_params=False)
        self.model.load_state_dict(shared["model"], strict=True)  # our parameter names are OLMo's
        self.model.to(self.device).train()
        # The original trainer's optimizer with the same hyperparameters as ours. Its AdamW.step is torch's when
        # update metrics and selective updates are off, as here.
        self.optimizer = build_optimizer(
            TrainConfig.new(model=request["model"], optimizer=request["optimizer"]), self.model
        )
        self.input_ids = shared["input_ids"].to(self.device)
        self.targets = shared["targets"].to(self.device)
        batches = shared["train_batches"]
        if self.device.type == "cuda":
            batches = [b.pin_memory() for b in batches]  # as our SyntheticBatches holds them
        self.train_batches = cycle(batches)
        return {
            "olmo_location": self.location,
            "olmo_version": _package_version(),
            "optimizer": type(self.optimizer).__module__ + "." + type(self.optimizer).__name__,
        }

    def train_step(self) -> torch.Tensor:
        """What the original ``Trainer.train_step`` does around the model for one micro-batch, without gradient
        clipping and metrics: zero the gradients, move the batch to the device, forward, cross entropy of
        ``logits[:, :-1]`` (made contiguous, as its ``model_forward`` does) against the next tokens, backward,
        ``optimizer.step()``, and the generation-1 collection its ``fit`` runs every step (``gen1_gc_interval:
        1``). The loss is the mean over the B*(T-1) labels (its trainer divides the sum by B*T, a constant
        factor), the objective ours trains on, so that the two loss curves can be compared."""
        self.optimizer.zero_grad(set_to_none=True)
        input_ids = next(self.train_batches).to(self.device, non_blocking=True)  # (B, T)
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            logits = self.model(input_ids=input_ids).logits  # (B, T, V)
            logits_for_loss = logits[:, :-1, :].contiguous().view(-1, logits.size(-1))  # (B*(T-1), V)
            loss = F.cross_entropy(logits_for_loss, input_ids[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        gc.collect(1)
        return loss.detach()


def _package_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ai2-olmo")
    except PackageNotFoundError:
        return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="The original OLMo behind a JSON-lines protocol on stdin/stdout, for scripts/benchmark_olmo.py "
        "(which starts it; not meant to be run by hand)."
    )
    parser.parse_args(argv)
    shared.serve(OriginalSide().handlers())
    return 0


if __name__ == "__main__":
    sys.exit(main())
