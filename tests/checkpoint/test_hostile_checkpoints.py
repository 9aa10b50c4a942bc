"""A crafted checkpoint never executes code: a pickle payload in any file of either layout, loaded
through every entry point (train.py --load_path and --try_load_latest_save, eval.py, unshard.py), is
refused with an OLMoCheckpointError (or, where that entry point never reads the file, ignored), and
the payload's side effect never happens."""

import dataclasses
import io
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import MARKER, list_checkpoints
from olmo.exceptions import OLMoCheckpointError, OLMoCliError, OLMoConfigurationError
from olmo.testing import run_main, run_script, run_train, tiny_config_dict, write_byte_memmap, write_config


class _Payload:
    """Unpickling this creates the file ``sentinel``: the proof that code from a checkpoint ran."""

    def __init__(self, sentinel: Path):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (exec, (f"open({self.sentinel!r}, 'w').close()",))


def _poison_torch_file(path: Path, sentinel: Path) -> None:
    torch.save({"state": _Payload(sentinel), "weight": torch.zeros(2)}, path)


def _poison_metadata(path: Path, sentinel: Path) -> None:
    """A real DCP ``Metadata`` object with the payload hidden inside one of its fields."""
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint: trusted here
    metadata.planner_data = {"hidden": _Payload(sentinel)}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _poison_distcp_bytes(folder: Path, sentinel: Path) -> None:
    """Point one non-tensor entry (an optimizer hyperparameter) at a payload appended to its shard file,
    exactly as an attacker who rewrites both files would."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    buffer = io.BytesIO()
    torch.save(_Payload(sentinel), buffer)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = next(
        i
        for i in metadata.storage_data
        if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata) and i.fqn.startswith("optim.")
    )
    info = metadata.storage_data[index]
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _poison_yaml(path: Path, sentinel: Path) -> None:
    with open(path, "a") as f:
        f.write(f"evil: !!python/object/apply:builtins.exec [\"open({str(sentinel)!r}, 'w').close()\"]\n")


def _remark(checkpoint: Path) -> None:
    """Update the marker's file sizes, as an attacker handing out a modified checkpoint would."""
    meta = json.loads((checkpoint / MARKER).read_text())
    meta["files"] = {rel: (checkpoint / rel).stat().st_size for rel in meta["files"]}
    (checkpoint / MARKER).write_text(json.dumps(meta))


# (layout, file, poison, read by eval.py, read by unshard.py)
PAYLOADS = {
    "unsharded/model.pt": ("unsharded", "model.pt", _poison_torch_file),
    "unsharded/optim.pt": ("unsharded", "optim.pt", _poison_torch_file),
    "unsharded/train.pt": ("unsharded", "train.pt", _poison_torch_file),
    "unsharded/config.yaml": ("unsharded", "config.yaml", _poison_yaml),
    "sharded/.metadata": ("sharded", "model_and_optim/.metadata", _poison_metadata),
    "sharded/distcp": ("sharded", "model_and_optim", _poison_distcp_bytes),
    "sharded/train/rank0.pt": ("sharded", "train/rank0.pt", _poison_torch_file),
    "sharded/config.yaml": ("sharded", "config.yaml", _poison_yaml),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with sharded and unsharded checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("hostile")
    write_byte_memmap(root / "a.npy", 8_000)
    cfg = tiny_config_dict(
        root / "run", [str(root / "a.npy")], max_duration=4, save_interval=2, save_interval_unsharded=2
    )
    assert run_train(write_config(root / "c.yaml", cfg)) == 0
    return root


def _poisoned_copy(run: Path, dest: Path, payload: str, step: int = 2) -> tuple[Path, Path]:
    layout, rel, poison = PAYLOADS[payload]
    shutil.copytree(run / "run", dest)
    checkpoint = dest / (f"step{step}" if layout == "sharded" else f"step{step}-unsharded")
    sentinel = dest.parent / f"{dest.name}-pwned"
    poison(checkpoint / rel, sentinel)
    _remark(checkpoint)
    return checkpoint, sentinel


def _config(run: Path, tmp_path: Path, **overrides) -> Path:
    cfg = tiny_config_dict(tmp_path / "new", [str(run / "a.npy")], max_duration=4, **overrides)
    return write_config(tmp_path / "c.yaml", cfg)


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_load_path(run, tmp_path, payload):
    checkpoint, sentinel = _poisoned_copy(run, tmp_path / "copy", payload)
    config = _config(run, tmp_path)
    if payload.endswith("config.yaml"):
        # Training never reads a checkpoint's config.yaml: the run goes on, and nothing executes.
        assert run_train(config, f"--load_path={checkpoint}") == 0
    else:
        with pytest.raises(
            OLMoCheckpointError, match=rf"Refusing to load '[^']*{Path(PAYLOADS[payload][1]).name}"
        ):
            run_train(config, f"--load_path={checkpoint}")
        assert not (tmp_path / "new").exists(), "a refused checkpoint must stop the launch before any write"
    assert not sentinel.exists()


@pytest.mark.parametrize("payload", ["unsharded/train.pt", "sharded/.metadata", "sharded/distcp"])
def test_try_load_latest_save_passes_over_a_crafted_newest_checkpoint(run, tmp_path, payload):
    layout = PAYLOADS[payload][0]
    folder = tmp_path / "run"
    checkpoint, sentinel = _poisoned_copy(run, folder, payload, step=4)
    # Leave the poisoned checkpoint as the only one of step 4.
    shutil.rmtree(folder / ("step4" if layout == "unsharded" else "step4-unsharded"))
    cfg = tiny_config_dict(
        folder, [str(run / "a.npy")], max_duration=4, save_interval=2, save_interval_unsharded=2
    )
    record: list = []
    assert run_train(write_config(tmp_path / "c.yaml", cfg), "--try_load_latest_save", record=record) == 0
    assert not sentinel.exists()
    assert [r["step"] for r in record if "train/CrossEntropyLoss" in r] == [3, 4], "resumed from step 2"
    assert list((folder).glob(f".{checkpoint.name}.damaged-*")), "the crafted checkpoint is moved aside"
    assert {c.step for c in list_checkpoints(folder)} == {2, 4}


@pytest.mark.parametrize(
    "payload",
    ["unsharded/model.pt", "unsharded/config.yaml", "sharded/.metadata", "sharded/distcp", "sharded/config.yaml"],
)
def test_eval(run, tmp_path, payload):
    checkpoint, sentinel = _poisoned_copy(run, tmp_path / "copy", payload)
    evaluators = f"--evaluators=[{{label: held, type: lm, data: {{paths: [{run / 'a.npy'}]}}}}]"
    out = tmp_path / "eval.json"
    if payload == "sharded/distcp":  # eval.py reads no optimizer entry: it evaluates, and nothing executes
        assert run_main("eval.py", checkpoint, evaluators, f"--out={out}") == 0
    else:
        error = OLMoConfigurationError if payload.endswith("config.yaml") else OLMoCheckpointError
        with pytest.raises(error, match="python/object|Refusing to load"):
            run_main("eval.py", checkpoint, evaluators, f"--out={out}")
        assert not out.exists()
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "payload", ["sharded/.metadata", "sharded/distcp", "sharded/train/rank0.pt", "sharded/config.yaml"]
)
def test_unshard(run, tmp_path, payload):
    checkpoint, sentinel = _poisoned_copy(run, tmp_path / "copy", payload)
    error = OLMoConfigurationError if payload.endswith("config.yaml") else OLMoCheckpointError
    with pytest.raises(error, match="python/object|Refusing to load"):
        run_main("unshard.py", checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not sentinel.exists()


def test_the_user_sees_one_paragraph_and_no_traceback(run, tmp_path):
    checkpoint, sentinel = _poisoned_copy(run, tmp_path / "copy", "sharded/.metadata")
    done = run_script("unshard.py", checkpoint, tmp_path / "out")
    assert done.returncode != 0
    assert "OLMoCheckpointError: Refusing to load" in done.stderr and ".metadata" in done.stderr
    assert "Traceback" not in done.stderr and "\x1b[" not in done.stderr
    assert not sentinel.exists()


def test_a_damaged_marker_makes_a_checkpoint_invisible(run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(run / "run", folder)
    (folder / "step4" / MARKER).write_text('{"step": 4, "shard')  # cut off mid-write
    (folder / "step4-unsharded" / MARKER).write_text("[]")
    assert {(c.step, c.sharded) for c in list_checkpoints(folder)} == {(2, False), (2, True)}
    with pytest.raises(OLMoCheckpointError, match=r"marker .*step4.* is damaged"):
        run_main("eval.py", folder / "step4")
    # A restart resumes from step 2 and replaces the invisible step-4 folders with good checkpoints.
    cfg = tiny_config_dict(
        folder, [str(run / "a.npy")], max_duration=4, save_interval=2, save_interval_unsharded=2
    )
    record: list = []
    assert run_train(write_config(tmp_path / "c.yaml", cfg), "--try_load_latest_save", record=record) == 0
    assert min(r["step"] for r in record) == 3
    assert {(c.step, c.sharded) for c in list_checkpoints(folder)} == {
        (2, False),
        (2, True),
        (4, False),
        (4, True),
    }


def test_eval_refuses_an_unwritable_out_and_names_its_own_argument(run, tmp_path):
    checkpoint = run / "run" / "step2-unsharded"
    (tmp_path / "file").write_text("")
    with pytest.raises(OLMoCliError, match=r"--out=.*file' is a file, not a folder"):
        run_main(
            "eval.py",
            checkpoint,
            f"--out={tmp_path / 'file' / 'eval.json'}",
            f"--evaluators=[{{label: held, type: lm, data: {{paths: [{run / 'a.npy'}]}}}}]",
        )
    with pytest.raises(OLMoCheckpointError, match=r"^CHECKPOINT_DIR '.*' does not exist") as error:
        run_main("eval.py", tmp_path / "step9-unsharded")
    assert "--load_path" not in str(error.value)


def test_refusals_carry_our_advice_not_torchs(run, tmp_path):
    checkpoint, _ = _poisoned_copy(run, tmp_path / "copy", "unsharded/train.pt")
    with pytest.raises(OLMoCheckpointError) as error:
        run_train(_config(run, tmp_path), f"--load_path={checkpoint}")
    message = str(error.value)
    assert "train.pt" in message and "weights-only" in message
    assert re.search(r"it asks to run or build (builtins\.)?exec,", message)  # the refused object, named
    assert "weights_only" not in message and "likely succeed" not in message  # torch's advice to unpickle it, not
    assert "bypass" not in message.lower() and "\x1b[" not in message and "\n" not in message


@pytest.mark.parametrize("payload", ["unsharded/train.pt", "unsharded/model.pt"])
def test_a_refused_file_from_a_url_is_named_by_its_url(run, tmp_path, payload):
    import functools
    import http.server
    import threading

    import cached_path

    checkpoint, sentinel = _poisoned_copy(run, tmp_path / "served", payload)
    cached_path.set_cache_dir(tmp_path / "cache")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(checkpoint.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{checkpoint.name}"
    try:
        with pytest.raises(OLMoCheckpointError, match="Refusing to load") as error:
            run_train(_config(run, tmp_path), f"--load_path={url}")
    finally:
        server.shutdown()
    message = str(error.value)
    assert f"'{url}/{payload.split('/')[1]}'" in message and str(tmp_path / "cache") not in message
    assert not sentinel.exists()


def test_a_changed_model_config_is_an_error_not_a_reason_to_pass_over_checkpoints(run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(run / "run", folder)
    cfg = tiny_config_dict(
        folder, [str(run / "a.npy")], max_duration=4, save_interval=2, save_interval_unsharded=2
    )
    with pytest.raises(OLMoCheckpointError, match="different model shape"):
        run_train(write_config(tmp_path / "c.yaml", cfg), "--try_load_latest_save", "--model.d_model=64")
    assert {c.step for c in list_checkpoints(folder)} == {2, 4}
    assert not list(folder.glob(".*damaged*"))


class _ShellPayload:
    def __reduce__(self):
        import os

        return (os.system, ("echo this must never run",))


def test_the_refusal_names_the_function_a_file_asks_for(tmp_path):
    from olmo.checkpoint.safe_reads import safe_torch_load

    torch.save({"weight": torch.zeros(2), "x": _ShellPayload()}, tmp_path / "model.pt")
    with pytest.raises(OLMoCheckpointError, match=r"it asks to run or build posix\.system, which is not a tensor"):
        safe_torch_load(tmp_path / "model.pt")


def test_eval_writes_over_its_own_results_only(run, tmp_path):
    """--out naming a file that is not an earlier result (a config, a system file), or a link, is refused before
    the evaluation; an earlier result is replaced whole."""
    checkpoint = run / "run" / "step2-unsharded"
    evaluators = f"--evaluators=[{{label: held, type: lm, data: {{paths: [{run / 'a.npy'}]}}}}]"
    precious = tmp_path / "passwd"
    precious.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "link.json").symlink_to(precious)
    for out, why in ((precious, "is not an earlier result"), (tmp_path / "link.json", "is a symlink")):
        with pytest.raises(OLMoCliError, match=f"--out=.* cannot be written: it (exists and )?{why}"):
            run_main("eval.py", checkpoint, f"--out={out}", evaluators)
    assert precious.read_text() == "root:x:0:0:root:/root:/bin/bash\n"
    result = tmp_path / "eval.json"
    for _ in range(2):  # the second run replaces the first run's result
        assert run_main("eval.py", checkpoint, f"--out={result}", evaluators) == 0
    assert json.loads(result.read_text())["step"] == 2 and not list(tmp_path.glob(".eval.json.tmp-*"))
