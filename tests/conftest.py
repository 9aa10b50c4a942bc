"""Settings for the whole test session, and the object-store servers (real ones, on 127.0.0.1) that several
test modules use."""

import os

import pytest
import slow_list
import torch

from olmo.testing import free_port

SLOW = slow_list.read()
"""{node id: (seconds, seconds of its setup)} of the tests measured slow."""

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


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` (left out of ``make test-quick``, the inner loop) every test that :mod:`slow_list` names, and
    every test that shares a fixture of its module with one whose setup took that long (whichever of them runs first
    pays it); ``make test`` and CI run everything. A listed test that no longer exists stops the run."""
    stale = _stale(config, [item.nodeid for item in items])
    if stale and items:
        items.append(StaleSlowList.from_parent(items[0].session, name=f"tests/{slow_list.PATH.name}", stale=stale))
    shared = {}  # module: the fixtures of its own (module scope and wider) that a listed test uses
    for item in items:
        if SLOW.get(item.nodeid, (0.0, 0.0))[1] >= slow_list.THRESHOLD:
            shared.setdefault(item.nodeid.split("::")[0], set()).update(_module_fixtures(item))
    for item in items:
        own = shared.get(item.nodeid.split("::")[0], set())
        if item.nodeid in SLOW or own.intersection(_module_fixtures(item)):
            item.add_marker(pytest.mark.slow)


def _module_fixtures(item) -> set:
    """The fixtures ``item`` uses that its own module defines with module scope or wider (set up once, by the first
    test of the module that asks)."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.nodeid.split("::")[0]
    return {
        name
        for name, defs in (info.name2fixturedefs.items() if info else ())
        if defs and defs[-1].scope != "function" and defs[-1].baseid == module
    }


class StaleSlowList(pytest.Item):
    """A test that fails when :data:`SLOW` names tests that no longer exist: the list must not go stale silently.
    (An item, not an error at collection: under xdist each worker collects, and a worker's error reads as an internal
    error of the run.)"""

    def __init__(self, *, stale: list, **kwargs):
        super().__init__(**kwargs)
        self.stale = stale

    def runtest(self):
        raise AssertionError(
            f"tests/{slow_list.PATH.name} names tests that no longer exist (run make slow-list, or edit it): "
            + ", ".join(self.stale)
        )

    def repr_failure(self, excinfo):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, self.name


def _stale(config, node_ids: list) -> list:
    """The tests of :data:`SLOW` that this run collects the whole file of (a folder above it or the file itself is
    an argument) but did not find."""
    found = set(node_ids)
    files = {node_id.split("::")[0] for node_id in node_ids}
    roots = [(config.invocation_params.dir / arg).resolve() for arg in config.args if "::" not in arg]
    stale = []
    for node_id in SLOW:
        path = node_id.split("::")[0]
        full = config.rootpath / path
        whole = any(full == root or root in full.parents for root in roots)
        if whole and node_id not in found and (path in files or not full.exists()):
            stale.append(node_id)
    return stale


class _LongestFirst:
    """Orders the selected tests so that the longest start first on every xdist worker: ``--dist worksteal`` hands
    worker ``i`` the ``i``-th of consecutive equal chunks of the collection and lets an idle worker take the end of a
    busy one's chunk, so each chunk starts with its share of the long modules (grouped by their recorded seconds,
    each module's tests kept together and in order: module fixtures are set up once) and ends with short tests."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        groups: dict = {}
        for item in items:
            groups.setdefault(item.nodeid.split("::")[0], []).append(item)
        weight = {path: sum(SLOW.get(item.nodeid, (0.0,))[0] for item in group) for path, group in groups.items()}
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        sizes, left = [], len(items)
        for i in range(workers):  # as xdist's scheduler splits the collection among its idle workers
            sizes.append(left // (workers - i))
            left -= sizes[-1]
        chunks: list = [[] for _ in sizes]
        load = [0.0 for _ in sizes]
        for path in sorted(groups, key=lambda p: -weight[p]):
            group = groups[path]
            while group:
                open_chunks = [i for i in range(workers) if len(chunks[i]) < sizes[i]]
                i = min(open_chunks, key=lambda c: load[c])
                taken, group = group[: sizes[i] - len(chunks[i])], group[sizes[i] - len(chunks[i]) :]
                chunks[i].extend(taken)
                load[i] += sum(SLOW.get(item.nodeid, (0.0,))[0] for item in taken)
        items[:] = [item for chunk in chunks for item in chunk]


class _Unlisted:
    """Reports (a warning, never a failure: tests never assert times) the tests not marked slow that took
    :data:`slow_list.THRESHOLD` seconds or more in this run: the list is out of date for them."""

    def __init__(self):
        self.seconds: dict = {}
        self.unmarked: set = set()

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if "slow" not in report.keywords:
            self.unmarked.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter):
        late = sorted(
            (seconds, node_id)
            for node_id, seconds in self.seconds.items()
            if node_id in self.unmarked and seconds >= slow_list.THRESHOLD
        )
        if late:
            terminalreporter.write_sep(
                "=",
                f"{len(late)} tests not in tests/{slow_list.PATH.name} took >= "
                f"{slow_list.THRESHOLD:g} s (make slow-list updates it)",
                yellow=True,
            )
            for seconds, node_id in list(reversed(late))[:15]:
                terminalreporter.write_line(f"{seconds:6.2f}s {node_id}")
            if len(late) > 15:
                terminalreporter.write_line(f"and {len(late) - 15} more (a busy machine makes many tests slower)")


def pytest_configure(config):
    config.pluginmanager.register(_LongestFirst(), "longest-first")
    config.pluginmanager.register(_Unlisted(), "unlisted-slow-tests")
