#!/usr/bin/env bash
# Run the original OLMo repository's own unit tests against this package, offline (RESEARCH_LOG.md records the
# result). The original's code is never copied into this project: the tests run from a temporary folder.
#
#   bash scripts/original_suite.sh ORIGINAL_GIT_DIR [COMMIT] [-- PYTEST_ARGS...]
#
# ORIGINAL_GIT_DIR is a clone (or bare snapshot) of github.com/allenai/OLMo; COMMIT defaults to 59a53e3, the
# commit issue 28 measured against. Its tests, conftest.py, pyproject.toml (pytest's settings), test_fixtures/ (files stored in Git LFS come out as
# pointers and the tests that read them fail) and hf_olmo/ are exported into a temporary folder; the conftest's
# hub tokenizer id `gpt2` is pointed at the GPT-2 tokenizer the repository ships in test_fixtures (the only
# change); then pytest runs there with this checkout first on PYTHONPATH and the hub offline. The temporary folder
# is removed when the script ends (on success, failure or interruption). A COMMIT the clone does not hold is
# refused before anything is exported (exit 2; fetch it into the clone first). --help anywhere before `--` prints
# this comment block.
. "$(dirname "$0")/lib/help.sh"
set -euo pipefail
src=${1:?usage: original_suite.sh ORIGINAL_GIT_DIR [COMMIT] [-- PYTEST_ARGS...]}
shift
if ! git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then
  echo "ORIGINAL_GIT_DIR=$src is not a git repository: give a clone (or bare snapshot) of github.com/allenai/OLMo." >&2
  exit 2
fi
commit=59a53e3
if [[ $# -gt 0 && $1 != "--" ]]; then commit=$1; shift; fi
[[ $# -gt 0 && $1 == "--" ]] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
gitdir=$(cd "$src" && cd "$(git rev-parse --git-dir)" && pwd)
# Checked before the temporary folder exists: git's own error would not say which argument is wrong.
if ! git --git-dir="$gitdir" rev-parse --verify --quiet "$commit^{commit}" > /dev/null; then
  echo "COMMIT=$commit is not a commit of $src: give one it holds (the default is 59a53e3), or fetch it first with git -C $src fetch origin $commit." >&2
  exit 2
fi
work=$(mktemp -d -t olmo-original-suite-XXXXXX)
trap 'rm -rf "$work"' EXIT  # on success, failure or Ctrl-C alike
git --git-dir="$gitdir" ls-tree -r --name-only "$commit" -- tests conftest.py pyproject.toml test_fixtures hf_olmo \
    > "$work/files.txt"
while IFS= read -r f; do
    mkdir -p "$work/$(dirname "$f")"
    git --git-dir="$gitdir" show "$commit:$f" > "$work/$f" 2>/dev/null || echo "not in the snapshot: $f" >&2
done < "$work/files.txt"
sed -i 's|^TEST_MODEL = "gpt2"|TEST_MODEL = "test_fixtures/test-olmo-model/tokenizer.json"|' "$work/conftest.py"
echo "Original tests of $commit in $work (removed when they end)" >&2
cd "$work"
PYTHONPATH="$here:$work" WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$python" -m pytest tests -p no:cacheprovider -q -rfE "$@"
