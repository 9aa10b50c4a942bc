"""Pipeline parallelism trains as one process does (issue 54, point 2): each schedule on 2 gloo ranks, and 1F1B and
ZBV with FSDP over 4, reproduce one process's losses and gradient norms over steps with gradient accumulation
(z-loss and documents on), and checkpoints move between layouts: a pipeline's (sharded or unsharded) resumes in one
process, and one process's resumes under a pipeline with FSDP, continuing as one process's resumption does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.testing.train_each import run_torchrun_each

STEPS, LONGER = 3, 5
SCHEDULES = {
    "1f1b": {},
    "interleaved": {"pipeline_parallel.schedule": "interleaved_1f1b", "pipeline_parallel.stages_per_rank": 2},
    "zero_bubble": {"pipeline_parallel.schedule": "zero_bubble", "pipeline_parallel.stages_per_rank": 2},
    "zbv": {"pipeline_parallel.schedule": "zbv", "pipeline_parallel.stages_per_rank": 2},
}


def _config(tmp_path: Path, name: str, corpus: Path, **overrides) -> Path:
    cfg = tiny_config_dict(
        tmp_path / name,
        [str(corpus)],
        **{
            "model.n_layers": 4,
            "global_train_batch_size": 8,
            "device_train_microbatch_size": 2,  # 4 micro-batches a step on one rank or one pipeline
            "softmax_auxiliary_loss": True,
            "data.generate_doc_lengths": True,
            "max_duration": STEPS,
            "save_interval": STEPS,
            "save_interval_unsharded": STEPS,
            "evaluators": [{"label": "held-out", "type": "lm", "data": {"paths": [str(corpus)]}}],
            "eval_interval": STEPS,
            "eval_subset_num_batches": 2,
            "device_eval_batch_size": 3,
            **overrides,
        },
    )
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _rows(folder: Path) -> list[tuple[int, float, float]]:
    """Each step's loss and gradient norm, and each evaluation's loss (as a row with norm 0)."""
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "train/CrossEntropyLoss" in r:
            out.append((r["step"], r["train/CrossEntropyLoss"], r["optim/total_grad_norm"]))
        if "eval/held-out/CrossEntropyLoss" in r:
            out.append((-r["step"], r["eval/held-out/CrossEntropyLoss"], 0.0))
    return out


def _same(a: list, b: list, evaluated: bool = True) -> None:
    assert [s for s, *_ in a] == [s for s, *_ in b] and any(s < 0 for s, *_ in a) == evaluated
    for (_, loss_a, norm_a), (_, loss_b, norm_b) in zip(a, b):
        assert loss_b == pytest.approx(loss_a, rel=1e-5) and norm_b == pytest.approx(norm_a, rel=1e-4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pp") / "corpus.npy"
    write_byte_memmap(path, 20_000)
    return path


def test_each_schedule_on_two_ranks_and_checkpoints_across_layouts(tmp_path, corpus):
    assert run_train(_config(tmp_path, "one", corpus)) == 0
    longer = {"max_duration": LONGER, "save_interval": LONGER, "save_interval_unsharded": None}
    resumed = _config(tmp_path, "one_resumed", corpus, load_path=str(tmp_path / "one/step3"), **longer)
    assert run_train(resumed) == 0
    pp = {"pipeline_parallel.degree": 2}
    runs = [[_config(tmp_path, name, corpus, **pp, **extra)] for name, extra in SCHEDULES.items()]
    # One process's checkpoint resumed under a pipeline (ZBV: the last stage on the first rank).
    from_one = _config(
        tmp_path, "from_one", corpus, load_path=str(tmp_path / "one/step3"), **pp, **SCHEDULES["zbv"], **longer
    )
    result = run_torchrun_each(2, [*runs, [from_one]], timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in SCHEDULES:
        _same(_rows(tmp_path / "one"), _rows(tmp_path / name))
    _same(_rows(tmp_path / "one_resumed"), _rows(tmp_path / "from_one"))
    # The pipeline's own checkpoints, sharded and unsharded, resumed in one process.
    for kind in ("step3", "step3-unsharded"):
        name = f"to_one_{kind}"
        config = _config(tmp_path, name, corpus, load_path=str(tmp_path / "1f1b" / kind), **longer)
        assert run_train(config) == 0
        _same(_rows(tmp_path / "one_resumed"), _rows(tmp_path / name))
    # The unsharded checkpoint is the whole model's (every stage's tensors, every parameter's optimizer state).
    import torch

    whole = torch.load(tmp_path / "one/step3-unsharded/model.pt", weights_only=True)
    staged = torch.load(tmp_path / "1f1b/step3-unsharded/model.pt", weights_only=True)
    assert whole.keys() == staged.keys()
    for key in whole:
        torch.testing.assert_close(staged[key], whole[key], rtol=1e-5, atol=1e-6)
    optim = torch.load(tmp_path / "1f1b/step3-unsharded/optim.pt", weights_only=True)
    names = [n for group in optim["param_groups"] for n in group["params"]]
    assert sorted(names) == sorted(whole) and len(optim["state"]) == len(whole)


def test_a_pipeline_of_fsdp_or_tensor_parallel_stages_trains_as_one_process(tmp_path, corpus):
    """4 ranks: 2 stages, each sharded by FSDP over 2 ranks reading different halves of the batch (an evaluation's
    subset would be two ranks' shares here, one's in one process: not compared), or each split over 2 ranks by
    tensor parallelism (OLMo 2's QK-norm on); the latter's checkpoint resumes in one process."""
    quiet = {"save_interval_unsharded": None, "evaluators": []}
    assert run_train(_config(tmp_path, "one", corpus, **quiet)) == 0
    pp = {"pipeline_parallel.degree": 2, **quiet}
    fsdp = ("1f1b", "zero_bubble", "zbv")  # the zero-bubble ones defer weight gradients: FSDP must keep them
    runs = [[_config(tmp_path, name, corpus, **pp, **SCHEDULES[name])] for name in fsdp]
    qk = {"model.attention_layer_norm": True, "model.layer_norm_type": "rms"}
    assert run_train(_config(tmp_path, "one_qk", corpus, **quiet, **qk)) == 0
    runs.append([_config(tmp_path, "tp", corpus, **pp, **qk, **{"tensor_parallel.degree": 2})])
    result = run_torchrun_each(4, runs, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in fsdp:
        _same(_rows(tmp_path / "one"), _rows(tmp_path / name), evaluated=False)
    _same(_rows(tmp_path / "one_qk"), _rows(tmp_path / "tp"), evaluated=False)
    longer = {"max_duration": LONGER, "save_interval": LONGER, **quiet, **qk}
    for name in ("one_qk", "tp"):
        config = _config(tmp_path, f"{name}_resumed", corpus, load_path=str(tmp_path / name / "step3"), **longer)
        assert run_train(config) == 0
    _same(_rows(tmp_path / "one_qk_resumed"), _rows(tmp_path / "tp_resumed"), evaluated=False)
