# Sourced by the post-training recipes (`. "$(dirname "$0")/lib/recipe.sh" "$@"`) after lib/help.sh: work from the
# checkout's root with its virtualenv, wandb offline unless set, the tiny config at 256 tokens, and BASE: the
# checkpoint given as the first argument, or else the one the quickstart trains now (runs/OLMo-tiny-DATE).
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export WANDB_MODE="${WANDB_MODE:-offline}"
CONFIG=configs/tiny/OLMo-tiny.yaml
SEQ=256
EX=examples/post_training

BASE="${1:-}"
if [ -z "$BASE" ]; then
  bash scripts/quickstart.sh
  BASE=$(ls -d runs/OLMo-tiny-2*/step150-unsharded | sort | tail -1)  # the run the quickstart just trained
fi
