"""Training: ``trainer`` (:class:`Trainer`, whose ``fit`` drives the loop), ``train_module`` (one step:
``TrainModule``, ``TransformerTrainModule``, ``BasicTrainModule``), ``kl`` (``KLTrainModule``, the KL penalty of a
stage), the loop's components ``checkpointer`` (``Checkpointer``), ``stop`` (``StopConditions``), ``metrics`` (step
metrics on the device, speed, MFU) and ``metrics_sinks`` (console, ``metrics.jsonl``, wandb), and ``stages``
(stage boundaries in steps and their data at run time).

May import every package below it: ``olmo.eval``, ``olmo.hf``, ``olmo.checkpoint``, ``olmo.data``,
``olmo.distributed``, ``olmo.model``, ``olmo.optim``, ``olmo.tokenizer``, ``olmo.config``, ``olmo.util``,
``olmo.exceptions``.
"""

from .trainer import (
    EXIT_CODE_STOPPED,
    Trainer,
    TrainerState,
)

__all__ = [
    "Trainer",
    "TrainerState",
    "EXIT_CODE_STOPPED",
]
