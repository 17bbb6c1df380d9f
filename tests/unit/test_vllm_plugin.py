"""The vLLM plugin that mends vLLM CPU's expand kernel (sampled speculative decoding)."""

from importlib.metadata import entry_points

import pytest
import torch

from eagleflow import vllm_plugin

cpu_tl = pytest.importorskip("vllm.utils.cpu_triton_utils")


def test_the_plugin_is_an_installed_vllm_general_plugin():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("eagleflow_cpu_expand_mend") == "eagleflow.vllm_plugin:register"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expansion_repeats_each_requests_value_over_its_tokens(dtype):
    values = torch.tensor([3, 7, -1, 5], dtype=dtype)
    cu = torch.tensor([1, 1, 4, 6], dtype=torch.int32)  # request 1 has no draft tokens
    out = torch.zeros(6, dtype=dtype)
    vllm_plugin.expand_kernel_impl(out, values, cu, -1, 9)
    assert out.tolist() == [3, 9, 9, 9, 5, 5]


def test_float_temperatures_survive_the_expansion():
    temps = torch.tensor([0.7, 1.0, 0.25])
    out = torch.empty(5)
    vllm_plugin.expand_kernel_impl(out, temps, torch.tensor([3, 4, 5], dtype=torch.int32), -1, 0)
    assert torch.allclose(out, torch.tensor([0.7, 0.7, 0.7, 1.0, 0.25]))


def test_the_installed_cpu_kernel_is_wrong_on_floats_and_register_mends_it(monkeypatch):
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the extension built for this CPU (AVX2 or AVX-512)
    original = getattr(cpu_tl, "_eagleflow_original_expand", None) or cpu_tl._expand_kernel_impl
    if vllm_plugin.expand_is_correct(original):
        pytest.skip("the installed vLLM's expand kernel is right: the mend retires itself")
    monkeypatch.setattr(cpu_tl, "_expand_kernel_impl", original)
    monkeypatch.setattr(cpu_tl, "_eagleflow_original_expand", None, raising=False)
    monkeypatch.setenv("EAGLEFLOW_VLLM_MEND", "0")
    vllm_plugin.register()
    assert cpu_tl._expand_kernel_impl is original  # switched off
    monkeypatch.delenv("EAGLEFLOW_VLLM_MEND")
    vllm_plugin.register()
    assert cpu_tl._expand_kernel_impl is vllm_plugin.expand_kernel_impl
    assert cpu_tl._eagleflow_original_expand is original
    assert vllm_plugin.expand_is_correct(cpu_tl._expand_kernel_impl)
    vllm_plugin.register()  # idempotent
    assert cpu_tl._eagleflow_original_expand is original


def test_a_correct_kernel_is_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_tl, "_expand_kernel_impl", vllm_plugin.expand_kernel_impl)
    monkeypatch.setattr(cpu_tl, "_eagleflow_original_expand", None, raising=False)
    vllm_plugin.register()
    assert cpu_tl._eagleflow_original_expand is None
