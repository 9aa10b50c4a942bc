"""Scaling ladders (scripts/ladder.py): the tiny ladder end to end on CPU, the OLMo ladder's arithmetic against the
model's own counts and the trainer's batch rules, errors for impossible ladders, and the scaling-law fits."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.exceptions import OLMoCliError, OLMoConfigurationError
from olmo.ladder import NAMED_SIZES, fit_chinchilla, fit_loss_vs_compute, load_ladder, plan_ladder
from olmo.ladder.report import lr_schedule, read_metrics
from olmo.model import OLMo
from olmo.testing import run_main, run_script, tiny_config_dict, write_byte_memmap, write_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/ladder/tiny.yaml"
OLMO = REPO / "configs/ladder/olmo.yaml"
SIZES = (
    "[{name: s16, d_model: 16, n_layers: 1, n_heads: 2}, {name: s32, d_model: 32, n_layers: 2, n_heads: 2}, "
    "{name: s48, d_model: 48, n_layers: 2, n_heads: 2}]"
)


@pytest.fixture(scope="module")
def base_config(tmp_path_factory) -> Path:
    """A byte-level OLMo train config on stdlib text, with a validation-loss evaluator (no quickstart data needed)."""
    root = tmp_path_factory.mktemp("ladder-data")
    write_byte_memmap(root / "train.npy", 60_000)
    write_byte_memmap(root / "val.npy", 4_000, skip_bytes=500_000)
    cfg = tiny_config_dict(
        root / "unused",
        [str(root / "train.npy")],
        evaluators=[{"label": "val", "type": "lm", "data": {"paths": [str(root / "val.npy")]}}],
        device_eval_batch_size=16,
        save_data_indices=False,
    )
    return write_config(root / "base.yaml", cfg)


def _tiny(base_config: Path, tmp_path: Path, *extra: str) -> list[str]:
    """configs/ladder/tiny.yaml's rules, shrunk: 3 byte-level sizes of 1-2 layers, 32-token instances, 8-instance
    batches, 10-60 steps each."""
    return [
        str(TINY),
        f"--base_config={base_config}",
        f"--dir={tmp_path / 'ladder'}",
        "--train_overrides=[console_log_interval=100]",
        f"--sizes={SIZES}",
        "--next_sizes=[{name: s64, d_model: 64, n_layers: 3, n_heads: 4}]",
        "--sequence_length=32",
        "--chinchilla_multiple=0.02",
        "--batch.tokens_coefficient=256",
        "--batch.exponent=0",
        "--lr.warmup_tokens_per_param=0.05",
        *extra,
    ]


def _json(capsys) -> object:
    return json.loads(capsys.readouterr().out)


def test_tiny_ladder_runs_end_to_end_on_cpu(base_config, tmp_path, capsys):
    args = _tiny(base_config, tmp_path)
    assert run_main("ladder.py", "dry-run", *args, "--json") == 0
    plans = {p["size"]: p for p in _json(capsys)}
    assert list(plans) == ["s16", "s32", "s48", "s64"]
    for p in plans.values():
        assert p["global_batch_size_instances"] == 8 and p["global_batch_size_tokens"] == 256
        assert p["num_devices"] == p["dp_world_size"] == 1 and p["grad_accum_steps"] == 1
        assert p["max_steps"] == math.ceil(0.02 * 20 * p["num_non_embedding_params"] / 256)
        assert p["checkpoint_steps"] == sorted({math.ceil(p["max_steps"] / 2), p["max_steps"]})

    for size in ("s16", "s32", "s48"):
        assert run_main("ladder.py", "run", *args, "--size", size) == 0
        assert (tmp_path / "ladder/configs" / f"{size}.yaml").is_file()
    checkpoints = sorted(p.name for p in (tmp_path / "ladder/s16").glob("step*"))
    assert run_main("ladder.py", "run", *args, "--size", "s16", "--benchmark", "--steps=2", "--warmup=1") == 0
    benchmark = json.loads((tmp_path / "ladder/benchmarks/s16.json").read_text())
    assert benchmark["results"]["tokens_per_second"] > 0 and benchmark["setup"]["batch"]["global_batch"] == 8
    assert sorted(p.name for p in (tmp_path / "ladder/s16").glob("step*")) == checkpoints  # nothing saved
    capsys.readouterr()

    assert run_main("ladder.py", "status", *args, "--json") == 0
    status = {s["size"]: s for s in _json(capsys)}
    for size in ("s16", "s32", "s48"):
        assert status[size]["finished"]
        assert all(c["present"] and Path(c["path"]).is_dir() for c in status[size]["checkpoints"])
        assert "eval/val/CrossEntropyLoss" in status[size]["checkpoints"][-1]["metrics"]
    assert not status["s64"]["finished"] and not any(c["present"] for c in status["s64"]["checkpoints"])
    assert run_main("ladder.py", "status", *args) == 0
    text = capsys.readouterr().out
    assert "✔" in text and "✘" in text and "not started" in text

    out = tmp_path / "results"
    assert run_main("ladder.py", "results", *args, "--json", f"--out={out}") == 0
    results = _json(capsys)
    assert [r["size"] for r in results["rows"]] == ["s16", "s32", "s48", "s64"]
    assert results["metric"] == "eval/val/CrossEntropyLoss"
    losses = [r["fit_value"] for r in results["rows"][:3]]
    assert losses[0] > losses[2], losses  # the largest size learns most
    fit = results["fit"]
    assert fit["n_points"] == 3 and set(fit["params"]) == {"E", "A", "alpha"}
    assert fit["next_size"]["size"] == "s64" and math.isfinite(fit["next_size"]["predicted_loss"])
    assert fit["next_size"]["measured_loss"] is None
    assert (out / "loss_vs_compute.png").stat().st_size > 0 and json.loads((out / "results.json").read_text())

    assert run_main("ladder.py", "plot-lr", *args, "--size", "s16", f"--out={out}") == 0
    assert (out / "lr_s16.png").stat().st_size > 0
    (rung,) = plan_ladder(load_ladder(args[0], args[1:]), ["s16"])
    logged = [m["optim/learning_rate_group0"] for _, m in sorted(read_metrics(rung.save_folder).items()) if m]
    assert lr_schedule(rung)[1] == pytest.approx(logged)  # the plotted schedule is the one the trainer ran


def test_budgets_train_the_stable_phase_once_and_a_decay_branch_per_budget(base_config, tmp_path, capsys):
    args = _tiny(
        base_config,
        tmp_path,
        "--budgets=[1, 2]",
        "--decay_fraction=0.25",
        "--next_sizes=[{name: s64, d_model: 64, n_layers: 3, n_heads: 4, budgets: [1]}]",
    )
    assert run_main("ladder.py", "dry-run", *args, "--json") == 0
    plans = {p["size"]: p for p in _json(capsys)}
    for p in plans.values():
        length = 0.02 * 20 * p["num_non_embedding_params"] / 256
        budgets = p["budgets"]
        assert [b["budget"] for b in budgets] == ([1, 2] if p["size"] != "s64" else [1])
        for b in budgets:
            assert b["steps"] == math.ceil(b["budget"] * length) and b["decay_steps"] == round(0.25 * b["steps"])
            assert b["branch_step"] == b["steps"] - b["decay_steps"] and b["branch_step"] in p["checkpoint_steps"]
            assert b["load_path"] == str(tmp_path / f"ladder/{p['size']}/stable/step{b['branch_step']}-unsharded")
        assert p["max_steps"] == max(b["branch_step"] for b in budgets)  # the stable run ends at the last branch
        separate, trained = (
            sum(b["steps"] for b in budgets),
            p["max_steps"] + sum(b["decay_steps"] for b in budgets),
        )
        assert p["compute"]["saving"] == pytest.approx(separate / trained)

    for size in ("s16", "s32", "s48"):
        assert run_main("ladder.py", "run", *args, "--size", size) == 0
    ladder = load_ladder(args[0], args[1:])
    (rung,) = plan_ladder(ladder, ["s32"])
    stable = read_metrics(rung.save_folder)
    assert max(stable) == rung.plan.max_steps  # trained once, to the latest branch point
    for branch in rung.branches:
        logged = read_metrics(branch.save_folder)
        assert min(logged) == branch.start_step + 1 and max(logged) == branch.steps
        assert (branch.save_folder / f"step{branch.steps}-unsharded").is_dir()
        # The branch's schedule: the stable run's learning rate, then its own decay (to alpha_f at its end).
        steps, lrs = lr_schedule(rung, branch)
        merged = {**stable, **logged}
        assert lrs == pytest.approx([merged[s]["optim/learning_rate_group0"] for s in steps])
        assert lrs[branch.start_step - 1] == pytest.approx(rung.plan.learning_rate)
        assert lrs[-1] == pytest.approx(rung.plan.learning_rate * rung.cfg.scheduler.alpha_f)
        # Up to its branch point it is the stable run: same losses (the stable run's own checkpoint resumed).
        assert all(stable[s]["train/CrossEntropyLoss"] == merged[s]["train/CrossEntropyLoss"] for s in steps[:3])

    # A rerun finds everything done: no step is trained again.
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "ladder/s16").rglob("metrics.jsonl")}
    assert run_main("ladder.py", "run", *args, "--size", "s16") == 0
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    with pytest.raises(OLMoCliError, match=r"--budget 3: size 's16' has budgets 1, 2\. Pick one"):
        run_main("ladder.py", "run", *args, "--size", "s16", "--budget", "3")
    capsys.readouterr()

    assert run_main("ladder.py", "status", *args, "--json") == 0
    status = {s["size"]: s for s in _json(capsys)}
    assert all(b["finished"] and b["branch_point_present"] for s in ("s16", "s48") for b in status[s]["branches"])
    assert not status["s64"]["branches"][0]["finished"]
    assert run_main("ladder.py", "status", *args) == 0
    assert "budget 2x" in capsys.readouterr().out

    assert run_main("ladder.py", "results", *args, "--json") == 0
    results = _json(capsys)
    runs = [r["run"] for r in results["rows"]]
    assert runs == [f"{s}/budget-{m}x" for s in ("s16", "s32", "s48") for m in (1, 2)] + ["s64/budget-1x"]
    for size in ("s16", "s32", "s48"):
        one, two = (r["fit_value"] for r in results["rows"] if r["size"] == size)
        assert two < one, size  # twice the tokens, lower validation loss
    assert results["fit"]["n_points"] == 6
    chinchilla = results["chinchilla_fit"]
    assert chinchilla["n_points"] == 6 and set(chinchilla["params"]) == {"E", "A", "alpha", "B", "beta"}
    (prediction,) = results["fit"]["predictions"]
    assert prediction["run"] == "s64/budget-1x" and math.isfinite(prediction["chinchilla_predicted_loss"])
    total = results["compute"]["total"]
    assert (
        total["saving"] == pytest.approx(total["separate_runs_flops"] / total["total_flops"])
        and total["saving"] > 1
    )
    assert run_main("ladder.py", "results", *args) == 0
    assert "by L(N, D)" in capsys.readouterr().out


def test_olmo_ladder_plan_matches_the_models_counts_and_the_trainers_batch_rules(capsys):
    ladder = load_ladder(OLMO)
    rungs = plan_ladder(ladder)
    assert [r.name for r in rungs] == ["60M", "150M", "300M", "600M", "1B", "3B", "7B", "13B"]
    for rung in rungs:
        plan, cfg, name = rung.plan, rung.cfg, rung.name
        with torch.device("meta"):
            model = OLMo(cfg.model)
        assert plan.num_params == model.num_params() and plan.sequence_length == 4096
        n = model.num_params(include_embedding=False)
        assert plan.num_non_embedding_params == n
        assert abs(n / _size_of(name) - 1) < 0.10, f"{name} has {n:,} non-embedding parameters"
        # The trainer's own rules for the batch, accumulation and length, at the planned world size.
        devices, micro = plan.num_devices, plan.rank_microbatch_instances
        assert devices == plan.dp_world_size <= ladder.max_devices
        assert (
            cfg.global_train_batch_size
            == plan.global_batch_size_instances
            == devices * micro * plan.grad_accum_steps
        )
        assert cfg.grad_accum_steps(devices) == plan.grad_accum_steps and cfg.device_train_microbatch_size == micro
        assert plan.global_batch_size_tokens == cfg.tokens_per_batch
        assert plan.max_steps == cfg.max_steps(0)
        target = ladder.chinchilla_multiple * 20 * n
        assert target <= plan.total_tokens < target + plan.global_batch_size_tokens
        assert plan.train_flops == model.num_flops_per_token(4096) * plan.total_tokens
        # The batch rule (a power of two of instances near the target) and the LR rule.
        instances = (
            ladder.batch.tokens_coefficient * (n / ladder.batch.reference_params) ** ladder.batch.exponent / 4096
        )
        assert 0.5 <= plan.global_batch_size_instances / max(1.0, instances) <= 2
        lr = ladder.lr.coefficient * (n / ladder.lr.reference_params) ** ladder.lr.params_exponent
        assert cfg.optimizer.learning_rate == pytest.approx(lr) == plan.learning_rate
        assert plan.warmup_steps == math.ceil(n / plan.global_batch_size_tokens) == cfg.scheduler.t_warmup
        assert plan.fits and 0 < plan.est_peak_memory_gb <= plan.device_memory_gb
        assert rung.checkpoint_steps[-1] == plan.max_steps and cfg.save_interval == rung.checkpoint_steps[0]
    assert run_main("ladder.py", "dry-run", str(OLMO), "--size", "7B", "--json") == 0
    (seven,) = json.loads(capsys.readouterr().out)
    assert seven["size"] == "7B" and seven["num_devices"] == 64 and seven["grad_accum_steps"] >= 1


def test_the_shipped_tiny_ladder_plans_three_cpu_sized_rungs_and_a_next_size(tmp_path, monkeypatch):
    for split in ("train", "val"):  # the quickstart corpus, as configs/ladder/tiny.yaml globs it
        (tmp_path / "data/quickstart" / split).mkdir(parents=True)
        (tmp_path / "data/quickstart" / split / "part-00000.npy").write_bytes(b"\0" * 1024)
    monkeypatch.chdir(tmp_path)
    base = REPO / "configs/tiny/OLMo-tiny.yaml"
    rungs = plan_ladder(load_ladder(TINY, [f"--base_config={base}"]))
    assert [(r.name, r.is_next) for r in rungs] == [
        ("d64", False),
        ("d96", False),
        ("d128", False),
        ("d192", True),
    ]
    assert all(r.plan.num_devices == 1 and r.plan.device == "cpu" for r in rungs)
    # What the 4-minute budget on a 2-core CPU (RESEARCH_LOG.md) was measured for.
    assert sum(r.plan.total_tokens for r in rungs[:3]) == 32_768 + 110_592 + 262_144
    assert [e.label for e in rungs[0].cfg.evaluators] == ["stdlib-validation"] and rungs[0].cfg.wandb is None


def test_the_shipped_tiny_wsd_ladder_plans_three_budgets_per_size(tmp_path, monkeypatch):
    for split in ("train", "val"):
        (tmp_path / "data/quickstart" / split).mkdir(parents=True)
        (tmp_path / "data/quickstart" / split / "part-00000.npy").write_bytes(b"\0" * 1024)
    monkeypatch.chdir(tmp_path)
    base = REPO / "configs/tiny/OLMo-tiny.yaml"
    rungs = plan_ladder(load_ladder(REPO / "configs/ladder/tiny-wsd.yaml", [f"--base_config={base}"]))
    assert [(r.name, [b.multiple for b in r.branches]) for r in rungs] == [
        ("d64", [1, 2, 4]),
        ("d96", [1, 2, 4]),
        ("d128", [1, 2, 4]),
        ("d192", [1]),
    ]
    for rung in rungs[:3]:  # what RESEARCH_LOG 2026-11-26 measured
        assert rung.cfg.scheduler.name == "wsd" and rung.cfg.scheduler.t_decay == 0
        assert rung.compute()["saving"] == pytest.approx(7 / 4.6, rel=0.02)
        expected = [f"runs/ladder/tiny-wsd/{rung.name}/stable/step{b.start_step}-unsharded" for b in rung.branches]
        assert [b.cfg.load_path for b in rung.branches] == expected


def _size_of(name: str) -> float:
    return float(name[:-1]) * (1e9 if name.endswith("B") else 1e6)


def test_named_sizes_are_named_for_their_non_embedding_parameters():
    from olmo.config import ModelConfig

    for name, shape in NAMED_SIZES.items():
        with torch.device("meta"):
            model = OLMo(ModelConfig(include_bias=False, layer_norm_with_affine=False, **shape))
        assert abs(model.num_params(include_embedding=False) / _size_of(name) - 1) < 0.10, name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--sizes_=[a]"], r"Unknown ladder key 'sizes_'.*Did you mean 'sizes'"),
        (["--batch.exponet=1"], r"Unknown ladder key 'batch.exponet'.*Did you mean 'batch.exponent'"),
        (
            ["--sizes=[{name: a, d_modle: 64, n_layers: 2, n_heads: 2}]"],
            r"sizes\[0\]\.d_modle.*Did you mean 'sizes\[0\]\.d_model'",
        ),
        (
            ["--sizes=[huge]"],
            r"sizes\[0\] \(size 'huge'\) has no d_model, n_layers, n_heads: use a known size name",
        ),
        (
            ["--sizes=[{name: a, d_model: 100, n_layers: 2, n_heads: 3}]"],
            r"size 'a'.*d_model=100 must be divisible by n_heads=3",
        ),
        (["--sizes=[60M, 60M]"], r"size '60M' is listed more than once"),
        (["--base_config=nowhere.yaml"], r"base_config='nowhere.yaml' is not a file"),
        (["--sizes=[{name: a, d_model: 64, n_layers: 2, n_heads: 2, max_duration: 2ep}]"], r"size 'a'.*in epochs"),
        (["--assumed_mfu=1.5"], r"assumed_mfu=1.5 must be in \(0, 1\]"),
        (["--chinchilla_multiple=0"], r"chinchilla_multiple=0.0 must be positive"),
        (["--budgets=[1, 0]"], r"budgets: 0.0 must be a positive multiple"),
        (["--budgets=[2, 2]"], r"budgets=\[2.0, 2.0\] lists a budget twice"),
        (["--decay_fraction=1"], r"decay_fraction=1.0 must be between 0 and 1"),
        (["--decay_shape=cosin"], r"decay_shape='cosin' is not a decay shape; use one of linear, cosine, 1-sqrt"),
        (["--sizes=[{name: a, d_model: 64, n_layers: 2, n_heads: 2, budgets: [-1]}]"], r"size 'a'\): budgets: -1"),
    ],
)
def test_bad_ladder_values_are_reported_with_the_key_and_the_fix(overrides, message):
    with pytest.raises(OLMoConfigurationError, match=message):
        load_ladder(OLMO, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--sizes=[7B]", "--next_sizes=[]", "--max_devices=1", "--device_type=A10G"],
            r"size '7B': a micro-batch of 1 instance of 4096 tokens needs ~\d+.*GB per device on 1 x A10G.*more than "
            r"its 25.8 GB\. Set activation checkpointing.*raise max_devices",
        ),
        (
            [
                "--sizes=[{name: a, d_model: 256, n_layers: 2, n_heads: 4, global_batch_size: 10, rank_microbatch_size: 4}]",
                "--next_sizes=[]",
                "--max_devices=1",
            ],
            r"size 'a': global_batch_size=10 is not divisible by devices \(1\) x micro-batch \(4\) = 4\. Set its "
            r"global_batch_size to 8 or 12",
        ),
        (
            ["--sizes=[60M]", "--next_sizes=[]", "--chinchilla_multiple=0.01"],
            r"size '60M': the warmup \(\d+ steps.*is not shorter than the run.*Lower lr.warmup_tokens_per_param",
        ),
        (
            ["--sizes=[60M]", "--next_sizes=[]", "--budgets=[0.05, 1]", "--decay_fraction=0.5"],
            r"size '60M': budget 0.05 \(\d+ steps\) would branch at step \d+, inside the warmup",
        ),
        (
            [
                "--sizes=[{name: a, d_model: 256, n_layers: 2, n_heads: 4, max_duration: 100}]",
                "--budgets=[0.999, 1]",
            ],
            r"size 'a': budgets 0.999 and 1 are both 100 steps",
        ),
        (
            ["--sizes=[60M]", "--next_sizes=[]", "--device_type=TPU v9"],
            r"device_type='TPU v9': its memory is unknown",
        ),
    ],
)
def test_impossible_plans_name_the_size_and_the_fix(overrides, message):
    with pytest.raises(OLMoConfigurationError, match=message):
        plan_ladder(load_ladder(OLMO, overrides))


def test_run_refuses_a_launch_of_the_wrong_size(base_config, tmp_path):
    args = _tiny(base_config, tmp_path)
    with pytest.raises(OLMoCliError, match=r"Size\(s\) 'huge' not in ladder 'tiny': its sizes are s16, s32, s48"):
        run_main("ladder.py", "run", *args, "--size", "huge")
    two = [
        *args,
        "--max_devices=2",
        "--sizes=[{name: s16, d_model: 16, n_layers: 1, n_heads: 2, rank_microbatch_size: 4}]",
    ]
    with pytest.raises(
        OLMoCliError, match=r"planned for 2 device\(s\).*this launch has 1 process.*nproc_per_node=2"
    ):
        run_main("ladder.py", "run", *two, "--size", "s16")
    assert not (tmp_path / "ladder/s16").exists()


def test_ladder_errors_print_one_paragraph_without_a_traceback():
    result = run_script("ladder.py", "dry-run", OLMO, "--sizes=[60M]", "--max_devise=8")
    assert result.returncode == 1 and result.stdout == ""
    assert "OLMoConfigurationError: Unknown ladder key 'max_devise'" in result.stderr
    assert "Did you mean 'max_devices'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("--batch.exponent=1e6", r"batch\.exponent=1000000\.0 must be between -4 and 4"),
        ("--lr.params_exponent=-50", r"lr\.params_exponent=-50\.0 must be between -4 and 4"),
        ("--chinchilla_multiple=1e300", r"chinchilla_multiple=1e\+300 is more than 10,000"),
        ("--batch.tokens_coefficient=1e300", r"size '60M': the batch rule .*at most 1e\+09 tokens"),
    ],
)
def test_absurd_ladder_numbers_are_refused_with_their_bound(tmp_path, override, pattern):
    with pytest.raises(OLMoConfigurationError, match=pattern):
        run_main("ladder.py", "dry-run", OLMO, "--sizes=[60M]", override)
    with pytest.raises(OLMoConfigurationError, match=pattern):
        run_main("ladder.py", "run", OLMO, "--sizes=[60M]", f"--dir={tmp_path / 'ladder'}", "--size=60M", override)
    assert not (tmp_path / "ladder").exists()


def test_plot_lr_into_a_file_is_refused(tmp_path):
    (tmp_path / "plots").write_text("not a folder")
    with pytest.raises(OLMoCliError, match=r"--out='.*plots' cannot hold the output: .* is a file, not a folder"):
        run_main("ladder.py", "plot-lr", OLMO, "--sizes=[60M]", f"--out={tmp_path / 'plots'}")
    assert (tmp_path / "plots").read_text() == "not a folder"


def test_compute_fit_recovers_known_parameters_with_errors_that_cover_them():
    rng = np.random.default_rng(0)
    flops = np.geomspace(1e15, 1e19, 6)
    truth = {"E": 1.8, "A": 2000.0, "alpha": 0.2}
    loss = truth["E"] + truth["A"] * flops ** -truth["alpha"]
    fit = fit_loss_vs_compute(flops, loss + rng.normal(0, 0.005, 6), np.full(6, 0.005))
    for name, value in truth.items():
        assert abs(fit.params[name] - value) < 3 * fit.as_dict()["stderr"][name], (name, fit.as_dict())
    predicted, stderr = fit.predict(1e20)
    assert abs(predicted - (1.8 + 2000 * 1e20**-0.2)) < 3 * stderr < 0.05
    # Three exact points determine the three parameters; the measurement errors give their uncertainty.
    exact = fit_loss_vs_compute(flops[:3], loss[:3], np.full(3, 0.01))
    assert exact.params == pytest.approx(truth, rel=1e-6) and all(s is not None for s in exact.stderr)
    assert fit_loss_vs_compute(flops[:3], loss[:3]).stderr == [None, None, None]  # no errors, no spare points


def test_chinchilla_fit_recovers_known_parameters():
    n = np.repeat(np.geomspace(1e7, 1e9, 4), 3)
    d = n * np.tile([5.0, 20.0, 80.0], 4)
    truth = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}
    loss = truth["E"] + truth["A"] * n ** -truth["alpha"] + truth["B"] * d ** -truth["beta"]
    assert fit_chinchilla(n, d, loss).params == pytest.approx(truth, rel=1e-4)


def test_a_loss_that_falls_ever_faster_pins_the_irreducible_loss_at_zero():
    fit = fit_loss_vs_compute([1e15, 1e16, 1e17, 1e18], [4.0, 3.0, 1.9, 0.7])
    assert fit.params["E"] == 0.0 and fit.as_dict()["stderr"]["E"] is None and fit.params["alpha"] > 0
