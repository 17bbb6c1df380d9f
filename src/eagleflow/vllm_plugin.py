"""A vLLM general plugin (entry point `vllm.general_plugins`) that mends vLLM CPU's sampled
speculative decoding.

Without Triton, vLLM replaces its rejection sampler's Triton kernels with C++ ones
(`vllm.platforms.cpu.register_triton_kernel_overrides`). In vLLM 0.32 the wrapper of
`expand_kernel` (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) hands the C++ op an int64
*copy* of a float32 output and never copies it back: the per-token temperatures, top-k and top-p
of sampled requests are then uninitialised memory (vllm-project/vllm#55005, fix proposed in
#55006). Greedy requests never reach it; sampled ones with a draft get garbage text and almost
no acceptance (measured here: 0.7 on the embedded default's draft, 0 accepted at positions 1-2).

vLLM loads general plugins in each worker before it registers the CPU kernels
(`vllm.v1.worker.worker_base`), so `register` swaps in a plain torch expansion there. It first
runs the installed wrapper on a small float32 case and does nothing when that is already right
(a fixed vLLM, or Triton present), so the mend retires itself. `EAGLEFLOW_VLLM_MEND=0` turns it
off.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def expand_kernel_impl(
    output,
    input_val,
    cu_num_tokens,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803
):
    """expand_kernel's contract in any dtype: request i's value (replace_from -> replace_to)
    into output[cu[i-1]:cu[i]]."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(vals, counts, output_size=output.numel()))


def expand_is_correct(impl) -> bool:
    """Whether `impl` expands float32 values correctly (the case vLLM 0.32 gets wrong)."""
    import torch

    values = torch.tensor([0.7, 1.3, -1.0], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    want = torch.tensor([0.7, 0.7, 1.3, 1.3, 1.3, 0.5], dtype=torch.float32)
    for _ in range(3):  # uninitialised memory can be right by chance once
        out = torch.full((6,), float("nan"), dtype=torch.float32)
        try:
            impl(out, values, cu, -1.0, 0.5)
        except Exception:  # noqa: BLE001 (a broken op is a wrong one)
            return False
        if not torch.allclose(out, want):
            return False
    return True


def register() -> None:
    """vLLM's plugin hook: mend the CPU expand kernel where the installed one is wrong."""
    if os.environ.get("EAGLEFLOW_VLLM_MEND", "1") == "0":
        return
    try:
        from vllm.triton_utils import HAS_TRITON
        from vllm.utils import cpu_triton_utils as cpu_tl
    except ImportError:
        return
    if HAS_TRITON or getattr(cpu_tl, "_eagleflow_original_expand", None) is not None:
        return
    try:  # registers torch.ops._C; the platform picks the build this CPU runs (a bare
        # `import vllm._C` loads the AVX-512 one and dies of SIGILL on an AVX2-only CPU)
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except ImportError:
        pass
    original = cpu_tl._expand_kernel_impl
    if expand_is_correct(original):
        return
    cpu_tl._eagleflow_original_expand = original
    cpu_tl._expand_kernel_impl = expand_kernel_impl
    log.warning(
        "eagleflow: vLLM CPU's expand kernel drops float results (vllm-project/vllm#55005); "
        "using a torch expansion so sampled speculative decoding sees the real temperatures"
    )
