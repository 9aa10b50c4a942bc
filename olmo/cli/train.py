"""Train an OLMo model.

    python scripts/train.py CONFIG.yaml [--key.path=value ...]
    torchrun --nproc_per_node=N scripts/train.py CONFIG.yaml [--key.path=value ...]

Overrides use the config's key paths: --model.n_layers=2, --data.paths=[a.npy,b.npy], --x=null; a bare
boolean flag means true (--save_overwrite), and --save-overwrite equals --save_overwrite. Resume with
--try_load_latest_save or --load_path=CHECKPOINT (add --reset_trainer_state to fine-tune). Every field and
its meaning is documented in olmo/config/train_config.py; `scripts/train.py CONFIG.yaml [--overrides ...] --help` lists
them all with the values that config and those overrides give them.

Everything that can be checked (config values, the checkpoint to restore and each of its files, the
save folder, training and evaluation data, the tokenizer) is checked before anything is written or the
process group, model or data order is set up. --dry_run stops right there and prints the run's plan
(parameters, batch and accumulation, steps, tokens, FLOPs, estimated memory per device and time).

Ctrl-C (or SIGTERM) saves a checkpoint after the current step and exits with 75; a second one aborts at once,
without that checkpoint, and exits with 130, naming the last committed checkpoint. Either way, relaunch the same
command with --try_load_latest_save to continue from the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from olmo.config import TrainConfig
from olmo.config.docs import describe_config
from olmo.config.rl_sections import apply_rl_run_settings
from olmo.exceptions import OLMoCliError
from olmo.util import env_rank, env_world_size
from olmo.util.secrets import redact_text

if TYPE_CHECKING:
    from olmo.train.callback import Callback

log = logging.getLogger("train")


def main(argv: Optional[list[str]] = None, callbacks: Sequence[Callback] = ()) -> int:
    """Train as ``scripts/train.py ARGV`` does; ``callbacks``: the training loop's own callbacks, called after the
    built-in ones (:mod:`olmo.train.callback`; README, "Your own callbacks").

    Usage errors, ``--help``, a bad ``callbacks`` list and every config error are answered before torch is imported
    (torch alone takes seconds to import; the config layer never needs it): only then is the launch imported."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        if env_rank() == 0:  # under torchrun, once, not once per rank
            print_help([a for a in argv if a not in ("-h", "--help")])
        return 0
    if not argv or argv[0].startswith("-"):
        raise OLMoCliError("Usage: scripts/train.py CONFIG.yaml [--key.path=value ...] (--help for more)")
    if not isinstance(callbacks, (list, tuple)) or callbacks:  # passed: olmo.train (and torch) is imported already
        from olmo.train.callback import check_callbacks

        check_callbacks(callbacks)
    cfg = TrainConfig.load(argv[0], argv[1:])
    for change in apply_rl_run_settings(cfg):
        log.info("rl.enabled: %s.", change)
    cfg.validate(env_world_size())
    from olmo.cli.train_launch import launch  # torch, the model, the data and the trainer

    return launch(cfg, callbacks)


def print_help(args: list[str]) -> None:
    """What the script does; given a config (and overrides), also every field with its value and doc (secrets
    masked). Output cut short by its reader (``--help | head``) ends quietly."""
    if not args or args[0].startswith("-"):
        text = __doc__ or ""
    else:
        cfg = TrainConfig.load(args[0], args[1:])  # loaded only: the values as given, before any checks
        overrides = redact_text(f" with {' '.join(args[1:])}") if args[1:] else ""
        text = (
            f"{__doc__}\nEvery field of {args[0]}{overrides} (key, value, first line of its doc in "
            f"olmo/config/train_config.py):\n\n{describe_config(cfg)}"
        )
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # The reader is gone: point stdout at nothing, so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
