"""Options OLMo honours and we do not warn at startup, once each, naming the key, the value and what happens."""

import logging

import pytest

from olmo.config import TrainConfig
from olmo.testing import tiny_config_dict

IGNORED = [
    ({"fsdp.wrapping_strategy": "size_based"}, "fsdp.wrapping_strategy=size_based has no effect: each block"),
    (
        {"fsdp.wrapping_strategy": "by_block_group"},
        "fsdp.wrapping_strategy=by_block_group has no effect: it acts as by_block",
    ),
    ({"fsdp.use_orig_params": False}, "fsdp.use_orig_params=False has no effect: FSDP2 always keeps"),
    ({"ddp": {"find_unused_params": True}}, "ddp.find_unused_params=True has no effect"),
    ({"wandb": {"rank_zero_only": False}}, "wandb.rank_zero_only=False has no effect: only rank 0 logs"),
    ({"wandb": {"log_artifacts": True}}, "wandb.log_artifacts=True has no effect"),
    ({"tokenizer.truncate_direction": "left"}, "tokenizer.truncate_direction=left has no effect"),
    ({"extra_steps_after_cancel": 3}, "extra_steps_after_cancel=3 has no effect: a canceled run saves and stops"),
]


def _warnings(tmp_path, caplog, overrides):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **overrides))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="olmo.config.validation"):
        cfg.validate()
    return [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]


@pytest.mark.parametrize("overrides, message", IGNORED, ids=[m.split(" has")[0] for _, m in IGNORED])
def test_an_option_we_do_not_honour_warns_once_with_key_value_and_outcome(tmp_path, caplog, overrides, message):
    warnings = _warnings(tmp_path, caplog, overrides)
    assert len(warnings) == 1 and warnings[0].startswith(message), warnings


def test_defaults_and_honoured_values_do_not_warn(tmp_path, caplog):
    honoured = {
        "fsdp.wrapping_strategy": "by_block_and_size",
        "wandb": {"rank_zero_only": True, "log_artifacts": False},
        "ddp": {"find_unused_params": False},
        "extra_steps_after_cancel": 0,
    }
    assert _warnings(tmp_path, caplog, {}) == []
    assert _warnings(tmp_path, caplog, honoured) == []
