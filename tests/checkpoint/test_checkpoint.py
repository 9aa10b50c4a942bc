import json
import shutil

import pytest
import torch

from olmo.checkpoint import (
    MARKER,
    find_latest_checkpoint,
    inspect_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_ephemeral_checkpoints,
    save_checkpoint,
)
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import tiny_config_dict


def _setup(tmp_path, seed=0):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"]))
    torch.manual_seed(seed)
    model = OLMo(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    model(torch.randint(0, 257, (2, 16))).logits.sum().backward()
    optimizer.step()
    return cfg, model, optimizer


@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip_restores_model_optimizer_and_trainer_state(tmp_path, sharded):
    cfg, model, optimizer = _setup(tmp_path)
    state = {"global_step": 3, "rng": {0: {"torch": torch.get_rng_state()}}}
    path = save_checkpoint(tmp_path, 3, model, optimizer, state, cfg, sharded=sharded)
    assert path.name == ("step3" if sharded else "step3-unsharded")
    assert (path / MARKER).is_file() and (path / "config.yaml").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "no temporary directory may remain"

    _, other_model, other_optimizer = _setup(tmp_path / "other", seed=1)
    restored = load_checkpoint(inspect_checkpoint(str(path)), other_model, other_optimizer)
    assert restored["global_step"] == 3
    assert torch.equal(restored["rng"][0]["torch"], state["rng"][0]["torch"])
    for (name, a), b in zip(model.state_dict().items(), other_model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), other_optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_unsharded_files_use_the_olmo_layout_and_load_with_weights_only(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"global_step": 1}, cfg, sharded=False)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MARKER, "config.yaml", "model.pt", "optim.pt", "train.pt"]
    )
    weights = torch.load(path / "model.pt", weights_only=True)
    assert "transformer.blocks.0.att_proj.weight" in weights and "transformer.wte.weight" in weights
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 1 and marker["files"]["model.pt"] == (path / "model.pt").stat().st_size


def test_discovery_needs_the_marker_and_prefers_sharded_at_equal_steps(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    for step, sharded in ((1, False), (2, False), (2, True)):
        save_checkpoint(tmp_path, step, model, optimizer, {}, cfg, sharded=sharded)
    (tmp_path / "step9-unsharded").mkdir()  # a crashed copy: no marker
    (tmp_path / ".step10.tmp-abcd").mkdir()  # an interrupted save
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step2"
    assert [(c.step, c.sharded) for c in list_checkpoints(tmp_path)] == [(1, False), (2, False), (2, True)]


def test_retention_keeps_the_newest(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, optimizer, {}, cfg, sharded=False)
        prune_checkpoints(tmp_path, sharded=False, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step3-unsharded", "step4-unsharded"]


def test_existing_checkpoint_is_replaced_only_with_overwrite(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    save_checkpoint(tmp_path, 1, model, optimizer, {"global_step": 1}, cfg, sharded=False)
    with pytest.raises(OLMoCheckpointError, match="--save_overwrite"):
        save_checkpoint(tmp_path, 1, model, optimizer, {"global_step": 1}, cfg, sharded=False)
    save_checkpoint(tmp_path, 1, model, optimizer, {"global_step": 99}, cfg, sharded=False, overwrite=True)
    assert torch.load(tmp_path / "step1-unsharded/train.pt", weights_only=True)["global_step"] == 99
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_original_olmo_checkpoint_without_marker_loads(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    legacy = tmp_path / "step5-unsharded"
    legacy.mkdir()
    torch.save(model.state_dict(), legacy / "model.pt")
    cfg.save(legacy / "config.yaml")
    info = inspect_checkpoint(str(legacy))
    assert (info.step, info.sharded, info.marked) == (5, False, False)
    _, other, _ = _setup(tmp_path / "o", seed=3)
    assert load_checkpoint(info, other, None, load_trainer_state=False) is None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_load_path_can_be_a_url(tmp_path, monkeypatch):
    import functools
    import http.server
    import threading

    import cached_path

    cached_path.set_cache_dir(tmp_path / "cache")
    cfg, model, optimizer = _setup(tmp_path)
    save_checkpoint(tmp_path / "served", 4, model, optimizer, {"global_step": 4}, cfg, sharded=False)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "served"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/step4-unsharded"
        info = inspect_checkpoint(url)
        assert (info.step, info.marked) == (4, True)
        _, other, other_optimizer = _setup(tmp_path / "o", seed=5)
        assert load_checkpoint(info, other, other_optimizer)["global_step"] == 4
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
        # A remote folder with neither the marker nor config.yaml (an upload that did not finish) is refused.
        partial = tmp_path / "served" / "step6-unsharded"
        partial.mkdir()
        shutil.copy(tmp_path / "served" / "step4-unsharded" / "model.pt", partial / "model.pt")
        with pytest.raises(OLMoCheckpointError, match="upload did not finish"):
            inspect_checkpoint(f"http://127.0.0.1:{server.server_address[1]}/step6-unsharded")
    finally:
        server.shutdown()
    # A server that wants credentials: the URL's are sent; wrong ones are named as such, masked, not as "no checkpoint".
    from olmo.testing.http import FileServer

    with FileServer(tmp_path / "served", auth=("user", "pw-5ecret")) as guarded:
        url = guarded.url("step4-unsharded")
        assert inspect_checkpoint(url.replace("http://", "http://user:pw-5ecret@")).step == 4
        with pytest.raises(OLMoCheckpointError, match=r"user:\*\*\*@.*denied \(HTTP 401\).*netrc") as error:
            inspect_checkpoint(url.replace("http://", "http://user:wrong-9@"))
        assert "wrong-9" not in str(error.value)


def test_only_the_newest_ephemeral_checkpoint_survives(tmp_path):
    cfg, model, optimizer = _setup(tmp_path)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, {}, cfg, sharded=True, ephemeral=True)
        remove_ephemeral_checkpoints(tmp_path, keep_step=step)
    assert [(c.step, c.ephemeral) for c in list_checkpoints(tmp_path)] == [(2, True)]
    save_checkpoint(tmp_path, 3, model, optimizer, {}, cfg, sharded=True)
    remove_ephemeral_checkpoints(tmp_path)
    prune_checkpoints(tmp_path, sharded=True, keep=1)  # retention never counts ephemeral checkpoints
    assert [(c.step, c.ephemeral) for c in list_checkpoints(tmp_path)] == [(3, False)]


def test_a_run_with_ephemeral_saves_ends_with_regular_checkpoints(tmp_path):
    from olmo.testing import run_train, write_byte_memmap, write_config

    write_byte_memmap(tmp_path / "a.npy", 20_000)
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(tmp_path / "a.npy")],
        max_duration=7,
        save_interval=4,
        save_interval_ephemeral=1,
        save_interval_unsharded=None,
        stop_at=6,
    )
    config = write_config(tmp_path / "c.yaml", cfg)
    assert run_train(config) == 0
    # Ephemeral 1-3 went with step 4; the stop at 6 turned that step's ephemeral save into a regular one.
    assert [(c.step, c.ephemeral) for c in list_checkpoints(tmp_path / "run")] == [(4, False), (6, False)]
    assert run_train(config, "--try_load_latest_save", "--stop_at=null", "--save_interval_unsharded=7") == 0
    kinds = [(c.step, c.sharded, c.ephemeral) for c in list_checkpoints(tmp_path / "run")]
    # The final unsharded save is OLMo's; the step-7 ephemeral one stays as the newest restart point.
    assert kinds == [(4, True, False), (6, True, False), (7, False, False), (7, True, True)]


def test_background_save_holds_the_state_of_its_step_and_is_invisible_until_committed(tmp_path):
    from olmo.checkpoint import begin_checkpoint, commit_checkpoint, model_and_optim_state

    cfg, model, optimizer = _setup(tmp_path)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pending = begin_checkpoint(
        tmp_path,
        1,
        model_and_optim_state(model, optimizer, full=False),
        {"global_step": 1},
        cfg,
        sharded=True,
        background=True,
    )
    with torch.no_grad():  # the next optimizer steps overwrite the weights in place while the write runs
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    assert find_latest_checkpoint(tmp_path) is None
    path = commit_checkpoint(pending)
    assert find_latest_checkpoint(tmp_path) == path
    _, restored, _ = _setup(tmp_path / "o", seed=9)
    load_checkpoint(inspect_checkpoint(str(path)), restored, None, load_trainer_state=False)
    assert all(torch.equal(expected[k], v) for k, v in restored.state_dict().items())
