"""vLLM's extract_hidden_states capture: the layer ids it accepts.

That vLLM's capture equals HF's hidden states layer by layer is tests/unit/extract/test_hf.py's
test_vllm_backend_matches_hf_backend (the vllm backend's shards against the hf backend's, which
test_shards_hold_the_configured_layers_and_the_pre_norm_final_slot checks against HF's own
output_hidden_states): one vLLM engine start instead of two.
"""

from __future__ import annotations

import pytest

from eagleflow.errors import EagleflowError
from eagleflow.extract.vllm_capture import check_layer_ids

N_LAYERS = 4


def test_layer_ids_are_checked():
    assert check_layer_ids([4, 0, 1, 0], N_LAYERS) == [0, 1, 4]
    for bad in ([], [5], [-1], [1.0]):
        with pytest.raises(EagleflowError, match="layer_ids"):
            check_layer_ids(bad, N_LAYERS)
