"""The standalone check's rule under sampling against SGLang's own verification code.

SGLang's target-only sampling kernel is CUDA (JIT-built), so it cannot run here; the test reads
the source the installed sglang 0.5.23 builds it from, and the Python that calls it, and fails
when a release changes the rule `eagleflow.serve.acceptance.accept_probability` models: accept a
greedily drafted token when `coin < p / threshold_acc` or `p >= threshold_single` (defaults
1.0), with zero draft probabilities, and on rejection sample relu(p - q) with q(x) := p(x).
"""

import re
import subprocess
from pathlib import Path

import pytest

from eagleflow.serve.acceptance import accept_probability

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def sglang_dir(sglang_python) -> Path:
    out = subprocess.run(
        [
            str(sglang_python),
            "-c",
            "import importlib.util, os; "
            "print(os.path.dirname(importlib.util.find_spec('sglang').origin))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return Path(out.stdout.strip())


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_kernel_accepts_a_chain_token_with_its_target_probability(sglang_dir):
    cuh = sglang_dir / "kernels/jit/include/sgl_kernel/speculative/sampling.cuh"
    src = _squash(cuh.read_text())
    # the acceptance test of one candidate, with the target probability of the drafted token
    assert "DType target_prob_single = target_probs[cur_prob_offset + draft_token_id];" in src
    assert "prob_acc += target_prob_single;" in src
    assert (
        "if (has_target_mass && (coin < prob_acc / threshold_acc || "
        "target_prob_single >= threshold_single))" in src
    )
    # a rejected candidate's draft prob becomes its target prob; the recovered token is drawn
    # from relu(target - draft): the target's distribution without the rejected token
    assert (
        "draft_probs[cur_prob_offset + draft_token_id] = "
        "target_probs[cur_prob_offset + draft_token_id];" in src
    )
    assert "relu_q_minus_p[j] = max(q_vec[j] - p_vec[j], DType(0));" in src
    # topk 1: one candidate per level, prob_acc starts at 0 for it, so the test is coin < p
    assert "prob_acc = 0.;" in src


def test_verify_passes_zero_draft_probs_and_temperature_scaled_target_probs(sglang_dir):
    py = _squash((sglang_dir / "srt/speculative/eagle_utils.py").read_text())
    assert "sampling_fn = tree_speculative_sampling_target_only" in py
    assert "else torch.zeros_like(target_probs)" in py  # target only: no draft probabilities
    assert (
        "target_probs = sampling_softmax( next_token_logits, temperatures=expanded_temperature"
        in py
    )
    assert "threshold_single=get_spec().speculative_accept_threshold_single" in py
    assert "threshold_acc=get_spec().speculative_accept_threshold_acc" in py


def test_defaults_are_the_plain_target_probability(sglang_dir):
    spec = _squash((sglang_dir / "srt/arg_groups/fields/spec.py").read_text())
    for name, default in (
        ("speculative_accept_threshold_single", "1.0"),
        ("speculative_accept_threshold_acc", "1.0"),
        ("speculative_use_rejection_sampling", "False"),
    ):
        m = re.search(rf"{name}: A\[ [^\]]*\] = ([\w.]+)", spec)
        assert m and m.group(1) == default, (name, m and m.group(1))
    # with those defaults the rule is the target probability itself, as for vLLM
    for p in (0.0, 0.2, 0.7, 1.0):
        assert accept_probability(p, "sglang") == pytest.approx(p)
        assert accept_probability(p, "sglang") == accept_probability(p, "vllm")
