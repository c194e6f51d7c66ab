"""Canaries: each private name of the installed vLLM that connectors/vllm.py relies on, and what it
relies on it doing. A vLLM upgrade that renames or changes one fails here, by name, instead of
storing wrong KV or losing saves somewhere inside an engine."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402


def test_get_attn_isa_picks_the_cpu_kernel_the_layout_follows() -> None:
    """kvstore.connectors.vllm._cpu_attn_isa calls it positionally (dtype, block_size, head_size, cache dtype)
    and maps "amx" to VllmCpuAmxLayout, every other ISA to VllmCpuLayout (checked at startup against
    vLLM's own cache writer)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

    params = list(inspect.signature(_get_attn_isa).parameters)
    assert params[:4] == ["dtype", "block_size", "head_size", "kv_cache_dtype"], params
    isa = _get_attn_isa(torch.bfloat16, 128, 64, "auto")
    assert isa in {"amx", "vec", "vec16", "neon", "vxe", "vsx", "rvv"}, isa
    amx = torch.cpu._is_amx_tile_supported()
    assert (isa == "amx") == amx, (isa, amx)
    assert _get_attn_isa(torch.float16, 128, 64, "auto") != "amx"  # AMX tiles are bf16 only


def test_cpu_cache_writer_takes_the_isa() -> None:
    from vllm import _custom_ops as ops  # noqa: PLC0415

    params = inspect.signature(ops.cpu_attn_reshape_and_cache).parameters
    names = ["key", "value", "key_cache", "value_cache", "slot_mapping", "isa"]  # the connector passes these
    assert list(params)[:6] == names, list(params)
    assert all(p.default is not p.empty for p in list(params.values())[6:]), "a new required argument"


def test_connector_base_keeps_the_private_fields_the_connector_reads() -> None:
    """_kv_transfer_config (kv_role), _vllm_config, _kv_cache_manager (block ids of a request, bound by
    bind_kv_cache_manager) and _get_connector_metadata()."""
    init = inspect.getsource(KVConnectorBase_V1.__init__)
    for name in ("self._kv_transfer_config", "self._vllm_config", "self._kv_cache_manager"):
        assert name in init, name
    assert "self._kv_cache_manager = " in inspect.getsource(KVConnectorBase_V1.bind_kv_cache_manager)
    assert callable(KVConnectorBase_V1._get_connector_metadata)
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415

    assert callable(KVCacheManager.get_block_ids)


def test_preemption_reaches_the_connector_before_the_blocks_are_reused() -> None:
    """The scheduler names preempted requests in SchedulerOutput.preempted_req_ids (the step after it
    freed their blocks), and the model runner calls handle_preemptions before it prepares the step's
    inputs (so before the forward that may overwrite the freed blocks)."""
    from vllm.v1.core.sched.output import SchedulerOutput  # noqa: PLC0415
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415

    assert "preempted_req_ids" in SchedulerOutput.__dataclass_fields__
    assert "handle_preemptions" in vars(KVConnectorBase_V1)
    source = inspect.getsource(GPUModelRunner.execute_model)
    at = source.find(".handle_preemptions(")
    assert 0 <= at < source.find("self._update_states(scheduler_output)"), "handle_preemptions moved"


def test_vllm_config_looks_the_connector_class_up_while_it_is_built() -> None:
    """connectors/vllm.py refuses what it cannot serve when vLLM's VllmConfig.__post_init__ looks the
    class up (to ask whether it supports the hybrid KV cache manager): found by walking up to that frame."""
    from vllm.config import VllmConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: PLC0415

    assert "KVConnectorFactory.supports_hma_config(" in inspect.getsource(VllmConfig.__post_init__)
    assert "get_connector_class(" in inspect.getsource(KVConnectorFactory.supports_hma_config)
    assert "getattr(connector_module, connector_name)" in inspect.getsource(
        KVConnectorFactory.get_connector_class
    )
