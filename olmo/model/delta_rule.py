"""The gated delta rule of Gated DeltaNet in pure PyTorch: the step-by-step recurrence
(:func:`recurrent_gated_delta_rule`, the definition) and the chunked form that computes the same thing with matrix
products (:func:`chunk_gated_delta_rule`, what training runs), both with the recurrent state reset at document
starts.

Each head keeps a state ``S`` (dk x dv). At position t, with decay ``a_t = exp(g_t)`` and write strength ``beta_t``::

    S <- a_t * S                                  (0 instead at a document start: nothing earlier is seen)
    u_t = beta_t * (v_t - S^T k_t)                (the correction of what S already stores under k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t

Inputs are (B, H, T, d); q and k arrive L2-normalised with q scaled (the mixer does that). Both functions compute
in at least fp32 (fp64 stays fp64, for the tests) and return that precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

__all__ = ["recurrent_gated_delta_rule", "chunk_gated_delta_rule", "l2_normalize"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one position at a time (decoding, and the reference of the chunked form).

    :param q: (B, H, T, dk) queries; ``k`` the same shape; ``v`` (B, H, T, dv).
    :param g: (B, H, T) log decay (<= 0); ``beta`` (B, H, T) write strength.
    :param resets: (B, T) bool, True at each document's first token: the state is zeroed before that step.
    :param initial_state: (B, H, dk, dv) state before position 0; None: zeros.
    :returns: The outputs (B, H, T, dv) and the state after the last position (B, H, dk, dv), in fp32 or wider.
    """
    dtype = _compute_dtype(q.dtype)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    decay = g.exp()  # (B, H, T)
    if resets is not None:
        decay = decay.masked_fill(resets[:, None, :], 0.0)
    outputs = []
    for t in range(T):
        state = state * decay[:, :, t, None, None]
        k_t = k[:, :, t]  # (B, H, dk)
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))  # (B, H, dv)
        state = state + k_t[..., :, None] * u[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outputs, dim=2), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule of :func:`recurrent_gated_delta_rule` over chunks of ``chunk_size`` positions: within a
    chunk, the corrections ``u`` solve one unit lower-triangular system (the WY form of the products of
    ``I - beta k k^T``); only the state passes from chunk to chunk. Same arguments and results.

    In a chunk with cumulative log decay ``G_i``, position i sees the state entering the chunk through
    ``Gamma_i = exp(G_i)`` and position j <= i through ``D_ij = exp(G_i - G_j)``; a document start in between makes
    that factor 0, which is how the state resets inside a chunk. Then ``(I + A) U = beta V - (beta Gamma K) S`` with
    ``A_ij = beta_i D_ij k_i.k_j`` (j < i), ``O = (Gamma Q) S + (Q K^T * D) U`` and
    ``S <- Gamma_C S + (D_Cj K)^T U``.
    """
    dtype = _compute_dtype(q.dtype)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # Padding after the last position (k = v = beta = 0, no decay) leaves every output and the state unchanged.
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))  # (B, H, N, C, d)
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)

    G = g.cumsum(dim=-1)  # (B, H, N, C) log decay from the chunk's start through each position
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    seen = causal.expand(B, 1, N, C, C)  # (B, 1, N, C, C)
    reaches_start = torch.ones(B, 1, N, C, dtype=torch.bool, device=q.device)
    if resets is not None:
        starts = F.pad(resets.to(torch.int32), (0, pad)).reshape(B, 1, N, C)
        segment = starts.cumsum(dim=-1)  # documents started in the chunk up to each position
        seen = seen & (segment[..., :, None] == segment[..., None, :])
        reaches_start = segment == 0
    log_d = (G[..., :, None] - G[..., None, :]).masked_fill(~seen, float("-inf"))
    D = log_d.exp()  # (B, H, N, C, C) decay from j to i, 0 across a document start or for j > i
    gamma = G.exp() * reaches_start  # (B, H, N, C) decay of the entering state to each position

    kk = k @ k.transpose(-1, -2)  # (B, H, N, C, C)
    strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    lower = (beta[..., :, None] * D * kk).masked_fill(~strictly_lower, 0.0) + torch.eye(
        C, dtype=dtype, device=q.device
    )
    rhs = torch.cat((beta[..., None] * v, (beta * gamma)[..., None] * k), dim=-1)  # (B, H, N, C, dv + dk)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u_own, u_from_state = solved.split((dv, dk), dim=-1)  # U = u_own - u_from_state @ S
    qk = (q @ k.transpose(-1, -2)) * D  # (B, H, N, C, C)
    q_gamma = q * gamma[..., None]  # (B, H, N, C, dk)
    k_to_end = k * D[..., -1, :, None]  # (B, H, N, C, dk): each position's key decayed to the chunk's end

    state = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.to(dtype)
    if torch.compiler.is_compiling():
        # torch.compile would unroll the loop below into a graph N chunks long, its compile time growing with the
        # sequence (~1.4 s a chunk on CPU: minutes at 8,192 tokens); scan compiles one chunk's step, at any length.
        # Eager keeps the loop: scan's eager path gives the same bits, twice as slowly.
        stacked_inputs = (u_own, u_from_state, q_gamma, qk, gamma[..., -1], k_to_end)
        chunks = [t.movedim(2, 0) for t in stacked_inputs]  # (N, B, H, ...): scan steps over the first dimension
        state, stacked = scan(_next_chunk, state, chunks)  # (B, H, dk, dv), (N, B, H, C, dv)
        return stacked.movedim(0, 2).reshape(B, H, N * C, dv)[:, :, :T], state
    outputs = []
    # Each chunk's slices taken once (unbind): indexing a chunk inside the loop would make the backward add a
    # zero-filled copy of the whole tensor per chunk, quadratic in the length (25x the time for 4x the tokens).
    per_chunk = zip(
        *(t.unbind(dim=2) for t in (u_own, u_from_state, q_gamma, qk, gamma[..., -1, None, None], k_to_end))
    )
    for u_own_n, u_from_state_n, q_gamma_n, qk_n, decay_n, k_to_end_n in per_chunk:
        u = u_own_n - u_from_state_n @ state  # (B, H, C, dv)
        outputs.append(q_gamma_n @ state + qk_n @ u)
        state = decay_n * state + k_to_end_n.transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(B, H, N * C, dv)[:, :, :T]
    return out, state


def _next_chunk(state: torch.Tensor, chunk: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of :func:`chunk_gated_delta_rule`'s pass over the chunks (compiled): the state after the chunk, and
    the chunk's outputs, as the eager loop computes them."""
    u_own, u_from_state, q_gamma, qk, gamma_end, k_to_end = chunk
    u = u_own - u_from_state @ state  # (B, H, C, dv)
    out = q_gamma @ state + qk @ u  # (B, H, C, dv)
    return gamma_end[..., None, None] * state + k_to_end.transpose(-1, -2) @ u, out
