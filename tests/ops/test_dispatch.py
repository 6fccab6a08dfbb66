"""The op dispatch seam (pagedllm/ops/dispatch.py): an op runs the highest-priority
implementation that can take the tensor's device and dtype, chooses once per device and
dtype, falls back to its torch reference, and lets a plugin join without layer edits."""

from __future__ import annotations

import pluggy
import pytest
import torch

from pagedllm import hookimpl, ops
from pagedllm.core import plugins
from pagedllm.core.contracts import OpImpl
from pagedllm.plugins.models.layers import RMSNorm


def registry_with(*impls: OpImpl) -> plugins.PluginRegistry:
    """The installed plugins plus one that offers `impls`."""

    class Extra:
        @hookimpl
        def pagedllm_op_impls(self):
            return list(impls)

    pm: pluggy.PluginManager = plugins.build_plugin_manager()
    pm.register(Extra(), name="extra-ops")
    return plugins.PluginRegistry(pm)


@pytest.fixture
def use_registry(monkeypatch):
    """Make the op dispatch see a given registry; forget every choice before and after."""
    def use(registry: plugins.PluginRegistry) -> None:
        monkeypatch.setattr(plugins, "get_registry", lambda: registry)
        ops.reset()

    yield use
    ops.reset()


def test_a_plugin_rms_norm_joins_the_layer_without_edits(use_registry):
    calls = []

    def counted(x, weight, eps, residual=None):
        calls.append(x.dtype)
        return ops.rms_norm.reference(x, weight, eps, residual)

    only_float64 = lambda device, dtype: [] if dtype == torch.float64 else ["float64 only"]  # noqa: E731
    use_registry(registry_with(OpImpl("rms_norm", "test_f64", counted, only_float64, priority=1000)))
    norm = RMSNorm(8, 1e-6, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    out = norm(x)
    torch.testing.assert_close(out, ops.rms_norm.reference(x, norm.scale(), 1e-6))
    assert calls == [torch.float64], "the plugin's rms_norm was not the one the layer ran"
    RMSNorm(8, 1e-6, dtype=torch.bfloat16)(torch.randn(3, 8, dtype=torch.bfloat16))
    assert calls == [torch.float64], "a float64-only implementation ran on bfloat16"
    assert ops.chosen()["rms_norm"]["cpu/float64"] == "test_f64"


def test_choice_is_made_once_per_device_and_dtype(use_registry):
    asked = []

    def check(device, dtype):
        asked.append((device.type, dtype))
        return []

    use_registry(registry_with(OpImpl("silu_and_mul", "test_once", ops.silu_and_mul.reference, check,
                                      priority=1000)))
    for _ in range(3):
        ops.silu_and_mul(torch.randn(2, 8))
    assert asked == [("cpu", torch.float32)], f"checks were repeated per call: {asked}"


def test_highest_priority_runnable_wins_and_reference_is_the_fallback(use_registry):
    def tagged(tag):
        return lambda table, ids: torch.full((ids.shape[0], table.shape[1]), float(tag))

    can = lambda device, dtype: []  # noqa: E731
    cannot = lambda device, dtype: ["never here"]  # noqa: E731
    use_registry(registry_with(OpImpl("gather_rows", "low", tagged(1), can, priority=500),
                               OpImpl("gather_rows", "high", tagged(2), can, priority=900),
                               OpImpl("gather_rows", "best_but_cannot", tagged(3), cannot, priority=2000)))
    table, ids = torch.randn(4, 3), torch.tensor([1, 2])
    assert torch.all(ops.gather_rows(table, ids) == 2.0), "the runnable implementation of top priority lost"
    use_registry(registry_with(OpImpl("gather_rows", "cannot", tagged(3), cannot, priority=2000)))
    with_ref = ops.gather_rows(table.double(), ids)  # the built-in native one takes float32 only
    assert torch.equal(with_ref, table.double()[ids]), "the torch reference did not run where nothing else can"


def test_an_impl_of_an_unknown_op_fails_naming_the_known_ones(use_registry):
    use_registry(registry_with(OpImpl("fused_moe_typo", "x", lambda *a: None, lambda d, t: [])))
    with pytest.raises(ValueError, match=r"unknown ops \['fused_moe_typo'\].*rms_norm"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)


def test_the_same_impl_name_twice_for_one_op_is_an_error():
    impl = OpImpl("rms_norm", "cpu_native", ops.rms_norm.reference, lambda d, t: [])
    with pytest.raises(ValueError, match="cpu_native.*rms_norm"):
        registry_with(impl)
