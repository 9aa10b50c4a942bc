"""The choice between flash-linear-attention's kernels and the pure-PyTorch chunked delta rule
(:mod:`olmo.model.delta_rule_kernels`). The kernels need a GPU and Triton (``scripts/gpu_checks.py`` compares them
with the chunked path there); here the call the layer makes is checked against a stand-in with the kernel's calling
convention (fla's documented arguments: (B, T, H, d) tensors, ``scale``, ``use_qk_l2norm_in_kernel``, a batch of one
row cut by ``cu_seqlens``), computed by the step-by-step recurrence, so the layout, the grouping of value heads and
the document cuts the layer hands a kernel are tested on every machine."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from olmo.model import describe_linear_attention
from olmo.model.delta_rule import l2_normalize, recurrent_gated_delta_rule
from olmo.model.delta_rule_kernels import gated_delta_rule, kernels_usable, load_kernels, sequence_starts


def _stand_in_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> tuple[torch.Tensor, None]:
    """fla's ``chunk_gated_delta_rule`` contract computed by the recurrence: (B, T, H, d) in, (B, T, Hv, dv) out;
    with ``cu_seqlens`` B is 1 and each segment starts from a zero state."""
    assert not unused and use_qk_l2norm_in_kernel and q.dtype == k.dtype == v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    groups = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(groups, dim=2) for t in (q * scale, k))
    resets = None
    if cu_seqlens is not None:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64 and int(cu_seqlens[-1]) == q.shape[1]
        resets = torch.zeros(1, q.shape[1], dtype=torch.bool)
        resets[0, cu_seqlens[:-1]] = True
    q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
    out, _ = recurrent_gated_delta_rule(q, k, v, g, beta, resets)
    return out.transpose(1, 2), None


def _layer_inputs(B: int, T: int, Hk: int, Hv: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    dk, dv = 6, 5
    q = torch.randn(B, T, Hk, dk, generator=gen, dtype=torch.float32)
    k = torch.randn(B, T, Hk, dk, generator=gen, dtype=torch.float32)
    v = torch.randn(B, T, Hv, dv, generator=gen, dtype=torch.float32)
    g = -torch.rand(B, T, Hv, generator=gen, dtype=torch.float32)
    beta = torch.rand(B, T, Hv, generator=gen, dtype=torch.float32) * 2
    return q, k, v, g, beta


@pytest.mark.parametrize("heads", [(2, 2), (2, 6)])
@pytest.mark.parametrize("with_documents", [False, True])
def test_the_kernels_call_computes_what_the_chunked_path_computes(
    heads: tuple[int, int], with_documents: bool
) -> None:
    """The layer's call of a kernel (flattened rows cut at every row and document start, value heads grouped on
    key heads, q and k normalised in the kernel) gives the chunked path's outputs."""
    B, T = 3, 90
    q, k, v, g, beta = _layer_inputs(B, T, *heads)
    resets = None
    if with_documents:
        resets = torch.zeros(B, T, dtype=torch.bool)
        resets[0, [10, 11, 70]] = True  # a one-token document too
        resets[2, 64] = True  # at a chunk's edge
    want, state = gated_delta_rule(q, k, v, g, beta, resets)
    assert state is not None and want.shape == (B, T, heads[1], 5)
    got, no_state = gated_delta_rule(q, k, v, g, beta, resets, kernel=_stand_in_kernel)
    assert no_state is None
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_sequence_starts_cut_rows_and_documents() -> None:
    resets = torch.zeros(2, 5, dtype=torch.bool)
    resets[0, 0] = resets[0, 3] = resets[1, 4] = True
    assert sequence_starts(2, 5, resets, torch.device("cpu")).tolist() == [0, 3, 5, 9, 10]
    assert sequence_starts(2, 5, None, torch.device("cpu")).tolist() == [0, 5, 10]


def test_a_cpu_runs_the_chunked_path_and_says_so() -> None:
    """On a CPU the kernels never run, installed or not, and the Speed setup line names the chunked path; on a GPU
    without them it says why."""
    cpu = torch.device("cpu")
    assert not kernels_usable(cpu)
    assert describe_linear_attention(cpu) == "pure-PyTorch chunked delta rule (64 positions a chunk)"
    kernel, why = load_kernels()
    if kernel is None:
        assert why.startswith("flash-linear-attention not usable") and why in describe_linear_attention(
            torch.device("cuda")
        )


def test_the_benchmark_report_reads_into_the_gpu_checks_table(tmp_path) -> None:
    """``scripts/benchmark_linear_attention.py`` on a CPU: every variant timed, the recurrence beside the chunked
    forward, the saved bytes of the chunked path growing with the length, and its JSON read by the GPU checks."""
    from olmo.bench.gpu_checks_table import read_report
    from olmo.bench.linear_attention import main

    out = tmp_path / "la.json"
    args = "--seq 64 128 --heads 2 --key-dim 8 --value-dim 16 --repeats 1 --recurrence-max 64 --threads 1"
    assert main([*args.split(), "--out", str(out)]) == 0
    numbers = read_report(str(out))
    assert set(numbers) == {
        "attention/chunked time @64",
        "attention/chunked time @128",
        "recurrence/chunked-forward time @64",
    }
    import json

    rows = {(r["variant"], r["seq"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("chunked", 128)]["saved_for_backward_mb"] > rows[("chunked", 64)]["saved_for_backward_mb"] > 0
    assert rows[("recurrence", 64)]["saved_for_backward_mb"] == 0


def test_the_speed_setup_line_names_the_linear_attention_path(tmp_path, caplog) -> None:
    """A hybrid run's startup line says how many linear-attention layers there are and what they run on."""
    import logging

    from olmo.testing import run_train, tiny_config_dict, write_byte_corpus, write_config

    data = write_byte_corpus(tmp_path / "data")
    overrides = {
        "model.layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "model.linear_attention": {"key_head_dim": 8, "value_head_dim": 8},
        "model.n_layers": 3,
        "model.layer_norm_type": "rms",
        "max_duration": 1,
    }
    path = write_config(tmp_path / "hybrid.yaml", tiny_config_dict(tmp_path / "run", data, **overrides))
    with caplog.at_level(logging.INFO):
        assert run_train(path) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Speed setup")]
    assert len(lines) == 1, caplog.text[-2000:]
    assert "; 2 linear-attention layer(s) on pure-PyTorch chunked delta rule (64 positions a chunk)" in lines[0]
