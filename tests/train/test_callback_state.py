"""Callbacks that keep their own state across a restart (``state_dict``/``load_state_dict``, in every checkpoint's
trainer state), and callbacks that say where they run among the built-ins (``priority``), through the real train
command."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from olmo.cli.train import main
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import tiny_config_dict, write_byte_corpus, write_config
from olmo.train.callback import Callback, check_callbacks, ordered_callbacks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


class LossTally(Callback):
    """Keeps the logged losses of the whole run (not only this launch) and a tensor it updates each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ema = torch.zeros(2)
        self.restored = 0

    def post_metrics(self, ctx) -> None:
        loss = ctx.values["train/CrossEntropyLoss"]
        self.losses.append(loss)
        self.ema = 0.9 * self.ema + 0.1 * torch.tensor([loss, ctx.step])

    def state_dict(self):
        return {"losses": list(self.losses), "ema": self.ema.clone(), "note": ("tally", None, True)}

    def load_state_dict(self, state) -> None:
        self.losses, self.ema, self.restored = list(state["losses"]), state["ema"], self.restored + 1


def _config(tmp_path: Path, corpus, **overrides) -> str:
    cfg = tiny_config_dict(tmp_path / "run", corpus, **{"max_duration": 6, **overrides})
    return str(write_config(tmp_path / "c.yaml", cfg))


@pytest.mark.parametrize("kind", ["save_interval_unsharded", "save_interval"])
def test_a_callback_resumes_its_own_state_bitwise(tmp_path, corpus, kind):
    """Stopped at step 3 and resumed (unsharded and sharded checkpoints): the callback ends with the state of an
    uninterrupted run, bitwise, its second instance of one class kept apart from the first."""
    whole, twin = LossTally(), LossTally()
    assert main([_config(tmp_path / "whole", corpus, **{kind: 3})], callbacks=[whole, twin]) == 0
    first, first_twin = LossTally(), LossTally()
    config = _config(tmp_path / "parts", corpus, **{kind: 3})
    assert main([config, "--stop_at=3"], callbacks=[first, first_twin]) == 0
    resumed, resumed_twin = LossTally(), LossTally()
    resumed_twin.losses = ["not restored"]  # type: ignore[list-item]
    assert main([config, "--try_load_latest_save", "--stop_at=null"], callbacks=[resumed, resumed_twin]) == 0
    assert resumed.restored == 1 and len(whole.losses) == 6
    assert resumed.losses == whole.losses and torch.equal(resumed.ema, whole.ema)
    assert resumed_twin.losses == twin.losses == whole.losses


def test_a_state_a_checkpoint_cannot_hold_is_refused_before_writing_it(tmp_path, corpus):
    class Unsaveable(Callback):
        def state_dict(self):
            return {"ok": [1, 2.0], "bad": {"deeper": object()}}

    with pytest.raises(
        OLMoConfigurationError, match=r"Unsaveable returned a state_dict\(\) .*\['bad'\]\['deeper'\] is"
    ):
        main([_config(tmp_path, corpus, save_interval_unsharded=2)], callbacks=[Unsaveable()])
    assert not list((tmp_path / "run").glob("step*")), "a checkpoint was written"


def test_a_saved_state_without_its_callback_is_reported(tmp_path, corpus, caplog):
    config = _config(tmp_path, corpus, save_interval_unsharded=3)
    assert main([config, "--stop_at=3"], callbacks=[LossTally()]) == 0
    with caplog.at_level(logging.WARNING):
        assert main([config, "--try_load_latest_save", "--stop_at=null"]) == 0
    assert (
        "holds the state of callbacks this run does not have, ignored: test_callback_state.LossTally"
        in caplog.text
    )


class Named(Callback):
    def __init__(self, name: str, priority: int = 0) -> None:
        self.name, self.priority = name, priority


def test_priority_places_a_callback_among_the_built_ins() -> None:
    built_in = [Named(f"b{i}") for i in range(10)]  # priorities 100, 90, ..., 10
    user = [Named("last"), Named("before-checkpoint", 45), Named("first", 1000), Named("ties-after-stop", 50)]
    order = [c.name for c in ordered_callbacks(built_in, user)]
    assert order == [
        "first", "b0", "b1", "b2", "b3", "b4", "b5", "ties-after-stop", "before-checkpoint", "b6", "b7", "b8", "b9",
        "last",
    ]  # fmt: skip
    assert [c.name for c in ordered_callbacks(built_in, [])] == [f"b{i}" for i in range(10)]
    for bad in (True, 2.5, "high", 10**7):
        with pytest.raises(
            OLMoConfigurationError, match=r"callbacks\[0\] \(Named\) has priority .* not a whole number"
        ):
            check_callbacks([Named("x", bad)])  # type: ignore[arg-type]
