"""Settings for the whole test session, and the object-store servers (real ones, on 127.0.0.1) that several
test modules use."""

import os

import pytest
import torch

from olmo.testing import free_port

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one xdist worker per core, and every subprocess a test starts gets OMP_NUM_THREADS=1; torch's
    # default of one intra-op thread per core in each worker would put two busy threads on every core.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def s3_server():
    """A real S3 server on 127.0.0.1 with dummy credentials; boto3 finds it through AWS_ENDPOINT_URL."""
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "S3_PROFILE", "R2_PROFILE", "WEKA_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance-metadata address for credentials
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)  # never a developer's real profiles
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def gcs_server():
    """A real GCS (JSON API) server on 127.0.0.1; google-cloud-storage finds it through STORAGE_EMULATOR_HOST."""
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        yield
    server.stop()


SLOW_SIGNS = ("run_torchrun(", "run_train(", "run_script(", "run_main(", "subprocess.", "main([", "fit()")
"""Calls that train a model or start processes: a test that makes one (itself, through a helper of its module or
through a fixture) is left out of ``make test-quick``."""


def _makes_slow_calls(func, module, seen: set) -> bool:
    """Whether ``func``'s source, or that of a function of ``module`` it names (two levels down), makes one of the
    :data:`SLOW_SIGNS` calls."""
    import inspect
    import re

    if func in seen or len(seen) > 50:
        return False
    seen.add(func)
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if any(sign in source for sign in SLOW_SIGNS):
        return True
    helpers = (getattr(module, name, None) for name in set(re.findall(r"\b(_?[a-z]\w*)\(", source)))
    return any(
        inspect.isfunction(h) and h.__module__ == module.__name__ and _makes_slow_calls(h, module, seen)
        for h in helpers
    )


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` (left out of ``make test-quick``, the inner loop) every test that trains or starts processes;
    ``make test`` and CI run everything."""
    for item in items:
        function = getattr(item, "function", None)
        if function is None or item.get_closest_marker("slow") is not None:
            continue
        funcs = [function]
        for defs in item._fixtureinfo.name2fixturedefs.values():
            funcs.extend(d.func for d in defs)
        seen: set = set()
        if any(_makes_slow_calls(f, item.module, seen) for f in funcs):
            item.add_marker(pytest.mark.slow)
