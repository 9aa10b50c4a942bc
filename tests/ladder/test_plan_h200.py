"""The memory plan against every peak measured on a GPU (one H200, bf16 autocast, one process,
``torch.cuda.max_memory_allocated``): the estimate of the tensors a step holds is within 15 % of each (issue 39's
bound). ``COMPILED_ACTIVATIONS`` was fitted to two differences of the first table (RESEARCH_LOG 2026-11-26: OLMo-300M's
and OLMo-1B's memory per instance, compiled against eager; every row within 1.3 % when written); the other rows check
it, and the second table (longer sequences, windows, activation checkpointing, a mixture of experts: RESEARCH_LOG
2026-11-27) was measured after the fit."""

from pathlib import Path

import pytest

from olmo.config import TrainConfig
from olmo.distributed.run_shape import RunShape
from olmo.ladder.estimates import estimate_memory, resolve_device
from olmo.ladder.run_planner import model_facts

OFFICIAL = Path(__file__).resolve().parents[2] / "configs" / "official"

# (config, micro-batch, batch per step, fused loss, compiled, measured peak in MiB)
MEASURED = [
    ("OLMo-300M", 16, 16, False, True, 38826),
    ("OLMo-300M", 16, 16, True, True, 25164),
    ("OLMo-300M", 32, 32, False, True, 72511),
    ("OLMo-1B", 8, 8, False, True, 47403),
    ("OLMo-1B", 8, 8, True, True, 41574),
    ("OLMo-1B", 16, 16, False, True, 79028),
    ("OLMo-300M", 4, 16, False, False, 15968),  # the ladders' rungs: 4 micro-batches per step
    ("OLMo-300M", 4, 16, False, True, 15011),
    ("OLMo-300M", 8, 16, False, True, 23434),
    ("OLMo-300M", 8, 16, True, True, 17439),
    ("OLMo-1B", 2, 8, False, False, 29458),
    ("OLMo-1B", 2, 8, False, True, 28179),
    ("OLMo-1B", 4, 8, False, True, 36080),
    ("OLMo-1B", 4, 8, True, True, 34054),
]

# (config, micro-batch = batch per step, compiled, overrides, measured peak in MiB), plain loss
MEASURED_AFTER_THE_FIT = [
    ("OLMo-300M", 8, True, ["model.max_sequence_length=4096"], 38828),
    (
        "OLMo-300M",
        8,
        True,
        ["model.max_sequence_length=4096", "model.sliding_window.pattern=[1024,1024,1024,-1]"],
        39020,
    ),
    ("OLMo-300M", 4, True, ["model.max_sequence_length=8192"], 38834),
    (
        "OLMo-300M",
        4,
        True,
        ["model.max_sequence_length=8192", "model.sliding_window.pattern=[2048,2048,2048,-1]"],
        39601,
    ),
    ("OLMo-1B", 16, True, ["activation_checkpointing=whole_layer"], 33931),
    ("OLMo-1B", 32, True, ["activation_checkpointing=fine_grained"], 54148),
    ("OLMo-1B", 32, True, ["activation_checkpointing=one_in_two"], 98205),
    ("OLMoE-1B-7B", 4, False, ["model.n_layers=4"], 49396),
    ("OLMoE-1B-7B", 4, True, ["model.n_layers=4"], 43506),
]


def _estimate_mib(name, micro, batch, compiled, extra):
    overrides = [
        f"device_train_microbatch_size={micro}",
        f"global_train_batch_size={batch}",
        "precision=amp_bf16",
        "compile={}" if compiled else "compile=null",
        "activation_checkpointing=null",
        "evaluators=[]",
        *extra,
    ]
    run = RunShape.from_train_config(TrainConfig.load(OFFICIAL / f"{name}.yaml", overrides))
    return estimate_memory(run, model_facts(run), 1, resolve_device("H200")).tensors / 2**20


@pytest.mark.parametrize("name, micro, batch, fused, compiled, measured", MEASURED)
def test_the_plan_predicts_each_measured_h200_peak_within_15_percent(
    name, micro, batch, fused, compiled, measured
):
    estimate = _estimate_mib(name, micro, batch, compiled, [f"fused_loss={str(fused).lower()}"])
    assert estimate == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("name, micro, compiled, extra, measured", MEASURED_AFTER_THE_FIT)
def test_the_plan_predicts_peaks_measured_after_its_fit_within_15_percent(name, micro, compiled, extra, measured):
    assert _estimate_mib(name, micro, micro, compiled, extra) == pytest.approx(measured, rel=0.15)
