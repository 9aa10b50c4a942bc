"""No secret is written or printed: a run whose data, evaluators, tokenizer and ``load_path`` are URLs with
credentials (``user:password@``, a token before the host, a presigned query string, a password read with
``${oc.env:...}``) trains from real servers on 127.0.0.1 that demand them, and no file the run writes (config.yaml,
checkpoints, remote_files.json, metrics, wandb's offline files) and nothing any command prints (training, ``--help``,
the errors of a wrong password, an object store endpoint holding credentials, an upper-case scheme, generate.py's
--tokenizer) holds one of them."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from olmo.config import TrainConfig
from olmo.exceptions import OLMoError
from olmo.testing import (
    REPO,
    run_main,
    tiny_config_dict,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)
from olmo.testing.http import FileServer
from olmo.util.secrets import RedactingFilter

PASSWORD, TOKEN, SIGNATURE, ENV_PASSWORD = "pw-5ecret-1", "tok-5ecret-2", "sig-5ecret-3", "env-5ecret-4"
SECRETS = (PASSWORD, TOKEN, SIGNATURE, ENV_PASSWORD)


def _run(script: str, *args, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / script), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _refused(what: str, expected: str, script: str, *args, caplog, capsys) -> None:
    """``SCRIPT ARGS`` (in this process: a launch costs seconds) fails with an error saying ``expected``; neither
    the error nor anything printed or logged (as the console's log handler writes it) holds a secret."""
    capsys.readouterr()
    caplog.clear()
    with pytest.raises(OLMoError) as error:
        run_main(script, *args)
    assert expected in str(error.value), str(error.value)
    console = RedactingFilter()
    logged = [r.getMessage() for r in caplog.records if console.filter(r)]
    printed = capsys.readouterr()
    _assert_clean("\n".join([str(error.value), *logged, printed.out, printed.err]), what)


def _assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} in {where}:\n{text[max(0, text.find(secret) - 500) :][:1000]}"


def _assert_folder_clean(folder: Path) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret!r} in {path}"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    write_byte_memmap(root / "a.npy", 12_000)
    write_byte_memmap(root / "b.npy", 8_000, skip_bytes=200_000)
    write_byte_memmap(root / ENV_PASSWORD / "val.npy", 32 * 6, skip_bytes=400_000)  # a folder named by a secret
    (np.arange(12_000) % 5 > 0).tofile(root / "a_mask.npy")
    (np.arange(8_000) % 3 > 0).tofile(root / "b_mask.npy")
    write_byte_tokenizer(root / "tokenizer.json")
    return root


@pytest.mark.slow  # four launches of scripts/train.py (about 30 s) and five in this process
def test_no_secret_is_written_or_printed(served, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("DATA_PW", ENV_PASSWORD)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "OLMo_NONINTERACTIVE": "1",
        "DATA_PW": ENV_PASSWORD,
    }
    run = tmp_path / "run"
    with (
        FileServer(served, auth=("user", PASSWORD)) as with_password,
        FileServer(served, auth=(TOKEN, "")) as with_token,
        FileServer(served, auth=("user", ENV_PASSWORD)) as with_env,
        FileServer(served) as presigned,
    ):
        a = with_password.url("a.npy").replace("http://", f"http://user:{PASSWORD}@")
        b = with_token.url("b.npy").replace("http://", f"http://{TOKEN}@")
        mask_a = with_env.url("a_mask.npy").replace("http://", "http://user:${oc.env:DATA_PW}@")
        mask_b = presigned.url("b_mask.npy") + f"?X-Amz-Signature={SIGNATURE}&X-Amz-Expires=600"
        val = with_env.url("${oc.env:DATA_PW}/val.npy").replace("http://", "http://user:${oc.env:DATA_PW}@")
        tokenizer = with_password.url("tokenizer.json").replace("http://", f"http://user:{PASSWORD}@")
        cfg = tiny_config_dict(
            run,
            [a, b],
            **{
                "data.label_mask_paths": [mask_a, mask_b],
                "tokenizer.identifier": str(served / "tokenizer.json"),
                "max_duration": 4,
                "save_interval_unsharded": 2,
                "save_interval": 2,
                "eval_interval": 2,
                "evaluators": [
                    {"label": "val", "data": {"datasets": {"val": [val]}}},
                    {"label": "s", "type": "generate", "prompts": ["def "], "max_new_tokens": 2},
                ],
                "wandb": {"project": "secrets", "entity": None},
            },
        )
        config = write_config(tmp_path / "config.yaml", cfg)

        trained = _run("train.py", config, env=env)
        assert trained.returncode == 0, trained.stderr[-3000:]
        _assert_clean(trained.stdout + trained.stderr, "the training's output")
        _assert_folder_clean(run)
        assert list((run / "wandb").glob("offline-run-*/*.wandb"))  # wandb's files are in the run folder, checked

        # The saved config writes what the user wrote: the masked URLs and the interpolation, which loads as text.
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["data"]["paths"][0] == a.replace(PASSWORD, "***")
        assert saved["data"]["paths"][1] == b.replace(TOKEN, "***")
        assert saved["data"]["label_mask_paths"] == [
            mask_a.replace("${oc.env:DATA_PW}", "***"),  # a password part is masked, whatever wrote it
            mask_b.replace(SIGNATURE, "***").replace("=600", "=***"),
        ]
        written = val.replace("user:${oc.env:DATA_PW}@", "user:***@")  # the path keeps what the user wrote
        assert saved["evaluators"][0]["data"]["datasets"]["val"] == [written.replace("${", "\\${")]
        reloaded = TrainConfig.load_saved(run / "config.yaml")  # refuses interpolations: these are text
        assert reloaded.evaluators[0].data.datasets["val"] == [written]

        # A checkpoint served with a password: --load_path restores it (the URL's credentials are sent).
        with FileServer(tmp_path, auth=("user", PASSWORD)) as checkpoints:
            load = checkpoints.url("run/step4-unsharded").replace("http://", f"http://user:{PASSWORD}@")
            more = _run(
                "train.py",
                config,
                f"--load_path={load}",
                f"--save_folder={tmp_path / 'more'}",
                "--max_duration=6",
                env=env,
            )
            assert more.returncode == 0, more.stderr[-3000:]
            _assert_clean(more.stdout + more.stderr, "the resumed training's output")
            _assert_folder_clean(tmp_path / "more")
            _refused(
                "a wrong load_path's error",
                "401",
                "train.py",
                config,
                f"--load_path={load.replace(PASSWORD, ENV_PASSWORD)}",
                f"--save_folder={tmp_path / 'wrong'}",
                caplog=caplog,
                capsys=capsys,
            )

        helped = _run("train.py", config, f"--data.paths=[{a}]", "--help", env=env)
        assert helped.returncode == 0 and "data.paths" in helped.stdout
        _assert_clean(helped.stdout + helped.stderr, "--help")

        no_masks = ["--data.label_mask_paths=null", f"--save_folder={tmp_path / 'refused'}"]
        refused = {"caplog": caplog, "capsys": capsys}
        tokenizer_url = f"--tokenizer.identifier={tokenizer}"
        _refused(
            "a tokenizer URL's error",
            "tokenizer.identifier='http://user:***@",
            "train.py",
            config,
            tokenizer_url,
            *no_masks,
            **refused,
        )
        wrong_password = f"--data.paths=[{a.replace(PASSWORD, SIGNATURE)}]"
        _refused("a wrong password's error", "HTTP 401", "train.py", config, wrong_password, *no_masks, **refused)
        upper = f"--data.paths=[{a.replace('http://', 'HTTP://').replace('a.npy', 'missing.npy')}]"
        _refused("an upper-case URL's error", "answered 404", "train.py", config, upper, *no_masks, **refused)
        generate = ["--prompt=x", f"--tokenizer={tokenizer.replace('tokenizer.json', 'gone.json')}"]
        _refused(
            "generate.py --tokenizer's error",
            "user:***@",
            "generate.py",
            run / "step4-unsharded",
            *generate,
            **refused,
        )
    # A third party's error text (botocore naming an endpoint that holds credentials), printed by the script itself.
    endpoint = {
        "AWS_ENDPOINT_URL": f"http://AKIA:{PASSWORD}@no-such-host.invalid:9000",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
    }
    s3 = "--data.paths=[s3://bucket/a.npy]"
    result = _run("train.py", config, s3, *no_masks, env={**env, **endpoint})
    assert result.returncode != 0 and "no-such-host.invalid" in result.stderr, result.stderr[-3000:]
    _assert_clean(result.stdout + result.stderr, "an object store's error")
