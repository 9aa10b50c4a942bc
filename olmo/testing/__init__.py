"""Helpers for tests (ours and users'): real text, tiny memmaps, tiny configs, short runs.

Tiny tests need a tiny vocabulary, so :func:`write_byte_memmap` stores real text (the Python
standard library's own source, always present offline) as byte-level tokens: ids 0-255 are bytes,
:data:`BYTE_EOS` ends each document. A model with ``vocab_size=257`` learns it quickly on CPU.
:mod:`olmo.testing.http` is a real HTTP file server (Range, latency, faults) for tests of remote data.

:func:`run_script` and :func:`run_torchrun` run the ``scripts/`` of the source checkout the tests run in
(:data:`REPO`): the nearest folder at or above pytest's working directory that holds ``scripts/train.py``.

May import every package below ``olmo.bench`` (``run_train`` records the metrics ``olmo.train`` logs).
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import yaml

from ..exceptions import OLMoError

__all__ = [
    "REPO",
    "BYTE_EOS",
    "BYTE_VOCAB",
    "write_byte_tokenizer",
    "stdlib_documents",
    "write_byte_memmap",
    "write_byte_corpus",
    "tiny_config_dict",
    "tiny_model_config",
    "write_config",
    "shrunk_copy",
    "SHRUNK_OLMO3_7B",
    "metric_by_step",
    "assert_same_weights",
    "forward_backward",
    "run_main",
    "run_train",
    "run_torchrun",
    "torchrun_command",
    "torchrun_launch",
    "run_script",
    "free_port",
]

BYTE_EOS = 256
BYTE_VOCAB = 257


def _find_checkout() -> Optional[Path]:
    here = Path.cwd().resolve()
    return next((folder for folder in (here, *here.parents) if (folder / "scripts/train.py").is_file()), None)


_CHECKOUT = _find_checkout()
"""Found when the tests import this module (their conftest.py does, as the session starts), before any test changes
the working directory."""


def __getattr__(name: str) -> Any:
    # REPO is looked up on use, so that tests outside a checkout fail only where they need one.
    if name == "REPO":
        return _scripts().parent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _scripts() -> Path:
    """The checkout's ``scripts/``, which :func:`run_script` and :func:`run_torchrun` run as a user does.

    :raises OLMoError: when the tests were not started in a checkout.
    """
    if _CHECKOUT is None:
        raise OLMoError(
            f"No source checkout holds the working directory {Path.cwd()}, so there is no scripts/ to run: start "
            f"pytest from the checkout, as make test does."
        )
    return _CHECKOUT / "scripts"


def stdlib_documents(max_bytes: int, skip_bytes: int = 0) -> list[bytes]:
    """Real text: the top-level standard-library modules in sorted order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[bytes] = []
    seen = total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        if seen + len(data) <= skip_bytes:
            seen += len(data)
            continue
        docs.append(data[: max_bytes - total])
        total += len(docs[-1])
        if total >= max_bytes:
            break
    return docs


def write_byte_memmap(
    path: Union[str, Path], n_tokens: int, skip_bytes: int = 0, dtype: str = "uint16"
) -> np.ndarray:
    """Write ``n_tokens`` byte-level tokens of real text (documents separated by EOS) as a headerless
    memmap, exactly like ``dolma tokens`` output; return the tokens."""
    tokens: list[int] = []
    for doc in stdlib_documents(n_tokens * 2, skip_bytes):
        tokens.extend(doc)
        tokens.append(BYTE_EOS)
        if len(tokens) >= n_tokens:
            break
    arr = np.asarray(tokens[:n_tokens], dtype=dtype)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    out = np.memmap(path, dtype=dtype, mode="w+", shape=arr.shape)
    out[:] = arr
    out.flush()
    return arr


def write_byte_corpus(root: Union[str, Path]) -> list[str]:
    """The end-to-end tests' training corpus: two token files in ``root`` (30,000 and 20,000 byte-level tokens of
    different stdlib text); returns their paths."""
    root = Path(root)
    write_byte_memmap(root / "a.npy", 30_000)
    write_byte_memmap(root / "b.npy", 20_000, skip_bytes=400_000)
    return [str(root / "a.npy"), str(root / "b.npy")]


def write_byte_tokenizer(path: Union[str, Path]) -> Path:
    """A tokenizer.json for the byte vocabulary of :func:`write_byte_memmap`: the 256 byte-level symbols, then
    ``<|endoftext|>`` (:data:`BYTE_EOS`); no merges. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = BYTE_EOS
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    assert tokenizer.get_vocab_size() == BYTE_VOCAB
    tokenizer.save(str(path))
    return Path(path)


def tiny_model_config(**overrides: Any) -> Any:
    """A small model config for model-level tests: 2 layers, d_model 32, 4 heads, vocabulary 100 (embedding 128),
    16 positions, RoPE, no dropout, EOS and padding id 0; ``overrides`` replace any field."""
    from ..config import ModelConfig

    fields: dict[str, Any] = dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        mlp_ratio=4,
        vocab_size=100,
        embedding_size=128,
        max_sequence_length=16,
        rope=True,
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return ModelConfig(**{**fields, **overrides})


def tiny_config_dict(save_folder: Union[str, Path], data_paths: list[str], **overrides: Any) -> dict[str, Any]:
    """A small, fast OLMo config (2 layers, d_model 32, byte vocabulary) as a plain dict.

    ``overrides`` use dotted keys: ``tiny_config_dict(..., **{"model.n_layers": 3})``.
    """
    cfg: dict[str, Any] = {
        "run_name": "tiny-test",
        "seed": 1234,
        "model": {
            "d_model": 32,
            "n_heads": 2,
            "n_layers": 2,
            "mlp_ratio": 4,
            "rope": True,
            "weight_tying": False,
            "include_bias": False,
            "layer_norm_with_affine": True,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "max_sequence_length": 32,
            "vocab_size": BYTE_VOCAB,
            "embedding_size": 320,
            "eos_token_id": BYTE_EOS,
            "pad_token_id": BYTE_EOS,
            "init_fn": "mitchell",
        },
        "optimizer": {"name": "adamw", "learning_rate": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        "scheduler": {"name": "cosine_with_warmup", "t_warmup": 3, "alpha_f": 0.1},
        "data": {"paths": list(data_paths), "num_workers": 0},
        "save_folder": str(save_folder),
        "save_interval": None,
        "save_interval_unsharded": 5,
        "max_duration": 10,
        "global_train_batch_size": 8,
        "device_train_microbatch_size": 4,
        "precision": "fp32",
        "max_grad_norm": 1.0,
        "wandb": None,
        "console_log_interval": 5,
        "no_pre_train_checkpoint": True,
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return cfg


def write_config(path: Union[str, Path], cfg: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


SHRUNK_OLMO3_7B: dict[str, Any] = {
    "model.d_model": 32,
    "model.n_heads": 4,
    "model.n_layers": 5,
    "model.mlp_hidden_size": 128,
    "model.sliding_window.pattern": [8, 8, 8, -1],
    "model.vocab_size": BYTE_VOCAB,
    "model.embedding_size": 320,
    "model.eos_token_id": BYTE_EOS,
    "model.pad_token_id": BYTE_EOS,
    "model.flash_attention": False,
    "data.num_workers": 0,
    "wandb": None,
    "compile": None,
}
"""The keys that shrink an OLMo 3 recipe (configs/official/OLMo-3-*.yaml) for :func:`shrunk_copy`: a few thousand
parameters on the byte vocabulary, windows shorter than the sequence on 3 of every 4 layers, the last layer full."""


def shrunk_copy(
    config: Union[str, Path],
    folder: Path,
    corpus: Union[str, Path],
    seq: int,
    batch: int,
    steps: Union[int, str],
    shrink: dict[str, Any],
    **changes: Any,
) -> Path:
    """The recipe ``config`` (a YAML file) with the dotted keys of ``shrink`` (what makes it tiny), this corpus,
    sequence length, batch (micro-batches of at most 2), length (checkpoint at the end) and ``changes``, written into
    ``folder`` under its own name; the run's checkpoints go to ``folder/run``. For tests that train a shipped recipe
    on a CPU."""
    from omegaconf import OmegaConf as om

    cfg = om.load(config)
    values = {
        **shrink,
        "model.max_sequence_length": seq,
        "data.paths": [str(corpus)],
        "global_train_batch_size": batch,
        "device_train_microbatch_size": min(batch, 2),
        "max_duration": steps,
        "save_interval": steps,
        "save_folder": str(folder / "run"),
        **changes,
    }
    for key, value in values.items():
        om.update(cfg, key, value, merge=False)
    folder.mkdir(parents=True)
    om.save(cfg, folder / Path(config).name)
    return folder / Path(config).name


def metric_by_step(run: Union[str, Path], key: str = "train/CrossEntropyLoss") -> dict[int, float]:
    """``key`` of each step a run logged, from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def run_main(script: str, *args: Any) -> Any:
    """Run ``scripts/SCRIPT ARGS...`` in this process: call ``olmo.cli.NAME.main([*ARGS])``, NAME being the script's
    name without ``.py``, and return what it returns (the exit status).

    Faster than :func:`run_script` (no interpreter start, no imports); errors propagate as exceptions.
    """
    import importlib

    module = importlib.import_module(f"olmo.cli.{Path(script).stem}")
    return module.main([str(a) for a in args])


def run_train(config_path: Union[str, Path], *args: str, record: Optional[list] = None) -> int:
    """Run ``scripts/train.py CONFIG ARGS...`` in this process; return its exit code.

    :param record: if given, every metrics dict logged is appended to it (training steps, then evaluations).
    """
    if record is None:
        return run_main("train.py", config_path, *args)
    from ..train.metrics import MetricsLogger

    original = MetricsLogger.log

    def logging_hook(self: MetricsLogger, step: int, metrics: dict[str, float], **kwargs: Any) -> None:
        record.append({"step": step, **metrics})
        original(self, step, metrics, **kwargs)

    MetricsLogger.log = logging_hook  # type: ignore[method-assign,assignment]
    try:
        return run_main("train.py", config_path, *args)
    finally:
        MetricsLogger.log = original  # type: ignore[method-assign]


def run_script(
    script: Union[str, Path], *args: Any, cwd: Optional[Union[str, Path]] = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python scripts/SCRIPT ARGS...`` as a user would (wandb disabled), capturing its output."""
    import os
    import sys

    path = _scripts() / script
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(path), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a test's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, config_path: Union[str, Path], *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``torchrun --nproc_per_node=N scripts/train.py CONFIG ARGS...`` on CPU
    (gloo), with a private rendezvous port, one thread per rank and wandb disabled."""
    return torchrun_launch(nproc, str(_scripts() / "train.py"), str(config_path), *args)


def torchrun_launch(nproc: int, *target: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``torchrun --nproc_per_node=N TARGET...`` (a script and its arguments, or
    ``-m MODULE ...``) on CPU (gloo), with a private rendezvous port, one thread per rank and wandb disabled."""
    import os
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
    ]
    return [*cmd, *target], {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def run_torchrun(
    nproc: int,
    config_path: Union[str, Path],
    *args: str,
    timeout: float = 300,
    cwd: Optional[Union[str, Path]] = None,
    env: Optional[dict[str, str]] = None,
) -> subprocess.CompletedProcess[str]:
    """Launch ``torchrun --nproc_per_node=N scripts/train.py CONFIG ARGS...`` on CPU (gloo), exactly as a
    user would, with a private rendezvous port and a timeout; return the finished process. ``env``: variables
    added to the workers' environment."""
    cmd, base = torchrun_command(nproc, config_path, *args)
    return subprocess.run(
        cmd, cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def assert_same_weights(first: Union[str, Path], second: Union[str, Path], tolerance: float = 1e-5) -> None:
    """Two ``model.pt`` files hold the same tensors within ``tolerance`` (relative and absolute)."""
    import torch

    a, b = torch.load(first, weights_only=True), torch.load(second, weights_only=True)
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=tolerance, atol=tolerance, msg=key)


def forward_backward(module: Any, x: Any, params: Optional[list[Any]] = None) -> tuple[Any, list[Any]]:
    """``module(x)`` and the gradients of the mean of its square with respect to ``x`` and ``params`` (default: the
    module's parameters), each ``.grad`` cleared first and after: a pass to compare (eager against compiled)."""
    tensors = [x, *(module.parameters() if params is None else params)]
    for t in tensors:
        t.grad = None
    out = module(x)
    out.float().square().mean().backward()
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads
