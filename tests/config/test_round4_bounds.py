"""Absurd but finite scales (issue 50): a factor, weight, coefficient, beta, scale or epsilon past a million in
magnitude passed every sign check and overflowed at step 1, where the report advised a lower learning rate. Every
such key, found by its name over the whole config, is refused at launch in one line naming it; scales that must be
positive are; large values of the other floats (RoPE theta, FLOPs, token counts) stay valid."""

import pytest

from olmo.config import RopeScalingConfig, TrainConfig
from olmo.config.attention_sections import attention_option_problems
from olmo.config.bounds import MAX_SCALE, is_scale_key, non_finite_problems
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_main, tiny_config_dict, write_byte_memmap, write_config

YARN = {"name": "yarn", "factor": 4.0, "old_context_len": 16}
LLAMA3 = {"name": "llama3", "factor": 4.0, "old_context_len": 16}
MOE = {"num_experts": 4, "top_k": 2, "hidden_size": 32}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("round4-bounds") / "a.npy"
    write_byte_memmap(path, 10_000)
    return str(path)


def _config(tmp_path, corpus, **overrides):
    return write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [corpus], **overrides))


def _problems(tmp_path, corpus, *args, **overrides) -> str:
    with pytest.raises(OLMoConfigurationError) as e:
        TrainConfig.load(_config(tmp_path, corpus, **overrides), list(args)).validate()
    return str(e.value)


def test_an_attention_factor_of_1e300_stops_the_launch_before_anything_is_written(tmp_path, corpus):
    config = _config(tmp_path, corpus, **{"model.rope_scaling": YARN})
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("train.py", config, "--model.rope_scaling.attention_factor=1e300")
    message = str(e.value)
    assert "1 problem" in message and "model.rope_scaling.attention_factor=1e+300 is beyond 1,000,000" in message
    assert "learning rate" not in message and "Traceback" not in message
    assert not (tmp_path / "run").exists()


SCALES = [
    ("model.rope_scaling.attention_factor", "1e7", {"model.rope_scaling": YARN}),
    ("model.rope_scaling.factor", "1e300", {"model.rope_scaling": YARN}),
    ("model.rope_scaling.beta_fast", "1e300", {"model.rope_scaling": YARN}),
    ("model.rope_scaling.high_freq_factor", "1e9", {"model.rope_scaling": LLAMA3}),
    ("model.moe.lb_loss_weight", "1e300", {"model.moe": MOE}),
    ("model.moe.z_loss_weight", "2e6", {"model.moe": MOE}),
    ("model.init_std", "1e300", {}),
    ("model.emb_init_std", "1e10", {}),
    ("model.init_cutoff_factor", "1e300", {}),
    ("model.layer_norm_eps", "1e300", {}),
    ("auxiliary_loss_multiplier", "-1e300", {}),
    ("optimizer.weight_decay", "1e9", {}),
    ("dpo.beta", "1e300", {}),
]


@pytest.mark.parametrize("key, value, extra", SCALES, ids=[s[0] for s in SCALES])
def test_every_scale_past_a_million_is_refused_naming_its_key(tmp_path, corpus, key, value, extra):
    message = _problems(tmp_path, corpus, f"--{key}={value}", **extra)
    line = next(line for line in message.splitlines() if f"{key}=" in line)
    assert "1 problem" in message, message
    if key != "dpo.beta":  # dpo.beta's own range check may report it first, in its own words
        assert "is beyond 1,000,000 in magnitude" in line and "Set the value you meant" in line, line


def test_a_stage_kl_beta_past_a_million_is_refused(tmp_path, corpus):
    stages = [{"name": "main", "duration": "5ep"}, {"name": "anneal", "duration": "1ep", "kl_beta": 1e30}]
    message = _problems(tmp_path, corpus, **{"stages": stages, "max_duration": "6ep"})
    assert "kl_beta=1e+30 is beyond 1,000,000" in message, message


@pytest.mark.parametrize(
    "key, value, extra",
    [
        ("model.init_std", "0", {}),
        ("model.init_std", "-0.02", {}),
        ("model.layer_norm_eps", "0", {}),
        ("model.layer_norm_eps", "-1e-5", {}),
        ("model.emb_init_std", "-1", {}),
        ("model.init_cutoff_factor", "0", {}),
        ("model.alibi_bias_max", "-8", {"model.alibi": True, "model.rope": False}),
    ],
)
def test_a_scale_that_must_be_positive_is_refused(tmp_path, corpus, key, value, extra):
    message = _problems(tmp_path, corpus, f"--{key}={value}", **extra)
    assert "1 problem" in message and f"{key}={float(value)} must be a positive number" in message, message


def test_large_values_of_other_floats_and_sensible_scales_stay_valid(tmp_path, corpus):
    config = _config(tmp_path, corpus, **{"model.rope_scaling": {**YARN, "factor": 32.0, "beta_fast": 64.0}})
    args = [
        "--model.rope_theta=1000000",
        "--speed_monitor.gpu_flops_available=9.89e14",
        "--scheduler.grad_clip_warmup_factor=10",
        "--scheduler.grad_clip_warmup_steps=2",
        "--model.layer_norm_eps=1e-6",
        f"--model.rope_scaling.attention_factor={MAX_SCALE}",
        "--model.alibi_bias_max=-8",  # without ALiBi it is never read
    ]
    cfg = TrainConfig.load(config, args)
    cfg.validate()
    assert cfg.model.rope_theta == 1_000_000 and cfg.speed_monitor.gpu_flops_available == 9.89e14


def test_the_converters_check_of_rope_scaling_bounds_its_factors_too():
    scaling = RopeScalingConfig(**{**YARN, "attention_factor": 1e300, "beta_slow": float("inf")})
    problems = attention_option_problems(None, scaling, rope=True)
    assert any(p.startswith("model.rope_scaling.attention_factor=1e+300 is beyond") for p in problems), problems
    assert any(p.startswith("model.rope_scaling.beta_slow=inf must be a finite number") for p in problems), (
        problems
    )


@pytest.mark.parametrize(
    "key, scale",
    [
        ("model.rope_scaling.attention_factor", True),
        ("stages[2].kl_beta", True),
        ("optimizer.betas", True),
        ("model.layer_norm_eps", True),
        ("auxiliary_loss_multiplier", True),
        ("model.rope_theta", False),
        ("speed_monitor.gpu_flops_available", False),
        ("optimizer.learning_rate", False),
        ("time_limit", False),
        ("stability.stragglers.threshold", False),
    ],
)
def test_which_keys_are_scales_is_read_from_their_name(key, scale):
    assert is_scale_key(key) is scale


def test_a_list_of_scales_is_bounded_as_one_key():
    cfg = TrainConfig()
    cfg.optimizer.betas = (0.9, -1e300)
    cfg.model.init_std = float("nan")
    problems = non_finite_problems(cfg)
    assert problems["optimizer.betas"].startswith("optimizer.betas=[0.9, -1e+300] is beyond 1,000,000")
    assert problems["model.init_std"] == "model.init_std=nan must be a finite number."
