"""Which implementation of the gated delta rule a linear-attention layer runs: flash-linear-attention's Triton
kernels (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, the ``linear`` extra) on a GPU when they import, else
the pure-PyTorch chunked form of :mod:`olmo.model.delta_rule` (the reference, and what runs on a CPU).

:func:`gated_delta_rule` takes the mixer's tensors as they come out of the short convolution, (B, T, heads, dim), and
does the rest either way: L2-normalising q and k, scaling q, sharing each key head with its group of value heads,
and resetting the state at document starts (the kernels' ``cu_seqlens``: the batch flattened to one row cut at
every row and document start, so packed documents never see each other). The choice is automatic (no config key):
the kernels for CUDA tensors without an initial state when ``fla`` imports, the chunked form otherwise;
:func:`describe_linear_attention` names it for the startup "Speed setup" line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch

from .delta_rule import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule

__all__ = [
    "gated_delta_rule",
    "pure_gated_delta_rule",
    "load_kernels",
    "kernels_usable",
    "describe_linear_attention",
    "sequence_starts",
]

CHUNK_SIZE = 64
"""Positions per chunk of the pure-PyTorch path (flash-linear-attention's and transformers' chunk)."""
STEP_TOKENS = 8
"""A decoding step of at most this many positions runs the recurrence (a chunk would pad it to 64 positions: one
token took 24 ms chunked and 1.7 ms step by step at 32 heads of 128 x 128 on this project's CPU)."""


@functools.cache
def load_kernels() -> tuple[Optional[Callable[..., Any]], str]:
    """flash-linear-attention's chunked gated delta rule and its version, or None and why it is not usable (not
    installed, or Triton missing: any import error is a reason to run the pure-PyTorch path, never a failure)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except Exception as e:  # ImportError, or Triton refusing this machine when fla imports it
        return None, f"flash-linear-attention not usable ({type(e).__name__}: {str(e)[:80]})"
    return kernel, f"flash-linear-attention {getattr(fla, '__version__', '?')}"


def kernels_usable(device: torch.device) -> bool:
    """Whether a linear-attention layer on ``device`` runs flash-linear-attention's kernels."""
    return device.type == "cuda" and load_kernels()[0] is not None


def describe_linear_attention(device: torch.device) -> str:
    """The implementation a linear-attention layer runs on ``device``, for the startup "Speed setup" line."""
    kernel, version = load_kernels()
    if kernel is not None and device.type == "cuda":
        return f"{version} chunk_gated_delta_rule (Triton)"
    why = f"; {version}" if device.type == "cuda" else ""  # on a GPU, why the kernels do not run
    return f"pure-PyTorch chunked delta rule ({CHUNK_SIZE} positions a chunk{why})"


def sequence_starts(B: int, T: int, resets: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The kernels' ``cu_seqlens`` for a (B, T) batch flattened to one row: the offset of every row's start and
    every document start inside a row (``resets``, True at a document's first token), then ``B * T``; int64."""
    starts = torch.zeros(B, T, dtype=torch.bool, device=device)
    if resets is not None:
        starts |= resets.to(device=device, dtype=torch.bool)
    starts[:, 0] = True
    offsets = starts.reshape(-1).nonzero().squeeze(-1)
    return torch.cat((offsets, offsets.new_tensor([B * T])))


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    keep_state: bool = False,
    kernel: Optional[Callable[..., Any]] = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of one layer, on the kernels or the chunked path (see the module's docstring).

    :param q: (B, T, Hk, dk) queries straight from the convolution (not yet normalised); ``k`` the same shape.
    :param v: (B, T, Hv, dv) values; Hv a multiple of Hk.
    :param g: (B, T, Hv) log decay; ``beta`` (B, T, Hv) write strength, both fp32.
    :param resets: (B, T) bool, True at each document's first token; None: one sequence a row.
    :param initial_state: (B, Hv, dk, dv) state before position 0 (decoding); None: zeros.
    :param keep_state: Return the state after the last position (generation's prefill and steps); then the pure
        PyTorch path runs, and steps of at most :data:`STEP_TOKENS` positions run the recurrence itself.
    :param kernel: Run this flash-linear-attention-compatible function instead of choosing (the GPU checks).
    :returns: The outputs (B, T, Hv, dv), fp32 on the pure path and ``v``'s dtype on the kernels, and the state
        after the last position (None without ``keep_state`` on the kernels).
    """
    if kernel is None and not keep_state and initial_state is None and kernels_usable(v.device):
        kernel = load_kernels()[0]
    if kernel is not None:
        return _on_kernels(kernel, q, k, v, g, beta, resets), None
    step_by_step = keep_state and q.shape[1] <= STEP_TOKENS
    return pure_gated_delta_rule(q, k, v, g, beta, resets, initial_state, step_by_step)


def pure_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    step_by_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` in pure PyTorch whatever the device, chunk by chunk (``step_by_step``: one position
    at a time, for a decoding step, which a chunk would pad to 64 positions): the outputs (B, T, Hv, dv) in fp32 and
    the state after the last position (B, Hv, dk, dv)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    if step_by_step:
        out, state = recurrent_gated_delta_rule(q, k, v, g, beta, resets, initial_state=initial_state)
    else:
        out, state = chunk_gated_delta_rule(
            q, k, v, g, beta, resets, initial_state=initial_state, chunk_size=CHUNK_SIZE
        )
    return out.transpose(1, 2), state


def _heads_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layer's (B, T, heads, ...) q, k, v, g and beta as the delta rule takes them, (B, Hv, T, ...): q and k
    L2-normalised in fp32 (q scaled by ``dk ** -0.5``), each key head repeated for its group of value heads."""
    q, k, v, g, beta = tensors
    Hk, dk, Hv = k.shape[2], k.shape[3], v.shape[2]
    q = l2_normalize(q.float()) * dk**-0.5
    k = l2_normalize(k.float())
    if Hv > Hk:  # each group of value heads reads one key head
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    return tuple(t.transpose(1, 2) for t in (q, k, v, g, beta))


def _on_kernels(
    kernel: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: Optional[torch.Tensor],
) -> torch.Tensor:
    """flash-linear-attention's call: q, k and v in one dtype (the activations'), q and k normalised in the kernel,
    value heads sharing key heads (the kernel's grouped value heads), documents as ``cu_seqlens`` of one long row."""
    B, T, _, dk = k.shape
    q, k = q.to(v.dtype), k.to(v.dtype)
    options: dict[str, Any] = {"scale": dk**-0.5, "use_qk_l2norm_in_kernel": True}
    if resets is None:
        out, _ = kernel(q, k, v, g, beta, **options)
        return out
    cu_seqlens = sequence_starts(B, T, resets, v.device)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, _ = kernel(*flat, cu_seqlens=cu_seqlens, **options)
    return out.reshape(B, T, *out.shape[2:])
