"""Functions marked to stay in eager mode inside compiled blocks: wrapped only once something compiles, so a process
that never compiles does not import torch's compiler."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import olmo.cli.train_launch  # everything a training launch imports before it builds a model
from olmo.distributed.context_parallel import ContextParallel
from olmo.distributed.tensor_parallel import TensorParallelGroup
from olmo.model import moe
print("before", "torch._dynamo" in sys.modules, hasattr(ContextParallel.gather, "_torchdynamo_disable"))
from olmo.model.compile_guards import install_compile_guards
install_compile_guards()
install_compile_guards()  # once per process
marked = [ContextParallel.gather, TensorParallelGroup.all_reduce, moe._loop_matmul, moe.MoEFeedForward._experts_in_parallel]
print("after", all(getattr(f, "_torchdynamo_disable", False) for f in marked), hasattr(marked[0].__wrapped__, "__wrapped__"))
"""


def test_the_compiler_is_imported_only_when_something_compiles():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO, env=_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["before False False", "after True False"], result.stdout


def test_only_module_level_functions_can_be_marked():
    import pytest

    from olmo.model.compile_guards import eager_in_compiled

    def outer():
        @eager_in_compiled
        def inner():
            pass

    with pytest.raises(TypeError, match="only module-level functions and methods"):
        outer()


def _env():
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
