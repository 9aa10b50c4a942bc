"""Checkpointer alone (no Trainer, no data): which checkpoints its schedule writes and keeps, what a train
module's ``state_dict_to_save`` puts in them, the final save, and restoring into a fresh module."""

import pytest
import torch

from olmo.checkpoint import inspect_checkpoint, list_checkpoints, safe_torch_load
from olmo.config import TrainConfig
from olmo.distributed.collectives import DistEnv
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import tiny_config_dict
from olmo.train.checkpointer import Checkpointer
from olmo.train.train_module import BasicTrainModule

ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _module(cfg, seed=0):
    torch.manual_seed(seed)
    model = OLMo(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    model(torch.randint(0, 257, (2, 16))).logits.sum().backward()
    optimizer.step()
    return BasicTrainModule(model, optimizer, learning_rate=1e-3)


def _checkpointer(tmp_path, module=None, **settings):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", ["x.npy"], **settings))
    module = module or _module(cfg)
    saves = []  # (gather_all_ranks,) per trainer-state request

    def trainer_state(gather_all_ranks):
        saves.append(gather_all_ranks)
        return {"global_step": len(saves)}

    collected = []
    return Checkpointer(cfg, ENV, module, trainer_state, lambda: collected.append(1)), saves, collected


def _kinds(folder):
    return [(c.step, c.sharded, c.ephemeral) for c in list_checkpoints(folder)]


def test_schedule_retention_and_final_save(tmp_path):
    ckpt, saves, collected = _checkpointer(
        tmp_path,
        save_interval=2,
        save_interval_unsharded=3,
        save_interval_ephemeral=1,
        save_num_checkpoints_to_keep=1,
        save_num_unsharded_checkpoints_to_keep=2,
        no_pre_train_checkpoint=False,
    )
    ckpt.start(0)  # the pre-train checkpoint: every kind due at step 0
    assert _kinds(tmp_path / "run") == [(0, False, False), (0, True, False)]
    written = [ckpt.maybe_save(step) for step in range(1, 8)]
    assert written == [True] * 7  # every step is due for something (ephemeral every step)
    assert ckpt.maybe_save(7) is False  # already saved at this step
    assert ckpt.maybe_save(7, final=True) is True  # the final save of a finished run: unsharded
    # One regular sharded (the newest), two unsharded, the newest ephemeral (step 7, newer than sharded step 6).
    assert _kinds(tmp_path / "run") == [(6, False, False), (6, True, False), (7, False, False), (7, True, True)]
    assert len(collected) == len(saves)  # metrics are read back before every save
    assert saves.count(True) == 4  # unsharded saves gather every rank's RNG states: steps 0, 3, 6, 7


def test_saving_off_still_leaves_a_checkpoint_at_the_end(tmp_path):
    ckpt, saves, _ = _checkpointer(
        tmp_path, save_interval=None, save_interval_unsharded=None, no_pre_train_checkpoint=False
    )
    ckpt.start(0)
    assert not any(ckpt.maybe_save(step) for step in range(1, 4)) and saves == []
    assert ckpt.maybe_save(3, final=True)
    assert _kinds(tmp_path / "run") == [(3, False, False)]  # one process: an unsharded one


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoints_hold_what_the_module_saves_and_restore_into_a_fresh_module(tmp_path, sharded):
    ckpt, _, _ = _checkpointer(tmp_path, save_interval=None, save_interval_unsharded=None)
    ckpt.save(5, sharded=sharded)
    info = inspect_checkpoint(str(tmp_path / "run" / ("step5" if sharded else "step5-unsharded")))
    fresh = _module(ckpt.cfg, seed=1)
    restorer = Checkpointer(ckpt.cfg, ENV, fresh, lambda gather: {})
    assert restorer.load(info, load_optimizer_state=True, load_trainer_state=True) == {"global_step": 1}
    saved = ckpt.train_module.state_dict()
    restored = fresh.state_dict()
    assert all(torch.equal(v, restored["model"][k]) for k, v in saved["model"].items())
    assert all(
        torch.equal(v, restored["optim"]["state"][name][key])
        for name, values in saved["optim"]["state"].items()
        for key, v in values.items()
    )


class ModelOnlyModule(BasicTrainModule):
    """Keeps the optimizer out of its checkpoints (what a module with untrained state would override)."""

    def state_dict_to_save(self, sharded):
        state = self.state_dict(full=not sharded)
        state["optim"] = {"state": {}, "param_groups": state["optim"]["param_groups"]}
        return state


def test_state_dict_to_save_decides_what_goes_in(tmp_path):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", ["x.npy"]))
    base = _module(cfg)
    module = ModelOnlyModule(base.model, base.optimizer, learning_rate=1e-3)
    ckpt, _, _ = _checkpointer(tmp_path, module=module, save_interval=None, save_interval_unsharded=None)
    ckpt.save(2, sharded=False)
    optim = safe_torch_load(tmp_path / "run" / "step2-unsharded" / "optim.pt")
    assert optim["state"] == {} and len(optim["param_groups"]) == len(base.optimizer.param_groups)
