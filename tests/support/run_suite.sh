#!/usr/bin/env bash
# The pytest part of `make test`. With no extra arguments, two pytest runs side by side on the
# machine's cores: the "beside" run takes tests/workflow/test_slurm.py, whose time is mostly the
# Slurm executor's status polling (the CPU idles), then tests/unit/serve/test_served.py (vLLM
# servers, ~8 minutes); the main run takes the rest. Both must pass; the beside run's output
# follows the main run's. With arguments (PYTEST_ARGS), one plain pytest run.
set -uo pipefail
py=$1; shift
if [ $# -gt 0 ]; then exec "$py" -m pytest -ra --durations=15 "$@"; fi
log=$(mktemp /tmp/eagleflow-slurm-tests.XXXXXX.log)
base=$(mktemp -d /tmp/eagleflow-slurm-tests.XXXXXX)
"$py" -m pytest -ra --durations=8 -p no:cacheprovider --basetemp="$base/t" \
  tests/workflow/test_slurm.py tests/unit/serve/test_served.py >"$log" 2>&1 &
slurm=$!
"$py" -m pytest -ra --durations=15 --ignore=tests/workflow/test_slurm.py \
  --ignore=tests/unit/serve/test_served.py
main=$?
wait $slurm
slurm_rc=$?
echo "== tests/workflow/test_slurm.py, tests/unit/serve/test_served.py (ran beside the rest; exit $slurm_rc)"
cat "$log"
rm -rf "$log" "$base"
[ $main -eq 0 ] && [ $slurm_rc -eq 0 ]
