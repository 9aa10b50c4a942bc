"""Careless inputs to the inspection and helper tools (issue 35), through their real entry points: each is refused
with one paragraph naming the file or flag and the fix, before anything is written, or answered at once."""

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from olmo.config import TrainConfig
from olmo.config.stage_sections import MAX_STEPS
from olmo.data import IterableDataset, batches_per_epoch, build_memmap_dataset, data_order_seed
from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.ladder.lock import run_lock
from olmo.testing import run_main, run_script, tiny_config_dict, write_config
from olmo.train.stability import SkipRange, locate_batch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_copy(tmp_path, run):
    """What inspect_batch.py reads of the run (its config and data order), to damage."""
    shutil.copy(run / "config.yaml", tmp_path / "config.yaml")
    shutil.copytree(run / "train_data", tmp_path / "train_data")
    return tmp_path


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


def test_inspect_batch_answers_a_far_step_at_once(run):
    start = time.perf_counter()
    rows = run_main("inspect_batch.py", run, "--step", 10**12)
    assert time.perf_counter() - start < 60  # walking its epochs one by one took hours
    cfg = TrainConfig.load_saved(run / "config.yaml")
    dataset = build_memmap_dataset(cfg, cfg.data)
    steps_per_epoch = batches_per_epoch(len(dataset), 8)
    epoch, batch = divmod(10**12 - 1, steps_per_epoch)
    order = IterableDataset(dataset, 8, seed=data_order_seed(cfg.data, cfg.seed), epoch=epoch).global_indices()
    assert [r.index for r in rows] == order[batch * 8 : (batch + 1) * 8].tolist()
    with pytest.raises(OLMoCliError, match=r"--step 1000000000001 is not a training step.*no run has more than"):
        run_main("inspect_batch.py", run, "--step", MAX_STEPS + 1)


def test_far_steps_after_skipped_batches_land_where_the_trainer_goes():
    """The arithmetic over whole epochs agrees with walking them, around and after epochs with skipped ranges."""
    ranges = [
        SkipRange("train_data", epoch, start, end, 0, 0, 0, "spike")
        for epoch, start, end in [(0, 8, 24), (0, 16, 40), (2, 0, 8), (3, 72, 80)]
    ]

    def walked(step: int, skipped: list) -> tuple[int, int]:  # the trainer's way: batch after batch
        trained = 0
        for epoch in range(step + 1):
            for batch in range(10):
                if any(r.epoch == epoch and r.start // 8 <= batch < -(-r.end // 8) for r in skipped):
                    continue
                trained += 1
                if trained == step:
                    return epoch, batch
        raise AssertionError("unreachable")

    for skipped in ([], ranges):
        for step in range(1, 12 * 10):
            assert locate_batch(step, 10, skipped, 8) == walked(step, skipped), (step, skipped)


def test_inspect_batch_names_the_bad_entry_of_a_damaged_order_file(run_copy):
    path = run_copy / "train_data" / "global_indices.npy"
    order = np.fromfile(path, dtype=np.uint32)
    order[8 + 5] = 1_000_000  # step 2's batch, position 5
    order.tofile(path)
    with pytest.raises(
        OLMoDataError,
        match=r"global_indices\.npy' holds 1000000 at entry 13 \(position 5 of step 2's batch.*only 312 instances",
    ):
        run_main("inspect_batch.py", run_copy, "--step", 2)
    assert len(run_main("inspect_batch.py", run_copy, "--step", 1)) == 8  # the other batches are intact


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{ranges: [", "it is not JSON"),
        ("[]", "it is JSON of another shape"),
        ('{"ranges": [{"epoch": 0}]}', "it is JSON of another shape"),
        ('{"ranges": "none"}', "it is JSON of another shape"),
        (
            '{"ranges": [{"order_dir": "train_data", "epoch": 0, "start": "8", "end": 16, "first_step": 2, '
            '"last_step": 2, "rolled_back_to": 1, "reason": "spike"}]}',
            "a range has start='8', not a count",
        ),
    ],
)
def test_inspect_batch_refuses_a_damaged_skipped_batches_file(run_copy, text, problem):
    (run_copy / "skipped_batches.json").write_text(text)
    with pytest.raises(OLMoDataError, match=r"skipped_batches\.json' is damaged") as e:
        run_main("inspect_batch.py", run_copy, "--step", 1)
    assert problem in str(e.value) and "delete it" in str(e.value)


def test_inspect_batch_reports_a_damaged_skipped_batches_file_as_one_paragraph(run_copy):
    (run_copy / "skipped_batches.json").write_text("not json")
    result = run_script("inspect_batch.py", run_copy, "--step", 1)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"OLMoDataError: '{run_copy / 'skipped_batches.json'}' is damaged: it is not JSON" in result.stderr


def test_plot_metrics_refuses_an_output_folder_that_is_a_file(tmp_path, run):
    image = tmp_path / "loss.png"
    image.write_bytes(b"an earlier plot")
    for out in (image, image / "plots"):
        message = f"--out '{out}' cannot hold the plots: '{image}' is a file, not a folder"
        with pytest.raises(OLMoCliError, match=re.escape(message)):
            run_main("plot_metrics.py", run, "--out", out)
    assert image.read_bytes() == b"an earlier plot"
    (run / "plots").write_text("not a folder")  # the default output folder
    try:
        with pytest.raises(OLMoCliError, match=r"The default output folder .*plots' cannot hold the plots"):
            run_main("plot_metrics.py", run)
    finally:
        (run / "plots").unlink()
    assert run_main("plot_metrics.py", run, "--out", tmp_path / "plots") == 0
    assert (tmp_path / "plots" / "loss.png").is_file()
    help_text = subprocess.run(
        [sys.executable, str(REPO / "scripts/plot_metrics.py"), "--help"], capture_output=True, text=True
    ).stdout
    assert "--out`` is always a folder" in help_text


def test_eval_never_writes_into_a_checkpoint(run):
    evaluated, other = run / "step2-unsharded", run / "step2"
    before = _digest(evaluated), _digest(other)
    for out in (evaluated, evaluated / "eval.json", evaluated / "new" / "eval.json", other / "eval.json"):
        for args in ([f"--out={out}"], ["--out", out]):
            with pytest.raises(OLMoCliError, match=r"nothing is ever written into a committed checkpoint") as e:
                run_main("eval.py", evaluated, *args)
            holder = evaluated if evaluated in (out, *out.parents) else other
            assert f"'{holder}'" in str(e.value) and f"--out={holder.parent}/eval-step2.json" in str(e.value)
    assert (_digest(evaluated), _digest(other)) == before
    assert not (evaluated / "new").exists()


def test_generate_refuses_a_prompt_that_is_not_utf8(run):
    # Python decodes argv with surrogateescape: the byte 0xe9 arrives as U+DCE9, and subprocess passes it back as is.
    result = run_script("generate.py", run / "step2-unsharded", "--prompt", "caf\udce9 au lait")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--prompt is not UTF-8 text: it holds the byte 0xe9 at character 3" in result.stderr


def _git(folder: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


def test_original_suite_names_a_bad_revision_and_leaves_no_temporary_folder(tmp_path):
    clone = tmp_path / "OLMo"
    (clone / "tests").mkdir(parents=True)
    (clone / "tests" / "test_one.py").write_text("def test_one():\n    pass\n")
    (clone / "conftest.py").write_text('TEST_MODEL = "gpt2"\n')
    (clone / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    _git(clone, "init", "-q")
    _git(clone, "add", ".")
    _git(clone, "commit", "-q", "-m", "tests")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHON": sys.executable}

    def suite(*args: str) -> subprocess.CompletedProcess:
        cmd = ["bash", str(REPO / "scripts/original_suite.sh"), str(clone), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    bad = suite("no-such-rev")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"COMMIT=no-such-rev is not a commit of {clone}") and "fetch" in bad.stderr
    assert list(temp.iterdir()) == []
    good = suite("HEAD")
    assert good.returncode == 0 and "1 passed" in good.stdout, good.stdout + good.stderr
    assert list(temp.iterdir()) == []  # removed once the tests ended


def test_a_second_ladder_run_of_a_size_is_refused(tmp_path, corpus):
    base = write_config(tmp_path / "base.yaml", tiny_config_dict(tmp_path / "unused", corpus))
    ladder = tmp_path / "ladder"
    args = [
        "run",
        REPO / "configs/ladder/tiny.yaml",
        f"--base_config={base}",
        f"--dir={ladder}",
        "--train_overrides=[console_log_interval=100]",
        "--sizes=[{name: s16, d_model: 16, n_layers: 1, n_heads: 2}]",
        "--next_sizes=[]",
        "--sequence_length=32",
        "--chinchilla_multiple=0.02",
        "--batch.tokens_coefficient=256",
        "--batch.exponent=0",
        "--size=s16",
    ]
    with run_lock(ladder, "s16") as lock:  # this process stands for the first launch
        result = run_script("ladder.py", *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"Size 's16' of the ladder in '{ladder}' is being trained by another launch" in result.stderr
        assert f"PID {os.getpid()} on " in result.stderr
        assert sorted(p.name for p in ladder.iterdir()) == [".locks"]  # nothing of the run was written
    with open(lock) as f:  # released with its holder
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
