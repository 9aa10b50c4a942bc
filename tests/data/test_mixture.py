"""Data mixtures (``data.mixture``, issue 26): sources of unequal sizes drawn by target token ratios, one of them
repeated; the realized shares, the determinism of the selection, the refusal of a mix that cannot be met, and
training on a mixture (``mixture.json``, exact resume)."""

import json
from pathlib import Path

import numpy as np
import pytest

from olmo.config import TrainConfig
from olmo.data import build_memmap_dataset
from olmo.data.mixture import allocate
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config

CHUNK = 32  # tiny_config_dict's max_sequence_length


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[str]]:
    """Three sources of 300, 60 and 20 instances of 32 tokens (web in two files)."""
    root = tmp_path_factory.mktemp("sources")
    write_byte_memmap(root / "web-0.npy", 200 * CHUNK)
    write_byte_memmap(root / "web-1.npy", 100 * CHUNK, skip_bytes=300_000)
    write_byte_memmap(root / "code.npy", 60 * CHUNK, skip_bytes=600_000)
    write_byte_memmap(root / "math.npy", 20 * CHUNK, skip_bytes=700_000)
    return {
        "web": [str(root / "web-*.npy")],
        "code": [str(root / "code.npy")],
        "math": [str(root / "math.npy")],
    }


def _mixture(sources, ratios=(0.6, 0.3, 0.1), repetitions=(1.0, 2.0, 4.0), **extra):
    return {
        "seed": 7,
        **extra,
        "sources": [
            {"name": name, "paths": sources[name], "ratio": r, "max_repetition": m}
            for name, r, m in zip(("web", "code", "math"), ratios, repetitions)
        ],
    }


def _config(tmp_path, sources, **overrides) -> TrainConfig:
    overrides = {"data.paths": None, "data.mixture": _mixture(sources), **overrides}
    return TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", [], **overrides))


def test_allocation_adds_up_and_rounds_by_largest_remainder():
    assert allocate([0.6, 0.3, 0.1], 10) == [6, 3, 1]
    assert allocate([1 / 3, 1 / 3, 1 / 3], 10) == [4, 3, 3]
    counts = allocate([0.123, 0.456, 0.421], 9_999)
    assert sum(counts) == 9_999 and all(abs(c - r * 9_999) < 1 for c, r in zip(counts, [0.123, 0.456, 0.421]))


def test_realized_shares_follow_the_targets_and_a_small_source_repeats(tmp_path, sources):
    cfg = _config(tmp_path, sources, max_duration=50)  # 50 steps x 8 instances = 400 instances
    cfg.validate(1)
    dataset = build_memmap_dataset(cfg, cfg.data)
    assert len(dataset) == 400
    drawn = [dataset[i]["metadata"]["source"] for i in range(len(dataset))]
    counts = {name: drawn.count(name) for name in ("web", "code", "math")}
    assert counts == {"web": 240, "code": 120, "math": 40}
    plan = dataset.mixture_plan.as_json()["sources"]
    assert [(s["name"], s["instances"], s["repetition"]) for s in plan] == [
        ("web", 240, 0.8),
        ("code", 120, 2.0),
        ("math", 40, 2.0),
    ]
    for s in plan:
        assert abs(s["realized_ratio"] - s["target_ratio"]) <= 1 / 400  # the nearest whole instance
    # Each math instance twice (two whole passes); web's 240 of 300 distinct, drawn with the seed.
    math_ids = [i for i in range(len(dataset)) if drawn[i] == "math"]
    math_tokens = {dataset[i]["input_ids"].numpy().tobytes() for i in math_ids}
    assert len(math_tokens) == 20
    web = dataset.selection.indices(0, 240)
    assert len(set(web.tolist())) == 240 and web.min() >= 0 and web.max() < 300  # distinct web instances
    # Deterministic: the same config gives the same instances.
    again = build_memmap_dataset(cfg, cfg.data)
    assert np.array_equal(again.selection.indices(), dataset.selection.indices())
    other_seed = _config(tmp_path, sources, max_duration=50, **{"data.mixture.seed": 8})
    other = build_memmap_dataset(other_seed, other_seed.data).selection
    assert not np.array_equal(other.indices(), dataset.selection.indices())


def test_a_mix_the_sources_cannot_meet_is_refused_with_the_numbers(tmp_path, sources):
    cfg = _config(
        tmp_path, sources, max_duration=50, **{"data.mixture": _mixture(sources, repetitions=(1, 2, 1.5))}
    )
    cfg.validate(1)
    with pytest.raises(
        OLMoConfigurationError,
        match=r"sources\[2\] \('math'\): ratio 0\.1 of 400 instances is 40 "
        r"instances, 2\.00x its 20 .* max_repetition=1\.5\. Raise max_repetition to 2\.0",
    ):
        build_memmap_dataset(cfg, cfg.data)


@pytest.mark.parametrize(
    "mixture, pattern",
    [
        (lambda s: _mixture(s, ratios=(0.6, 0.3, 0.2)), r"the ratios add up to 1\.1, not 1"),
        (lambda s: _mixture(s, ratios=(0.6, 0.5, -0.1)), r"sources\[2\]\.ratio=-0\.1 must be in \(0, 1\]"),
        (lambda s: {**_mixture(s), "sources": []}, r"data\.mixture\.sources is empty"),
        (lambda s: {**_mixture(s), "tokens": 5}, r"data\.mixture\.tokens=5 must be at least one instance"),
    ],
)
def test_an_impossible_mixture_is_refused_at_validation(tmp_path, sources, mixture, pattern):
    cfg = _config(tmp_path, sources, **{"data.mixture": mixture(sources)})
    with pytest.raises(OLMoConfigurationError, match=pattern):
        cfg.validate(1)


def test_mixture_and_paths_are_exclusive_and_names_are_names(tmp_path, sources):
    mixture = _mixture(sources)
    mixture["sources"][1]["name"] = "web"
    mixture["sources"][2]["name"] = "a/b"
    cfg = _config(tmp_path, sources, **{"data.paths": sources["code"], "data.mixture": mixture})
    with pytest.raises(OLMoConfigurationError) as error:
        cfg.validate(1)
    message = str(error.value)
    assert "exclusive with data.paths" in message and "'web' is used 2 times" in message
    assert "name='a/b' must be letters" in message


def test_training_on_a_mixture_records_it_and_resumes_exactly(tmp_path, sources):
    def config(folder: Path) -> Path:
        cfg = tiny_config_dict(folder, [], max_duration=6, save_interval_unsharded=3)
        cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
        return write_config(folder.parent / f"{folder.name}.yaml", cfg)

    full = tmp_path / "full"
    assert run_train(config(full)) == 0
    record = json.loads((full / "train_data" / "mixture.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["web", "code", "math"]
    assert record["total_instances"] == 48 and sum(s["instances"] for s in record["sources"]) == 48
    assert {k for k in record["sources"][0]} >= {
        "name",
        "target_ratio",
        "realized_ratio",
        "tokens",
        "instances",
        "repetition",
    }

    parts = tmp_path / "parts"
    assert run_train(config(parts), "--stop_at=3") == 0
    assert run_train(config(parts), "--try_load_latest_save") == 0

    def losses(folder: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/CrossEntropyLoss"] for r in rows if "train/CrossEntropyLoss" in r}

    assert losses(parts) == losses(full)
    # What step 5 trained on, asked of the resumed run and of the uninterrupted one: the same instances.
    from olmo.testing import run_main as _run_main

    answers = []
    for folder in (full, parts):
        rows = _run_main("inspect_batch.py", folder, "--step", "5", "--json")
        answers.append([(r.index, r.source, r.path, r.offset) for r in rows])
    assert answers[0] == answers[1] and all(a[1] in ("web", "code", "math") for a in answers[0])
    assert (parts / "train_data" / "mixture.json").read_text() == (
        full / "train_data" / "mixture.json"
    ).read_text()
    from olmo.testing import run_main

    assert run_main("plot_metrics.py", full) == 0
    assert (full / "plots" / "loss_by_source.png").stat().st_size > 0


def test_inspect_batch_names_each_instances_source(tmp_path, sources, capsys):
    """An entry of global_indices.npy is a position in the selection; mixture.json's ranges say whose."""
    from olmo.testing import run_main

    cfg = tiny_config_dict(tmp_path / "run", [], max_duration=3)
    cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
    assert run_train(write_config(tmp_path / "c.yaml", cfg)) == 0
    ranges = {
        s["name"]: s["positions"]
        for s in json.loads((tmp_path / "run/train_data/mixture.json").read_text())["sources"]
    }
    capsys.readouterr()
    run_main("inspect_batch.py", tmp_path / "run", "--step", "3", "--json")
    instances = json.loads(capsys.readouterr().out)
    assert len(instances) == 8
    for inst in instances:
        low, high = ranges[inst["source"]]
        assert low <= inst["index"] < high
        assert Path(inst["file"]).name.startswith(inst["source"])  # web-0.npy, code.npy, math.npy
        assert inst["documents"] == [] and inst["document_metadata"] is False  # no dolma metadata beside them


def test_the_run_plan_shows_the_shares_and_a_dry_run_writes_nothing(tmp_path, sources, capsys):
    from olmo.testing import run_main

    cfg = tiny_config_dict(tmp_path / "run", [], max_duration=50)
    cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
    assert run_main("train.py", write_config(tmp_path / "c.yaml", cfg), "--dry_run") == 0
    out = capsys.readouterr().out
    assert "mixture (mixture.json):" in out
    assert "web: 60.00% of tokens (target 60.00%), 240 instances, 0.80x its 300" in out
    assert "math: 10.00% of tokens (target 10.00%), 40 instances, 2.00x its 20" in out
    assert not (tmp_path / "run").exists()


def test_an_anneal_stage_trains_on_its_own_mixture(tmp_path, sources, capsys):
    """Stage 2 of a two-stage run anneals on a different mix of the sources, recorded as mixture-anneal.json, and
    inspect_batch --json names the sources of its steps (stage 1's have none). Its mixture.tokens is null: it draws
    what the stage trains."""
    from olmo.testing import run_main

    mixture = _mixture(sources, ratios=(0.2, 0.4, 0.4), repetitions=(1, 2, 4))
    cfg = tiny_config_dict(tmp_path / "run", sources["code"], max_duration=None)
    cfg["stages"] = [
        {"name": "pretrain", "max_duration": 4},
        {"name": "anneal", "max_duration": 4, "kl_beta": 0.1, "data": {"mixture": mixture}},
    ]
    assert run_train(write_config(tmp_path / "c.yaml", cfg)) == 0
    record = json.loads((tmp_path / "run" / "train_data" / "mixture-anneal.json").read_text())
    assert [s["instances"] for s in record["sources"]] == [6, 13, 13]  # 0.2/0.4/0.4 of 32 instances
    assert not (tmp_path / "run" / "train_data" / "mixture.json").exists()  # stage 1 trains on data.paths
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 8
    # Per-source losses exist in the mixture stage (with its KL penalty) only.
    assert not any("train/code/CrossEntropyLoss" in r for r in rows if r["step"] <= 4)
    annealed = [r for r in rows if r["step"] > 4 and "train/CrossEntropyLoss" in r]
    assert len(annealed) == 4 and all("train/code/CrossEntropyLoss" in r and "train/KL" in r for r in annealed)
    capsys.readouterr()
    for step, named in ((2, False), (6, True)):
        run_main("inspect_batch.py", tmp_path / "run", "--step", str(step), "--json")
        instances = json.loads(capsys.readouterr().out)
        assert len(instances) == 8
        assert all((inst["source"] in ("web", "code", "math")) == named for inst in instances)
        if named:
            assert all(Path(inst["file"]).name.startswith(inst["source"]) for inst in instances)


def test_a_null_mixture_tokens_draws_what_its_data_segment_trains(tmp_path, sources):
    """In a staged run, the run's mixture is drawn for the stages that train on the run's data (a stage without its
    own data continues the one before), and a stage's own mixture for its segment; a length in epochs of the
    mixture itself is refused, naming the key."""
    from olmo.train.stages import plan_stages

    stages = [
        {"name": "a", "max_duration": 3},
        {"name": "b", "max_duration": "768T"},  # 3 steps of 8 x 32 tokens, continuing the run's mixture
        {"name": "c", "max_duration": 4, "data": {"mixture": _mixture(sources, ratios=(0.5, 0.25, 0.25))}},
        {"name": "d", "max_duration": 1},
    ]
    cfg = _config(tmp_path, sources, max_duration=None, stages=stages)
    cfg.validate(1)
    plan = plan_stages(cfg)
    assert [s.data.mixture.tokens for s in plan.stages] == [6 * 8 * CHUNK] * 2 + [5 * 8 * CHUNK] * 2
    assert plan.stages[0].data is plan.stages[1].data and plan.stages[2].data is plan.stages[3].data
    assert len(build_memmap_dataset(cfg, plan.stages[2].data)) == 40
    assert len(build_memmap_dataset(cfg, cfg.data)) == 48  # the same draw, from the config alone
    stages[3]["max_duration"] = "2ep"
    with pytest.raises(OLMoConfigurationError, match=r"stages\[2\]\.data\.mixture\.tokens is null.*'2ep'"):
        _config(tmp_path, sources, max_duration=None, stages=stages).validate(1)


@pytest.mark.parametrize("fused", [False, True])
def test_per_source_losses_reduce_exactly_to_the_overall_loss(tmp_path, sources, fused):
    """train/{source}/CrossEntropyLoss is each source's token-weighted mean: weighted by the labels each source had
    in the step's global batch (read back from the data order), they give train/CrossEntropyLoss."""
    cfg = tiny_config_dict(tmp_path / "run", [], max_duration=4, fused_loss=fused)
    cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
    config = write_config(tmp_path / "c.yaml", cfg)
    assert run_train(config) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/CrossEntropyLoss" in r]
    assert len(train_rows) == 4
    loaded = TrainConfig.load(config)
    dataset = build_memmap_dataset(loaded, loaded.data)
    order = np.fromfile(run / "train_data" / "global_indices.npy", dtype=np.uint32)
    batch = loaded.global_train_batch_size
    for r in train_rows:
        step = r["step"]
        drawn = [dataset[int(i)]["metadata"]["source"] for i in order[(step - 1) * batch : step * batch]]
        labels = {name: drawn.count(name) * (CHUNK - 1) for name in ("web", "code", "math")}  # T-1 labels a row
        logged = {name: r.get(f"train/{name}/CrossEntropyLoss") for name in labels}
        assert all((logged[n] is None) == (labels[n] == 0) for n in labels), (logged, labels)
        total = sum(logged[n] * labels[n] for n in labels if labels[n]) / sum(labels.values())
        assert total == pytest.approx(r["train/CrossEntropyLoss"], rel=1e-6)


def test_two_fsdp_ranks_train_the_mixture_as_one_process(tmp_path, sources):
    """The selection does not depend on the world size: 2 gloo ranks (FSDP) see the same instances and log the same
    overall and per-source losses as 1 process (rtol 1e-5)."""
    from olmo.testing import run_torchrun

    def config(name: str) -> Path:
        cfg = tiny_config_dict(tmp_path / name, [], max_duration=4, save_interval_unsharded=None)
        cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
        return write_config(tmp_path / f"{name}.yaml", cfg)

    assert run_train(config("single")) == 0
    proc = run_torchrun(2, config("fsdp"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def metrics(name: str) -> dict[int, dict]:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "train/CrossEntropyLoss" in r}

    single, fsdp = metrics("single"), metrics("fsdp")
    assert set(single) == set(fsdp) == {1, 2, 3, 4}
    for step in single:
        keys = {k for k in single[step] if k.startswith("train/") and k.endswith("CrossEntropyLoss")}
        assert len(keys) >= 3 and keys == {
            k for k in fsdp[step] if k.startswith("train/") and k.endswith("CrossEntropyLoss")
        }
        for key in keys:
            assert fsdp[step][key] == pytest.approx(single[step][key], rel=1e-5), (step, key)
    assert (tmp_path / "fsdp/train_data/mixture.json").read_text() == (
        tmp_path / "single/train_data/mixture.json"
    ).read_text()


def test_the_shipped_tiny_mixture_config_trains_on_the_stdlib_split_into_three_sources(tmp_path):
    """configs/tiny/OLMo-tiny-mix.yaml with its sources prepared as its header says (smaller globs here)."""
    import os
    import shutil
    import sysconfig

    from olmo.testing import run_main, run_script

    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "configs", tmp_path / "configs")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name, pattern in (("a-m", "[a-c]*.py"), ("n-z", "[p-s]*.py"), ("packages", "json/*.py")):
        result = run_script(
            "prepare_memmap_dataset.py", str(stdlib / pattern), "-o", f"data/mix/{name}", cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-2000:]
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        args = ["configs/tiny/OLMo-tiny-mix.yaml", "--max_duration=3", "--evaluators=[]", "--wandb=null"]
        assert run_main("train.py", *args) == 0
    finally:
        os.chdir(cwd)
    record = json.loads((tmp_path / "runs/OLMo-tiny-mix/train_data/mixture.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["stdlib-a-m", "stdlib-n-z", "packages"]
    assert [s["instances"] for s in record["sources"]] == [12, 7, 5]  # 0.5/0.3/0.2 of 3 x 8 instances
    rows = [json.loads(line) for line in (tmp_path / "runs/OLMo-tiny-mix/metrics.jsonl").read_text().splitlines()]
    assert any("train/packages/CrossEntropyLoss" in r for r in rows)


def test_label_masks_are_given_per_source_and_follow_their_instances(tmp_path, sources):
    """Each source's masks travel with its files: every drawn instance carries its own file's mask slice."""
    masks = {}
    for name, paths in sources.items():
        folder = Path(paths[0]).parent
        files = sorted(folder.glob(Path(paths[0]).name))
        mask_paths = []
        for i, f in enumerate(files):
            n = f.stat().st_size // 2
            mask = (np.arange(n) + i + len(name)) % 3 != 0  # a different pattern per file
            mask_path = tmp_path / f"{f.stem}-mask.npy"
            mask.tofile(mask_path)
            mask_paths.append(str(mask_path))
        masks[name] = mask_paths
    mixture = _mixture(sources)
    for src in mixture["sources"]:
        src["paths"] = [
            str(p) for p in sorted(Path(sources[src["name"]][0]).parent.glob(Path(sources[src["name"]][0]).name))
        ]
        src["label_mask_paths"] = masks[src["name"]]
    cfg = _config(tmp_path, sources, max_duration=10, **{"data.mixture": mixture})
    cfg.validate(1)
    dataset = build_memmap_dataset(cfg, cfg.data)
    for i in range(0, len(dataset), 7):
        item = dataset[i]
        path, offset = dataset.instance_location(i)
        mask_path = masks[item["metadata"]["source"]][
            [
                str(p) for s in mixture["sources"] for p in s["paths"] if s["name"] == item["metadata"]["source"]
            ].index(path)
        ]
        expected = np.fromfile(mask_path, dtype=np.bool_)[offset : offset + CHUNK]
        assert np.array_equal(item["label_mask"].numpy(), expected)
    one_masked = _mixture(sources)
    one_masked["sources"][0]["label_mask_paths"] = masks["web"]
    bad = _config(tmp_path, sources, **{"data.mixture": one_masked})
    with pytest.raises(OLMoConfigurationError, match=r"label masks are given for 1 of 3 sources"):
        bad.validate(1)


def test_a_mixture_keeps_the_instance_filter_and_document_masking(tmp_path, sources, capsys):
    """A source of repetitive instances: they are drawn at its ratio, dropped from the loss by the filter, and said
    so by inspect_batch --json; document masking runs on the mixture too."""
    from olmo.testing import run_main

    repetitive = tmp_path / "rep.npy"
    np.tile(np.array([65, 66], dtype=np.uint16), 20 * CHUNK // 2).tofile(repetitive)  # "ABAB...": 20 instances
    mixture = _mixture({**sources, "math": [str(repetitive)]})
    cfg = tiny_config_dict(tmp_path / "run", [], max_duration=3)
    cfg["data"] = {
        "paths": None,
        "num_workers": 0,
        "mixture": mixture,
        "instance_filter": {"repetition_max_period": 4, "repetition_min_period": 1, "repetition_max_count": 8},
        "generate_doc_lengths": True,
    }
    assert run_train(write_config(tmp_path / "c.yaml", cfg)) == 0
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    filtered = sum(r.get("train/FilteredInstances", 0) for r in rows)
    capsys.readouterr()
    seen = reported = 0
    for step in (1, 2, 3):
        run_main("inspect_batch.py", tmp_path / "run", "--step", str(step), "--json")
        for inst in json.loads(capsys.readouterr().out):
            if inst["source"] == "math":  # all repetitive; stdlib text can be too (long runs of '=' or spaces)
                assert inst["filtered"]
                seen += 1
            reported += inst["filtered"]
    assert seen > 0 and filtered == reported


def test_a_source_read_from_a_url_mixes_as_the_same_files_on_disk(tmp_path, sources):
    """A source at http:// (read by byte range) gives the same mixture, instances and losses as the local files."""
    from olmo.testing.http import FileServer

    folder = Path(sources["code"][0]).parent

    def config(name: str, code: list[str]) -> Path:
        cfg = tiny_config_dict(tmp_path / name, [], max_duration=3, save_interval_unsharded=None)
        mixture = _mixture({**sources, "code": code})
        cfg["data"] = {"paths": None, "num_workers": 0, "mixture": mixture}
        return write_config(tmp_path / f"{name}.yaml", cfg)

    assert run_train(config("local", sources["code"])) == 0
    with FileServer(folder) as server:
        assert run_train(config("remote", [server.url("code.npy")])) == 0

    def losses(name: str) -> list[float]:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["train/CrossEntropyLoss"] for r in rows if "train/CrossEntropyLoss" in r]

    assert losses("remote") == losses("local")
    local, remote = (
        json.loads((tmp_path / n / "train_data/mixture.json").read_text()) for n in ("local", "remote")
    )
    assert [s["instances"] for s in local["sources"]] == [s["instances"] for s in remote["sources"]]


def test_a_missing_source_file_is_named_by_its_source(tmp_path, sources):
    cfg = _config(
        tmp_path, sources, **{"data.mixture": _mixture({**sources, "code": [str(tmp_path / "gone.npy")]})}
    )
    cfg.validate(1)
    with pytest.raises(
        Exception, match=r"gone\.npy' \(an entry of data\.mixture\.sources\[1\]\.paths\) does not exist"
    ):
        build_memmap_dataset(cfg, cfg.data)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_draw_is_a_permutation_of_the_source(n):
    """The keyed permutation behind a partial pass: every instance exactly once over a whole pass, so the first k
    values are k distinct instances; another seed or source gives another order."""
    from olmo.data.mixture import _Permutation

    perm = _Permutation(n, (42, 0))
    values = [perm(x) for x in range(n)]
    assert sorted(values) == list(range(n))
    if n >= 64:
        assert values != [_Permutation(n, (43, 0))(x) for x in range(n)]
        assert values != [_Permutation(n, (42, 1))(x) for x in range(n)]
        assert values != list(range(n))


def test_an_olmo_scale_selection_takes_no_memory():
    """A billion-instance mix of a source drawn 1.5 times over: held in a few objects, answered position by position."""
    import pickle

    from olmo.config import MixtureConfig, MixtureSourceConfig
    from olmo.data.mixture import mixture_selection, plan_mixture

    mixture = MixtureConfig(
        seed=3,
        sources=[
            MixtureSourceConfig(name="web", paths=["x"], ratio=0.75, max_repetition=1.0),
            MixtureSourceConfig(name="math", paths=["y"], ratio=0.25, max_repetition=2.0),
        ],
    )
    plan = plan_mixture(mixture, [900_000_000, 200_000_000], 1_000_000_000, 4096)
    selection = mixture_selection(plan, [0, 900_000_000])
    assert len(pickle.dumps(selection)) < 10_000  # what each DataLoader worker receives
    assert len(selection) == 1_000_000_000
    assert 0 <= selection[0] < 900_000_000 and selection[749_999_999] < 900_000_000
    math_first_pass = [selection[750_000_000 + p] for p in (0, 1, 199_999_999)]
    assert math_first_pass == [900_000_000, 900_000_001, 1_099_999_999]  # whole passes come first, in order
    rest = {selection[950_000_000 + p] for p in range(1000)}  # the partial pass: distinct draws
    assert len(rest) == 1000 and all(900_000_000 <= r < 1_100_000_000 for r in rest)


def test_a_run_that_replaces_another_keeps_its_mixture_record(tmp_path, sources):
    """--save_overwrite (as ladder.py run --overwrite passes it) cleans the folder first, then the record is written."""
    cfg = tiny_config_dict(tmp_path / "run", [], max_duration=2, save_interval_unsharded=None)
    cfg["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
    config = write_config(tmp_path / "c.yaml", cfg)
    assert run_train(config) == 0
    assert run_train(config, "--save_overwrite") == 0
    record = json.loads((tmp_path / "run/train_data/mixture.json").read_text())
    assert record["total_instances"] == 16


def test_a_ladder_trains_each_size_on_the_mixture_of_its_base_config(tmp_path, sources):
    from olmo.testing import run_main

    repo = Path(__file__).resolve().parents[2]
    base = tiny_config_dict(tmp_path / "unused", [], save_data_indices=False)
    base["data"] = {"paths": None, "num_workers": 0, "mixture": _mixture(sources)}
    args = [
        str(repo / "configs/ladder/tiny.yaml"),
        f"--base_config={write_config(tmp_path / 'base.yaml', base)}",
        f"--dir={tmp_path / 'ladder'}",
        "--train_overrides=[console_log_interval=100,'evaluators=[]']",
        "--sizes=[{name: s16, d_model: 16, n_layers: 1, n_heads: 2}]",
        "--next_sizes=[]",
        "--sequence_length=32",
        "--chinchilla_multiple=0.02",
        "--batch.tokens_coefficient=256",
        "--batch.exponent=0",
        "--lr.warmup_tokens_per_param=0.05",
    ]
    assert run_main("ladder.py", "run", *args, "--size", "s16", "--overwrite") == 0
    record = json.loads((tmp_path / "ladder/s16/train_data/mixture.json").read_text())
    steps = [json.loads(line)["step"] for line in (tmp_path / "ladder/s16/metrics.jsonl").read_text().splitlines()]
    assert record["total_instances"] == max(steps) * 8  # the size's length, drawn 60/30/10
    assert [s["name"] for s in record["sources"]] == ["web", "code", "math"]
