"""What only a GPU can show: bf16 autocast with the fused loss, the SDPA flash kernel on our shapes, TF32,
and a training step that never waits for the GPU between metric collections. Skipped without CUDA."""

import subprocess
import sys

import pytest
import torch

from olmo.config import TrainConfig
from olmo.data import build_train_dataloader
from olmo.distributed import ParallelizeOptions, ParallelLayout, build_model, init_distributed
from olmo.optim import build_optimizer, build_scheduler
from olmo.testing import tiny_config_dict, write_byte_memmap
from olmo.train import Trainer
from olmo.train.build_module import build_train_module
from olmo.util.rng import seed_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "a.npy"
    write_byte_memmap(path, 60_000)
    return [str(path)]


def _trainer(tmp_path, corpus, **overrides):
    settings = {"precision": "amp_bf16", "model.d_model": 128, "model.n_heads": 2, **overrides}
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, corpus, **settings))
    env = init_distributed()
    seed_all(cfg.seed)
    loader = build_train_dataloader(cfg, world_size=1, rank=0, work_dir=tmp_path)
    model = build_model(
        cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg, training=True)
    )
    optimizer = build_optimizer(cfg.optimizer, model, skip_steps=cfg.stability.skip_spikes.enabled)
    trainer = Trainer(
        cfg, env, build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler)), loader
    )
    return trainer, iter(loader)


def _train(trainer, batches, steps):
    records = []
    for _ in range(steps):
        trainer.state.global_step += 1
        records.append(trainer.train_step(next(batches)))
    trainer.collect_metrics()
    return [r.values["train/CrossEntropyLoss"] for r in records]


def test_bf16_training_with_the_fused_loss_follows_the_plain_loss(tmp_path, corpus):
    losses = {}
    for fused in (False, True):
        trainer, batches = _trainer(tmp_path / str(fused), corpus, fused_loss=fused)
        losses[fused] = _train(trainer, batches, 8)
    assert losses[True][-1] < losses[True][0] - 0.5, losses
    for plain, fused in zip(losses[False], losses[True]):
        assert fused == pytest.approx(plain, rel=2e-2)


def _float8_skip_reason(recipe: str):
    from olmo.distributed.float8 import MIN_CAPABILITY

    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY[recipe]:
        return f"float8 {recipe} needs compute capability {MIN_CAPABILITY[recipe]}, this GPU has {capability}"
    return None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_training_follows_bf16(tmp_path, corpus, recipe):
    """On float8 tensor cores (not emulated), compiled: the converted layers train and the loss follows bf16's
    within the emulated tests' tolerance (tests/train/test_float8.py)."""
    reason = _float8_skip_reason(recipe)
    if reason is not None:
        pytest.skip(reason)
    losses = {}
    for name, float8 in (("bf16", None), ("float8", {"enabled": True, "recipe": recipe, "min_features": 16})):
        extra = {"model.float8": float8} if float8 else {}
        trainer, batches = _trainer(tmp_path / name, corpus, compile={"fullgraph": True}, **extra)
        kinds = {type(m).__name__ for m in trainer.train_module.model.modules()}
        assert ("Float8Linear" in kinds) == (float8 is not None)
        losses[name] = _train(trainer, batches, 8)
    assert losses["float8"][-1] < losses["float8"][0] - 0.5, losses
    for plain, low in zip(losses["bf16"], losses["float8"]):
        assert low == pytest.approx(plain, rel=5e-2)


def test_float8_weights_all_gathered_over_nccl_checkpoint_and_load_back(tmp_path):
    """FSDP2 over NCCL (one rank) with weights all-gathered in float8: olmo/testing/float8_fsdp.py on the GPU."""
    reason = _float8_skip_reason("tensorwise")
    if reason is not None:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "olmo.testing.float8_fsdp", str(tmp_path / "store"), str(tmp_path / "ckpt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "checkpoint ok" in result.stdout, result.stderr[-3000:]


def _steps_without_host_sync(trainer, batches, steps: int) -> list:
    """Train ``steps`` steps under ``set_sync_debug_mode("error")`` (a host sync raises), then collect; return
    the steps' records."""
    ready = [next(batches) for _ in range(steps)]
    records = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in ready:
            trainer.state.global_step += 1
            records.append(trainer.train_step(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    trainer.collect_metrics()
    return records


def test_no_host_sync_between_metric_collections(tmp_path, corpus):
    trainer, batches = _trainer(tmp_path, corpus, fused_loss=True, metrics_collect_interval=100)
    assert trainer.train_loader.pin_memory
    _train(trainer, batches, 2)  # optimizer state and caches are created in the first steps
    _steps_without_host_sync(trainer, batches, 3)


def test_training_step_runs_on_the_sdpa_flash_kernel(tmp_path, corpus):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trainer, batches = _trainer(tmp_path, corpus)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if our shapes or dtypes do not qualify
        losses = _train(trainer, batches, 2)
    assert all(loss == loss for loss in losses)


def test_fp32_matmuls_may_use_tf32_unless_told_otherwise(tmp_path, corpus):
    _trainer(tmp_path / "default", corpus)
    assert torch.get_float32_matmul_precision() == "high"
    _trainer(tmp_path / "strict", corpus, float32_matmul_precision="highest")
    assert torch.get_float32_matmul_precision() == "highest"
    torch.set_float32_matmul_precision("high")


def test_per_source_losses_add_no_host_sync(tmp_path):
    """A mixture's per-source losses (``train/{source}/CrossEntropyLoss``) are summed on the device and only read at
    metric collection, like the overall loss: still no host synchronization between collections."""
    for name, skip in (("web", 0), ("code", 300_000)):
        write_byte_memmap(tmp_path / f"{name}.npy", 30_000, skip_bytes=skip)
    mixture = {
        "seed": 3,
        "sources": [
            {"name": "web", "paths": [str(tmp_path / "web.npy")], "ratio": 0.7, "max_repetition": 4.0},
            {"name": "code", "paths": [str(tmp_path / "code.npy")], "ratio": 0.3, "max_repetition": 4.0},
        ],
    }
    for fused in (False, True):
        trainer, batches = _trainer(
            tmp_path / str(fused),
            [],
            fused_loss=fused,
            metrics_collect_interval=100,
            **{"data.paths": None, "data.mixture": mixture},
        )
        trainer.train_module.enter_stage(trainer.stage_plan.at(1), at_boundary=True)
        _train(trainer, batches, 2)
        records = _steps_without_host_sync(trainer, batches, 3)
        per_source = {k: v for k, v in records[-1].values.items() if k.count("/") == 2}
        assert set(per_source) == {"train/web/CrossEntropyLoss", "train/code/CrossEntropyLoss"}, per_source
        assert all(0 < v < 20 for v in per_source.values()), per_source


def test_spike_skipping_adds_no_host_sync(tmp_path, corpus):
    """The skip decision is made on the device (stability.skip_spikes): a step with the detector armed and the
    skip-step AdamW runs without a host synchronization, and a skipped step leaves the weights as they were."""
    from olmo.optim.skip_step import SkipStepAdamW

    settings = {
        "stability.skip_spikes.enabled": True,
        "stability.skip_spikes.warmup_steps": 0,
        "stability.skip_spikes.window": 8,
    }
    trainer, batches = _trainer(tmp_path, corpus, metrics_collect_interval=100, **settings)
    assert isinstance(trainer.optimizer, SkipStepAdamW)
    _train(trainer, batches, 10)  # the window fills (8 steps) and the detector is armed
    _steps_without_host_sync(trainer, batches, 3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.optimizer.step_factor = torch.zeros((), device="cuda")
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    trainer.optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_windowed_attention_is_the_same_on_flash_attn_and_the_sdpa_mask(documents):
    """OLMo 3's windows on the GPU: flash-attn's ``window_size`` (plain and varlen kernels, where the package is
    installed) and SDPA with the window folded into the mask give the same bf16 logits."""
    pytest.importorskip("flash_attn")
    from olmo.config import SlidingWindowConfig
    from olmo.model import OLMo
    from olmo.testing import tiny_model_config

    torch.manual_seed(0)
    windows = SlidingWindowConfig(pattern=[16, 16, 16, -1])
    cfg = tiny_model_config(d_model=256, n_heads=4, n_layers=4, max_sequence_length=128, sliding_window=windows)
    sdpa = OLMo(cfg).cuda().eval()
    flash = OLMo(tiny_model_config(**{**vars(cfg), "flash_attention": True})).cuda().eval()
    flash.load_state_dict(sdpa.state_dict())
    ids = torch.randint(1, 100, (2, 128), device="cuda")
    doc_lens = torch.tensor([[50, 78], [128, 0]], device="cuda") if documents else None
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = sdpa(ids, doc_lens=doc_lens).logits.float()
        actual = flash(ids, doc_lens=doc_lens).logits.float()
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


def test_the_whole_loop_syncs_only_to_collect_metrics(tmp_path, corpus):
    """``Trainer.fit`` with every built-in callback (watchdog, stragglers, spike detector, throughput, metrics, stop
    agreement, checkpointer): a step between metric collections, with its callbacks, never waits for the GPU. A
    callback of our own, called last, arms ``set_sync_debug_mode("error")`` for such steps."""
    from olmo.train.callback import Callback

    interval, steps = 4, 11

    class NoSyncBetweenCollections(Callback):
        def __init__(self):
            self.checked = []

        def pre_step(self, ctx):
            step = ctx.step + 1
            if step > 2 and step % interval != 0 and step < steps:  # the first steps create optimizer state
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                self.checked.append(step)

        def post_step(self, ctx):
            torch.cuda.set_sync_debug_mode("default")

    settings = {
        "metrics_collect_interval": interval,
        "console_log_interval": interval,
        "max_duration": steps,
        "save_interval_unsharded": None,
        "stability.skip_spikes.enabled": True,
        "stability.skip_spikes.warmup_steps": 0,
        "stability.skip_spikes.window": 4,
    }
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, corpus, precision="amp_bf16", **settings))
    env = init_distributed()
    seed_all(cfg.seed)
    loader = build_train_dataloader(cfg, world_size=1, rank=0, work_dir=tmp_path)
    model = build_model(
        cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg, training=True)
    )
    optimizer = build_optimizer(cfg.optimizer, model, skip_steps=True)
    module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler))
    check = NoSyncBetweenCollections()
    try:
        assert Trainer(cfg, env, module, loader, callbacks=[check]).fit() == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert check.checked == [3, 5, 6, 7, 9, 10]


def test_windows_without_flash_attn_warn_once_on_a_gpu(caplog):
    """Without flash-attn, and with model.attention_backend=sdpa, a window is an SDPA mask on the GPU, 30-44 % slower
    than full attention (RESEARCH_LOG): building such a model says so, once, with the fix (null: FlexAttention)."""
    import importlib.util
    import logging

    import olmo.model.attention_mixer as mixer
    from olmo.config import SlidingWindowConfig
    from olmo.model import OLMo
    from olmo.testing import tiny_model_config

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: the window goes to its kernel")
    mixer._warn_once.cache_clear()
    windows = SlidingWindowConfig(pattern=[16, 16, 16, -1])
    with caplog.at_level(logging.WARNING):
        OLMo(
            tiny_model_config(
                n_layers=4, max_sequence_length=128, sliding_window=windows, attention_backend="sdpa"
            )
        )
        OLMo(tiny_model_config(n_layers=4, max_sequence_length=128))  # no windows: nothing to say
        OLMo(tiny_model_config(n_layers=4, max_sequence_length=128, sliding_window=windows))  # FlexAttention
    warnings = [
        r.getMessage() for r in caplog.records if "model.sliding_window without flash-attn" in r.getMessage()
    ]
    assert len(warnings) == 1 and "pip install -e '.[flash]'" in warnings[0]


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_flex_attention_trains_as_the_sdpa_mask(documents):
    """FlexAttention (compiled, block-sparse) against SDPA with the window and documents folded into the mask, bf16:
    the same logits and the same gradients (issue 55: its backward exists on a GPU only)."""
    from olmo.config import SlidingWindowConfig
    from olmo.model import OLMo
    from olmo.testing import tiny_model_config

    torch.manual_seed(0)
    windows = SlidingWindowConfig(pattern=[128, 128, 128, -1])
    base = dict(d_model=256, n_heads=4, n_kv_heads=2, n_layers=4, max_sequence_length=1024, sliding_window=windows)
    sdpa = OLMo(tiny_model_config(**base, attention_backend="sdpa")).cuda()
    flex = OLMo(tiny_model_config(**base, attention_backend="flex")).cuda()
    flex.load_state_dict(sdpa.state_dict())
    ids = torch.randint(1, 100, (2, 1024), device="cuda")
    doc_lens = torch.tensor([[300, 724], [1024, 0]], device="cuda") if documents else None
    results = []
    for model in (sdpa, flex):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, doc_lens=doc_lens).logits.float()
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-2, atol=2e-2)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=5e-2, atol=5e-3, msg=name)


def test_the_expert_layer_never_waits_for_the_gpu_and_compiles_to_its_eager_values():
    """OLMoE's layer in bf16 (issue 55): routing, the permutation both ways (gathers), the grouped multiplies and
    the auxiliary losses, forward and backward, with CUDA's sync debug mode raising on any host synchronization;
    then compiled (fullgraph), the same values and gradients as eager within bf16 rounding."""
    from olmo.model.compile_guards import install_compile_guards
    from olmo.model.moe import MoEFeedForward
    from olmo.testing import forward_backward

    torch.manual_seed(0)
    layer = MoEFeedForward(256, 16, 4, 128, device="cuda", lb_weight=0.01, z_weight=0.001).to(torch.bfloat16)
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager, expected = forward_backward(layer, x)  # also the warm-up: lazy CUDA initialisation may synchronize once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, again = forward_backward(layer, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for grad, first in zip(again, expected):
        torch.testing.assert_close(grad, first)  # the same pass again
    install_compile_guards()
    compiled, grads = forward_backward(torch.compile(layer, fullgraph=True), x, list(layer.parameters()))
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-3)
    for grad, eager_grad in zip(grads, expected):
        torch.testing.assert_close(grad, eager_grad, rtol=5e-2, atol=5e-3)
