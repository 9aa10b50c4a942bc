"""Issue 50 (robustness round 4), scripts/plan.py and --dry_run: a plan runs the layout checks of a launch
(``olmo.config.validation.layout_problems``) and refuses what ``scripts/train.py`` refuses, in one paragraph naming
the key; a dry run started as one process checks the layout for the launch it plans; the plan's table shows units
and no unrelated warning, and answers refusals without importing torch; the CPU peak's source says how it was
measured."""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from olmo.config import TrainConfig
from olmo.config.layout_checks import MAX_WORLD_SIZE, layout_problems
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoConfigurationError
from olmo.ladder.estimates import _cpu_peak_source, resolve_device
from olmo.ladder.mesh_plan import mesh_variants, plan_meshes
from olmo.model.flops import PeakFlops
from olmo.testing import run_main, tiny_config_dict, write_byte_corpus, write_config

REPO = Path(__file__).resolve().parents[2]
OFFICIAL = REPO / "configs" / "official"
MOE = {
    "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16},
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "max_duration": 8,
    "device_train_microbatch_size": 2,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path, corpus, **overrides) -> Path:
    return write_config(tmp_path / "config.yaml", tiny_config_dict(tmp_path / "run", corpus, **overrides))


def _refused_by_plan(config, world_size, *overrides) -> str:
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("plan.py", config, f"--world_size={world_size}", "--device=h100", *overrides)
    assert type(e.value) is OLMoConfigurationError
    return str(e.value)


# (overrides, world size, a phrase of the refusal): the examples, then variants of each.
REFUSED = [
    pytest.param(
        ["--tensor_parallel.degree=3"], 3, "tensor_parallel.degree=3 must divide model.n_heads", id="tp_heads"
    ),
    pytest.param(
        ["--tensor_parallel.degree=2"], 3, "must divide the number of processes launched (3)", id="tp_world"
    ),
    pytest.param(["--context_parallel.degree=4"], 2, "context_parallel.degree=4 must divide", id="cp_over_world"),
    pytest.param(["--expert_parallel.degree=2"], 2, "expert_parallel.degree=2 needs model.moe", id="ep_dense"),
    pytest.param([], 64, "global_train_batch_size=8 must be divisible", id="batch_below_ranks"),
    pytest.param(["--global_train_batch_size=0"], 1, "global_train_batch_size", id="batch_zero"),
    pytest.param(["--device_train_microbatch_size=0"], 1, "device_train_microbatch_size", id="micro_zero"),
    pytest.param(["--global_train_batch_size=-8"], 2, "global_train_batch_size", id="batch_negative"),
    pytest.param(["--context_parallel.degree=3"], 3, "2 x 3 = 6 equal chunks", id="cp_sequence"),
    pytest.param(
        ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.hybrid_sharding_num_model_replicas=3"],
        4,
        "hybrid_sharding_num_model_replicas=3 must divide",
        id="hybrid_replicas",
    ),
    pytest.param(
        ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.hybrid_sharding_num_model_replicas=-2"],
        4,
        "hybrid_sharding_num_model_replicas=-2 must be a whole number",
        id="hybrid_replicas_negative",
    ),
    pytest.param(["--distributed_strategy=single"], 2, "distributed_strategy=single", id="single_on_two"),
    pytest.param(
        ["--tensor_parallel.degree=0"], 2, "tensor_parallel.degree=0 must be a whole number", id="tp_zero"
    ),
]


@pytest.mark.parametrize("overrides, world_size, phrase", REFUSED)
def test_the_plan_refuses_what_a_launch_refuses(tmp_path, corpus, overrides, world_size, phrase):
    config = _config(tmp_path, corpus)
    message = _refused_by_plan(config, world_size, *overrides)
    assert phrase in message and f"--world_size={world_size}" in message, message
    # The launch of that many processes refuses it with the same sentence.
    cfg = TrainConfig.load(config, [o[2:] for o in overrides])
    with pytest.raises(OLMoConfigurationError) as launch:
        cfg.validate(world_size)
    refused = [line for line in message.splitlines() if line.startswith("  - ")]
    assert refused and all(line in str(launch.value) for line in refused), (message, str(launch.value))


def test_moe_layouts_the_plan_refuses_as_a_launch_does(tmp_path, corpus):
    config = _config(tmp_path, corpus, **MOE)
    assert "must divide model.moe.num_experts=4" in _refused_by_plan(config, 3, "--expert_parallel.degree=3")
    assert "expert_parallel.degree=2 must divide the number of processes launched (3)" in _refused_by_plan(
        config, 3, "--expert_parallel.degree=2", "--global_train_batch_size=6"
    )
    assert "tensor_parallel.degree=2 with a mixture of experts" in _refused_by_plan(
        config, 2, "--tensor_parallel.degree=2"
    )


@pytest.mark.parametrize("world_size", ["0", "-3", str(MAX_WORLD_SIZE + 1), str(10**12)])
def test_absurd_world_sizes_are_usage_errors(world_size, tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as e:
        run_main("plan.py", _config(tmp_path, corpus), f"--world_size={world_size}", "--device=h100")
    assert e.value.code == 2 and f"--world_size={world_size} must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config, world_size, overrides",
    [
        (OFFICIAL / "OLMoE-1B-7B.yaml", 16, []),
        (OFFICIAL / "OLMo-7B.yaml", 64, []),
        (OFFICIAL / "OLMo-3-7B-long-context.yaml", 16, []),
        (OFFICIAL / "OLMo-1B.yaml", 16, ["fsdp.hybrid_sharding_num_model_replicas=2"]),
    ],
)
def test_every_mesh_offered_is_one_a_launch_accepts(config, world_size, overrides):
    """The other meshes a plan lists (FSDP layouts, EP, CP and TP degrees) are each checked as a launch would: the
    config with the mesh's parallel sections has no layout problem."""
    cfg = TrainConfig.load(config, ["evaluators=[]", *overrides])
    variants = dict(mesh_variants(RunShape.from_train_config(cfg), world_size))
    offered = [plan.name for plan in plan_meshes(cfg, world_size, resolve_device("H100"))]
    assert len(offered) > 1
    for name in offered:
        mesh = variants[name]
        sections = {
            k: getattr(mesh, k) for k in ("fsdp", "expert_parallel", "context_parallel", "tensor_parallel")
        }
        assert layout_problems(dataclasses.replace(cfg, **sections), world_size) == [], name


def test_the_table_shows_gib_and_no_flash_attn_warning(capsys, caplog):
    caplog.set_level(logging.WARNING)
    config = OFFICIAL / "OLMo-300M.yaml"  # flash_attention: true, and flash-attn is not installed here
    assert run_main("plan.py", config, "--world_size=8", "--device=h100", "--evaluators=[]") == 0
    out = capsys.readouterr().out
    assert "8 x H100 (80 GiB each" in out and "memory per rank in GiB" in out, out
    assert "flash" not in caplog.text.lower(), caplog.text


def test_refusals_and_help_answer_without_importing_torch(tmp_path, corpus):
    config = _config(tmp_path, corpus)
    code = (
        "import sys\n"
        "from olmo.cli.plan import main\n"
        "from olmo.exceptions import OLMoConfigurationError\n"
        f"try:\n    main([{str(config)!r}, '--world_size=64', '--device=h100'])\n"
        "except OLMoConfigurationError as e:\n    print('refused' if 'divisible' in str(e) else e)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.stdout.split() == ["refused", "False"], result.stdout + result.stderr


def test_a_dry_run_as_one_process_accepts_expert_parallelism_and_says_what_it_needs(tmp_path, corpus, capsys):
    config = _config(tmp_path, corpus, **MOE)
    assert run_main("train.py", config, "--dry_run", "--expert_parallel.degree=2") == 0
    plan = capsys.readouterr().out
    assert "under torchrun: expert_parallel.degree=2, on a multiple of 2 processes" in plan, plan
    assert "over 1 rank" not in plan and "in this one process (nothing is sharded)" in plan, plan
    assert not (tmp_path / "run").exists()


def test_a_dry_run_checks_the_layout_for_the_launch_it_plans(tmp_path, corpus):
    """One process: the degrees against the model and the fewest processes they need; under torchrun: its size,
    as scripts/plan.py --world_size does."""
    cfg = TrainConfig.load(_config(tmp_path, corpus, **MOE), ["dry_run=true", "expert_parallel.degree=4"])
    cfg.validate(1)  # 4 ranks x micro-batch 2 divide the batch of 8
    small = TrainConfig.load(
        _config(tmp_path, corpus, **MOE), ["dry_run=true", "expert_parallel.degree=4", "global_train_batch_size=4"]
    )
    with pytest.raises(OLMoConfigurationError, match="at least 4: the degrees need 4"):
        small.validate(1)
    with pytest.raises(
        OLMoConfigurationError,
        match=r"expert_parallel.degree=4 must divide the number of processes launched \(2\)",
    ):
        cfg.validate(2)  # a dry run under torchrun of 2 processes: what that launch would do
    with pytest.raises(OLMoConfigurationError, match="must divide model.moe.num_experts"):
        TrainConfig.load(_config(tmp_path, corpus, **MOE), ["dry_run=true", "expert_parallel.degree=3"]).validate(
            1
        )
    dense = TrainConfig.load(_config(tmp_path, corpus), ["dry_run=true", "tensor_parallel.degree=3"])
    with pytest.raises(OLMoConfigurationError, match="must divide model.n_heads"):
        dense.validate(1)


def _peak(tmp_path, content) -> str:
    path = tmp_path / "cpu_peak_flops.json"
    path.write_text(content)
    return _cpu_peak_source(PeakFlops(1e11, "the fp32 matmul rate measured on this CPU", "fix", path, "cpu"))


def test_the_cpu_peak_says_how_and_when_it_was_measured(tmp_path):
    busy = {"cpu": {"peak_flops": 1e11, "cpu_share": 0.5, "idle": False, "measured": "2026-01-02T03:04:05"}}
    text = _peak(tmp_path, json.dumps(busy))
    assert "while other work was running (50% of its threads' time)" in text and "2026-01-02" in text, text
    assert "speed_monitor.gpu_flops_available" in text
    idle = {"cpu": {"peak_flops": 1e11, "cpu_share": 0.97, "idle": True}}
    assert _peak(tmp_path, json.dumps(idle)).endswith("on an idle machine")
    low_share = {"cpu": {"peak_flops": 1e11, "cpu_share": 0.4, "idle": True}}
    assert "provisional" in _peak(tmp_path, json.dumps(low_share))
    for damaged in ("{not json", "[1, 2]", json.dumps({"cpu": "x"}), json.dumps({"cpu": {"cpu_share": "nan?"}})):
        assert _peak(tmp_path, damaged).endswith("the best of a few 1-2k fp32 matmuls"), damaged
