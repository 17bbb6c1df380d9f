"""Probe: eagleflow.layers.sglang_capture_real under the contract venv's SGLang.

Request: {"cases": [[family, layer_ids, num_layers], ...]}; answer: [[captured ids, version], ...].
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from eagleflow import layers as lay  # noqa: E402

if __name__ == "__main__":
    request = json.load(sys.stdin)
    print(json.dumps([list(lay.sglang_capture_real(*case)) for case in request["cases"]]))
