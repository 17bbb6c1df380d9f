#!/bin/sh
# Thin shim: the logic is eagleflow.remote.client (src/eagleflow/remote/client.py), run by the project's venv.
# Snakemake kills the cancel command after 2 s: the work runs detached (immune to Ctrl-C and to
# that timeout) and this shim returns at once. Its output: .snakemake/remote-gpu/cancel.log.
here=$(cd "$(dirname "$0")" && pwd -P)   # the repository's profiles/remote-gpu (links resolved)
repo=$(dirname "$(dirname "$here")")
py=${EAGLEFLOW_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
export EAGLEFLOW_REMOTE_SETTINGS="${EAGLEFLOW_REMOTE_SETTINGS:-$here/settings.yaml}"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export EAGLEFLOW_REMOTE_CALLER=$PPID   # Snakemake (it runs this directly): which run cancels
mkdir -p .snakemake/remote-gpu
(trap '' INT HUP TERM; exec "$py" -m eagleflow.remote.client cancel "$@") \
  </dev/null >>.snakemake/remote-gpu/cancel.log 2>&1 &
