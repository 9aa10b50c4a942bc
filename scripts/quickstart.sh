#!/usr/bin/env bash
# Quickstart: install, build a small real-text corpus offline (the Python standard library's own
# source, tokenized with the OLMo tokenizer shipped in ai2-olmo-eval), and train a tiny OLMo on CPU.
# Extra arguments are passed to scripts/train.py, e.g. --max_duration=50. Once the data exists,
# `.venv/bin/python scripts/train.py configs/tiny/OLMo-tiny.yaml --help` lists every config field and its value.
set -euo pipefail
# --help anywhere on the line (before a `--`) prints the comment block above, before `make install` and the data run.
. "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."

make install
PY=.venv/bin/python

if [ ! -s data/quickstart/train/part-00000.npy ]; then
  STDLIB=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  $PY scripts/prepare_memmap_dataset.py "$STDLIB/*.py" -o data/quickstart --val-fraction 0.05
fi

RUN_NAME="OLMo-tiny-$(date +%Y%m%d-%H%M%S)"
export WANDB_MODE="${WANDB_MODE:-offline}"
$PY scripts/train.py configs/tiny/OLMo-tiny.yaml --run_name="$RUN_NAME" "$@"
$PY scripts/plot_metrics.py "runs/$RUN_NAME"
echo "Outputs: runs/$RUN_NAME (config.yaml, train_data/global_indices.npy, checkpoints, metrics.jsonl, plots/, wandb/)"
