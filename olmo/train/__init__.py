"""Training: ``trainer`` (:class:`Trainer`, whose ``fit`` drives the loop), ``train_module`` (one step:
``TrainModule``, ``TransformerTrainModule``, ``BasicTrainModule``), ``kl`` (``KLTrainModule``, the KL penalty of a
stage), the loop's components ``checkpointer`` (``Checkpointer``), ``stop`` (``StopConditions``), ``metrics`` (step
metrics on the device, speed, MFU) and ``metrics_sinks`` (console, ``metrics.jsonl``, wandb), and ``stages``
(stage boundaries in steps and their data at run time).

May import every package below it: ``olmo.eval``, ``olmo.hf``, ``olmo.checkpoint``, ``olmo.data``,
``olmo.distributed``, ``olmo.model``, ``olmo.optim``, ``olmo.tokenizer``, ``olmo.config``, ``olmo.util``,
``olmo.exceptions``.
"""

from typing import TYPE_CHECKING, Any

from ..model.loss import cross_entropy_loss, fused_loss_fn

if TYPE_CHECKING:
    from .trainer import EXIT_CODE_STOPPED, Trainer, TrainerState


def __getattr__(name: str) -> Any:
    # The trainer is imported on first use, so that a light module of this package (``olmo.train.stages`` for
    # ``inspect_batch.py``) does not pull in torch.distributed.checkpoint (0.7 s).
    if name in ("Trainer", "TrainerState", "EXIT_CODE_STOPPED"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Trainer",
    "TrainerState",
    "EXIT_CODE_STOPPED",
    "cross_entropy_loss",
    "fused_loss_fn",
]
