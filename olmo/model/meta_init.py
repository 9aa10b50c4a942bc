"""Building a model on the meta device without its constructors' initializations (:func:`skip_meta_init`).

A module's constructor initializes its parameters (``nn.Embedding``'s ``normal_``, ``nn.Linear``'s
``kaiming_uniform_``). On meta tensors that computes nothing, but it runs through torch's reference implementations,
which import torch's compiler (``torch._dynamo``: about 1.2 s of CPU) in every process that builds a model: each rank
of each launch. Under :func:`skip_meta_init` those calls return their meta tensor untouched. Nothing else changes: a
meta tensor holds no values and the calls draw no random numbers (the generator's state is the same either way), and
the parameters are initialized for real later, on their device (``OLMo.reset_parameters``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["skip_meta_init"]

_INITS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.zero_,
    torch.Tensor.fill_,
    torch.nn.init.normal_,
    torch.nn.init.uniform_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
    torch.nn.init.zeros_,
    torch.nn.init.ones_,
    torch.nn.init.constant_,
}


class skip_meta_init(TorchFunctionMode):  # noqa: N801  (used as a context manager, like torch.device)
    """Within it, an initialization (``nn.init.*``, ``Tensor.normal_``, ...) of a meta tensor returns the tensor."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITS:
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None and first.is_meta:
                return first
        return func(*args, **kwargs)
