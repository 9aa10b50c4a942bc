"""The OLMo 3 recipes (configs/official/OLMo-3-*.yaml): ``--help`` and ``--dry_run`` work on each before any of its
data exists (offline: no test here reaches olmo-data.org), and a shrunk copy of each size trains its three stages on
CPU, each stage from the checkpoint of the one before, as the files' headers tell a user to."""

import json
import math
from pathlib import Path
from typing import Union

import pytest
from omegaconf import OmegaConf as om

from olmo.config import TrainConfig
from olmo.exceptions import OLMoDataError
from olmo.testing import SHRUNK_OLMO3_7B, run_main, run_torchrun, run_train, shrunk_copy, write_byte_memmap

OFFICIAL = Path(__file__).resolve().parents[2] / "configs" / "official"
STAGES = ("", "-midtrain", "-long-context")

# What --dry_run prints for each recipe: parameters, batch, steps, peak learning rate (OLMo-core's numbers; the
# files cite where each comes from). The 32B's stage 1 lasts an epoch of its data, so its steps need the data.
P7, P32 = "7,298,617,344 total", "32,234,279,936 total"
COSINE, MID, LONG = (
    "cosine_with_warmup, 2,000 warmup",
    "linear_with_warmup, 0 warmup",
    "linear_with_warmup, 200 warmup",
)
PLANS = {
    "OLMo-3-7B": (P7, "512 instances x 8192", "1,192,093 steps", f"0.0003 peak, {COSINE}"),
    "OLMo-3-7B-midtrain": (P7, "256 instances x 8192", "47,684 steps", f"0.0002071 peak, {MID}"),
    "OLMo-3-7B-long-context": (P7, "64 instances x 65536", "11,921 steps", f"0.0002071 peak, {LONG}"),
    "OLMo-3-32B": (P32, "1,024 instances x 8192", f"0.0006 peak, {COSINE}"),
    "OLMo-3-32B-midtrain": (P32, "512 instances x 8192", "23,842 steps", f"0.0002071 peak, {MID}"),
    "OLMo-3-32B-long-context": (P32, "128 instances x 65536", "11,921 steps", f"0.0002071 peak, {LONG}"),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_help_lists_each_recipe(name, capsys):
    assert run_main("train.py", OFFICIAL / f"{name}.yaml", "--help") == 0
    rows = {
        line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")
    }
    assert rows["model.sliding_window.pattern"][:4] == ["[4096,", "4096,", "4096,", "-1]"]
    long_context = name.endswith("long-context")
    assert rows["model.max_sequence_length"][0] == ("65536" if long_context else "8192")
    if long_context:  # YaRN from the 8,192 tokens of the earlier stages to 65,536
        assert [rows[f"model.rope_scaling.{key}"][0] for key in ("name", "factor", "old_context_len")] == [
            "yarn",
            "8.0",
            "8192",
        ]
    else:
        assert rows["model.rope_scaling"][0] == "null"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_dry_run_prints_each_recipe_s_plan_before_its_data_exists(name, tmp_path, capsys, offline):
    run = tmp_path / "run"
    with pytest.raises(OLMoDataError, match=r"olmo-data\.org|matches no file"):
        run_main("train.py", OFFICIAL / f"{name}.yaml", "--dry_run", f"--save_folder={run}")
    plan = capsys.readouterr().out
    assert not run.exists(), "--dry_run wrote something"
    for expected in PLANS[name]:
        assert expected in plan, f"{expected!r} is not in the plan:\n{plan}"


SHRUNK = {
    **SHRUNK_OLMO3_7B,
    "model.float8.enabled": False,  # the 7B long-context recipe's float8 needs a Hopper GPU (tests/train/test_float8.py)
    "evaluators": [],
    "save_interval_ephemeral": None,
    "no_pre_train_checkpoint": True,
}
"""A few thousand parameters on a byte corpus, in the recipes' kind: windows shorter than the sequence on 3 of every 4
layers, the last layer full; everything not named here (norms, QK-norm, z-loss, optimizer, schedule shape, spike
skipping, document masking, YaRN, the stage's loading) is the file's."""


def _shrunk_copy(
    name: str, folder: Path, corpus: Path, seq: int, batch: int, steps: Union[int, str], **changes
) -> Path:
    """``configs/official/{name}.yaml`` with :data:`SHRUNK` (:func:`olmo.testing.shrunk_copy`)."""
    return shrunk_copy(OFFICIAL / f"{name}.yaml", folder, corpus, seq, batch, steps, SHRUNK, **changes)


@pytest.mark.parametrize("size", ["7B", "32B"])
def test_shrunk_recipes_train_their_three_stages(size, tmp_path):
    """Stage 1 as the file has it (a cosine stopped halfway for the 7B, one epoch for the 32B), then midtraining and
    the long-context stage, each loading the previous checkpoint's model and optimizer with a fresh step count: the
    context grows 8x under YaRN with the window still shorter than it, and documents masked from each other."""
    corpus, epoch = tmp_path / "corpus.npy", tmp_path / "epoch.npy"
    write_byte_memmap(corpus, 30_000, dtype="uint32")
    write_byte_memmap(epoch, 17 * 32, dtype="uint32")  # one epoch: 17 instances of 32 tokens, 4 steps of 4
    name = f"OLMo-3-{size}"
    gqa = {"model.n_kv_heads": 2} if size == "32B" else {}  # 40 query heads share 8 key/value heads in the 32B
    learn = {"optimizer.learning_rate": 1e-2, "scheduler.t_warmup": 1, "save_interval": 4, **gqa}
    if size == "7B":  # an 8-step schedule stopped after 4 steps, as OLMo-core's part 1 was
        first = _shrunk_copy(name, tmp_path / "stage1", corpus, 32, 4, 8, stop_at=4, **learn)
    else:
        first = _shrunk_copy(name, tmp_path / "stage1", epoch, 32, 4, "1ep", **learn)
    midtrain = _shrunk_copy(f"{name}-midtrain", tmp_path / "midtrain", corpus, 32, 2, 3, **gqa)
    # 32 -> 256 tokens: the recipe's factor 8 over the context the earlier stages trained at.
    yarn = {"model.rope_scaling.old_context_len": 32, **gqa}
    one = {"context_parallel.degree": 1}  # the recipe's 8 ranks per instance, in one process here (see below)
    long_context = _shrunk_copy(
        f"{name}-long-context", tmp_path / "long-context", corpus, 256, 2, 3, **yarn, **one
    )
    cfg = TrainConfig.load(long_context)
    assert cfg.model.layer_windows() == [8, 8, 8, None, None] and cfg.model.rope_scaling.factor == 8
    assert cfg.data.generate_doc_lengths and cfg.reset_trainer_state
    recipe = om.load(OFFICIAL / f"{name}-long-context.yaml")
    assert recipe.context_parallel.degree == 8
    assert recipe.model.get("float8", {}).get("enabled", False) == (size == "7B")  # as OLMo-core's recipes

    records: dict[str, list] = {stage: [] for stage in STAGES}
    assert run_train(first, record=records[""]) == 0
    assert run_train(midtrain, f"--load_path={tmp_path}/stage1/run/step4", record=records["-midtrain"]) == 0
    load = f"--load_path={tmp_path}/midtrain/run/step3"
    assert run_train(long_context, load, record=records["-long-context"]) == 0

    assert [r["step"] for r in records[""]] == [1, 2, 3, 4]
    for stage in STAGES[1:]:
        assert [r["step"] for r in records[stage]] == [1, 2, 3], "a later stage starts its own step count"
    losses = {stage: [r["train/CrossEntropyLoss"] for r in records[stage]] for stage in STAGES}
    assert all(math.isfinite(loss) for stage in STAGES for loss in losses[stage])
    # Stage 1 learned (from about ln 257 = 5.55), and each later stage starts from what the one before learned.
    assert losses[""][-1] < losses[""][0] - 0.5
    assert losses["-midtrain"][0] < losses[""][0] - 0.5
    assert losses["-long-context"][0] < losses[""][0] - 0.5

    if size == "7B":  # the long-context stage as the recipe runs it, with instances shared by 2 ranks (not 8)
        cp = _shrunk_copy(
            f"{name}-long-context",
            tmp_path / "long-context-cp",
            corpus,
            256,
            2,
            3,
            **yarn,
            **{"context_parallel.degree": 2},
        )
        result = run_torchrun(2, cp, load, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        rows = [
            json.loads(line) for line in (tmp_path / "long-context-cp/run/metrics.jsonl").read_text().splitlines()
        ]
        shared = [r["train/CrossEntropyLoss"] for r in rows if "train/CrossEntropyLoss" in r]
        assert shared == pytest.approx(losses["-long-context"], rel=1e-5)
