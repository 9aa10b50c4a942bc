"""Checkpoints on disk: ``storage`` (atomic save, verified load, discovery, retention; the names re-exported
here), ``files`` (reading checkpoint files without executing code), ``save`` (temporary directory, fsync, marker,
rename), ``restore`` (what a launch restores and where it saves, checked before anything is built),
``olmo_formats`` (the original OLMo trainer's layouts), ``upload`` (``remote_save_folder``) and ``model_loading``
(:func:`load_model`, and ``OLMo.from_checkpoint``, which importing this package provides). The commit marker
and discovery without torch are :mod:`olmo.util.checkpoint_dirs`, so that config resolvers can use them.

``olmo_checkpointers`` holds OLMo's checkpointer objects (``FullCheckpointer``, ``build_sharded_checkpointer``).

May import: ``olmo.distributed``, ``olmo.optim``, ``olmo.model``, ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from .model_loading import load_model
from .olmo_checkpointers import (
    Checkpointer,
    FullCheckpointer,
    LocalShardedCheckpointer,
    TorchNewStyleShardedCheckpointer,
    build_sharded_checkpointer,
)
from .safe_reads import (
    safe_torch_load,
)
from .storage import (
    FORMAT_VERSION,
    MARKER,
    CheckpointInfo,
    ModelMismatchError,
    PendingCheckpoint,
    begin_checkpoint,
    check_shapes,
    commit_checkpoint,
    delete_checkpoint,
    find_latest_checkpoint,
    inspect_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_and_optim_state,
    prune_checkpoints,
    remove_ephemeral_checkpoints,
    save_checkpoint,
    sharded_model_shapes,
    trainer_state,
)

__all__ = [
    "Checkpointer",
    "FullCheckpointer",
    "LocalShardedCheckpointer",
    "TorchNewStyleShardedCheckpointer",
    "build_sharded_checkpointer",
    "load_model",
    "safe_torch_load",
    "MARKER",
    "CheckpointInfo",
    "ModelMismatchError",
    "find_latest_checkpoint",
    "list_checkpoints",
    "check_shapes",
    "sharded_model_shapes",
    "trainer_state",
    "delete_checkpoint",
    "inspect_checkpoint",
    "save_checkpoint",
    "begin_checkpoint",
    "model_and_optim_state",
    "commit_checkpoint",
    "PendingCheckpoint",
    "FORMAT_VERSION",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_ephemeral_checkpoints",
]
