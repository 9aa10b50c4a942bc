"""A rank's attention under context parallelism (:mod:`olmo.model.context_attention`), in one process: each of its
two chunks attends to the prefix of the sequence that ends with it, with ``causal_lower_right`` (the CUDA path) or
with the masks built from positions (documents, windows; the CPU path), and gives exactly the rows of full causal
attention at its positions. The multi-process parity is tests/distributed/test_context_parallel.py."""

import pytest
import torch
import torch.nn.functional as F

from olmo.config import ModelConfig
from olmo.distributed.context_parallel import ContextParallel
from olmo.model.attention import document_ids
from olmo.model.context_attention import ContextAttention, context_parallel_inputs


class _Gathered(ContextParallel):
    """Rank ``rank`` of ``degree`` whose gathers return the whole keys, then the whole values, given up front."""

    def __init__(self, degree, rank, keys, values):
        super().__init__(degree, rank, None)
        self.whole = [keys, values]

    def gather(self, t, dim):
        return self.whole.pop(0)


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)  # (B, Tq, H, hd)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device", DEVICES)  # on CUDA plain causal chunks take causal_lower_right, with no mask
@pytest.mark.parametrize("degree, rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("documents, window", [(False, None), (True, None), (False, 5), (True, 5)])
def test_each_chunk_attends_as_full_attention_does_at_its_positions(device, degree, rank, documents, window):
    torch.manual_seed(0)
    B, H, T, hd = 2, 3, 32, 8
    q, k, v = (torch.randn(B, H, T, hd, device=device) for _ in range(3))
    doc_lens = torch.tensor([[5, 20, 7], [32, 0, 0]], device=device) if documents else None
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if window is not None:
        allowed = allowed & (
            torch.arange(T, device=device)[None, :] > torch.arange(T, device=device)[:, None] - window
        )
    if doc_lens is not None:
        ids = document_ids(doc_lens, T)
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)  # (B, T, H, hd)

    cp = _Gathered(degree, rank, k, v)
    positions = cp.positions(T, q.device)
    config = ModelConfig(d_model=H * hd, n_heads=H, max_sequence_length=T, rope=False)
    windows = [] if window is None else [window]
    inputs = context_parallel_inputs(
        config, cp, (B, T // degree), q.device, None, doc_lens, None, windows, None, torch.float32
    )
    attention, _ = inputs[window]
    assert (attention.masks[0] is None) == (device == "cuda" and not documents and window is None)
    got = attention.attend(q[:, :, positions], k[:, :, positions], v[:, :, positions], _sdpa)
    tolerance = {} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}  # CUDA's kernels differ from the math path
    torch.testing.assert_close(got, expected[:, positions], **tolerance)
    if not documents and window is None:  # the CUDA path: no mask built, a lower-right causal bias instead
        cuda_like = ContextAttention(_Gathered(degree, rank, k, v), attention.chunks, (None, None))
        got = cuda_like.attend(q[:, :, positions], k, v, _sdpa)
        torch.testing.assert_close(got, expected[:, positions], **tolerance)
