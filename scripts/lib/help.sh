# Sourced first by the shell commands in scripts/ (`. "$(dirname "$0")/lib/help.sh"`): with -h or --help among the
# command's arguments (before a `--`, after which they belong to another program), print the command's own header
# comment, from its second line to the first line that is not a comment, and exit.
for arg in "$@"; do
  [ "$arg" = "--" ] && break
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
    exit 0
  fi
done
