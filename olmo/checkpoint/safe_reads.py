"""Reading checkpoint files without ever executing code from them.

Every file a checkpoint holds is read through this module:

* ``*.pt`` (``model.pt``, ``optim.pt``, ``train.pt``, ``train/rank{R}.pt``): ``torch.load(weights_only=True)``,
  which rebuilds only tensors and plain containers and refuses every other pickled object.
* ``model.safetensors``: the safetensors format holds no code at all.
* ``model_and_optim/.metadata`` of a sharded checkpoint: ``torch.distributed.checkpoint`` unpickles it with
  plain ``pickle``, so a crafted file runs code. :func:`read_dcp_metadata` unpickles it with
  :class:`_MetadataUnpickler`, which admits only the classes DCP's metadata is made of.
* the non-tensor entries inside ``*.distcp`` shards (optimizer hyperparameters): DCP's default planner
  loads them with ``weights_only=False``; :class:`SafeLoadPlanner` loads them with ``weights_only=True``.
* ``config.yaml``: OmegaConf's loader is built on ``yaml.SafeLoader`` (no ``!!python/...`` tags).
* ``.olmo-checkpoint.json``: JSON, parsed and checked by :func:`read_marker`.

Anything refused is an :class:`~olmo.exceptions.OLMoCheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pathlib
import pickle
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..exceptions import OLMoCheckpointError
from ..optim import OPTIMIZER_STATE_KEYS
from ..util import is_url, resource_path
from ..util.checkpoint_dirs import MARKER, read_marker

__all__ = [
    "ModelMismatchError",
    "check_optimizer_kind",
    "check_shapes",
    "check_trainer_state",
    "MARKER",
    "fetch",
    "read_marker",
    "safe_torch_load",
    "load_state_file",
    "read_dcp_metadata",
    "read_dcp_bytes_entries",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
]


# Modules whose dataclasses and enums make up a DCP ``Metadata`` object (their constructors only store
# the arguments they are given, so calling them with an attacker's arguments does nothing else).
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")
# torch's own advice in its weights-only error ("you can bypass this ...") is wrong for untrusted files,
# and it carries terminal colour codes; the first line says what was refused.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def fetch(checkpoint: str, name: str) -> Path:
    """The local path of file ``name`` of ``checkpoint`` (downloaded through cached-path for a URL)."""
    return resource_path(f"{checkpoint.rstrip('/')}/{name}") if is_url(checkpoint) else Path(checkpoint) / name


def refusal(path: Union[str, Path], e: BaseException) -> OLMoCheckpointError:
    """Our refusal of a file that weights-only loading stopped: names the object the file asked for (torch's
    ``GLOBAL module.name``) and never repeats torch's advice to load it with ``weights_only=False``."""
    text = _ANSI.sub("", str(e))
    asked = re.search(r"GLOBAL ([\w.]+)", text)
    if asked:
        reason = f"it asks to run or build {asked.group(1)}, which is not a tensor or a plain value"
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        advice = ("weights_only", "Re-running", "documentation", "trusted source")
        reason = next((line for line in lines if not any(a in line for a in advice)), type(e).__name__)[:200]
    return OLMoCheckpointError(
        f"Refusing to load '{path}': {reason}. Checkpoint files are loaded weights-only, so code or other pickled "
        f"objects in a file are never unpickled. Use a checkpoint written by this trainer, or load weights only with "
        f"--reset_trainer_state if only train.pt is affected."
    )


def safe_torch_load(
    path: Path, mmap: bool = True, allowed_globals: Sequence[Any] = (), name: Optional[str] = None
) -> Any:
    """``torch.load`` of a checkpoint file, weights-only, memory-mapped by default.

    :param allowed_globals: classes admitted besides tensors and plain values (``torch.serialization.safe_globals``
        entries), for files of the original OLMo trainer that hold a few harmless ones.
    :param name: how errors name the file (its URL, for a file fetched into the cache); default ``path``.
    :raises OLMoCheckpointError: for a missing, unreadable or non-weights-only file.
    """
    shown = name or str(path)
    try:
        # Memory-mapped: tensors are read straight from the page cache into the model and optimizer
        # instead of first being copied into freshly allocated memory (3-10x faster for large files).
        with torch.serialization.safe_globals(list(allowed_globals)), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core names in old pickles
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise OLMoCheckpointError(f"Checkpoint file '{shown}' is missing.") from None
    except pickle.UnpicklingError as e:
        raise refusal(shown, e) from None
    except Exception as e:
        raise OLMoCheckpointError(
            f"Could not read checkpoint file '{shown}' ({type(e).__name__}: {_ANSI.sub('', str(e)).strip()[:300]}). "
            f"It is damaged or not a torch checkpoint file; copy it again or load another checkpoint."
        ) from None


def load_state_file(checkpoint: str, stem: str) -> dict[str, Any]:
    """``{stem}.safetensors`` of ``checkpoint`` if present, else ``{stem}.pt`` (weights-only)."""
    if stem == "model":
        try:
            st = fetch(checkpoint, "model.safetensors")
        except Exception:  # a remote checkpoint without safetensors
            st = None
        if st is not None and st.is_file():
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                return load_file(str(st))
            except (SafetensorError, OSError) as e:
                raise OLMoCheckpointError(
                    f"Could not read '{st}' ({e}). It is damaged or not a safetensors file."
                ) from None
    state = safe_torch_load(fetch(checkpoint, f"{stem}.pt"), name=f"{checkpoint.rstrip('/')}/{stem}.pt")
    if not isinstance(state, dict):
        raise OLMoCheckpointError(
            f"'{checkpoint}/{stem}.pt' holds a {type(state).__name__}, not a state dict; it is not a checkpoint file."
        )
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # type: ignore[attr-defined]
        if module == "pathlib" and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            return dict
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of checkpoint metadata")


def read_dcp_metadata(
    folder: Union[str, Path],
    unpickler: type[pickle.Unpickler] = _MetadataUnpickler,
    action: str = "load",
    advice: str = "Load another checkpoint.",
) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint folder, unpickled with an allowlist of metadata types.

    :param unpickler: the allowlist (a subclass of ours admits one more writer's classes, e.g. OLMo-core's).
    :param action: what the caller does with the checkpoint, and ``advice`` what to do instead, for the messages.
    :raises OLMoCheckpointError: if the file is missing, damaged, or holds anything but DCP metadata.
    """
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = unpickler(f).load()
    except FileNotFoundError:
        raise OLMoCheckpointError(
            f"Sharded checkpoint file '{path}' is missing; the checkpoint is incomplete. {advice}"
        ) from None
    except Exception as e:  # whatever a damaged or crafted pickle raises
        raise OLMoCheckpointError(
            f"Refusing to {action} '{path}' ({type(e).__name__}: {e}). A sharded checkpoint's metadata may hold only "
            f"torch.distributed.checkpoint's own metadata types; this file was damaged or crafted. {advice}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise OLMoCheckpointError(
            f"Refusing to {action} '{path}': it holds a {type(metadata).__name__}, not checkpoint metadata."
        )
    return metadata


def read_dcp_bytes_entries(folder: Union[str, Path], prefixes: tuple[str, ...] = ("",)) -> int:
    """Load every non-tensor entry of a DCP checkpoint whose key starts with one of ``prefixes``,
    weights-only, so a crafted entry is refused before anything is built or written. Returns the count."""
    root = Path(folder)
    metadata = read_dcp_metadata(root)
    storage = metadata.storage_data or {}
    count = 0
    for index, info in storage.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(entry, BytesStorageMetadata) or not index.fqn.startswith(prefixes):
            continue
        path = root / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as e:
            raise OLMoCheckpointError(f"Could not read '{path}' ({e}); the checkpoint is damaged.") from None
        _safe_bytes_load(io.BytesIO(data), f"{path} (entry {index.fqn})")
        count += 1
    return count


def _safe_bytes_load(value: BinaryIO, what: str) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refusal(what, e) from None
    except Exception as e:
        raise OLMoCheckpointError(
            f"Could not read '{what}' ({type(e).__name__}: {e}); the checkpoint is damaged."
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of its plain-pickle metadata load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)  # type: ignore[union-attr]
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are loaded weights-only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = _safe_bytes_load(value, f"entry {read_item.dest_index.fqn} of a sharded checkpoint")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def root_cause(e: BaseException) -> BaseException:
    """The exception behind a DCP ``CheckpointException`` (the first failing rank's), else ``e`` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    while isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return e


def describe_os_error(e: OSError) -> str:
    """A few words for the disk problems a save runs into, with the file involved."""
    import errno

    reason = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EFBIG: "the file is larger than this system allows",
    }.get(e.errno or 0, e.strerror or str(e))
    return f"{reason} ({e.filename})" if e.filename else reason


class ModelMismatchError(OLMoCheckpointError):
    """A sound checkpoint of another model shape: the config is wrong, not the checkpoint."""


def check_optimizer_kind(path: str, saved_keys: set[str], optimizer: str) -> None:
    """The per-parameter optimizer state a checkpoint holds (``saved_keys``, e.g. ``exp_avg``) is the state of the
    configured ``optimizer``: checked before anything is written, since a resume would otherwise fail (or, sharded,
    quietly load another optimizer's moments) after the launch had claimed its save folder.

    :raises ModelMismatchError: naming both optimizers and the fixes (the config differs, not the checkpoint).
    """
    wanted = OPTIMIZER_STATE_KEYS.get(optimizer)  # type: ignore[call-overload]
    if wanted is None or not saved_keys:
        return
    known = set().union(*OPTIMIZER_STATE_KEYS.values())
    found = saved_keys & known
    if found == wanted:
        return
    holder = next((str(name) for name, keys in OPTIMIZER_STATE_KEYS.items() if keys == found), "another optimizer")
    raise ModelMismatchError(
        f"The optimizer state in '{path}' is {holder}'s (it holds {sorted(found)}), but optimizer.name is "
        f"{optimizer}, which keeps {sorted(wanted)}. Set optimizer.name={holder} to resume; or, to start {optimizer} "
        f"fresh from these weights, pass --load_path={path} --reset_optimizer_state (without --try_load_latest_save, "
        f"which restores everything)."
    )


TRAINER_STATE_COUNTERS = ("global_step", "global_train_tokens_seen", "global_train_examples_seen_this_epoch")


def check_trainer_state(path: Union[str, Path], state: Any, ours: bool = True) -> None:
    """A trainer state (``train.pt``, ``train/rank{R}.pt``) holds what a resume reads, as whole numbers.

    :param ours: written by this trainer; an original OLMo state may spell its data position the legacy way.
    :raises OLMoCheckpointError: naming the file and the key.
    """
    if not isinstance(state, dict):
        raise OLMoCheckpointError(f"'{path}' holds a {type(state).__name__}, not a trainer state.")
    counters = TRAINER_STATE_COUNTERS if ours else ("global_step",)
    for key in counters:
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            what = "is missing" if key not in state else f"is {value!r}, not a whole number >= 0"
            raise OLMoCheckpointError(
                f"The trainer state '{path}' is damaged: {key} {what}, so where training stopped is unknown. Resume "
                f"from another checkpoint, or load this one's weights with --reset_trainer_state."
            )


def _shape(value: Any) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def check_shapes(path: str, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    wrong = sorted(k for k in set(saved) & set(expected) if _shape(saved[k]) != _shape(expected[k]))
    if not (missing or unexpected or wrong):
        return
    details = []
    if wrong:
        details.append(
            "shape mismatches: "
            + ", ".join(
                f"{k} {list(_shape(saved[k]))} in checkpoint vs {list(_shape(expected[k]))} in model"
                for k in wrong[:5]
            )
        )
    if missing:
        details.append(f"missing from checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        details.append(f"not in model: {', '.join(unexpected[:5])}")
    raise ModelMismatchError(
        f"Checkpoint '{path}' was saved from a different model shape ({'; '.join(details)}). Make the "
        f"model section of your config match the checkpoint's config.yaml, or load another checkpoint."
    )
