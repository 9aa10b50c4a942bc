"""OLMo's public Python API works for user scripts: ``from olmo import ...``, ``OLMo(config, init_params=...)``,
``DataCollator.from_train_config``, ``build_train_dataloader``, ``olmo.torch_util`` and the schedulers' names."""

import math
import subprocess
import sys

import pytest
import torch

import olmo
from olmo.config import SchedulerConfig, SchedulerType
from olmo.optim import (
    BoltOnWarmupScheduler,
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosLinearEnvelope,
    CosWithWarmup,
    InvSqrtWithWarmup,
    LinearWithWarmup,
    MaxScheduler,
    build_scheduler,
)
from olmo.testing import BYTE_EOS, tiny_config_dict, write_byte_memmap

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "FS_LOCAL_RANK",
    "OLMO_SHARED_FS",
    "SLURM_NTASKS",
    "SLURM_PROCID",
)


@pytest.fixture
def no_launcher(monkeypatch):
    """A process started without torchrun or srun, whatever launched the tests."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def config_without_data(tmp_path, **overrides):
    return olmo.TrainConfig.from_dict(tiny_config_dict(tmp_path, ["unused.npy"], **overrides))


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The tiny config; its data files do not exist."""
    return config_without_data(tmp_path_factory.mktemp("run"))


@pytest.fixture
def train_config(tmp_path):
    tokens = tmp_path / "tokens.npy"
    write_byte_memmap(tokens, 32 * 20)
    return olmo.TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", [str(tokens)]))


def test_an_olmo_style_script_runs(no_launcher, train_config):
    from olmo import OLMo
    from olmo.data import DataCollator, build_train_dataloader
    from olmo.torch_util import get_default_device, move_to_device, seed_all

    cfg = train_config
    seed_all(cfg.seed)
    trained = OLMo(cfg.model)
    rng_before = torch.get_rng_state()
    model = OLMo(cfg.model, init_params=False)
    assert torch.equal(torch.get_rng_state(), rng_before), "init_params=False must draw no random numbers"
    model.load_state_dict(trained.state_dict())

    loader = build_train_dataloader(cfg, world_size=1, rank=0)
    batch = move_to_device(next(iter(loader)), get_default_device())
    assert batch["input_ids"].shape == (cfg.global_train_batch_size, cfg.model.max_sequence_length)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
        assert torch.equal(logits, trained(batch["input_ids"]).logits)
    assert logits.shape == (*batch["input_ids"].shape, cfg.model.embedding_size)

    collate = DataCollator.from_train_config(cfg)
    padded = collate([{"input_ids": [1, 2, 3]}, {"input_ids": torch.tensor([4])}])
    assert padded["input_ids"].tolist() == [[1, 2, 3], [4, BYTE_EOS, BYTE_EOS]]


def test_init_params_false_skips_initialization_positionally_too(config):
    torch.manual_seed(0)
    initialized = olmo.OLMo(config.model, True)
    torch.manual_seed(0)
    skipped = olmo.OLMo(config.model, False)
    skipped.reset_parameters()
    # The same draws happen later: only their timing moved.
    for (name, a), (_, b) in zip(initialized.state_dict().items(), skipped.state_dict().items()):
        assert torch.equal(a, b), name


def test_collator_from_train_config_pads_on_the_configured_side(tmp_path):
    cfg = config_without_data(tmp_path, **{"data.pad_direction": "left", "model.pad_token_id": 7})
    from olmo.data import DataCollator

    batch = DataCollator.from_train_config(cfg)([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert batch["input_ids"].tolist() == [[1, 2], [7, 3]]


def test_dataloader_rank_defaults_come_from_the_launcher(no_launcher, train_config):
    from olmo.data import build_train_dataloader

    for name, value in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_ADDR": "x", "MASTER_PORT": 1}.items():
        no_launcher.setenv(name, str(value))
    loader = build_train_dataloader(train_config, fs_local_rank=0, include_instance_metadata=True)
    assert (loader.dataset.rank, loader.dataset.world_size) == (1, 2)
    batch = next(iter(loader))
    assert len(batch["input_ids"]) == train_config.global_train_batch_size // 2
    assert len(batch["metadata"]) == len(batch["input_ids"])


def test_torch_util_helpers_in_one_process(no_launcher):
    from olmo import torch_util as tu

    tu.seed_all(42)
    first = torch.rand(3)
    tu.seed_all(42)
    assert torch.equal(torch.rand(3), first)
    for bad_seed in (-1, 2**32):
        with pytest.raises(ValueError, match="invalid"):
            tu.seed_all(bad_seed)

    assert not tu.is_distributed()
    assert (tu.get_world_size(), tu.get_global_rank()) == (1, 0)
    assert (tu.get_local_world_size(), tu.get_local_rank()) == (1, 0)
    assert (tu.get_node_rank(), tu.get_fs_local_rank()) == (0, 0)
    tu.barrier()
    assert tu.synchronize_value(3, torch.device("cpu")) == 3
    assert tu.synchronize_flag(True, torch.device("cpu")) is True
    tu.gc_cuda()
    if not torch.cuda.is_available():
        assert tu.peak_gpu_memory() is None
        assert tu.get_default_device() == torch.device("cpu")

    moved = tu.move_to_device({"a": [torch.ones(1), (torch.zeros(2), "text")], "n": 3}, torch.device("meta"))
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta
    assert isinstance(moved["a"][1], tuple) and moved["a"][1][1] == "text" and moved["n"] == 3

    x = torch.tensor([-math.inf, 1.0, math.inf])
    tu.ensure_finite_(x)
    assert x.tolist() == [torch.finfo(torch.float32).min, 1.0, math.inf]
    tu.ensure_finite_(x, check_neg_inf=False, check_pos_inf=True)
    assert x[2].item() == torch.finfo(torch.float32).max

    # Two instances packed with documents of lengths 3 + 5 and 8 (zero-padded).
    cu_seqlens = tu.get_cumulative_document_lengths(torch.tensor([[3, 5], [8, 0]]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 8, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_util_gpu_helpers():
    from olmo import torch_util as tu

    x = tu.move_to_device({"x": torch.ones(1000, 1000)}, torch.device("cuda"))["x"]  # 4 MB
    assert x.is_cuda and tu.get_default_device() == torch.device("cuda")
    peak = tu.peak_gpu_memory()
    assert peak is not None and peak >= 4.0
    del x
    tu.gc_cuda()
    tu.peak_gpu_memory(reset=True)
    assert tu.peak_gpu_memory() <= peak - 4.0


def test_torch_util_ranks_follow_the_launcher_variables(no_launcher):
    from olmo import torch_util as tu

    launcher = {
        "RANK": 3,
        "WORLD_SIZE": 4,
        "LOCAL_RANK": 1,
        "LOCAL_WORLD_SIZE": 2,
        "MASTER_ADDR": "x",
        "MASTER_PORT": 1,
    }
    for name, value in launcher.items():
        no_launcher.setenv(name, str(value))
    assert (tu.get_local_rank(), tu.get_local_world_size(), tu.get_node_rank()) == (1, 2, 1)
    assert tu.get_fs_local_rank() == 1
    no_launcher.setenv("OLMO_SHARED_FS", "1")
    assert tu.get_fs_local_rank() == tu.get_global_rank() == 0  # no process group: rank 0, as in OLMo
    no_launcher.setenv("FS_LOCAL_RANK", "5")
    no_launcher.setenv("NODE_RANK", "7")
    assert (tu.get_fs_local_rank(), tu.get_node_rank()) == (5, 7)


def original_style_schedulers():
    """Each schedule as OLMo's ``build_scheduler`` constructs it, with OLMo's class and keyword names."""
    common = dict(grad_clip_warmup_steps=5, grad_clip_warmup_factor=3.0, warmup_min_lr=None)
    decaying = dict(warmup_steps=10, alpha_f=0.1, t_max=None, **common)
    return {
        SchedulerType.cosine_with_warmup: CosWithWarmup(**decaying),
        SchedulerType.linear_with_warmup: LinearWithWarmup(**decaying),
        SchedulerType.inverse_sqrt_with_warmup: InvSqrtWithWarmup(warmup_steps=10, **common),
        SchedulerType.max_scheduler: MaxScheduler(
            sched1=CosWithWarmup(**decaying), sched2=InvSqrtWithWarmup(warmup_steps=10, **common), **common
        ),
        SchedulerType.constant: ConstantScheduler(**common),
        SchedulerType.cosine_linear_envelope: CosLinearEnvelope(**decaying),
        SchedulerType.constant_with_warmup: ConstantWithWarmupScheduler(warmup_steps=10, **common),
    }


@pytest.mark.parametrize("name", [n for n in SchedulerType if n != SchedulerType.wsd])  # wsd is not OLMo's
def test_schedulers_built_with_olmo_names_equal_ours(name, config):
    sched_cfg = SchedulerConfig(
        name=name, t_warmup=10, alpha_f=0.1, grad_clip_warmup_steps=5, grad_clip_warmup_factor=3.0
    )
    ours = build_scheduler(sched_cfg)
    theirs = original_style_schedulers()[name]
    lr, max_steps = 2e-3, 110
    for step in range(0, 2 * max_steps, 3):
        assert theirs.get_lr(initial_lr=lr, step=step, max_steps=max_steps) == ours.get_lr(lr, step, max_steps)
        assert theirs.get_max_grad_norm(1.0, step, max_steps) == ours.get_max_grad_norm(1.0, step)
        assert theirs.get_max_grad_norm_ratio(0.5, step, max_steps) == ours.get_max_grad_norm(0.5, step)
    # OLMo's build_scheduler(train_config, sched_cfg=None) signature.
    assert build_scheduler(config, sched_cfg) == ours
    assert build_scheduler(config) == build_scheduler(config.scheduler)


def test_bolt_on_warmup_wrap():
    inner = CosWithWarmup(warmup_steps=10, grad_clip_warmup_steps=5, grad_clip_warmup_factor=3.0)
    bolt = BoltOnWarmupScheduler.wrap(inner, 40, 60)
    assert bolt == BoltOnWarmupScheduler(inner, 40, 60)
    target = inner.get_lr(1.0, 60, 100)
    ramp = [bolt.get_lr(1.0, step, 100) for step in (39, 40, 50, 60, 80)]
    assert ramp == [0.0, 0.0, target / 2, target, inner.get_lr(1.0, 80, 100)]
    assert bolt.get_max_grad_norm(1.0, 5, 100) == 3.0  # the inner schedule's grad-clip warmup


def test_importing_olmo_config_does_not_import_torch():
    check = (
        "import sys, olmo.config, olmo.util.json_lines, olmo\n"
        "assert olmo.TrainConfig is olmo.config.TrainConfig and olmo.Tokenizer\n"
        "assert 'torch' not in sys.modules, 'olmo imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_package_exports_what_olmo_exports():
    assert {"OLMo", "TrainConfig", "ModelConfig", "Tokenizer"} <= set(olmo.__all__) <= set(dir(olmo))
    aliases = {"LayerNormBase": "LayerNorm", "OLMoSequentialBlock": "OLMoBlock"}  # OLMo's names for ours
    for name in olmo.__all__:
        assert getattr(olmo, name).__name__ == aliases.get(name, name)
    # The ten names of OLMo 0.6's olmo/__init__.py this package lacked (issue 28), and its smoke check.
    for name in ("CheckpointType", "RMSLayerNorm", "RotaryEmbedding", "Activation", "GELU", "ReLU", "SwiGLU"):
        assert name in olmo.__all__
    olmo.check_install()
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        olmo.NoSuchName  # noqa: B018
