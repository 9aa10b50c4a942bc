import re
from pathlib import Path

import pytest

from olmo.config import TrainConfig, clean_opt
from olmo.config.rl_sections import apply_rl_run_settings
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import tiny_config_dict, write_config

REPO = Path(__file__).resolve().parents[2]
# configs/ladder/ holds ladder configs (olmo/ladder/config.py), tested in tests/ladder/test_ladder.py.
SHIPPED_CONFIGS = sorted(p for p in REPO.glob("configs/**/*.yaml") if "ladder" not in p.relative_to(REPO).parts)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads_and_validates(path, tmp_path, monkeypatch):
    if "tiny" in path.parts:
        # The quickstart config globs the prepared corpus; give it one file to find.
        for split in ("train", "val"):
            (tmp_path / "data/quickstart" / split).mkdir(parents=True)
            (tmp_path / "data/quickstart" / split / "part-00000.npy").write_bytes(b"\0" * 1024)
        monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.load(path)
    if (
        cfg.dpo.enabled or cfg.rl.enabled
    ):  # post-training stages: started from the stage before, as their headers say
        cfg.load_path = "runs/the-stage-before/step100"
    apply_rl_run_settings(cfg)  # an RL run's data are its prompts
    world_size = 1 if "tiny" in path.parts else 8
    cfg.validate(world_size)
    assert cfg.run_name and cfg.save_folder.endswith(cfg.run_name)
    mixture = cfg.data.mixture
    assert cfg.data.paths or (mixture and all(s.paths for s in mixture.sources)), (
        "every shipped config trains on data"
    )


def test_official_configs_keep_the_released_hyperparameters():
    one_b = TrainConfig.load(REPO / "configs/official/OLMo-1B.yaml")
    assert (one_b.model.d_model, one_b.model.n_heads, one_b.model.n_layers, one_b.model.mlp_ratio) == (
        2048,
        16,
        16,
        8,
    )
    assert one_b.max_duration == 739_328 and one_b.global_train_batch_size == 2048
    assert one_b.optimizer.learning_rate == 4.0e-4 and one_b.scheduler.t_warmup == 2000
    assert len(one_b.data.paths) == 249 and len(one_b.evaluators) == 13
    seven_b = TrainConfig.load(REPO / "configs/official/OLMo-7B.yaml")
    assert seven_b.model.mlp_hidden_size == 22016 and not seven_b.model.weight_tying
    assert seven_b.max_steps(0) == 476_838  # 2e12 tokens / (2048 x 2048)
    research = TrainConfig.load(REPO / "configs/official/OLMo-300M.yaml")
    assert (research.model.d_model, research.model.n_heads, research.model.max_sequence_length) == (1536, 8, 2048)
    assert research.model.flash_attention


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--save-overwrite", "save_overwrite=true"),
        ("--model.n_layers=2", "model.n_layers=2"),
        ("--data.paths=[a.npy,b.npy]", "data.paths=[a.npy,b.npy]"),
        ("--load_path=null", "load_path=null"),
        ("--reset_trainer_state", "reset_trainer_state=true"),
    ],
)
def test_clean_opt(arg, expected):
    assert clean_opt(arg) == expected


def _config(tmp_path, save_folder=None, **overrides):
    cfg = tiny_config_dict(save_folder or str(tmp_path / "run"), ["x.npy"], **overrides)
    return write_config(tmp_path / "c.yaml", cfg)


def test_overrides_apply_before_interpolation(tmp_path):
    path = _config(tmp_path, save_folder="runs/${run_name}")
    cfg = TrainConfig.load(
        path,
        [
            clean_opt(a)
            for a in ["--run_name=foo", "--data.paths=[a.npy,b.npy]", "--wandb.project=p", "--max_duration=2e6T"]
        ],
    )
    assert cfg.save_folder == "runs/foo"
    assert cfg.data.paths == ["a.npy", "b.npy"]
    assert cfg.wandb is not None and cfg.wandb.project == "p"
    assert cfg.max_steps(0) == 7813  # ceil(2e6 / (8 x 32))


def test_env_interpolation_and_glob_resolver(tmp_path, monkeypatch):
    (tmp_path / "shards").mkdir()
    for name in ("b.npy", "a.npy"):
        (tmp_path / "shards" / name).write_bytes(b"")
    monkeypatch.setenv("MY_DATA", str(tmp_path / "shards"))
    path = _config(tmp_path, **{"data.paths": "${path.glob:${oc.env:MY_DATA}/*.npy}"})
    cfg = TrainConfig.load(path)
    assert [Path(p).name for p in cfg.data.paths] == ["a.npy", "b.npy"]


def test_glob_with_no_match_loads_and_fails_when_the_data_is_built(tmp_path):
    """The config loads (--help and a dry run's plan need no data); the data names the key and the pattern."""
    from olmo.data import build_memmap_dataset
    from olmo.exceptions import OLMoDataError

    path = _config(tmp_path, **{"data.paths": f"${{path.glob:{tmp_path}/nothing/*.npy}}"})
    cfg = TrainConfig.load(path)
    assert cfg.data.paths == [f"{tmp_path}/nothing/*.npy"]
    with pytest.raises(OLMoDataError, match=r"data\.paths entry '.*nothing/\*\.npy' matches no file"):
        build_memmap_dataset(cfg, cfg.data)


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(OLMoConfigurationError, match=r"model\.d_modle.*Did you mean.*d_model"):
        TrainConfig.load(_config(tmp_path), ["model.d_modle=64"])


def test_unknown_key_in_yaml_is_reported_with_its_path(tmp_path):
    with pytest.raises(OLMoConfigurationError, match=r"optimizer\.learning_rat"):
        TrainConfig.load(_config(tmp_path, **{"optimizer.learning_rat": 0.1}))


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(OLMoConfigurationError, match=r"model\.n_layers.*abc"):
        TrainConfig.load(_config(tmp_path), ["model.n_layers=abc"])


def test_bad_enum_value_names_the_key(tmp_path):
    with pytest.raises(OLMoConfigurationError, match=r"optimizer\.name"):
        TrainConfig.load(_config(tmp_path), ["optimizer.name=sgd"])


def test_missing_config_file(tmp_path):
    with pytest.raises(OLMoConfigurationError, match="does not exist"):
        TrainConfig.load(tmp_path / "nope.yaml")


def test_validation_reports_every_problem_at_once(tmp_path):
    cfg = TrainConfig.load(
        _config(tmp_path),
        ["model.n_heads=5", "global_train_batch_size=10", "optimizer.learning_rate=-1", "precision=amp_bf17"],
    )
    with pytest.raises(OLMoConfigurationError) as info:
        cfg.validate(1)
    message = str(info.value)
    assert "4 problem(s)" in message
    for key in ("model.n_heads", "global_train_batch_size", "optimizer.learning_rate", "precision"):
        assert key in message


def test_batch_must_divide_by_microbatch_times_world_size(tmp_path):
    cfg = TrainConfig.load(_config(tmp_path))  # global 8, micro 4
    cfg.validate(1)
    cfg.validate(2)
    with pytest.raises(OLMoConfigurationError, match=r"global_train_batch_size=8.*x world size \(4\)"):
        cfg.validate(4)


def test_data_urls_and_remote_settings_are_checked_before_any_request(tmp_path):
    cfg = TrainConfig.load(
        _config(tmp_path),
        [
            "data.paths=[htps://olmo-data.org/a.npy,s3://bucket/b.npy]",
            "data.label_mask_paths=[hf://datasets/x/m.npy,gs://bucket/m.npy]",
            "data.remote.max_concurrency=100000",
            "data.remote.timeout_seconds=0",
        ],
    )
    with pytest.raises(OLMoConfigurationError) as info:
        cfg.validate(1)
    message = str(info.value)
    assert "4 problem(s)" in message
    assert "data.paths[0]='htps://olmo-data.org/a.npy': htps:// URLs cannot be read by byte range" in message
    assert "data.label_mask_paths[0]='hf://datasets/x/m.npy'" in message
    assert "data.remote.max_concurrency=100000" in message and "data.remote.timeout_seconds=0" in message


def test_dtype_must_hold_the_vocabulary(tmp_path):
    cfg = TrainConfig.load(_config(tmp_path), ["model.vocab_size=100000", "model.embedding_size=100352"])
    with pytest.raises(OLMoConfigurationError, match="memmap_dtype=uint32"):
        cfg.validate(1)
    TrainConfig.load(
        _config(tmp_path), ["model.vocab_size=100000", "model.embedding_size=100352", "data.memmap_dtype=uint32"]
    ).validate(1)


def test_save_then_load_round_trips(tmp_path):
    cfg = TrainConfig.load(_config(tmp_path, save_folder="runs/${run_name}"))
    cfg.save(tmp_path / "saved.yaml")
    assert "${" not in (tmp_path / "saved.yaml").read_text()
    assert TrainConfig.load(tmp_path / "saved.yaml") == cfg


def test_legacy_spellings_load(tmp_path):
    cfg = TrainConfig.load(
        _config(
            tmp_path, activation_checkpointing=True, **{"optimizer.name": "decoupled_lionw", "optimizer.eps": 1e-8}
        )
    )
    assert cfg.activation_checkpointing == "whole_layer"
    assert cfg.optimizer.name == "lionw"


def test_durations(tmp_path):
    cfg = TrainConfig.load(_config(tmp_path))
    assert TrainConfig.load(_config(tmp_path, max_duration="3ep")).max_steps(100) == 36  # 3 x (100 // 8)
    assert cfg.max_steps(0) == 10
    with pytest.raises(OLMoConfigurationError, match="max_duration"):
        TrainConfig.load(_config(tmp_path, max_duration="ten")).validate(1)


def test_one_field_of_one_list_entry_can_be_overridden(tmp_path):
    """``--data.mixture.sources[1].ratio=0.3`` (or ``.1.``) sets that field of that entry only; an index past the
    end, a field the entries lack, a bad value or an index into a section are refused naming the key."""
    mixture = {
        "sources": [
            {"name": "web", "paths": ["w.npy"], "ratio": 0.6},
            {"name": "code", "paths": ["c.npy"], "ratio": 0.4},
        ]
    }
    config = _config(
        tmp_path, evaluators=[{"label": "a"}, {"label": "b"}], data={"paths": None, "mixture": mixture}
    )
    cfg = TrainConfig.load(
        config,
        ["--data.mixture.sources[1].ratio=0.3", "--data.mixture.sources.0.ratio=0.7", "evaluators.1.label=x"],
    )
    assert [(s.name, s.ratio, s.paths) for s in cfg.data.mixture.sources] == [
        ("web", 0.7, ["w.npy"]),
        ("code", 0.3, ["c.npy"]),
    ]
    assert [e.label for e in cfg.evaluators] == ["a", "x"]
    bad = {
        "--data.mixture.sources[2].ratio=0.1": r"data\.mixture\.sources has 2 entries \(0 to 1\), so \[2\] names none",
        "--data.mixture.sources[0].weight=1": r"'data\.mixture\.sources\[0\]\.weight'.*Key 'weight' not in",
        "--data.mixture.sources[0].ratio=most": r"'data\.mixture\.sources\[0\]\.ratio'.*could not be converted",
        "--model[0].d_model=8": r"model is not a list",
    }
    with pytest.raises(OLMoConfigurationError) as error:
        TrainConfig.load(config, list(bad))
    for pattern in bad.values():
        assert re.search(pattern, str(error.value)), (pattern, str(error.value))


def test_fields_newer_olmo_writes_load_and_what_cannot_be_honoured_is_refused(tmp_path, caplog):
    written = tiny_config_dict(
        tmp_path / "run",
        ["x.npy"],
        distributed_strategy="single",
        single={"device": "auto"},
        **{"data.custom_dataset": None},
    )
    cfg = TrainConfig.from_dict(written)
    cfg.validate()
    assert cfg.distributed_strategy == "single" and cfg.data.custom_dataset is None
    with pytest.raises(OLMoConfigurationError, match=r"distributed_strategy=single .* 2 processes"):
        cfg.validate(world_size=2)
    custom = {"name": "MyDataset", "module": "my.module", "args": {"x": 1}, "collate_config": {"index_field": "i"}}
    with pytest.raises(
        OLMoConfigurationError,
        match=r"data\.custom_dataset \(my\.module\.MyDataset\) cannot train with scripts/train.py",
    ):
        TrainConfig.from_dict({**written, "data": {**written["data"], "custom_dataset": custom}}).validate()
    with caplog.at_level("WARNING"):
        TrainConfig.from_dict({**written, "single": {"device": "cuda"}}).validate()
    assert "single.device='cuda' has no effect" in caplog.text


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            {"model.block_type": "llama"},
            r"model\.block_type=llama is not supported.*--model\.block_type=sequential",
        ),
        (
            {"model.block_group_size": 2},
            r"model\.block_group_size=2 is not supported.*--model\.block_group_size=1",
        ),
    ],
)
def test_olmo_block_options_we_lack_fail_validation_with_the_reason(tmp_path, overrides, pattern):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **overrides))
    with pytest.raises(OLMoConfigurationError, match=pattern):
        cfg.validate()
    from olmo.model import OLMo

    with pytest.raises(OLMoConfigurationError, match="not implemented"):
        OLMo(cfg.model)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"scheduler.name": "wsd"}, r"scheduler\.name=wsd needs scheduler\.t_decay.*--scheduler\.t_decay=1000"),
        ({"scheduler.name": "wsd", "scheduler.t_decay": -5}, r"scheduler\.t_decay=-5 must be >= 0"),
        (
            {"scheduler.name": "cosine_with_warmup", "scheduler.t_decay": 10},
            r"scheduler\.t_decay=10 is used by scheduler\.name=wsd only.*Remove t_decay, or set scheduler\.name=wsd",
        ),
        (
            {"scheduler.name": "linear_with_warmup", "scheduler.decay_shape": "1-sqrt"},
            r"scheduler\.decay_shape=1-sqrt is used by scheduler\.name=wsd only",
        ),
        (  # 100 steps, warmup 30, decay 80: the decay would start at step 20
            {"max_duration": 100, "scheduler.name": "wsd", "scheduler.t_warmup": 30, "scheduler.t_decay": 80},
            r"scheduler\.t_decay=80 starts the decay at 20 steps, before the warmup ends \(scheduler\.t_warmup=30\); "
            r"the run's length \(100 steps\)\. Use a t_decay of at most 70",
        ),
        (  # in tokens: 2 steps of 8 x 32 tokens
            {
                "max_duration": "512T",
                "scheduler.name": "wsd",
                "scheduler.units": "tokens",
                "scheduler.t_warmup": 256,
                "scheduler.t_decay": 300,
            },
            r"starts the decay at 212 tokens, before the warmup ends",
        ),
        (
            {"stages": [{"max_duration": 10, "scheduler": {"name": "wsd", "t_warmup": 0}}]},
            r"stages\[0\]\.scheduler\.name=wsd needs stages\[0\]\.scheduler\.t_decay",
        ),
    ],
)
def test_inconsistent_schedules_are_refused_naming_the_key(tmp_path, overrides, pattern):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **overrides))
    with pytest.raises(OLMoConfigurationError, match=pattern):
        cfg.validate()


def test_a_wsd_schedule_that_fits_validates(tmp_path):
    for overrides in (
        {"max_duration": 100, "scheduler.name": "wsd", "scheduler.t_warmup": 30, "scheduler.t_decay": 70},
        {"max_duration": "1ep", "scheduler.name": "wsd", "scheduler.t_decay": 10**9},  # epochs: checked at start
        {"max_duration": 100, "scheduler.name": "wsd", "scheduler.t_decay": 0, "scheduler.decay_shape": "cosine"},
    ):
        TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **overrides)).validate()


def test_a_saved_config_holds_no_secret_and_saves_again_unchanged(tmp_path, monkeypatch):
    """What a run writes as config.yaml: values read from the environment as written (loading them gives the text),
    URL credentials and query values masked, literal text kept literal; loading it and saving it again changes
    nothing."""
    monkeypatch.setenv("DATA_TOKEN", "tok-5ecret-9")
    path = _config(
        tmp_path,
        **{
            "data.paths": ["https://h/${oc.env:DATA_TOKEN}/a.npy", "https://u:pw-5ecret@h/b.npy?sig=s1g-5ecret"],
            "run_name": "tok-${oc.env:DATA_TOKEN,none}",
        },
    )
    cfg = TrainConfig.load(path)
    assert cfg.data.paths[0] == "https://h/tok-5ecret-9/a.npy" and cfg.run_name == "tok-tok-5ecret-9"
    cfg.save(tmp_path / "saved.yaml")
    text = (tmp_path / "saved.yaml").read_text()
    assert "5ecret" not in text
    saved = TrainConfig.load_saved(tmp_path / "saved.yaml")  # refuses interpolations: these are text
    assert saved.data.paths == ["https://h/${oc.env:DATA_TOKEN}/a.npy", "https://u:***@h/b.npy?sig=***"]
    assert saved.run_name == "tok-${oc.env:DATA_TOKEN,none}"
    saved.save(tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == text
