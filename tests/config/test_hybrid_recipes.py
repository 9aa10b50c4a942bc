"""The OLMo Hybrid recipes (configs/official/OLMo-Hybrid-7B*.yaml): ``--help``, ``--dry_run`` and ``scripts/plan.py``
work on each before any of its data exists (offline), the FLOPs of its Gated DeltaNet layers do not grow with the
sequence, and a shrunk copy (the same layer pattern and options, tiny sizes) trains the three stages on CPU, each
stage from the checkpoint of the one before, as the files' headers tell a user to."""

import json
import math
from pathlib import Path
from typing import Union

import pytest
import torch

from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError, OLMoDataError
from olmo.model import OLMo
from olmo.testing import run_main, run_train, shrunk_copy, write_byte_memmap

OFFICIAL = Path(__file__).resolve().parents[2] / "configs" / "official"
STAGES = ("", "-midtrain", "-long-context")
PATTERN = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

# What --dry_run prints for each recipe (OLMo-core's numbers; the files cite where each comes from). Stage 1 lasts an
# epoch of its data, so its steps need the data.
P = "7,430,870,688 total"
PLANS = {
    "OLMo-Hybrid-7B": (
        P,
        "512 instances x 8192",
        "45.5G per token",
        "0.0003 peak, cosine_with_warmup, 2,000 warmup",
    ),
    "OLMo-Hybrid-7B-midtrain": (
        P,
        "512 instances x 8192",
        "23,842 steps",
        "0.0002071 peak, linear_with_warmup, 0 warmup",
    ),
    "OLMo-Hybrid-7B-long-context": (
        P,
        "64 instances x 65536",
        "23,842 steps",
        "66.7G per token",
        "activation checkpointing whole_layer; fused_loss True",
        "0.0002071 peak, linear_with_warmup, 200 warmup",
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_help_lists_each_recipe_s_layers(name, capsys):
    assert run_main("train.py", OFFICIAL / f"{name}.yaml", "--help") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["model.layer_types"][:3] == ["[linear_attention,", "linear_attention,", "linear_attention,"]
    recurrence = {k: rows[f"model.linear_attention.{k}"][0] for k in ("num_key_heads", "key_head_dim")}
    assert recurrence == {"num_key_heads": "30", "key_head_dim": "96"}
    assert rows["model.max_sequence_length"][0] == ("65536" if name.endswith("long-context") else "8192")
    cfg = TrainConfig.load(OFFICIAL / f"{name}.yaml")
    assert cfg.model.layer_kinds() == PATTERN * 8
    assert cfg.model.layer_windows() == [None] * 32  # OLMo 3's windows fall on no attention layer of the hybrid
    la = cfg.model.linear_attention
    assert (la.num_value_heads, la.value_head_dim, la.conv_kernel_size, la.allow_neg_eigval) == (30, 192, 4, True)
    # RoPE in stages 1 and 2, none from the long context on (DroPE, as OLMo-core's and the release); no context
    # parallelism (see each file's header for what OLMo-core did).
    long_context = name.endswith("long-context")
    assert (cfg.model.rope, cfg.model.nope) == (not long_context, long_context)
    assert cfg.context_parallel.degree == 1


@pytest.mark.parametrize("name", sorted(PLANS))
def test_dry_run_prints_each_recipe_s_plan_before_its_data_exists(name, tmp_path, capsys, offline):
    run = tmp_path / "run"
    with pytest.raises(OLMoDataError, match=r"olmo-data\.org|matches no file"):
        run_main("train.py", OFFICIAL / f"{name}.yaml", "--dry_run", f"--save_folder={run}")
    plan = capsys.readouterr().out
    assert not run.exists(), "--dry_run wrote something"
    for expected in PLANS[name]:
        assert expected in plan, f"{expected!r} is not in the plan:\n{plan}"


def test_the_linear_layers_flops_do_not_grow_with_the_sequence():
    """Of the 7B's FLOPs per token, only its 8 attention layers' term grows with the sequence (12 d_model T each); the
    24 Gated DeltaNet layers add their recurrence, 18 x 30 heads x 96 x 192, at 8,192 tokens as at 65,536."""
    cfg = TrainConfig.load(OFFICIAL / "OLMo-Hybrid-7B-long-context.yaml").model
    with torch.device("meta"):
        model = OLMo(cfg)
    matmul = model.num_active_params(include_embedding=False)  # the output layer included: it is not tied
    for T in (8192, 65536):
        assert model.num_flops_per_token(T) == 6 * matmul + 8 * 12 * cfg.d_model * T + 24 * 18 * 30 * 96 * 192


@pytest.mark.parametrize(("name", "world_size"), [(n, 64 if n.endswith("long-context") else 512) for n in PLANS])
def test_plan_fits_each_recipe_on_h100s(name, world_size, capsys):
    """The configured mesh on the GPUs each recipe is planned for (the header's numbers): it fits an 80 GiB H100."""
    capsys.readouterr()
    args = (f"--world_size={world_size}", "--device=h100", "--json", "--evaluators=[]")
    assert run_main("plan.py", OFFICIAL / f"{name}.yaml", *args) == 0
    (configured,) = [m for m in json.loads(capsys.readouterr().out) if m["configured"]]
    assert configured["fits"] and configured["micro_batch"] == 1
    assert 20 < configured["memory"]["total"] / 2**30 < 75  # GiB: ~61 for stages 1 and 2, ~37 for the long context


def test_the_long_context_recipe_refuses_olmo_core_s_context_parallelism(tmp_path, offline):
    with pytest.raises(OLMoConfigurationError, match=r"context_parallel\.degree=2 with linear_attention layers"):
        run_main(
            "train.py",
            OFFICIAL / "OLMo-Hybrid-7B-long-context.yaml",
            "--dry_run",
            "--context_parallel.degree=2",
            f"--save_folder={tmp_path / 'run'}",
        )
    assert not (tmp_path / "run").exists()


SHRUNK = {
    "model.d_model": 32,
    "model.n_heads": 4,
    "model.n_layers": 4,
    "model.mlp_hidden_size": 128,
    "model.linear_attention.num_key_heads": 4,
    "model.linear_attention.num_value_heads": 4,
    "model.linear_attention.key_head_dim": 8,
    "model.linear_attention.value_head_dim": 16,
    "model.vocab_size": 257,
    "model.embedding_size": 320,
    "model.eos_token_id": 256,
    "model.pad_token_id": 256,
    "model.flash_attention": False,
    "data.num_workers": 0,
    "evaluators": [],
    "wandb": None,
    "compile": None,
    "save_interval_ephemeral": None,
    "no_pre_train_checkpoint": True,
}
"""A few thousand parameters on a byte corpus, in the recipes' kind: three Gated DeltaNet layers then one attention
layer; everything not named here (the layer pattern, the recurrence's kernel and negative eigenvalues, norms, QK-norm,
z-loss, optimizer, schedule shape, spike skipping, activation checkpointing and the fused loss of the long context,
the stage's loading) is the file's."""


def _shrunk_copy(
    name: str, folder: Path, corpus: Path, seq: int, batch: int, steps: Union[int, str], **changes
) -> Path:
    """``configs/official/{name}.yaml`` with :data:`SHRUNK` (:func:`olmo.testing.shrunk_copy`)."""
    return shrunk_copy(OFFICIAL / f"{name}.yaml", folder, corpus, seq, batch, steps, SHRUNK, **changes)


def test_shrunk_recipes_train_their_three_stages(tmp_path):
    """Stage 1 for one epoch, then midtraining and the long-context stage (a longer context), each loading the
    previous checkpoint's model and optimizer with a fresh step count."""
    corpus, epoch = tmp_path / "corpus.npy", tmp_path / "epoch.npy"
    write_byte_memmap(corpus, 30_000, dtype="uint32")
    write_byte_memmap(epoch, 17 * 32, dtype="uint32")  # one epoch: 17 instances of 32 tokens, 4 steps of 4
    learn = {"optimizer.learning_rate": 1e-2, "scheduler.t_warmup": 1, "save_interval": 4}
    first = _shrunk_copy("OLMo-Hybrid-7B", tmp_path / "stage1", epoch, 32, 4, "1ep", **learn)
    midtrain = _shrunk_copy("OLMo-Hybrid-7B-midtrain", tmp_path / "midtrain", corpus, 32, 2, 2)
    # 4x the context (past the delta rule's 64-token chunks), for 8x in the recipe.
    long_context = _shrunk_copy("OLMo-Hybrid-7B-long-context", tmp_path / "long-context", corpus, 128, 2, 2)
    cfg = TrainConfig.load(long_context)
    assert cfg.model.layer_kinds() == PATTERN and cfg.reset_trainer_state and cfg.fused_loss

    records: dict[str, list] = {stage: [] for stage in STAGES}
    assert run_train(first, record=records[""]) == 0
    assert run_train(midtrain, f"--load_path={tmp_path}/stage1/run/step4", record=records["-midtrain"]) == 0
    load = f"--load_path={tmp_path}/midtrain/run/step2"
    assert run_train(long_context, load, record=records["-long-context"]) == 0

    assert [r["step"] for r in records[""]] == [1, 2, 3, 4]
    for stage in STAGES[1:]:
        assert [r["step"] for r in records[stage]] == [1, 2], "a later stage starts its own step count"
    losses = {stage: [r["train/CrossEntropyLoss"] for r in records[stage]] for stage in STAGES}
    assert all(math.isfinite(loss) for stage in STAGES for loss in losses[stage])
    # Stage 1 learned (from about ln 257 = 5.55), and each later stage starts from what the one before learned.
    assert losses[""][-1] < losses[""][0] - 0.5
    assert losses["-midtrain"][0] < losses[""][0] - 0.5
    assert losses["-long-context"][0] < losses[""][0] - 0.5


def test_the_long_context_recipe_is_the_released_model() -> None:
    """The released OLMo-Hybrid-7B's config.json (rebuilt from the published numbers, tests/fixtures/olmo_hybrid_7b)
    imports as the model the long-context recipe trains: the same shape, layer pattern, recurrence and no RoPE."""
    pytest.importorskip("transformers")
    from olmo.hf import model_config_from_hf
    from olmo.hf.files import read_hf_config

    released = model_config_from_hf(read_hf_config(OFFICIAL.parents[1] / "tests" / "fixtures" / "olmo_hybrid_7b"))
    recipe = TrainConfig.load(OFFICIAL / "OLMo-Hybrid-7B-long-context.yaml").model
    fields = (
        "d_model n_heads effective_n_kv_heads n_layers effective_mlp_hidden_size effective_embedding_size "
        "max_sequence_length weight_tying norm_after layer_norm_eps rope nope linear_attention"
    ).split()
    assert {f: getattr(recipe, f) for f in fields} == {f: getattr(released, f) for f in fields}
    assert recipe.layer_kinds() == released.layer_kinds()
