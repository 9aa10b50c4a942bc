#!/usr/bin/env bash
# Tokenize dolma-format documents with `dolma tokens`, offline, with the OLMo tokenizer shipped in ai2-olmo-eval.
#
#   scripts/prepare_dolma.sh DOCS_GLOB OUTPUT_DIR [extra `dolma tokens` arguments]
#
# DOCS_GLOB: quoted glob of gzipped JSON-lines files, one document per line with a "text" (and "id") field,
# e.g. 'data/raw/*.json.gz'. OUTPUT_DIR receives headerless uint16 token memmaps `part-*.npy` (EOS after
# every document, documents shuffled) plus `part-*.csv.gz` (start,end,id,src_path,line_no per document).
# Extra arguments come last, so they override the defaults below, e.g. `--processes 16 --seed 1`. dolma's own
# options: `.venv-dolma/bin/dolma tokens --help`.
# Like dolma, and unlike scripts/prepare_memmap_dataset.py, this strips whitespace around each document.
#
# dolma lives in its own virtualenv (.venv-dolma, built by `make dolma-env` on first use): it pins numpy<2
# and tokenizers<=0.19, which clash with the trainer's .venv.
set -euo pipefail
# --help before a `--` prints the comment block above (rather than being taken as DOCS_GLOB or passed to dolma).
. "$(dirname "$0")/lib/help.sh"

REPO="$(cd "$(dirname "$0")/.." && pwd)"
DOLMA="$REPO/.venv-dolma/bin/dolma"
PY="$REPO/.venv/bin/python"

if [ $# -lt 2 ]; then
  echo "Usage: $0 DOCS_GLOB OUTPUT_DIR [extra dolma tokens arguments]" >&2
  exit 2
fi
DOCS_GLOB="$1"
OUTPUT_DIR="$2"
shift 2

# An unquoted glob is expanded by the shell, and its second match would become OUTPUT_DIR.
if [ -f "$OUTPUT_DIR" ]; then
  echo "OUTPUT_DIR '$OUTPUT_DIR' is a file. Quote DOCS_GLOB so the shell does not expand it: '$DOCS_GLOB'" >&2
  exit 2
fi
if [[ "$DOCS_GLOB" != *://* ]] && ! compgen -G "$DOCS_GLOB" >/dev/null; then
  echo "DOCS_GLOB '$DOCS_GLOB' matches no file." >&2
  exit 2
fi
# Stale parts from an earlier run would be picked up by ${path.glob:OUTPUT_DIR/*.npy} along with the new ones.
if compgen -G "$OUTPUT_DIR/part-*" >/dev/null; then
  echo "OUTPUT_DIR '$OUTPUT_DIR' already holds part-* files; remove them or choose another directory." >&2
  exit 2
fi
if [ ! -x "$PY" ]; then
  echo "$PY not found; run 'make install' first (it provides the OLMo tokenizer file)." >&2
  exit 2
fi

[ -x "$DOLMA" ] || make -C "$REPO" dolma-env

TOKENIZER="$("$PY" -c 'from olmo.tokenizer import DEFAULT_TOKENIZER, resolve_tokenizer_path as r; print(r(DEFAULT_TOKENIZER))')"
DTYPE=uint16
prev=""
for arg in "$@"; do
  case "$arg" in
    --dtype=*) DTYPE="${arg#--dtype=}" ;;
    *) [ "$prev" = "--dtype" ] && DTYPE="$arg" ;;
  esac
  prev="$arg"
done

# A local tokenizer file needs no network; the rest keeps every library from trying it anyway.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# dolma 1.2.1 calls omegaconf's deprecated register_new_resolver on every start.
export PYTHONWARNINGS="ignore:register_new_resolver"
"$DOLMA" tokens \
  --documents "$DOCS_GLOB" \
  --destination "$OUTPUT_DIR" \
  --tokenizer.name_or_path "$TOKENIZER" \
  --tokenizer.eos_token_id 50279 \
  --tokenizer.pad_token_id 1 \
  --processes "$(nproc)" \
  --dtype uint16 \
  "$@"

OUT="$(cd "$OUTPUT_DIR" && pwd)"
shopt -s nullglob
parts=("$OUT"/part-*.npy)
if [ ${#parts[@]} -eq 0 ]; then
  echo "dolma wrote no token files to $OUT; check its log above (empty documents are skipped)." >&2
  exit 1
fi
TOKENS="$("$PY" -c 'import os, sys, numpy as np
print(f"{sum(os.path.getsize(p) for p in sys.argv[2:]) // np.dtype(sys.argv[1]).itemsize:,}")' "$DTYPE" "${parts[@]}")"
echo
echo "Wrote $TOKENS $DTYPE tokens in ${#parts[@]} file(s) to $OUT"
echo "Train on them with (YAML):"
echo "  data:"
echo "    paths: \${path.glob:$OUT/*.npy}"
echo "    memmap_dtype: $DTYPE"
echo "or on the command line: scripts/train.py CONFIG '--data.paths=\${path.glob:$OUT/*.npy}'"
