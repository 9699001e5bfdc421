#!/usr/bin/env bash
# Mutation testing of one module against its own tests: `make mutate MODULE=vembed/x.py TESTS="tests/test_x.py ..."`
# (or `bash scripts/mutate.sh vembed/x.py tests/test_x.py -k "not slow_test"`).
# mutmut rewrites the code it mutates, so it runs on a copy of the tree (tracked and untracked files, not ignored ones)
# in a temporary folder; the working tree is never touched. Prints the score and each surviving mutant's diff.
set -euo pipefail
cd "$(dirname "$0")/.."
module="${1:?usage: scripts/mutate.sh vembed/MODULE.py tests/TEST.py [tests/MORE.py ...]}"
shift
[ "$#" -gt 0 ] || { echo "scripts/mutate.sh: name the module's own tests after the module" >&2; exit 2; }
[ -f "$module" ] || { echo "scripts/mutate.sh: $module is not a file" >&2; exit 2; }
# Test files, and pytest's selection options with their values (-k EXPR, -m MARKERS): each mutant reruns the tests
# that reach it, so leaving out a slow test (`-k "not two_ranks"`) can make a run fit its time.
option=""
for test in "$@"; do
  if [ -n "$option" ] || [[ "$test" == -* ]]; then
    [ -z "$option" ] && [[ "$test" == -[km] ]] && option=1 || option=""
    continue
  fi
  [ -e "$test" ] || { echo "scripts/mutate.sh: $test does not exist" >&2; exit 2; }
done
repo=$PWD
mutmut="$repo/.venv/bin/mutmut"
[ -x "$mutmut" ] || mutmut=$(command -v mutmut) || { echo "mutmut is not installed: make setup (dev extra)" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/vembed-mutate.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM  # a stopped run still removes its copy (the EXIT trap runs)
git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C "$work"
# mutmut runs the tests in its own mutants/ folder, into which it copies only vembed/ and tests/: the tests also read
# bench/, configs/, examples/ (a test that cannot import its helper would count every mutant as 0 of N killed).
also_copy=$(cd "$work" && for entry in *; do [ "$entry" = vembed ] || [ "$entry" = tests ] || printf '"%s", ' "$entry"; done)
# Workers fork from a server that has only imported the tests ("forkserver"), not from mutmut's main process: that one
# ran the tests under torch's OpenMP threads, and its forks hung forever at 0% CPU (no CPU-time limit ever fires).
{
  printf '\n[tool.mutmut]\nsource_paths = ["vembed"]\nonly_mutate = ["%s"]\nalso_copy = [%s]\n' "$module" "${also_copy%, }"
  printf 'process_isolation = "forkserver"\n'
  printf 'pytest_add_cli_args_test_selection = ['
  sep=""; for test in "$@"; do printf '%s"%s"' "$sep" "$test"; sep=", "; done
  printf ']\n'
} >> "$work/pyproject.toml"

cd "$work"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1  # one thread per worker: mutmut runs one worker a core
"$mutmut" run >"$work/run.log" 2>&1 || true   # exit status says survivors exist; the score below says how many
if grep -qiE "failed to collect stats|failed to run clean test|stopping early" "$work/run.log"; then
  tr '\r' '\n' <"$work/run.log" | grep -v '^⠀*[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]' | tail -40 >&2
  echo "scripts/mutate.sh: the tests fail on the unmutated copy (above): no score" >&2
  exit 1
fi
"$mutmut" export-cicd-stats >/dev/null
"$mutmut" results 2>/dev/null | awk -F: '/survived|timeout|suspicious|no tests/ {print $1}' | while read -r name; do
  "$mutmut" show "$name" 2>/dev/null; echo
done
python3 - "$module" mutants/mutmut-cicd-stats.json <<'PY'
import json, sys
module, path = sys.argv[1], sys.argv[2]
s = json.load(open(path))
total = s["total"] - s["skipped"]
print(f"{module}: {s['killed']} of {total} mutants killed ({100 * s['killed'] / max(total, 1):.0f}%), "
      f"{s['survived']} survived, {s['no_tests']} untested, {s['timeout']} timed out")
PY
