"""Functions that a compiled block must leave to eager mode (host-side sizes, collectives), marked with
:func:`eager_in_compiled` where they are defined and wrapped in ``torch.compiler.disable`` by
:func:`install_compile_guards` only once something is about to be compiled.

``torch.compiler.disable`` imports torch's compiler (``torch._dynamo``: about 1.2 s of CPU, as long as torch's own
import), so applied at definition it made every process that imports the model pay for a compiler most never use:
each rank of each launch, each command, each test that starts a process. Eager mode is the same either way (the
wrapper only tells the compiler to stop tracing); compiled code is the same too, since every compile of this package
(:func:`olmo.distributed.parallelize.build_model`) installs the guards first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["eager_in_compiled", "install_compile_guards"]

F = TypeVar("F", bound=Callable[..., Any])

_MARKED: list[tuple[str, str]] = []
"""``(module, qualified name)`` of each marked function or method, in the order they were defined."""
_installed = False


def eager_in_compiled(fn: F) -> F:
    """Mark ``fn`` (a module-level function or a method of a module-level class) to run in eager mode inside a
    compiled region; returns it unchanged until :func:`install_compile_guards`."""
    if "<locals>" in fn.__qualname__:
        raise TypeError(f"{fn.__qualname__}: only module-level functions and methods can be marked")
    _MARKED.append((fn.__module__, fn.__qualname__))
    return fn


def install_compile_guards() -> None:
    """Wrap every marked function in ``torch.compiler.disable`` (once per process; call before compiling)."""
    global _installed
    if _installed:
        return
    import torch
    import torch.nn.attention.bias  # noqa: F401  (imported inside the attention of context parallelism)

    for module_name, qualname in _MARKED:
        owner: Any = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, torch.compiler.disable(getattr(owner, name)))
    _installed = True
