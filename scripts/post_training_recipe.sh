#!/usr/bin/env bash
# Post-training recipe on CPU: the quickstart's tiny base model, then SFT on examples/post_training/chat.jsonl, then
# DPO on examples/post_training/preferences.jsonl (both made by examples/post_training/make_examples.py, no download),
# with greedy answers before and after each stage and the preference accuracy of the SFT and DPO models on held-out
# pairs (examples/post_training/preferences-heldout.jsonl). About 25 minutes on 2 cores.
#   bash scripts/post_training_recipe.sh [BASE_CHECKPOINT]
# Without BASE_CHECKPOINT the quickstart trains one first (runs/OLMo-tiny-DATE). Outputs: runs/OLMo-tiny-sft,
# runs/OLMo-tiny-dpo, data/post_training.
set -euo pipefail
. "$(dirname "$0")/lib/help.sh"  # --help prints the comment block above
. "$(dirname "$0")/lib/recipe.sh" "$@"  # PY, CONFIG, SEQ, EX and BASE (the quickstart's unless given)
OUT=data/post_training
$PY scripts/prepare_sft_data.py $EX/chat.jsonl -o $OUT/sft --seq-len $SEQ --overwrite
$PY scripts/prepare_preference_data.py $EX/preferences.jsonl -o $OUT/dpo --seq-len $SEQ --overwrite
$PY scripts/prepare_preference_data.py $EX/preferences-heldout.jsonl -o $OUT/dpo-heldout --seq-len $SEQ --overwrite

ask() {  # greedy answers of checkpoint $1 to three questions in the chat layout the data uses
  $PY scripts/generate.py "$1" --max_new_tokens 16 \
    --prompt $'<|endoftext|><|user|>\nWhat is 17 plus 25?\n<|assistant|>\n' \
    --prompt $'<|endoftext|><|user|>\nReverse the word \'tunnel\'.\n<|assistant|>\n' \
    --prompt $'<|endoftext|><|user|>\nHow many letters are in \'meadow\'?\n<|assistant|>\n'
}
echo "== base model =="; ask "$BASE"

# Both stages start from a checkpoint with a fresh trainer state; no evaluators (the quickstart's need its data).
COMMON=(--reset_trainer_state --evaluators=[] --save_overwrite --save_interval_unsharded=null
        --scheduler.t_warmup=10 --console_log_interval=25)
$PY scripts/train.py $CONFIG --run_name=OLMo-tiny-sft --load_path="$BASE" "${COMMON[@]}" \
  --data.paths=[$OUT/sft/input_ids.npy] --data.label_mask_paths=[$OUT/sft/label_mask.npy] \
  --max_duration=300 --optimizer.learning_rate=1e-3
SFT=runs/OLMo-tiny-sft/step300-unsharded
echo "== after SFT =="; ask "$SFT"

$PY scripts/train.py $CONFIG --run_name=OLMo-tiny-dpo --load_path="$SFT" "${COMMON[@]}" \
  --data.paths=[$OUT/dpo/input_ids.npy] --data.label_mask_paths=[$OUT/dpo/label_mask.npy] \
  --dpo.enabled=true --dpo.beta=0.1 --fused_loss=false --max_duration=200 --optimizer.learning_rate=3e-4
DPO=runs/OLMo-tiny-dpo/step200-unsharded
echo "== after DPO =="; ask "$DPO"

echo "== preference accuracy on held-out pairs (chance 0.5) =="
echo -n "SFT model against the base model: "
$PY scripts/eval_preferences.py "$SFT" "$BASE" $OUT/dpo-heldout --beta 0.1
echo -n "DPO model against the SFT model (its reference): "
$PY scripts/eval_preferences.py "$DPO" "$SFT" $OUT/dpo-heldout --beta 0.1
