"""Fixtures of the command-line tests: a small corpus and a finished run to point the tools at (one of each per
test module)."""

import pytest

from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 10_000)
    return [str(root / "a.npy")]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A finished 2-step run with a sharded and an unsharded checkpoint of step 2."""
    root = tmp_path_factory.mktemp("run")
    config = write_config(
        root / "c.yaml",
        tiny_config_dict(root / "run", corpus, max_duration=2, save_interval=2, save_interval_unsharded=2),
    )
    assert run_train(config) == 0
    return root / "run"
