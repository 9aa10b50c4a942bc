#!/usr/bin/env bash
# RL recipe on CPU: the quickstart's tiny base model, a short SFT on sums (examples/post_training/rl-sft.jsonl), then
# reinforcement learning with a verifiable reward (exact answers) on examples/post_training/rl-prompts.jsonl, with the
# exact-answer accuracy of greedy answers to held-out sums (rl-heldout.jsonl: sums neither set holds) after SFT and
# after RL. The sets are made by examples/post_training/make_examples.py; nothing is downloaded.
#   bash scripts/rl_recipe.sh [BASE_CHECKPOINT]
# Without BASE_CHECKPOINT the quickstart trains one first (runs/OLMo-tiny-DATE). Outputs: runs/OLMo-tiny-rl-sft,
# runs/OLMo-tiny-rl, data/rl_recipe.
set -euo pipefail
. "$(dirname "$0")/lib/help.sh"  # --help prints the comment block above
. "$(dirname "$0")/lib/recipe.sh" "$@"  # PY, CONFIG, SEQ, EX and BASE (the quickstart's unless given)
OUT=data/rl_recipe
$PY scripts/prepare_sft_data.py $EX/rl-sft.jsonl -o $OUT/sft --seq-len $SEQ --overwrite
$PY scripts/prepare_rl_prompts.py $EX/rl-prompts.jsonl -o $OUT/prompts --seq-len $SEQ --max-prompt-tokens 64 --overwrite
$PY scripts/prepare_rl_prompts.py $EX/rl-heldout.jsonl -o $OUT/heldout --seq-len $SEQ --max-prompt-tokens 64 --overwrite

COMMON=(--reset_trainer_state --evaluators=[] --save_overwrite --save_interval_unsharded=null --console_log_interval=25)
$PY scripts/train.py $CONFIG --run_name=OLMo-tiny-rl-sft --load_path="$BASE" "${COMMON[@]}" --scheduler.t_warmup=10 \
  --data.paths=[$OUT/sft/input_ids.npy] --data.label_mask_paths=[$OUT/sft/label_mask.npy] \
  --max_duration=400 --optimizer.learning_rate=1e-3
SFT=runs/OLMo-tiny-rl-sft/step400-unsharded

$PY scripts/train.py $CONFIG --run_name=OLMo-tiny-rl --load_path="$SFT" "${COMMON[@]}" --scheduler.t_warmup=5 \
  --rl.enabled=true --rl.prompts=$OUT/prompts --rl.group_size=8 --rl.prompts_per_step=8 --rl.max_new_tokens=16 \
  --max_duration=100 --optimizer.learning_rate=3e-4
RL=runs/OLMo-tiny-rl/step100-unsharded

echo "== exact-answer accuracy of greedy answers to 100 held-out sums =="
echo -n "after SFT: "; $PY scripts/eval_rl.py "$SFT" $OUT/heldout --max-new-tokens 16
echo -n "after RL:  "; $PY scripts/eval_rl.py "$RL" $OUT/heldout --max-new-tokens 16
