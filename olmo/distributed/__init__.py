"""The distributed names scripts and users import, in one place: process groups and collectives
(:mod:`olmo.distributed.collectives`) and what is applied to a built model (:mod:`olmo.distributed.parallelize`).

Library code imports from those two modules directly, so that code below the parallelization layer
(evaluators' reductions, metrics) does not depend on the model.
"""

from __future__ import annotations

from .collectives import DistEnv, all_reduce, barrier, init_distributed, teardown_distributed
from .parallelize import (
    apply_activation_checkpointing,
    autocast_dtype,
    build_model,
    defer_replica_all_reduce,
    model_config_fingerprint,
)

__all__ = [
    "DistEnv",
    "init_distributed",
    "teardown_distributed",
    "all_reduce",
    "barrier",
    "build_model",
    "apply_activation_checkpointing",
    "defer_replica_all_reduce",
    "autocast_dtype",
    "model_config_fingerprint",
]
