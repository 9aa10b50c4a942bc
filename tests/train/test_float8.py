"""Float8 training (``model.float8``) on the CPU through torchao's emulation: which layers are converted, training
that follows fp32, the refusal where float8 cannot run, and checkpoints that float8 and plain runs exchange.

The tolerance of the emulated loss (every step within 5 % of fp32's, the last ten within 1.5 % on average) is
justified in RESEARCH_LOG ("Float8 training", 2026-11-28): e4m3's 3 mantissa bits round each operand by up to
2^-4 relative; measured over 40 steps of this model, at most 3.2 % at one step and 0.4-0.6 % over the last ten.
"""

import subprocess
import sys

import pytest
import torch

from olmo.config import Float8Config, MoEConfig, TrainConfig
from olmo.distributed.float8 import Float8Plan, convert_float8, float8_device_problem, float8_plan
from olmo.distributed.parallelize import ParallelizeOptions, model_config_fingerprint
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo
from olmo.testing import (
    metric_by_step,
    run_main,
    run_train,
    tiny_config_dict,
    tiny_model_config,
    write_byte_corpus,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each

EMULATED = {"enabled": True, "emulate": True, "min_features": 16}
BLOCK_LINEARS = ("att_proj", "attn_out", "ff_proj", "ff_out")


def _meta_model(**overrides):
    with torch.device("meta"):
        return OLMo(tiny_model_config(**{"d_model": 64, "weight_tying": False, **overrides}))


def test_plan_converts_the_blocks_linears_and_says_why_it_keeps_the_rest():
    plan = float8_plan(_meta_model(), Float8Config(**EMULATED))
    assert set(plan.converted) == {f"transformer.blocks.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS}
    assert plan.kept == {"transformer.ff_out": "the output layer (its product runs in the loss)"}
    assert plan.unused_patterns == ()
    # The default width threshold keeps this small model's layers, each with its reason.
    default = float8_plan(_meta_model(), Float8Config(enabled=True))
    assert default.converted == ()
    assert default.kept["transformer.blocks.0.att_proj"] == "narrower than model.float8.min_features=1024"
    # Skip patterns keep what they match and report what they do not.
    skipped = float8_plan(_meta_model(), Float8Config(**EMULATED, skip=["transformer.blocks.0.*", "nope.*"]))
    assert set(skipped.converted) == {f"transformer.blocks.1.{n}" for n in BLOCK_LINEARS}
    assert skipped.kept["transformer.blocks.0.ff_proj"] == "model.float8.skip (transformer.blocks.0.*)"
    assert skipped.unused_patterns == ("nope.*",)
    assert "4 linear layer(s) in float8" in skipped.describe()
    # A module's name keeps the layers inside it.
    block = float8_plan(_meta_model(), Float8Config(**EMULATED, skip=["transformer.blocks.1"]))
    assert set(block.converted) == {f"transformer.blocks.0.{n}" for n in BLOCK_LINEARS}
    assert block.kept["transformer.blocks.1.attn_out"] == "model.float8.skip (transformer.blocks.1)"


def test_plan_keeps_widths_float8_cannot_multiply_and_the_expert_router():
    odd = float8_plan(_meta_model(d_model=40, n_heads=4), Float8Config(**EMULATED))
    assert odd.converted == ()  # 40 is not a multiple of 16
    assert set(odd.kept.values()) >= {"widths not multiples of 16"}
    # The router's product is taken from its weight, so it stays even where its width would do (64 experts).
    moe = float8_plan(_meta_model(moe=MoEConfig(num_experts=64, top_k=2)), Float8Config(**EMULATED))
    assert moe.kept["transformer.blocks.0.moe.router"].startswith("the expert router")
    assert "transformer.blocks.0.att_proj" in moe.converted


def test_conversion_keeps_the_parameters_and_their_names():
    cfg = tiny_model_config(d_model=64, weight_tying=False)
    torch.manual_seed(0)
    plain = OLMo(cfg)
    converted = OLMo(cfg)
    converted.load_state_dict(plain.state_dict())
    plan = convert_float8(converted, Float8Config(**EMULATED), fsdp=False)
    assert isinstance(plan, Float8Plan)
    kinds = {name: type(m).__name__ for name, m in converted.named_modules()}
    assert all(kinds[name] == "Float8Linear" for name in plan.converted)
    assert kinds["transformer.ff_out"] == "OutputLayer"
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert type(converted.state_dict()[key]) is torch.Tensor
        torch.testing.assert_close(converted.state_dict()[key], value, rtol=0, atol=0)
    tokens = torch.randint(0, 100, (2, 16))
    a, b = plain(tokens).logits, converted(tokens).logits
    assert not torch.equal(a, b)  # float8 rounding is applied ...
    torch.testing.assert_close(b, a, rtol=0.1, atol=0.1)  # ... and stays close


def test_float8_is_refused_where_it_cannot_run_in_one_paragraph():
    problem = float8_device_problem(Float8Config(enabled=True), torch.device("cpu"))
    assert problem is not None and "\n" not in problem
    for needed in ("model.float8.enabled=true", "compute capability 8.9", "--model.float8.emulate=true"):
        assert needed in problem
    rowwise = float8_device_problem(Float8Config(enabled=True, recipe="rowwise"), torch.device("cpu"))
    assert rowwise is not None and "compute capability 9.0" in rowwise
    assert float8_device_problem(Float8Config(enabled=True, emulate=True), torch.device("cpu")) is None
    assert float8_device_problem(Float8Config(enabled=False), torch.device("cpu")) is None


def test_bad_float8_values_are_reported_with_their_keys(tmp_path):
    corpus = write_byte_corpus(tmp_path / "data")
    bad = {"enabled": True, "recipe": "mxfp8", "min_features": 0, "skip": [""]}
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", corpus, **{"model.float8": bad}))
    with pytest.raises(OLMoConfigurationError) as e:
        cfg.validate(1)
    for key in ("model.float8.recipe='mxfp8'", "model.float8.min_features=0", "model.float8.skip"):
        assert key in str(e.value)
    tp = tiny_config_dict(tmp_path / "run", corpus, **{"model.float8": EMULATED, "tensor_parallel.degree": 2})
    with pytest.raises(OLMoConfigurationError, match="tensor_parallel.degree=2 is not implemented"):
        TrainConfig.from_dict({**tp, "distributed_strategy": "fsdp"}).validate(2)


def test_float8_leaves_the_model_fingerprint_and_the_other_models_alone(tmp_path):
    plain = tiny_model_config()
    assert model_config_fingerprint(
        tiny_model_config(float8=Float8Config(**EMULATED))
    ) == model_config_fingerprint(plain)
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **{"model.float8": EMULATED}))
    assert ParallelizeOptions.from_train_config(cfg).float8 is None  # references, evaluation, conversion
    assert ParallelizeOptions.from_train_config(cfg, training=True).float8 == cfg.model.float8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path, corpus, name, float8=None, **overrides):
    settings = {"model.d_model": 64, "model.n_heads": 4, "save_interval_unsharded": None, **overrides}
    if float8 is not None:
        settings["model.float8"] = float8
    return write_config(tmp_path / f"{name}.yaml", tiny_config_dict(tmp_path / name, corpus, **settings))


def test_the_launch_refuses_float8_on_the_cpu_before_writing_anything(tmp_path, corpus):
    config = _config(tmp_path, corpus, "refused", float8={"enabled": True})
    with pytest.raises(OLMoConfigurationError, match="--model.float8.emulate=true"):
        run_train(config)
    assert not (tmp_path / "refused").exists()
    assert run_train(config, "--dry_run") == 0  # a dry run plans a GPU run elsewhere: it warns


def test_emulated_float8_training_follows_fp32(tmp_path, corpus):
    losses = {}
    for name, float8 in {
        "fp32": None,
        "tensorwise": EMULATED,
        "rowwise": {**EMULATED, "recipe": "rowwise"},
    }.items():
        assert run_train(_config(tmp_path, corpus, name, float8, max_duration=40)) == 0
        losses[name] = metric_by_step(tmp_path / name)
    base = losses["fp32"]
    for name in ("tensorwise", "rowwise"):
        rel = [abs(losses[name][s] - base[s]) / base[s] for s in sorted(base)]
        assert len(rel) == 40
        assert max(rel) > 1e-4, f"{name}: float8 changed nothing"
        assert max(rel) < 0.05, f"{name}: a step's loss is {max(rel):.1%} from fp32's"
        assert sum(rel[-10:]) / 10 < 0.015, f"{name}: the last ten steps are {sum(rel[-10:]) / 10:.2%} from fp32"


def _losses(run):
    return metric_by_step(run)


CHECKPOINTED = {
    "save_interval": 5,
    "save_interval_unsharded": 10,
    "distributed_strategy": "fsdp",
    "model.layer_norm_with_affine": False,  # OlmoForCausalLM's norm, for the export below
}
ROWWISE = {**EMULATED, "recipe": "rowwise"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus):
    """The 2-rank runs of this module, in one torchrun launch (each launch costs seconds of start-up), in turn: a
    float8 and a plain run, the three resumes of each from the other's (and its own) step-5 checkpoint, and the
    rowwise run that ``test_rowwise_float8_on_two_fsdp_ranks_follows_one_process`` compares with one process."""
    root = tmp_path_factory.mktemp("two_ranks")
    float8_run = _config(root, corpus, "float8", EMULATED, **CHECKPOINTED)
    plain_run = _config(root, corpus, "plain", None, **CHECKPOINTED)
    resumes = [
        [config, f"--save_folder={root / name}", f"--load_path={root / source / 'step5'}"]
        for name, config, source in (
            ("f8-from-f8", float8_run, "float8"),
            ("plain-from-f8", plain_run, "float8"),
            ("f8-from-plain", float8_run, "plain"),
        )
    ]
    rowwise = _config(root, corpus, "two", ROWWISE, distributed_strategy="fsdp")
    result = run_torchrun_each(2, [[float8_run], [plain_run], *resumes, [rowwise]])
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_float8_and_plain_runs_resume_from_each_others_checkpoints(two_ranks, tmp_path):
    """2 FSDP ranks: the sharded and unsharded checkpoints hold plain tensors, a float8 resume continues as the
    uninterrupted run, plain and float8 runs resume each other's, and the float8 run exports to transformers. (On
    GPUs the weights are all-gathered in float8, wrapped by torchao: the test below checks their unwrapping.)"""
    runs = two_ranks
    uninterrupted, resumed = _losses(runs / "float8"), _losses(runs / "f8-from-f8")
    assert [resumed[s] for s in range(6, 11)] == [uninterrupted[s] for s in range(6, 11)]
    # Each kind of run continues near its own uninterrupted run: the weights crossed over intact.
    for name, reference in (("plain-from-f8", "float8"), ("f8-from-plain", "plain")):
        assert abs(_losses(runs / name)[10] - _losses(runs / reference)[10]) < 0.05
    # The checkpoints are a plain run's: readable with weights_only and without torchao.
    check = (
        "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
        "assert all(type(v) is torch.Tensor for v in sd.values()); assert 'torchao' not in sys.modules; "
        "import torch.distributed.checkpoint as dcp; dcp.FileSystemReader(sys.argv[2]).read_metadata(); "
        "assert 'torchao' not in sys.modules"
    )
    model_pt = runs / "float8" / "step10-unsharded" / "model.pt"
    sharded = runs / "float8" / "step5" / "model_and_optim"
    subprocess.run([sys.executable, "-c", check, str(model_pt), str(sharded)], check=True, timeout=120)
    plain_pt = torch.load(runs / "plain" / "step10-unsharded" / "model.pt", weights_only=True)
    float8_pt = torch.load(model_pt, weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in float8_pt.items()} == {
        k: (v.shape, v.dtype) for k, v in plain_pt.items()
    }
    # And it exports to transformers as a plain run's does.
    assert run_main("convert_to_hf.py", model_pt.parent, tmp_path / "hf") == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_rowwise_float8_on_two_fsdp_ranks_follows_one_process(two_ranks, tmp_path, corpus):
    """Rowwise scales do not depend on which instances share a micro-batch, so FSDP follows one process to within
    the rare float8 rounding that the gradient all-reduce's different fp32 sums flip, which then grows a little
    (measured at step 10: 1.4e-4 on one CPU, 1.6e-3 on another, whose first flip came at step 8; tensorwise scales
    depend on the layout, and its runs differ by ~1 %)."""
    assert run_train(_config(tmp_path, corpus, "one", ROWWISE)) == 0
    one, two = _losses(tmp_path / "one"), _losses(two_ranks / "two")  # the fixture trained "two" on 2 ranks
    assert one.keys() == two.keys()
    for step in one:
        assert abs(one[step] - two[step]) < 5e-3, step
    assert abs(one[1] - two[1]) < 1e-5  # the first step, before any update


def test_float8_layers_compile_into_the_blocks_graph(tmp_path, corpus):
    """torch.compile with fullgraph traces torchao's float8 casts inside each block (aot_eager: the same graph
    capture as inductor, without generating kernels, which the GPU's float8 runs in tests/test_gpu.py do)."""
    short = {"max_duration": 4, "console_log_interval": 1}
    assert run_train(_config(tmp_path, corpus, "eager", EMULATED, **short)) == 0
    compiled = {"compile": {"fullgraph": True, "backend": "aot_eager"}, **short}
    assert run_train(_config(tmp_path, corpus, "compiled", EMULATED, **compiled)) == 0
    eager, graph = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert eager.keys() == graph.keys() == {1, 2, 3, 4}
    for step in eager:
        assert abs(eager[step] - graph[step]) < 1e-5, step


def test_a_missing_torchao_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import torchao.float8` meets without torchao
    problem = float8_device_problem(Float8Config(enabled=True, emulate=True), torch.device("cpu"))
    assert problem is not None and "pip install 'torchao>=0.17'" in problem and "\n" not in problem


def test_a_model_with_no_layer_to_convert_says_so(caplog):
    with caplog.at_level("WARNING"):
        plan = convert_float8(_meta_model(), Float8Config(enabled=True, emulate=True), fsdp=False)
    assert plan.converted == ()
    assert "converts no layer of this model" in caplog.text and "min_features" in caplog.text


PLAIN_TENSORS_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from olmo.checkpoint.save import plain_tensors

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
inner = torch.randn(8, 4)
wrapped = WeightWithDynamicFloat8CastTensor(inner, LinearMMConfig(), torch.float8_e4m3fn)
# Once FSDP has gathered it, the wrapper also holds its precomputed scale: still the weight is what is written.
scaled = WeightWithDynamicFloat8CastTensor(inner, LinearMMConfig(), torch.float8_e4m3fn, torch.tensor(2.0))
assert type(plain_tensors({"w": scaled})["w"]) is torch.Tensor
sharded = DTensor.from_local(wrapped, init_device_mesh("cpu", (1,)), [Shard(0)], run_check=False)
state = plain_tensors({"model": {"w": wrapped, "d": sharded, "list": [wrapped]}, "step": 3})
w, d = state["model"]["w"], state["model"]["d"]
assert type(w) is torch.Tensor and w.data_ptr() == inner.data_ptr()
assert type(d) is DTensor and type(d.to_local()) is torch.Tensor and d.to_local().data_ptr() == inner.data_ptr()
assert d.placements == sharded.placements and d.shape == sharded.shape
assert type(state["model"]["list"][0]) is torch.Tensor and state["step"] == 3
print("plain")
"""


def test_checkpoints_unwrap_float8_weights_into_their_own_memory(tmp_path):
    """What FSDP's float8 all-gather holds on GPUs (torchao's weight wrapper, inside a DTensor) is written as the
    plain tensor it wraps, sharing its memory so that a load in place reaches the weight."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TENSORS_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "plain", result.stderr[-3000:]


def test_the_plan_of_a_float8_run_says_so(tmp_path, corpus, capsys):
    assert run_train(_config(tmp_path, corpus, "planned", {"enabled": True}), "--dry_run") == 0
    assert "float8 (tensorwise) on the blocks' linear layers at least 1,024 wide" in capsys.readouterr().out


def test_float8_weights_gathered_by_fsdp_checkpoint_and_load_back(tmp_path):
    """The path GPUs take under FSDP (torchao's float8 weight wrapper inside DTensors, scales refreshed after each step
    and after the load), emulated over gloo: olmo/testing/float8_fsdp.py, also run on CUDA by tests/test_gpu.py."""
    cmd = [sys.executable, "-m", "olmo.testing.float8_fsdp", str(tmp_path / "store"), str(tmp_path / "ckpt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "checkpoint ok" in result.stdout, result.stderr[-3000:]
