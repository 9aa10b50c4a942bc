"""Values that passed validation and failed later, or trained wrongly without a word (issue 35): each is refused at
launch, before any data or model work, in one report naming the key and its range; a warmup as long as the run
warns; and a misspelled key no longer hides the bad values of the same launch."""

import logging

import pytest

from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_main, tiny_config_dict, write_byte_memmap, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("bounds-data") / "a.npy"
    write_byte_memmap(path, 10_000)
    return str(path)


@pytest.fixture
def config(tmp_path, corpus):
    return write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [corpus]))


def _refused(config, *args) -> str:
    """The one error a launch with ``args`` stops with, after checking that it wrote nothing."""
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("train.py", config, *args)
    assert not (config.parent / "run").exists()
    return str(e.value)


def _valid(config, *args) -> TrainConfig:
    cfg = TrainConfig.load(config, list(args))
    cfg.validate()
    return cfg


@pytest.mark.parametrize("value", ["-1", "50", "nan"])
def test_alpha_f_outside_0_to_1_is_refused(config, value):
    message = _refused(config, f"--scheduler.alpha_f={value}")
    assert "1 problem" in message and f"scheduler.alpha_f={float(value)} must be in [0, 1]" in message, message


def test_alpha_f_0_and_1_are_valid(config):
    assert _valid(config, "--scheduler.alpha_f=0").scheduler.alpha_f == 0
    assert _valid(config, "--scheduler.alpha_f=1").scheduler.alpha_f == 1


DURATIONS = [
    ("data.remote.timeout_seconds", "inf", "must be above 0 and at most 86400 seconds (a day)"),
    ("data.remote.timeout_seconds", "1e12", "must be above 0 and at most 86400 seconds (a day)"),
    ("data.remote.backoff_seconds", "1e300", "must be from 0 to 3600 seconds (an hour)"),
    ("data.remote.backoff_seconds", "1e8", "must be from 0 to 3600 seconds (an hour)"),
    ("data.remote.max_backoff_seconds", "1e8", "must be above 0 and at most 3600 seconds (an hour)"),
    ("data.remote.max_attempts", "100000", "is more than 1000"),
    ("data.timeout", "100000000", "must be a number of seconds from 0 (wait forever) to 86400 (a day)"),
    ("distributed_timeout_minutes", "inf", "must be above 0 and at most 1440 (a day"),
    ("distributed_timeout_minutes", "1e12", "must be above 0 and at most 1440 (a day"),
    ("stability.watchdog.upload_wait", "1e12", "must be a positive number of seconds, at most 86400 (a day"),
    ("stability.watchdog.data_wait", "nan", "must be a positive number of seconds, at most 86400 (a day"),
    ("time_limit", "inf", "must be a finite number (or null)"),
    ("time_limit", "nan", "must be a finite number (or null)"),
]


@pytest.mark.parametrize("key, value, expected", DURATIONS, ids=[f"{k}={v}" for k, v, _ in DURATIONS])
def test_durations_are_finite_and_bounded(config, key, value, expected):
    message = _refused(config, f"--{key}={value}")
    assert "1 problem" in message and f"  - {key}=" in message and expected in message, message


def test_durations_at_their_bounds_are_valid(config):
    cfg = _valid(
        config,
        "--data.remote.timeout_seconds=86400",
        "--data.remote.backoff_seconds=3600",
        "--data.remote.max_backoff_seconds=3600",
        "--data.remote.max_attempts=1000",
        "--data.timeout=86400",
        "--distributed_timeout_minutes=1440",
        "--stability.watchdog.upload_wait=86400",
        "--time_limit=1e9",
    )
    assert cfg.distributed_timeout_minutes == 1440


def test_muon_ns_steps_is_bounded(config):
    message = _refused(config, "--optimizer.name=muon", "--optimizer.muon_ns_steps=100000000")
    assert "optimizer.muon_ns_steps=100000000 must be from 1 to 100" in message, message
    assert _valid(config, "--optimizer.name=muon", "--optimizer.muon_ns_steps=100").optimizer.muon_ns_steps == 100


GENERATION = [
    ("temperature: nan", "evaluators[0].temperature=nan must be a finite number >= 0"),
    ("temperature: .inf", "evaluators[0].temperature=inf must be a finite number >= 0"),
    ("temperature: -0.5", "evaluators[0].temperature=-0.5 must be a finite number >= 0"),
    ("temperature: 0.8, top_p: .nan", "evaluators[0].top_p=nan must be in (0, 1]"),
    ("temperature: 0.8, top_p: 1.5", "evaluators[0].top_p=1.5 must be in (0, 1]"),
    ("temperature: 0.8, top_p: 0", "evaluators[0].top_p=0.0 must be in (0, 1]"),
    ("temperature: 0.8, top_k: 100000", "evaluators[0].top_k=100000 must be from 1 to model.vocab_size=257"),
]


def _generate(settings: str) -> str:
    return f"--evaluators=[{{label: sample, type: generate, prompts: [Once upon], {settings}}}]"


@pytest.mark.parametrize("settings, expected", GENERATION, ids=[s for s, _ in GENERATION])
def test_generate_evaluator_sampling_settings_are_checked_at_launch(config, settings, expected):
    message = _refused(config, _generate(settings))
    assert "1 problem" in message and expected in message, message


def test_generate_evaluator_with_sensible_sampling_is_valid(config):
    assert _valid(config, _generate("temperature: 0.8, top_p: 0.9")).evaluators[0].top_p == 0.9
    assert _valid(config, _generate("temperature: 0.8, top_k: 257")).evaluators[0].top_k == 257


def _staged(tmp_path, corpus, *names, **stage_fields):
    stages = [{"max_duration": 5, **({} if name is None else {"name": name})} for name in names]
    for key, value in stage_fields.items():  # stage1_scheduler={...}: stages[1].scheduler
        index, field = key[len("stage") :].split("_", 1)
        stages[int(index)][field] = value
    cfg = tiny_config_dict(tmp_path / "run", [corpus], max_duration=None, stages=stages)
    return write_config(tmp_path / "staged.yaml", cfg)


STAGE_NAMES = [
    (
        ["ok", "/../x"],
        "stages[1].name='/../x' must be 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'",
    ),
    ([".."], "stages[0].name='..' must be 1 to 64 letters"),
    ([".hidden"], "stages[0].name='.hidden' must be 1 to 64 letters"),
    (["a/b"], "stages[0].name='a/b' must be 1 to 64 letters"),
    ([""], "stages[0].name='' must be 1 to 64 letters"),
    (["x" * 65], "must be 1 to 64 letters"),
    (["same", "same"], "stages[1].name='same' is also the name of stages[0]; stage names are unique"),
    (["stage1", None], "stages[1].name='stage1' is also the name of stages[0] (the name of a stage without one"),
]


@pytest.mark.parametrize("names, expected", STAGE_NAMES, ids=[repr(n)[:20] for n, _ in STAGE_NAMES])
def test_stage_names_are_unique_safe_file_name_parts(tmp_path, corpus, names, expected):
    message = _refused(_staged(tmp_path, corpus, *names))
    assert "1 problem" in message and expected in message, message


def test_safe_stage_names_are_valid(tmp_path, corpus):
    cfg = _valid(_staged(tmp_path, corpus, "pretrain", "anneal-kl", "v1.2_final", None))
    assert [s.name for s in cfg.stages or []] == ["pretrain", "anneal-kl", "v1.2_final", None]


def test_a_stage_schedule_gets_the_same_alpha_f_check(tmp_path, corpus):
    schedule = {"name": "linear_with_warmup", "t_warmup": 1, "alpha_f": 2}
    message = _refused(_staged(tmp_path, corpus, "a", "b", stage1_scheduler=schedule))
    assert "stages[1].scheduler.alpha_f=2.0 must be in [0, 1]" in message, message


def _warmup_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if ".t_warmup=" in r.getMessage()]


def test_a_warmup_as_long_as_the_run_warns_once_at_launch(tmp_path, corpus, caplog):
    """An official config shortened with --max_duration kept its 2,000-step warmup and trained at lr=0.0000."""
    config = write_config(
        tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [corpus], **{"scheduler.t_warmup": 2000})
    )
    with caplog.at_level(logging.WARNING):
        assert run_main("train.py", config, "--max_duration=10", "--dry_run") == 0
    warnings = _warmup_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "scheduler.t_warmup=2,000 steps is not shorter than the run (max_duration=10: 10 steps), so all of it is "
        "warmup: the learning rate climbs from 10.0% to 10.5% of optimizer.learning_rate=0.01 and never decays. "
        "Set --scheduler.t_warmup=1 (a tenth of it) or a longer --max_duration."
    ), warnings


def test_a_warmup_in_tokens_is_compared_with_the_run_in_tokens(config, caplog):
    # 8 instances of 32 tokens a step: 10240 tokens are 40 steps.
    with caplog.at_level(logging.WARNING):
        _valid(config, "--max_duration=10240T", "--scheduler.units=tokens", "--scheduler.t_warmup=10240")
    assert len(_warmup_warnings(caplog)) == 1 and "(max_duration='10240T': 10,240 tokens)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _valid(config, "--max_duration=10240T", "--scheduler.units=tokens", "--scheduler.t_warmup=1024")
    assert _warmup_warnings(caplog) == []


def test_a_stage_schedule_warns_about_its_own_warmup(tmp_path, corpus, caplog):
    schedule = {"name": "cosine_with_warmup", "t_warmup": 5, "alpha_f": 0.1}
    with caplog.at_level(logging.WARNING):
        _valid(_staged(tmp_path, corpus, "a", "b", stage1_scheduler=schedule))
    warnings = _warmup_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("stages[1].scheduler.t_warmup=5 steps"), warnings
    assert "--stages[1].scheduler.t_warmup=1" in warnings[0]


@pytest.mark.parametrize(
    "args", [[], ["--scheduler.name=constant", "--scheduler.t_warmup=2000"], ["--max_duration=1ep"]]
)
def test_no_warmup_warning_for_a_short_warmup_a_constant_schedule_or_a_length_in_epochs(config, caplog, args):
    with caplog.at_level(logging.WARNING):
        _valid(config, *args)
    assert _warmup_warnings(caplog) == []


def test_only_rank_0_warns_about_the_warmup(config, caplog, monkeypatch):
    cfg = TrainConfig.load(config, ["--scheduler.t_warmup=2000"])
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with caplog.at_level(logging.WARNING):
        cfg.validate(2)
    assert _warmup_warnings(caplog) == []


def test_a_misspelled_key_and_bad_values_come_in_one_report(tmp_path, corpus):
    cfg = tiny_config_dict(tmp_path / "run", [corpus])
    cfg["optimizer"]["learning_rat"] = 0.1
    cfg["evaluators"] = [{"label": "sample", "type": "generate", "prompts": ["Once"], "temprature": 0.5}]
    config = write_config(tmp_path / "c.yaml", cfg)
    message = _refused(config, "--model.n_layer=3", "--scheduler.alpha_f=50", "--data.remote.timeout_seconds=inf")
    assert "and its command-line overrides have 5 problems" in message, message
    for expected in (
        "'optimizer.learning_rat' (in ",
        "Did you mean: 'learning_rate'?",
        "'evaluators[0].temprature' (in ",
        "Did you mean: 'temperature'?",
        "'model.n_layer' (from the command-line override '--model.n_layer=3')",
        "Did you mean: 'n_layers'?",
        "scheduler.alpha_f=50.0 must be in [0, 1]",
        "data.remote.timeout_seconds=inf must be above 0",
    ):
        assert expected in message, (expected, message)


def test_a_misspelled_key_alone_is_still_one_paragraph(config):
    message = _refused(config, "--model.d_modle=64")
    assert message.startswith("Invalid config key 'model.d_modle' (from the command-line override"), message
    assert "Did you mean one of: 'd_model', 'moe'?" in message  # omegaconf's suggestions (moe is close too)


def test_a_misspelled_key_and_a_wrong_type_are_still_reported_together(config):
    message = _refused(config, "--model.n_layer=3", "--seed=abc", "--scheduler.alpha_f=50")
    assert "have 2 problems" in message and "'model.n_layer'" in message and "'seed'" in message, message


def test_every_non_finite_float_is_refused_once_by_its_key(config):
    message = _refused(
        config,
        "--model.clip_qkv=nan",
        "--speed_monitor.gpu_flops_available=inf",
        "--auxiliary_loss_multiplier=nan",
        "--stability.watchdog.data_wait=nan",
    )
    assert "4 problem" in message, message
    for key in ("model.clip_qkv", "speed_monitor.gpu_flops_available", "auxiliary_loss_multiplier"):
        assert f"  - {key}=" in message and message.count(f"{key}=") == 1, (key, message)
    assert message.count("stability.watchdog.data_wait=nan") == 1, message


def test_an_infinite_clipping_limit_still_means_no_clipping(config):
    assert _valid(config, "--max_grad_norm=inf").max_grad_norm == float("inf")


def test_a_config_listing_twelve_thousand_files_loads_and_an_alias_bomb_is_refused(tmp_path):
    """OLMo 3's midtraining mix lists 12,252 files: such a config (and the config.yaml a run of it saves) loads,
    while OmegaConf's default limit of 10,000 YAML nodes refused it. YAML aliases that multiply are still refused."""
    paths = [f"https://olmo-data.org/mix/part-{i:05d}.npy" for i in range(12_000)]
    config = write_config(tmp_path / "big.yaml", tiny_config_dict(tmp_path / "run", paths))
    assert len(TrainConfig.load(config).data.paths) == 12_000
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 8):  # 10^8 nodes once expanded
        prev, name = chr(96 + i), chr(97 + i)
        bomb += f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]\n"
    (tmp_path / "bomb.yaml").write_text(bomb)
    with pytest.raises(OLMoConfigurationError, match="bomb.yaml' is not valid YAML: YAML node expansion exceeds"):
        TrainConfig.load(tmp_path / "bomb.yaml")
