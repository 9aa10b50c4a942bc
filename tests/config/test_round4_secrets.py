"""Issue 50: a secret read with ``${oc.env:...}`` is masked in every form an error or a log line prints it in: a
parent folder named on its own, a sibling in the folder that holds it, the value normalized, made absolute or
resolved through a link. Real environment variables, the real config loader, real errors."""

import logging
import os

import pytest

import olmo.util.secrets as secrets
from olmo.checkpoint.restore import LaunchOptions, LaunchPlan, prepare_save_folder
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoError
from olmo.util.secrets import RedactingFilter, redact_text


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """What these tests note is forgotten afterwards (the registry is per process)."""
    monkeypatch.setattr(secrets, "_env_values", {})
    monkeypatch.setattr(secrets, "_env_folders", {})


def _load(tmp_path, text: str) -> TrainConfig:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return TrainConfig.load(path)


def test_a_parent_folder_of_a_secret_save_folder_is_masked(tmp_path, monkeypatch):
    """The issue's example: save_folder under a secret path, and the error names the folder above it."""
    (tmp_path / "acme-tenant-7f3k").write_text("a file where a folder should be")
    monkeypatch.setenv("R4_SECRET_ROOT", str(tmp_path / "acme-tenant-7f3k" / "runs"))
    cfg = _load(tmp_path, "save_folder: ${oc.env:R4_SECRET_ROOT}/run1\n")
    with pytest.raises(OLMoCheckpointError) as raised:
        prepare_save_folder(LaunchOptions.from_train_config(cfg), LaunchPlan(None))
    message = str(raised.value)
    assert "acme-tenant-7f3k" not in message, message
    assert "'${oc.env:R4_SECRET_ROOT}/..' is a file" in message


def test_every_form_of_a_secret_path_is_masked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real-bucket-q9z").mkdir()
    (tmp_path / "link-to-bucket").symlink_to(tmp_path / "real-bucket-q9z")
    monkeypatch.setenv("R4_TRAILING", str(tmp_path / "cust-zeta-111") + "/")
    monkeypatch.setenv("R4_RELATIVE", "./rel-omega-222/shards")
    monkeypatch.setenv("R4_LINKED", str(tmp_path / "link-to-bucket" / "data"))
    cfg = _load(
        tmp_path,
        "data:\n  paths: ['${oc.env:R4_TRAILING}/a.npy', '${oc.env:R4_RELATIVE}/b.npy', '${oc.env:R4_LINKED}/c.npy']\n",
    )
    assert cfg.data.paths[0].endswith("cust-zeta-111//a.npy")
    printed = {
        # normalized (the doubled slash gone), absolute, resolved through the link
        os.path.normpath(cfg.data.paths[0]): "${oc.env:R4_TRAILING}/a.npy",
        os.path.abspath(cfg.data.paths[1]): "${oc.env:R4_RELATIVE}/b.npy",
        os.path.realpath(cfg.data.paths[2]): "${oc.env:R4_LINKED}/c.npy",
        str(tmp_path / "rel-omega-222"): "${oc.env:R4_RELATIVE}/..",  # a parent on its own
        str(tmp_path / "real-bucket-q9z" / "step5"): "${oc.env:R4_LINKED}/../step5",  # a sibling
    }
    for path, shown in printed.items():
        message = str(OLMoError(f"'{path}' cannot be read."))
        assert message == f"'{shown}' cannot be read.", (path, message)
    # Log lines are masked the same way (the filter every handler of ours carries).
    record = logging.LogRecord(
        "x", logging.WARNING, __file__, 1, "Reading %s.", (str(tmp_path / "rel-omega-222"),), None
    )
    assert RedactingFilter().filter(record) and record.getMessage() == "Reading ${oc.env:R4_RELATIVE}/..."


def test_paths_that_merely_look_alike_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("R4_SECRET_DIR", str(tmp_path / "vault-aa11" / "inner"))
    _load(tmp_path, "save_folder: ${oc.env:R4_SECRET_DIR}\n")
    others = [
        str(tmp_path / "vault-aa112"),  # a longer name
        str(tmp_path / "vault-aa11.npy"),
        str(tmp_path / "x" / "vault-aa11"),  # the same name in another folder
    ]
    for path in others:
        assert redact_text(f"'{path}'") == f"'{path}'"
    # A folder further up is masked only on its own, not where an unrelated path starts with it.
    assert redact_text(f"'{tmp_path}'") == "'${oc.env:R4_SECRET_DIR}/../..'"
    assert redact_text(str(tmp_path / "other")) == str(tmp_path / "other")
    # A short value (a number, a mode) is not masked anywhere.
    monkeypatch.setenv("R4_SHORT", "gpu")
    _load(tmp_path, "run_name: ${oc.env:R4_SHORT}\n")
    assert redact_text("a gpu run") == "a gpu run"
