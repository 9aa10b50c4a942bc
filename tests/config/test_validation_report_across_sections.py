"""The one report of every problem in a config, exactly as users read it, for configs whose problems lie between
sections: stages (against ``max_duration``, the run's data and each other), mixtures (against the lengths that train
on them), evaluators (against the run's batch size and the model) and the tokenizer they use, the run's name in its
folders, and non-finite values anywhere; and the warnings about settings that have no effect. See
``test_validation_report.py``; these reports too were captured from the code before the checks moved (issue 37)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from olmo.config import TrainConfig, eval_sections
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import tiny_config_dict

KNOWN_LABELS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "piqa", "sciq")
"""The downstream labels ``olmo_eval`` is made to know here, so that the report's list of them is short and does
not change with its version."""


def _config(save_folder: str = "runs/golden", **overrides: Any) -> TrainConfig:
    return TrainConfig.from_dict(tiny_config_dict(save_folder, ["data/a.npy"], **overrides))


REPORTS = [
    pytest.param(
        {
            "max_duration": 30,
            "data.paths": None,
            "data.label_mask_paths": ["data/m.npy"],
            "data.mixture": {
                "seed": -1,
                "tokens": 10,
                "sources": [
                    {
                        "name": "web site",
                        "paths": [],
                        "ratio": 1.5,
                        "max_repetition": 0.0,
                        "label_mask_paths": ["data/m.npy"],
                    },
                    {"name": "web site", "paths": ["data/a.npy"], "ratio": 0.2},
                    {"name": "code", "paths": ["data/c.npy"], "ratio": 0.3, "label_mask_paths": []},
                ],
            },
            "stages": [
                {"name": "pre", "max_duration": 10},
                {
                    "name": "pre",
                    "max_duration": "ten",
                    "kl_beta": -1.0,
                    "kl_estimator": "exact",
                    "data": {"pathz": 1},
                },
                {
                    "max_duration": "1ep",
                    "data": {"mixture": {"sources": [{"name": "a", "paths": ["data/a.npy"], "ratio": 0.5}]}},
                    "scheduler": {"name": "wsd", "t_warmup": 0},
                },
                {"name": ".hidden"},
                {"name": "empty", "max_duration": 5, "data": {"mixture": {"sources": []}}},
            ],
        },
        1,
        (
            "The config has 25 problem(s); fix them in the YAML or with --key=value:\n"
            "  - data.label_mask_paths has 1 entries but data.paths has 0; give exactly one label mask per token file, in the same order.\n"
            "  - data.mixture is exclusive with data.paths, data.datasets and data.label_mask_paths: list the files in the mixture's sources, and set the others to null.\n"
            "  - data.mixture.sources[0].name='web site' must be letters, digits, '.', '_' or '-' (it names a metric).\n"
            "  - data.mixture: the source name 'web site' is used 2 times; names are unique.\n"
            "  - data.mixture.sources[0] ('web site') has no paths; list its token files.\n"
            "  - data.mixture.sources[0].ratio=1.5 must be in (0, 1].\n"
            "  - data.mixture.sources[0].max_repetition=0.0 must be a positive number (1: each instance once).\n"
            "  - data.mixture.sources[0].label_mask_paths has 1 entries for 0 paths; give one label mask per token file, in the same order.\n"
            "  - data.mixture.sources[1].name='web site' must be letters, digits, '.', '_' or '-' (it names a metric).\n"
            "  - data.mixture.sources[2].label_mask_paths has 0 entries for 1 paths; give one label mask per token file, in the same order.\n"
            "  - data.mixture: label masks are given for 2 of 3 sources; give them for every source (an all-True mask trains on every token) or for none.\n"
            "  - data.mixture: the ratios add up to 2, not 1 (web site 1.5, web site 0.2, code 0.3); they are shares of the drawn tokens.\n"
            "  - data.mixture.tokens=10 must be at least one instance (32 tokens), or null.\n"
            "  - data.mixture.seed=-1 must be >= 0.\n"
            "  - stages[2].data.mixture: the ratios add up to 0.5, not 1 (a 0.5); they are shares of the drawn tokens.\n"
            "  - stages[2].data.mixture.tokens is null, so the mixture draws what its run or stage trains, but that length is '1ep', in epochs of this very mixture; give stages[2].data.mixture.tokens, or the length in steps or tokens.\n"
            "  - stages[4].data.mixture.sources is empty: give each source's name, paths and ratio.\n"
            "  - stages[2].scheduler.name=wsd needs stages[2].scheduler.t_decay: the length of the final decay, in stages[2].scheduler.units, which ends at the end of the run (or t_max). Set e.g. --stages[2].scheduler.t_decay=1000 (0: no decay, a stable run to branch decays from).\n"
            "  - stages[1] (pre).max_duration='ten' is not a duration. Use an int number of steps (1000), tokens with a T suffix ('2e12T'), or epochs with an ep suffix ('1ep').\n"
            "  - stages[1] (pre).kl_beta=-1.0 must be a finite number >= 0 (0 turns the KL penalty off); e.g. --stages=[...] with kl_beta: 0.1.\n"
            "  - stages[1] (pre).kl_estimator='exact' is not an estimator; use nll_diff (the per-token difference of the two models' cross entropies) or full (the exact KL over the vocabulary).\n"
            "  - stages[1] (pre).data.pathz: Key 'pathz' not in 'DataConfig'. Did you mean: 'paths'?. A stage's data takes the fields of the run's data section (paths, datasets, label_mask_paths, num_workers, seed, ...; see DataConfig in olmo/config/data_sections.py).\n"
            "  - stages[3] (.hidden).max_duration is missing: every stage needs a length, in steps (1000), tokens ('2e9T') or epochs of its data ('1ep').\n"
            "  - stages[1].name='pre' is also the name of stages[0]; stage names are unique, as they name the stages' files and log lines. Rename one of them.\n"
            "  - stages[3].name='.hidden' must be 1 to 64 letters, digits, '.', '_' or '-', not starting with '.': it becomes part of file names (mixture-NAME.json) and log lines. E.g. name: anneal."
        ),
        id="stages_and_mixtures",
    ),
    pytest.param(
        {
            "max_duration": 20,
            "stages": [
                {"max_duration": 5, "kl_beta": 0.1, "kl_estimator": "full"},
                {
                    "name": "stage0",
                    "max_duration": "512T",
                    "scheduler": {"name": "cosine_with_warmup", "alpha_f": 2},
                },
            ],
        },
        1,
        (
            "The config has 3 problem(s); fix them in the YAML or with --key=value:\n"
            "  - stages[1].scheduler.alpha_f=2.0 must be in [0, 1]: the final learning rate as a fraction of the peak (below 0 the rate turns negative, above 1 the decay rises). Set e.g. --stages[1].scheduler.alpha_f=0.1.\n"
            "  - stages[1].name='stage0' is also the name of stages[0] (the name of a stage without one is stage{index}); stage names are unique, as they name the stages' files and log lines. Rename one of them.\n"
            "  - max_duration=20 is 20 steps, but the stages add up to 7 steps (5 + 512T). With stages the run's length is their sum: remove max_duration (or set --max_duration=null), or make the two agree."
        ),
        id="stages_that_do_not_add_up",
    ),
    pytest.param(
        {"run_name": None, "save_folder": "runs/None", "stages": []},
        1,
        (
            "The config has 2 problem(s); fix them in the YAML or with --key=value:\n"
            "  - save_folder='runs/None' names a folder 'None': it interpolates a key that is null, most likely run_name. Set --run_name=NAME (or give save_folder in full).\n"
            "  - stages=[] has no stage; give at least one, or remove the key."
        ),
        id="run_name_and_empty_stages",
    ),
    pytest.param(
        {
            "evaluators": [
                {"label": "lm-none", "device_eval_batch_size": 0, "definitions": "olmo"},
                {
                    "label": "mix",
                    "data": {"mixture": {"sources": [{"name": "web", "paths": ["data/w.npy"], "ratio": 0.6}]}},
                },
                {
                    "label": "remote",
                    "data": {"paths": ["htps://x/a.npy"], "remote": {"max_attempts": 0}, "timeout": -1},
                },
                {
                    "label": "gen",
                    "type": "generate",
                    "prompts": [],
                    "max_new_tokens": 0,
                    "temperature": 0.0,
                    "top_k": 1000,
                    "top_p": 1.5,
                },
                {"label": "gen2", "type": "generate", "prompts": ["Once"], "temperature": -1.0},
                {"label": "arc_easyy", "type": "downstream"},
                {"label": "hellaswag", "type": "downstream"},
                {"label": "pica", "type": "downstream"},
                {"label": "ok", "data": {"datasets": {"a": ["data/a.npy"]}}},
            ],
        },
        1,
        (
            "The config has 18 problem(s); fix them in the YAML or with --key=value:\n"
            "  - evaluators[0].device_eval_batch_size (or device_eval_batch_size) must be at least 1.\n"
            "  - evaluators[0].definitions='olmo' is not a set of metric definitions; use olmo_eval or olmo-0.6.\n"
            "  - evaluators[0] (label 'lm-none') is an lm evaluator without data: set evaluators[0].data.paths to token files or evaluators[0].data.datasets to label -> files, or set evaluators[0].type=downstream.\n"
            "  - evaluators[1].data.mixture: an evaluator reads its files whole, not a mixture; list them in evaluators[1].data.paths or, per label, in evaluators[1].data.datasets.\n"
            "  - evaluators[2].data.paths[0]='htps://x/a.npy': htps:// URLs cannot be read by byte range. Use http://, https://, s3://, r2://, weka://, gs://, a file:// URL or a local path (download the file first).\n"
            "  - evaluators[2].data.remote.max_attempts=0 must be at least 1.\n"
            "  - evaluators[2].data.timeout=-1 must be a number of seconds from 0 (wait forever) to 86400 (a day): how long the DataLoader waits for a worker's batch.\n"
            "  - evaluators[3] (label 'gen') is a generate evaluator without prompts: set evaluators[3].prompts to a list of texts, e.g. [\"The capital of France is\"].\n"
            "  - evaluators[3].max_new_tokens=0 must be between 1 and 4096.\n"
            "  - evaluators[3]: give top_k or top_p, not both.\n"
            "  - evaluators[3].top_k=1000 must be from 1 to model.vocab_size=257 (the tokens sampled from).\n"
            "  - evaluators[3].top_p=1.5 must be in (0, 1].\n"
            "  - evaluators[3]: top_k and top_p sample; set evaluators[3].temperature above 0 (e.g. 0.8) with them.\n"
            "  - evaluators[4].temperature=-1.0 must be a finite number >= 0 (0: greedy decoding).\n"
            "  - evaluators[5].label='arc_easyy' is not a downstream task in ai2-olmo-eval. Did you mean 'arc_easy'?\n"
            "  - evaluators[7].label='pica' is not a downstream task in ai2-olmo-eval. Did you mean 'piqa'?\n"
            "  - Available downstream labels (6, closest first): arc_easy, arc_challenge, piqa, boolq, hellaswag, sciq. Fix the label, or make the evaluator type: lm with data.\n"
            "  - tokenizer.identifier='allenai_gpt-neox-olmo-dolma-v1_5.json' has 50280 tokens but model.vocab_size=257; the downstream evaluators need them to match: set the tokenizer the model was trained with."
        ),
        id="evaluators_and_tokenizer",
    ),
    pytest.param(
        {
            "model.clip_qkv": float("nan"),
            "optimizer.learning_rate": float("nan"),
            "optimizer.betas": [float("nan"), 0.9],
            "scheduler.alpha_f": float("nan"),
            "scheduler.t_warmup": float("inf"),
            "max_grad_norm": float("inf"),
            "max_grad_norm_ratio": float("nan"),
            "time_limit": float("inf"),
            "data.remote.backoff_seconds": float("inf"),
            "stability.stragglers.threshold": float("nan"),
            "evaluators": [{"label": "g", "type": "generate", "prompts": ["x"], "temperature": float("inf")}],
            "max_duration": None,
            "stages": [{"name": "anneal", "max_duration": 10, "kl_beta": float("nan")}],
        },
        1,
        (
            "The config has 11 problem(s); fix them in the YAML or with --key=value:\n"
            "  - data.remote.backoff_seconds=inf must be from 0 to 3600 seconds (an hour): the wait before the first retry, doubled before each later one (0.5 is the default).\n"
            "  - optimizer.learning_rate=nan must be a positive, finite number.\n"
            "  - optimizer.betas=[nan, 0.9] must each be in [0, 1).\n"
            "  - scheduler.alpha_f=nan must be in [0, 1]: the final learning rate as a fraction of the peak (below 0 the rate turns negative, above 1 the decay rises). Set e.g. --scheduler.alpha_f=0.1.\n"
            "  - evaluators[0].temperature=inf must be a finite number >= 0 (0: greedy decoding).\n"
            "  - stages[0] (anneal).kl_beta=nan must be a finite number >= 0 (0 turns the KL penalty off); e.g. --stages=[...] with kl_beta: 0.1.\n"
            "  - stability.stragglers.threshold=nan must be a number above 1 (e.g. 1.5).\n"
            "  - model.clip_qkv=nan must be a finite number (or null).\n"
            "  - scheduler.t_warmup=inf must be a finite number.\n"
            "  - max_grad_norm_ratio=nan must be a finite number (or null).\n"
            "  - time_limit=inf must be a finite number (or null)."
        ),
        id="non_finite",
    ),
]


@pytest.mark.parametrize("overrides, world_size, report", REPORTS)
def test_the_report_of_a_broken_config_reads_as_before(
    monkeypatch, overrides: dict[str, Any], world_size: int, report: str
):
    monkeypatch.setattr(eval_sections, "task_labels", lambda: sorted(KNOWN_LABELS))
    cfg = _config(**overrides)
    with pytest.raises(OLMoConfigurationError) as e:
        cfg.validate(world_size)
    assert type(e.value) is OLMoConfigurationError
    assert str(e.value) == report


WARNED = {
    "device_train_batch_size": 3,
    "data.instance_filter": {"repetition_max_count": 2},
    "tokenizer.truncate_direction": "left",
    "model.max_sequence_length": 16384,
    "model.sliding_window": {"pattern": [4096, -1]},
    "max_duration": None,
    "scheduler.t_warmup": 2000,
    "stages": [{"max_duration": 5}, {"max_duration": 5, "scheduler": {"t_warmup": 10}}],
    "reset_optimizer_state": True,
    "early_stopping_factor": 1.0,
    "python_profiling": True,
    "optimizer.metrics_log_interval": 10,
    "single": {"device": "cuda"},
    "fsdp": {"wrapping_strategy": "size_based", "use_orig_params": False},
    "ddp": {"find_unused_params": True},
    "wandb": {"rank_zero_only": False, "log_artifacts": True},
    "extra_steps_after_cancel": 3,
}


GOLDEN_WARNINGS = [
    "device_train_batch_size=3 is ignored: it is derived as global_train_batch_size / world size = 8.",
    "data.instance_filter.repetition_max_count=2 acts as 3: the repetition detector (as in OLMo) only sees patterns repeated at least 3 times.",
    "scheduler.t_warmup=2,000 steps is not shorter than the run (the stages' max_duration: 10 steps), so all of it is warmup: the learning rate climbs from 10.0% to 10.5% of optimizer.learning_rate=0.01 and never decays. Set --scheduler.t_warmup=1 (a tenth of it).",
    "stages[1].scheduler.t_warmup=10 steps is not shorter than stages[1] (stages[1].max_duration=5: 5 steps), so all of it is warmup: the learning rate climbs from 10.0% to 55.0% of optimizer.learning_rate=0.01 and never decays. Set --stages[1].scheduler.t_warmup=1 (a tenth of it).",
    "model.sliding_window at model.max_sequence_length=16,384 without model.flash_attention: PyTorch SDPA then takes a 16,384 x 16,384 attention mask, 1.0 GiB in fp32 per forward (per instance with document masking) plus a copy per layer in the compute dtype. Install flash-attn and set --model.flash_attention=true on CUDA (its kernels take the window and the documents without a mask).",
    "--reset_optimizer_state has no effect without --load_path.",
    "optimizer.metrics_log_interval=10: per-parameter norm metrics are not collected here; the global gradient norm is logged at every step.",
    "single.device='cuda' has no effect: the device is chosen automatically (CUDA when available).",
    "early_stopping_factor is accepted for OLMo compatibility but not implemented yet; it has no effect.",
    "python_profiling is accepted for OLMo compatibility but not implemented yet; it has no effect.",
    "fsdp.wrapping_strategy=size_based has no effect: each block is its own FSDP unit, as with by_block.",
    "fsdp.use_orig_params=False has no effect: FSDP2 always keeps the original parameters.",
    "ddp.find_unused_params=True has no effect: DDP runs as FSDP2 replication, which does not need it.",
    "wandb.rank_zero_only=False has no effect: only rank 0 logs to wandb, after reducing across ranks.",
    "wandb.log_artifacts=True has no effect: no artifacts are uploaded to wandb (OLMo uploads none either).",
    "tokenizer.truncate_direction=left has no effect: training data is pre-tokenized and downstream tasks truncate queries on the left, as in OLMo.",
    "extra_steps_after_cancel=3 has no effect: a canceled run saves and stops at once.",
]


def test_the_warnings_of_a_valid_config_read_as_before(caplog):
    cfg = _config(**WARNED)
    with caplog.at_level(logging.WARNING):
        cfg.validate(1)
    assert [r.getMessage() for r in caplog.records] == GOLDEN_WARNINGS
