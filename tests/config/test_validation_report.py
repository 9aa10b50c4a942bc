"""The one report of every problem in a config, exactly as users read it: configs broken in many places at once,
section by section (the model and its attention options, the run's own settings, the optimizer and its schedule,
the data with its remote reads and instance filter, stability), each with its whole report pinned word for word, in
order, and the report at load that lists misspelled keys with the bad values. The checks live beside the fields they
check; this test (with ``test_validation_report_across_sections.py``) keeps what a user reads from changing when
they move.

The reports were captured from the code before the checks moved (issue 37); change one only with a change of what
users should read."""

from __future__ import annotations

from typing import Any

import pytest

from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import tiny_config_dict, write_config


def _config(save_folder: str = "runs/golden", **overrides: Any) -> TrainConfig:
    return TrainConfig.from_dict(tiny_config_dict(save_folder, ["data/a.npy"], **overrides))


REPORTS = [
    pytest.param(
        {
            "model.d_model": 30,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.multi_query_attention": True,
            "model.alibi": True,
            "model.flash_attention": True,
            "model.embedding_size": 200,
            "model.clip_qkv": -1.0,
            "model.block_group_size": 2,
            "model.block_type": "llama",
            "model.attention_dropout": 1.0,
            "model.residual_dropout": -0.1,
            "model.max_sequence_length": 2**25,
            "model.eos_token_id": 400,
            "model.init_std": float("nan"),
            "model.sliding_window": {"pattern": []},
            "model.rope_scaling": {"name": "ntk", "factor": 0.5, "old_context_len": 0},
            "global_train_batch_size": 10,
            "device_train_batch_size": 3,
            "float32_matmul_precision": "low",
            "precision": "amp_bf17",
            "max_duration": "ten",
            "stop_at": 0,
            "time_limit": -1.0,
            "distributed_timeout_minutes": 0.0,
            "seed": -1,
            "distributed_strategy": "single",
            "auxiliary_loss_multiplier": float("nan"),
            "speed_monitor": {"gpu_flops_available": float("inf")},
        },
        2,
        (
            "The config has 29 problem(s); fix them in the YAML or with --key=value:\n"
            "  - model.d_model=30 must be divisible by model.n_heads=4.\n"
            "  - model.multi_query_attention=true contradicts model.n_kv_heads=2; remove multi_query_attention and keep n_kv_heads.\n"
            "  - model.alibi and model.rope are mutually exclusive; set one of them to false.\n"
            "  - model.alibi does not work with model.flash_attention; disable one of them.\n"
            "  - model.embedding_size=200 must be at least model.vocab_size=257.\n"
            "  - model.clip_qkv=-1.0 must be positive (or null to disable).\n"
            "  - model.block_group_size=2 is not supported: in OLMo, block groups only change how FSDP wraps the blocks (parameters named transformer.block_groups.G.i...), not what the model computes. Set --model.block_group_size=1 (the same model; use fsdp.wrapping_strategy one_in_N for coarser FSDP units); checkpoints saved with block groups do not load yet.\n"
            "  - model.block_type=llama is not supported: only OLMo's sequential block (fused att_proj, as in every released OLMo model) is implemented; OLMo's llama block (separate q_proj/k_proj/v_proj) is not. Set --model.block_type=sequential for a new model; a checkpoint of a llama-block model cannot be loaded yet.\n"
            "  - model.attention_dropout=1.0 must be in [0, 1).\n"
            "  - model.residual_dropout=-0.1 must be in [0, 1).\n"
            "  - model.eos_token_id=400 is outside the embedding (size 200).\n"
            "  - model.pad_token_id=256 is outside the embedding (size 200).\n"
            "  - model.sliding_window.pattern is empty: give the window of each layer in the cycle, e.g. [4096, 4096, 4096, -1] (-1 = full attention), or set model.sliding_window to null.\n"
            "  - model.rope_scaling.name='ntk' is not one of yarn, llama3.\n"
            "  - model.rope_scaling.factor=0.5 must be at least 1 (how many times longer the context is).\n"
            "  - model.rope_scaling.old_context_len=0 must be positive.\n"
            "  - model.max_sequence_length=33,554,432 is more than 16,777,216 tokens.\n"
            "  - global_train_batch_size=10 must be divisible by device_train_microbatch_size (4) x world size (2) = 8; change one of them (e.g. --global_train_batch_size=8).\n"
            "  - float32_matmul_precision='low' must be highest, high or medium.\n"
            "  - precision='amp_bf17' must be one of amp_bf16, amp_fp16, fp32.\n"
            "  - max_duration='ten' is not a duration. Use an int number of steps (1000), tokens with a T suffix ('2e12T'), or epochs with an ep suffix ('1ep').\n"
            "  - stop_at=0 must be positive (or null).\n"
            "  - time_limit=-1.0 must be positive (or null).\n"
            "  - distributed_timeout_minutes=0.0 must be above 0 and at most 1440 (a day: a collective still waiting after a day is hung); 30 is the default.\n"
            "  - seed=-1 must be in [0, 2^32).\n"
            "  - distributed_strategy=single trains on one device, but 2 processes were launched. Use --distributed_strategy=fsdp (or ddp) under torchrun, or launch one process.\n"
            "  - model.init_std=nan must be a finite number.\n"
            "  - speed_monitor.gpu_flops_available=inf must be a finite number (or null).\n"
            "  - auxiliary_loss_multiplier=nan must be a finite number (or null)."
        ),
        id="model_and_run",
    ),
    pytest.param(
        {
            "model.d_model": 2**20,
            "model.n_layers": 100,
            "model.rope": False,
            "model.sliding_window": {"pattern": [0, -2, 4096]},
            "model.rope_scaling": {"name": "yarn", "beta_fast": 1.0, "beta_slow": 2.0, "attention_factor": -1.0},
        },
        1,
        (
            "The config has 5 problem(s); fix them in the YAML or with --key=value:\n"
            "  - model.sliding_window.pattern=[0, -2, 4096] holds [0, -2]: each entry is a window of 1 to 16,777,216 tokens, or -1 for full attention.\n"
            "  - model.rope_scaling is set but model.rope=false: scaling applies to RoPE; set model.rope=true.\n"
            "  - model.rope_scaling.beta_fast=1.0, beta_slow=2.0: YaRN needs beta_fast > beta_slow > 0 (OLMo 3: 32 and 1).\n"
            "  - model.rope_scaling.attention_factor=-1.0 must be positive (or null).\n"
            "  - model.d_model=1,048,576 with model.n_layers=100 makes about 1.3e+15 parameters, more than 1e+13 (a typo?); OLMo-2 32B has d_model 5120 and 64 layers."
        ),
        id="model_size_and_rope_scaling",
    ),
    pytest.param(
        {
            "model.n_layers": 5000,
            "model.rope_scaling": {"name": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 1.0},
        },
        1,
        (
            "The config has 2 problem(s); fix them in the YAML or with --key=value:\n"
            "  - model.rope_scaling.low_freq_factor=4.0, high_freq_factor=1.0: llama3 scaling needs high_freq_factor > low_freq_factor > 0 (Llama 3.1: 4 and 1).\n"
            "  - model.n_layers=5,000 is more than 4,096; the deepest released models have ~130."
        ),
        id="llama3_scaling_and_layers",
    ),
    pytest.param(
        {
            "optimizer.learning_rate": -1.0,
            "optimizer.betas": [1.0, 0.95],
            "optimizer.eps": float("nan"),
            "optimizer.muon_ns_steps": 7,
            "scheduler.alpha_f": 2.0,
            "scheduler.t_warmup": -1,
            "scheduler.t_decay": 10,
            "scheduler.decay_shape": "cosine",
            "scheduler.warmup_min_lr": 0.5,
            "scheduler.t_max": float("inf"),
            "max_grad_norm": 0.0,
            "max_grad_norm_ratio": -1.0,
            "save_interval": -5,
            "eval_interval": 0,
            "console_log_interval": 0,
            "save_num_checkpoints_to_keep": -3,
            "sharded_checkpointer": "foo",
            "load_path_sharded_checkpointer": "bar",
            "hf_export": {"dtype": "float16", "max_shard_size": "big"},
            "run_name": "a/b",
            "save_folder": "s3:/bucket/run",
            "load_path": "gs:/bucket/ckpt",
            "kl_reference": {"load_path": "https:host/ref"},
            "remote_save_folder": "ftp://host/x",
        },
        1,
        (
            "The config has 26 problem(s); fix them in the YAML or with --key=value:\n"
            "  - optimizer.learning_rate=-1.0 must be a positive, finite number.\n"
            "  - optimizer.betas=[1.0, 0.95] must each be in [0, 1).\n"
            "  - optimizer.muon_ns_steps=7 is used by optimizer.name=muon only, and the name is adamw. Remove muon_ns_steps, or set optimizer.name=muon.\n"
            "  - scheduler.alpha_f=2.0 must be in [0, 1]: the final learning rate as a fraction of the peak (below 0 the rate turns negative, above 1 the decay rises). Set e.g. --scheduler.alpha_f=0.1.\n"
            "  - scheduler.t_warmup=-1 must be >= 0.\n"
            "  - scheduler.t_decay=10 is used by scheduler.name=wsd only, and the name is cosine_with_warmup. Remove t_decay, or set scheduler.name=wsd.\n"
            "  - scheduler.decay_shape=cosine is used by scheduler.name=wsd only, and the name is cosine_with_warmup. Remove decay_shape, or set scheduler.name=wsd.\n"
            "  - scheduler.warmup_min_lr=0.5 must be in [0, optimizer.learning_rate=-1.0).\n"
            "  - max_grad_norm=0.0 must be positive (or null to disable clipping).\n"
            "  - max_grad_norm_ratio=-1.0 must be positive (or null).\n"
            "  - save_interval=-5 must be a positive number of steps (or null to disable).\n"
            "  - eval_interval=0 must be a positive number of steps (or null to disable).\n"
            "  - console_log_interval=0 must be a positive number of steps.\n"
            "  - save_num_checkpoints_to_keep=-3 must be -1 (keep all), 0 (no such checkpoints) or a count.\n"
            "  - sharded_checkpointer='foo' is not one of OLMo's sharded checkpointers (torch_new, torch_legacy, local, olmo_core); every one maps onto ours, so use torch_new or leave it out.\n"
            "  - load_path_sharded_checkpointer='bar' is not one of OLMo's sharded checkpointers (torch_new, torch_legacy, local, olmo_core); every one maps onto ours, so use torch_new or leave it out.\n"
            "  - hf_export.dtype='float16' must be bfloat16 or float32.\n"
            "  - hf_export.max_shard_size='big' must be a size such as 5GB or 500MB.\n"
            "  - run_name='a/b' is not a name: it must not be empty, '.' or '..', nor hold '/', '\\' or NUL, because it becomes a folder name (save_folder: runs/${run_name} would land outside runs/). Use letters, digits, '-', '_' or '.', e.g. --run_name=OLMo-1B-seed2; set save_folder to choose the folder.\n"
            "  - save_folder='s3:/bucket/run' is a s3:// URL with a slash missing; as written it would name a local folder 's3:' in the working directory. Write it as s3://bucket/run.\n"
            "  - load_path='gs:/bucket/ckpt' is a gs:// URL with a slash missing; as written it would name a local folder 'gs:' in the working directory. Write it as gs://bucket/ckpt.\n"
            "  - kl_reference.load_path='https:host/ref' is a https:// URL with a slash missing; as written it would name a local folder 'https:' in the working directory. Write it as https://host/ref.\n"
            "  - remote_save_folder='ftp://host/x': checkpoints cannot be uploaded to ftp:// URLs. Use s3://BUCKET/PREFIX, r2://BUCKET/PREFIX, gs://BUCKET/PREFIX, a file:// URL or a local folder (or null to upload nothing).\n"
            "  - kl_reference.load_path is set but the run has no stages: the reference is only used by a stage with kl_beta > 0. Add stages (see configs/tiny/OLMo-tiny-two-stage.yaml) or remove the key.\n"
            "  - optimizer.eps=nan must be a finite number.\n"
            "  - scheduler.t_max=inf must be a finite number (or null)."
        ),
        id="optimizer_checkpoints_and_locations",
    ),
    pytest.param(
        {"max_duration": 100, "scheduler.name": "wsd", "scheduler.t_warmup": 30, "scheduler.t_decay": 80},
        1,
        (
            "The config has 1 problem(s); fix them in the YAML or with --key=value:\n"
            "  - scheduler.t_decay=80 starts the decay at 20 steps, before the warmup ends (scheduler.t_warmup=30); the run's length (100 steps). Use a t_decay of at most 70, or a shorter warmup."
        ),
        id="wsd_schedule",
    ),
    pytest.param(
        {"scheduler.name": "wsd", "scheduler.t_warmup": 30, "scheduler.t_decay": 40, "scheduler.t_max": 50},
        1,
        (
            "The config has 1 problem(s); fix them in the YAML or with --key=value:\n"
            "  - scheduler.t_decay=40 starts the decay at 10 steps, before the warmup ends (scheduler.t_warmup=30); scheduler.t_max=50. Use a t_decay of at most 20, or a shorter warmup."
        ),
        id="wsd_with_t_max",
    ),
    pytest.param(
        {
            "data.memmap_dtype": "uint8",
            "data.paths": ["htps://olmo-data.org/a.npy", "hf://x/b.npy", "s3:/bucket/c.npy"],
            "data.datasets": {"val": ["ftp://h/v.npy"]},
            "data.label_mask_paths": ["data/m.npy"],
            "data.num_workers": -1,
            "data.remote": {
                "max_concurrency": 100000,
                "prefetch_bytes": 0,
                "max_attempts": 2000,
                "backoff_seconds": -1.0,
                "max_backoff_seconds": 0.0,
                "timeout_seconds": 1e6,
            },
            "data.timeout": -1,
            "data.instance_filter": {"repetition_min_period": 20, "repetition_max_period": 13},
            "data.custom_dataset": {"name": "MyDataset", "module": "my.module"},
        },
        1,
        (
            "The config has 17 problem(s); fix them in the YAML or with --key=value:\n"
            "  - data.memmap_dtype=uint8 cannot hold token ids up to model.vocab_size-1=256; use --data.memmap_dtype=uint32 (and tokenize with that dtype).\n"
            "  - data.paths and data.datasets are mutually exclusive; set only one.\n"
            "  - data.label_mask_paths has 1 entries but data.paths has 3; give exactly one label mask per token file, in the same order.\n"
            "  - data.num_workers must be >= 0.\n"
            "  - data.paths[0]='htps://olmo-data.org/a.npy': htps:// URLs cannot be read by byte range. Use http://, https://, s3://, r2://, weka://, gs://, a file:// URL or a local path (download the file first).\n"
            "  - data.paths[1]='hf://x/b.npy': hf:// URLs cannot be read by byte range. Use http://, https://, s3://, r2://, weka://, gs://, a file:// URL or a local path (download the file first).\n"
            "  - data.paths[2]='s3:/bucket/c.npy' is a s3:// URL with a slash missing; as written it would name a local folder 's3:' in the working directory. Write it as s3://bucket/c.npy.\n"
            "  - data.datasets.val[0]='ftp://h/v.npy': ftp:// URLs cannot be read by byte range. Use http://, https://, s3://, r2://, weka://, gs://, a file:// URL or a local path (download the file first).\n"
            "  - data.remote.prefetch_bytes=0 must be at least 1.\n"
            "  - data.remote.max_concurrency=100000 would start that many threads and connections in every loader process; use at most 1024 (64 already fetch ~1,200 instances/s at 50 ms).\n"
            "  - data.remote.max_attempts=2000 is more than 1000; a file that fails that often is not coming back (10, the default, rides out about two minutes of outage).\n"
            "  - data.remote.backoff_seconds=-1.0 must be from 0 to 3600 seconds (an hour): the wait before the first retry, doubled before each later one (0.5 is the default).\n"
            "  - data.remote.max_backoff_seconds=0.0 must be above 0 and at most 3600 seconds (an hour): the longest wait between two tries, during which the process does not stop when asked to (30 is the default).\n"
            "  - data.remote.timeout_seconds=1000000.0 must be above 0 and at most 86400 seconds (a day): how long one request waits for the server (60 is the default).\n"
            "  - data.timeout=-1 must be a number of seconds from 0 (wait forever) to 86400 (a day): how long the DataLoader waits for a worker's batch.\n"
            "  - data.instance_filter.repetition_min_period=20 is above repetition_max_period=13, so no pattern length is checked and nothing is ever filtered. Swap them, or set data.instance_filter to null to turn the filter off.\n"
            "  - data.custom_dataset (my.module.MyDataset) cannot train with scripts/train.py: the trainer's exact data order, resume and global_indices.npy need token memmaps, and it would import and run code named by the config (in your own Python loop, olmo.data.build_custom_dataset and build_collator build it as OLMo does). Tokenize the data into memmaps (dolma tokens or scripts/prepare_memmap_dataset.py), list them in data.paths, and set data.custom_dataset to null."
        ),
        id="data",
    ),
    pytest.param(
        {
            "optimizer.name": "muon",
            "optimizer.muon_momentum": 1.0,
            "optimizer.muon_ns_steps": 0,
            "optimizer.muon_rms_scale": 0.0,
            "optimizer.selective_updates": True,
            "stability": {
                "skip_spikes": {"enabled": True, "z_threshold": -1.0, "window": 4, "warmup_steps": -1},
                "rollback": {"enabled": True, "max_rollbacks": 2000, "skipped_steps": 0, "within_steps": -1},
                "watchdog": {"data_wait": 0.0, "optimizer": 1e6},
                "stragglers": {"interval": 0, "threshold": 1.0, "sustained": 0},
            },
            "save_interval_unsharded": None,
            "data.instance_filter": {"repetition_max_count": 0, "repetition_max_period": -1},
        },
        1,
        (
            "The config has 20 problem(s); fix them in the YAML or with --key=value:\n"
            "  - data.instance_filter.repetition_max_period=-1 must be a positive number of tokens; set it to one, e.g. OLMo's default 13.\n"
            "  - data.instance_filter.repetition_max_count=0 must be a positive number of repeats; set it to one, e.g. OLMo's default 32.\n"
            "  - optimizer.muon_momentum=1.0 must be in [0, 1).\n"
            "  - optimizer.muon_ns_steps=0 must be from 1 to 100 (5 is usual: each iteration is three matrix products per weight matrix per step, and the orthogonalization has converged long before 100).\n"
            "  - optimizer.muon_rms_scale=0.0 must be positive (0.2 matches AdamW's update RMS).\n"
            "  - optimizer.selective_updates=true is not supported with optimizer.name=muon; set it to false.\n"
            "  - stability.skip_spikes needs optimizer.name adamw or lionw; muon has no skip-step version yet. Turn stability.skip_spikes.enabled off, or use adamw.\n"
            "  - stability.skip_spikes.z_threshold=-1.0 must be a positive number (e.g. 6).\n"
            "  - stability.skip_spikes.window=4 must be from 8 to 100,000 steps.\n"
            "  - stability.skip_spikes.warmup_steps=-1 must be >= 0.\n"
            "  - stability.skip_spikes needs optimizer.name adamw or lionw (the skip-step versions exist for those); it is 'muon'.\n"
            "  - stability.rollback.max_rollbacks=2000 must be from 0 to 1000.\n"
            "  - stability.rollback.skipped_steps=0 must be >= 1.\n"
            "  - stability.rollback.within_steps=-1 must be at least skipped_steps=0.\n"
            "  - stability.rollback.enabled needs checkpoints to roll back to: set save_interval, save_interval_unsharded or save_interval_ephemeral.\n"
            "  - stability.watchdog.data_wait=0.0 must be a positive number of seconds, at most 86400 (a day: a phase that takes longer is hung); the default is 1800.\n"
            "  - stability.watchdog.optimizer=1000000.0 must be a positive number of seconds, at most 86400 (a day: a phase that takes longer is hung); the default is 600.\n"
            "  - stability.stragglers.interval=0 must be >= 1.\n"
            "  - stability.stragglers.threshold=1.0 must be a number above 1 (e.g. 1.5).\n"
            "  - stability.stragglers.sustained=0 must be >= 1."
        ),
        id="muon_stability_and_filter",
    ),
    pytest.param(
        {"stability": {"rollback": {"enabled": True, "on_non_finite": False}}},
        1,
        (
            "The config has 1 problem(s); fix them in the YAML or with --key=value:\n"
            "  - stability.rollback.enabled is true but nothing can start one: turn on stability.skip_spikes.enabled (persistent spikes) or stability.rollback.on_non_finite (non-finite losses)."
        ),
        id="rollback_without_a_trigger",
    ),
    pytest.param(
        {
            "model.d_model": 12,
            "model.n_heads": 4,
            "model.n_kv_heads": 3,
            "model.n_layers": 0,
            "global_train_batch_size": 0,
            "stop_after": -1,
            "metrics_collect_interval": 0,
            "save_num_unsharded_checkpoints_to_keep": -2,
            "run_name": "x" * 200,
            "data.memmap_dtype": "int8",
            "data.remote.max_concurrency": 0,
            "data.instance_filter": {"repetition_min_period": 0},
            "scheduler.name": "wsd",
            "scheduler.t_decay": -5,
        },
        1,
        (
            "The config has 10 problem(s); fix them in the YAML or with --key=value:\n"
            "  - model.rope needs an even head size; d_model/n_heads = 3.\n"
            "  - model.n_kv_heads=3 must be positive and divide model.n_heads=4.\n"
            "  - model.n_layers must be positive.\n"
            "  - global_train_batch_size and device_train_microbatch_size must be positive.\n"
            "  - data.memmap_dtype='int8' must be one of uint8, uint16, uint32, uint64.\n"
            "  - data.remote.max_concurrency=0 must be at least 1.\n"
            "  - data.instance_filter.repetition_min_period=0 must be a positive number of tokens; set it to one, e.g. OLMo's default 1.\n"
            "  - scheduler.t_decay=-5 must be >= 0 (0: no decay).\n"
            "  - save_num_unsharded_checkpoints_to_keep=-2 must be -1 (keep all), 0 (no such checkpoints) or a count.\n"
            "  - run_name is 200 bytes long in UTF-8 ('xxxxxxxxxxxxxxxxxxxxxxxx'...); it becomes a folder name and file systems allow 255 bytes a name, with suffixes added. Use at most 128 bytes."
        ),
        id="edges",
    ),
    pytest.param(
        {},
        3,
        (
            "The config has 1 problem(s); fix them in the YAML or with --key=value:\n"
            "  - global_train_batch_size=8 must be divisible by device_train_microbatch_size (4) x world size (3) = 12; change one of them (e.g. --global_train_batch_size=12)."
        ),
        id="one_problem",
    ),
]


@pytest.mark.parametrize("overrides, world_size, report", REPORTS)
def test_the_report_of_a_broken_config_reads_as_before(overrides: dict[str, Any], world_size: int, report: str):
    cfg = _config(**overrides)
    with pytest.raises(OLMoConfigurationError) as e:
        cfg.validate(world_size)
    assert type(e.value) is OLMoConfigurationError
    assert str(e.value) == report


REPORTS_AT_LOAD = [
    pytest.param(
        {"optimizer.learning_rat": 0.1, "stability.watchdog.data_wait": 0.0},
        ["--model.n_layer=3", "--scheduler.alpha_f=50", "--data.remote.timeout_seconds=inf", "--seed=-4"],
        (
            "TMP/c.yaml and its command-line overrides have 6 problems; fix them all:\n"
            "  - Invalid config key 'optimizer.learning_rat' (in TMP/c.yaml): Key 'learning_rat' not in 'OptimizerConfig'. Did you mean: 'learning_rate'? Remove or rename that key (see olmo/config/train_config.py for every field and its meaning).\n"
            "  - Invalid config key 'model.n_layer' (from the command-line override '--model.n_layer=3'): Key 'n_layer' not in 'ModelConfig'. Did you mean: 'n_layers'? Remove or rename that key (see olmo/config/train_config.py for every field and its meaning).\n"
            "  - seed=-4 must be in [0, 2^32).\n"
            "  - data.remote.timeout_seconds=inf must be above 0 and at most 86400 seconds (a day): how long one request waits for the server (60 is the default).\n"
            "  - scheduler.alpha_f=50.0 must be in [0, 1]: the final learning rate as a fraction of the peak (below 0 the rate turns negative, above 1 the decay rises). Set e.g. --scheduler.alpha_f=0.1.\n"
            "  - stability.watchdog.data_wait=0.0 must be a positive number of seconds, at most 86400 (a day: a phase that takes longer is hung); the default is 1800."
        ),
        id="unknown_keys_and_bad_values",
    ),
    pytest.param(
        {},
        ["--model.d_modle=64"],
        (
            "Invalid config key 'model.d_modle' (from the command-line override '--model.d_modle=64'): Key 'd_modle' not in 'ModelConfig'. Did you mean one of: 'd_model', 'moe'? Remove or rename that key (see olmo/config/train_config.py for every field and its meaning)."
        ),
        id="one_unknown_key",
    ),
    pytest.param(
        {"data.num_worker": 2, "data.num_workers": -1},
        [],
        (
            "TMP/c.yaml has 2 problems; fix them all:\n"
            "  - Invalid config key 'data.num_worker' (in TMP/c.yaml): Key 'num_worker' not in 'DataConfig'. Did you mean: 'num_workers'? Remove or rename that key (see olmo/config/train_config.py for every field and its meaning).\n"
            "  - data.num_workers must be >= 0."
        ),
        id="unknown_key_in_the_file_only",
    ),
]


@pytest.mark.parametrize("in_file, overrides, report", REPORTS_AT_LOAD)
def test_the_report_at_load_lists_unknown_keys_with_the_bad_values_as_before(tmp_path, in_file, overrides, report):
    path = write_config(tmp_path / "c.yaml", tiny_config_dict("runs/golden", ["data/a.npy"], **in_file))
    with pytest.raises(OLMoConfigurationError) as e:
        TrainConfig.load(path, overrides)
    assert type(e.value) is OLMoConfigurationError
    assert str(e.value).replace(str(tmp_path), "TMP") == report
