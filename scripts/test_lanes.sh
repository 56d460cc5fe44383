#!/usr/bin/env bash
# `make test` and `make test-fast`: the test suite as two pytest processes side by side, one per
# core (much of the suite is one thread at a time: graph compilation, Python, waits on subprocesses).
#
#   lane 1: the files listed in tests/lanes.txt (every file with msrun tests first, so their jobs
#           of 2 workers + a scheduler run one after another, never two at once), then files
#           that even out the two lanes' times;
#   lane 2: every other test file.
#
# Each lane is a plain `pytest FILES` run; each output line starts with its lane's name. The
# script fails if either lane fails (pytest's "no tests selected" counts as passing: test-fast
# selects no msrun test).
#
# usage: scripts/test_lanes.sh PYTHON [MARK_EXPRESSION] [PYTEST_ARGS...]
#   scripts/test_lanes.sh .venv/bin/python                                         # make test
#   scripts/test_lanes.sh .venv/bin/python "not slow and not msrun and not sigkill"  # make test-fast
set -u
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/test_lanes.sh PYTHON [MARK_EXPRESSION] [PYTEST_ARGS...]}
marks=${2:-}
shift $(( $# < 2 ? $# : 2 ))

# Every test starts Python processes (msrun workers, CLI runs, Ray workers): let them cache the
# bytecode they compile. Where PYTHONDONTWRITEBYTECODE is set (this project's CI machines set it), a
# process compiles every module it imports from source, every time: ~9 s of CPU more for
# `import torch, transformers` in each lane, ~1.3 s for `import ray` in each Ray worker, and all of
# mspretrain in every subprocess, since `pip install -e` byte-compiles none of it (docs/benchmarks.md,
# "The suite's time: bytecode, the final eval, one probe process").
unset PYTHONDONTWRITEBYTECODE
mapfile -t lane1 < <(grep -v '^\s*\(#\|$\)' tests/lanes.txt)
ignore=()
for f in "${lane1[@]}"; do
    [ -f "$f" ] || { echo "error: tests/lanes.txt names $f, which does not exist" >&2; exit 2; }
    ignore+=("--ignore=$f")
done
select=()
[ -n "$marks" ] && select=(-m "$marks")
# two pytest processes would race over .pytest_cache (the last writer wins): no cache
common=(-p no:cacheprovider --durations=15 "${select[@]}" "$@")

run_lane() {  # NAME PYTEST_ARGS...: the lane's exit code (5, nothing selected, is 0)
    local name=$1
    shift
    set -o pipefail
    "$py" -m pytest "$@" 2>&1 | sed -u "s/^/[$name] /"
    local rc=$?
    [ "$rc" -eq 5 ] && rc=0
    return "$rc"
}

run_lane "lane 1" "${lane1[@]}" "${common[@]}" &
first=$!
run_lane "lane 2" tests "${ignore[@]}" "${common[@]}" &
second=$!
wait "$first"
rc1=$?
wait "$second"
rc2=$?
echo "lane 1: exit $rc1, lane 2: exit $rc2"
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
