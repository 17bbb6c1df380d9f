#!/bin/sh
# Thin shim: the logic is eagleflow.remote.client (src/eagleflow/remote/client.py), run by the project's venv.
here=$(cd "$(dirname "$0")" && pwd -P)   # the repository's profiles/remote-gpu (links resolved)
repo=$(dirname "$(dirname "$here")")
py=${EAGLEFLOW_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
export EAGLEFLOW_REMOTE_SETTINGS="${EAGLEFLOW_REMOTE_SETTINGS:-$here/settings.yaml}"
PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m eagleflow.remote.client submit "$@"
