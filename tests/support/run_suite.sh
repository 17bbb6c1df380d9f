#!/usr/bin/env bash
# The pytest part of `make test`. With no extra arguments, tests/workflow/test_slurm.py runs in a
# second pytest beside the rest: its time is mostly the Slurm executor's status polling (the CPU
# idles), so the two together take about as long as the rest alone. Both must pass; the Slurm
# run's output follows the main run's. With arguments (PYTEST_ARGS), one plain pytest run.
set -uo pipefail
py=$1; shift
if [ $# -gt 0 ]; then exec "$py" -m pytest -ra --durations=15 "$@"; fi
log=$(mktemp /tmp/eagleflow-slurm-tests.XXXXXX.log)
base=$(mktemp -d /tmp/eagleflow-slurm-tests.XXXXXX)
"$py" -m pytest -ra --durations=8 -p no:cacheprovider --basetemp="$base/t" \
  tests/workflow/test_slurm.py >"$log" 2>&1 &
slurm=$!
"$py" -m pytest -ra --durations=15 --ignore=tests/workflow/test_slurm.py
main=$?
wait $slurm
slurm_rc=$?
echo "== tests/workflow/test_slurm.py (ran beside the rest; exit $slurm_rc)"
cat "$log"
rm -rf "$log" "$base"
[ $main -eq 0 ] && [ $slurm_rc -eq 0 ]
