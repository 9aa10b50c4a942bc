"""The training loop as a user meets it (issue 50, round 4): wrong callbacks refused before the run folder exists,
rewinds that would never end stopped at a limit, Ctrl-C twice aborting in one line that names what is lost, the
run summary naming the last checkpoint, and DTensor's warning kept for the redistributions it is about."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from olmo.cli.train import main
from olmo.distributed.tensor_parallel import quiet_exact_redistributions
from olmo.exceptions import OLMoConfigurationError, OLMoTrainingError
from olmo.testing import tiny_config_dict, write_byte_corpus, write_config
from olmo.train.callback import Callback, check_callbacks
from olmo.train.loop_control import MAX_REWINDS_TO_ONE_CHECKPOINT
from olmo.train.stop import EXIT_CODE_ABORTED

FIX = "Pass a list of instances of Callback subclasses"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path, corpus, **overrides):
    raw = tiny_config_dict(
        tmp_path / "run", corpus, **{"max_duration": 10, "save_interval_unsharded": 2, **overrides}
    )
    return str(write_config(tmp_path / "c.yaml", raw))


class NoArgument(Callback):
    def post_step(self):  # the loop passes a context
        pass


class NotAMethod(Callback):
    post_train = None


def _generator():
    yield Callback()


@pytest.mark.parametrize(
    "callbacks, expected",
    [
        ([None], "callbacks[0] is None"),  # the three examples
        (["progress"], "callbacks[0] is 'progress' (a str), not a Callback"),
        (
            [Callback(), NoArgument],
            "callbacks[1] is the class NoArgument, not an instance of it: write NoArgument(...)",
        ),
        # Variants: not a list at all, one callback alone, a non-Callback class or object, hooks the loop cannot
        # call, and a huge object shown in a few characters.
        ("progress", "callbacks is 'progress' (a str), not a list of callbacks"),
        (None, "callbacks is None (a NoneType), not a list of callbacks"),
        (_generator(), "not a list of callbacks"),
        (Callback(), "callbacks is one Callback, not a list of callbacks"),
        ([object], "callbacks[0] is the class object, which is not a Callback subclass"),
        ([print], "callbacks[0] is <built-in function print>"),
        ([NoArgument()], "callbacks[0] (NoArgument).post_step cannot be called with the loop's 1 argument(s)"),
        ([NotAMethod()], "callbacks[0] (NotAMethod) has a post_train that is not a method"),
        ([list(range(10**6))], "callbacks[0] is [0, 1, 2, 3, 4, 5, ...] (a list)"),
    ],
)
def test_wrong_callbacks_are_refused_naming_the_item_before_the_run_folder_exists(tmp_path, callbacks, expected):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    with pytest.raises(OLMoConfigurationError) as e:
        main([str(config)], callbacks=callbacks)
    assert expected in str(e.value) and FIX in str(e.value)
    assert len(str(e.value)) < 1000
    assert not (tmp_path / "run").exists()


def test_every_problem_of_a_callbacks_list_comes_in_one_message():
    with pytest.raises(OLMoConfigurationError) as e:
        check_callbacks([Callback(), None, "x", Callback])
    message = str(e.value)
    assert (
        "callbacks[1] is None" in message
        and "callbacks[2] is 'x'" in message
        and "callbacks[3] is the class" in message
    )
    assert check_callbacks((Callback(),))[0].__class__ is Callback  # a tuple is fine


class RewindAfterEveryStep(Callback):
    """Asks to go back before every step past the first checkpoint: without a limit, the run never ends."""

    def __init__(self):
        self.rewinds = 0

    def post_step(self, ctx):
        if ctx.step >= 3:
            ctx.loop.rewind(ctx.step, "after every step")

    def on_rewind(self, ctx):
        self.rewinds += 1


class RecoverByRewinding(RewindAfterEveryStep):
    """A variant: every step past the checkpoint fails, and the callback recovers from it by rewinding."""

    def post_step(self, ctx):
        if ctx.step >= 3:
            raise RuntimeError("a deterministic failure")

    def on_error(self, ctx):
        ctx.loop.rewind(ctx.step, "recovering from an error")


@pytest.mark.parametrize("callback", [RewindAfterEveryStep, RecoverByRewinding])
def test_rewinds_to_one_checkpoint_stop_at_the_limit_and_the_summary_names_the_last_checkpoint(
    tmp_path, corpus, callback, caplog
):
    asker = callback()
    with caplog.at_level(logging.INFO), pytest.raises(OLMoTrainingError) as e:
        main([_config(tmp_path, corpus)], callbacks=[asker])
    message = str(e.value)
    assert asker.rewinds == MAX_REWINDS_TO_ONE_CHECKPOINT
    assert "to the checkpoint of step 2 again" in message and "MAX_REWINDS_TO_ONE_CHECKPOINT" in message
    assert "--try_load_latest_save" in message
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == ["step2-unsharded"]  # nothing else deleted
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Run summary"))
    assert "global step: 3" in summary
    assert f"last checkpoint: step 2 ({tmp_path / 'run' / 'step2-unsharded'})" in summary
    assert "steps after it (not saved): 3-3" in summary


SLOW_SAVE = """
import sys, time
from olmo.cli.train import main
from olmo.train.callback import Callback
from olmo.util import exit_process, prepare_cli_environment


class SlowFinalSave(Callback):
    def pre_checkpoint(self, ctx):
        if ctx.step > 4:  # the save the first Ctrl-C asked for: the second Ctrl-C comes while it waits
            print("SAVING", flush=True)
            time.sleep(60)


prepare_cli_environment()
exit_process(main(sys.argv[1:], callbacks=[SlowFinalSave()]))
"""


def test_a_second_ctrl_c_aborts_in_one_line_naming_the_last_checkpoint_and_the_steps_lost(tmp_path, corpus):
    config = _config(tmp_path, corpus, max_duration=100_000, save_interval_unsharded=4)
    env = {**os.environ, "WANDB_MODE": "disabled", "OLMo_NONINTERACTIVE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SLOW_SAVE), config],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics, deadline = tmp_path / "run/metrics.jsonl", time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "SAVING"
        time.sleep(0.5)  # two signals that come before Python runs the handler of the first are handled as one
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)  # not the minute the save waits
    finally:
        proc.kill()
    assert proc.returncode == EXIT_CODE_ABORTED, stderr[-3000:]
    assert "Traceback" not in stderr
    first = next(line for line in stderr.splitlines() if "Received SIGINT: saving a checkpoint" in line)
    assert "A second Ctrl-C (SIGINT) aborts at once, without that checkpoint" in first
    assert "relaunch the same command with --try_load_latest_save" in first and str(tmp_path / "run") in first
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Received a second SIGINT: aborted without saving a checkpoint (exit code 130)")
    step = int(last.split("steps 5-")[1].split(" ")[0])
    assert step >= 6 and "last checkpoint: step 4 (" in last and "--try_load_latest_save" in last
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == ["step4-unsharded"]


def _torch_warning(target, collective):
    """Let torch itself warn, as a redistribution over two mesh dimensions does; the records that come out."""
    from torch.distributed.tensor import _redistribute

    class Mesh:  # what the warning reads of a DeviceMesh
        mesh_dim_names = ("shard", "tp")

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    _redistribute.logger.addHandler(handler)
    try:
        source = (Partial(), Partial()) if collective != "all_gather" else (Shard(0), Shard(0))
        _redistribute._warn_flatten_optimization_not_possible(
            Mesh(), (0, 1), source, target, 2, collective, "no_flattened_mesh"
        )
    finally:
        _redistribute.logger.removeHandler(handler)
    return [r.getMessage() for r in records]


@pytest.mark.parametrize(
    "target, collective, shown",
    [
        ((Replicate(), Replicate()), "all_gather", False),  # a full parameter: copies, nothing is added
        ((Replicate(), Replicate()), "all_reduce", False),  # the gradient norm: every rank adds the same
        ((Shard(0), Shard(0)), "reduce_scatter", True),  # not our case: still warned about
        ((Replicate(), Shard(0)), "all_reduce", True),
    ],
)
def test_dtensor_warns_of_inconsistent_reductions_only_where_they_can_happen(target, collective, shown):
    quiet_exact_redistributions()
    messages = _torch_warning(target, collective)
    assert len(messages) == int(shown)
    if shown:
        assert "inconsistent results between ranks" in messages[0]


class InterruptedAtStart(Callback):
    def pre_train(self, ctx):
        raise KeyboardInterrupt  # as Ctrl-C does where no handler of the loop catches it (setup, teardown)


def test_ctrl_c_outside_the_loop_ends_the_launch_in_one_line_with_the_abort_code(tmp_path, corpus, caplog):
    with caplog.at_level(logging.INFO):
        assert main([_config(tmp_path, corpus)], callbacks=[InterruptedAtStart()]) == EXIT_CODE_ABORTED
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("Interrupted (Ctrl-C) outside the training loop"), errors
    assert "Last checkpoint in" in errors[0] and ": none." in errors[0] and "--try_load_latest_save" in errors[0]
