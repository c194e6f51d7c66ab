"""`KVStoreConnectorV1`: kvstore as a KV connector of real vLLM (V1), loaded by module path.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnectorV1",
        "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "http://127.0.0.1:8100"}}'

The only module that imports vllm. It is the bundled engine's connector in vLLM's signatures: the
same chunk keys (`kvstore.keys`, one layout fingerprint for every engine), codecs, SDK, save queue
and load-error reporting (`KVStoreScheduler`, `KVStoreWorker`), with vLLM's paged layout converted
in `kvstore.connectors.layouts`. So what vLLM stores is a hit for `kvstore-engine` and the reverse whenever
model, KV dtype and chunk size match.

vLLM runs the scheduler side in its EngineCore process and the worker side in its Worker process:
each opens its own client to a `kvstore-server` (`url`; an in-process store would be two stores that
never meet). Settings come from `kv_connector_extra_config` over `KVSTORE_*` variables
(`KVTransferConfig.from_mapping`). Roles: `kv_both` loads and saves, `kv_producer` saves (and answers
only once its saves landed: a decode instance asks the store next), `kv_consumer` loads.

A load that fails (missing, corrupt, unreachable) reports its blocks through
`get_block_ids_with_load_errors` and vLLM recomputes them; a store is a cache, so the connector refuses
to start without `kv_load_failure_policy: recompute` (vLLM's default, `fail`, would fail the request).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.kv_worker import KVStoreWorker
from kvstore.connectors.layouts import PagedLayout, VllmCpuAmxLayout, VllmCpuLayout, VllmCudaLayout
from kvstore.connectors.meta import StepTransfers
from kvstore.connectors.store_handle import StoreHandle, acquire_store, release_store
from kvstore.connectors.vllm_scheduler import VllmScheduler
from kvstore.connectors.vllm_support import check_supported
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

from kvstore.errors import ConfigError
from kvstore.keys import model_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)
# how a rejected token's message says to pass one, in vLLM's terms
TOKEN_HINT = (
    '"token_file": "FILE" (or "token") in the kv_connector_extra_config of --kv-transfer-config or '
    "LLM(kv_transfer_config=...), or the KVSTORE_AUTH_TOKEN_FILE variable"
)
OUR_LOGGERS = ("connectors", "sdk", "kvstore")  # the connector and what it calls


class _ThroughVllm(logging.Handler):
    """Hands records to vLLM's logger, so they print with vLLM's handler and format. Its handlers are
    found when a record comes: vLLM configures its logging again in every process it starts."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def log_through_vllm() -> None:
    """Our loggers write where vLLM's do, at vLLM's level: without this their INFO lines never show
    and their WARNINGs reach Python's last-resort handler, bare, on stderr. Only where nobody set up
    Python logging (no root handler): an application that did keeps getting our records itself."""
    from vllm import envs  # noqa: PLC0415

    if logging.getLogger().handlers:
        return
    for name in OUR_LOGGERS:
        ours = logging.getLogger(name)
        if not any(isinstance(h, _ThroughVllm) for h in ours.handlers):
            ours.addHandler(_ThroughVllm())
            ours.propagate = False
            if ours.level == logging.NOTSET:
                ours.setLevel(envs.VLLM_LOGGING_LEVEL)


log_through_vllm()  # vLLM imports this module in each process that builds a connector
_KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32"}


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """EngineCore -> Worker, once per step (pickled between the processes)."""

    transfers: StepTransfers = field(default_factory=StepTransfers)
    held: frozenset[str] = frozenset()  # finished requests whose blocks vLLM keeps until we report them


def transfer_config(vllm_config: VllmConfig) -> KVTransferConfig:
    """The connector's settings and the KV layout (the fingerprint of every key) of this vLLM."""
    check_supported(vllm_config)  # what it cannot serve: one sentence naming the setting to change
    ktc = vllm_config.kv_transfer_config
    base = KVTransferConfig.from_mapping({**(ktc.kv_connector_extra_config or {}), "kv_role": ktc.kv_role})
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    raw = get_hf_file_to_dict("config.json", mc.model, mc.revision)
    if not raw:
        raise ConfigError(f"cannot read config.json of {mc.model}: the KV layout fingerprint needs it")
    cache_dtype = str(cc.cache_dtype)
    kv_dtype = _KV_DTYPES[str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype]
    layout = model_layout(raw, model=mc.model, kv_dtype=kv_dtype)
    return KVTransferConfig(
        **{**base.model_dump(), "layout": layout, "block_size": cc.block_size, "load_async": False}
    )


def _vllm_config_being_built() -> VllmConfig | None:
    """The `VllmConfig` whose `__post_init__` is looking this connector's class up, if one is (vLLM asks
    the class there whether it supports the hybrid KV cache manager: the first moment a connector can see
    the settings, before any process, weight or cache exists)."""
    from vllm.config import VllmConfig  # noqa: PLC0415

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code.co_name == "__post_init__":
            config = frame.f_locals.get("self")
            if isinstance(config, VllmConfig):
                return config
        frame = frame.f_back
    return None


class KVStoreConnectorV1(KVConnectorBase_V1):
    """Reached through this module's `__getattr__` (see the end of the module)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                "KVStoreConnectorV1 supports models with one KV cache group (no hybrid attention)"
            )
        self.config = transfer_config(vllm_config)
        self.handle: StoreHandle = acquire_store(self.config, TOKEN_HINT)
        self._scheduler: VllmScheduler | None = None
        self._worker: KVStoreWorker | None = None
        try:
            if role is KVConnectorRole.SCHEDULER:
                self._scheduler = VllmScheduler(KVStoreScheduler(self.config, self.handle), self._block_ids)
            else:
                self._worker = KVStoreWorker(self.config, self.handle, paged=_layout(vllm_config))
        except BaseException:
            release_store(self.handle)
            raise
        self._closed = False
        logger.info(
            "KVStoreConnectorV1 (%s, %s): store %s, codec %s, chunk %d tokens, layout %s",
            role.name, self._kv_transfer_config.kv_role, self.config.store_url, self.config.codec,
            self.config.chunk_size, self.config.layout,
        )  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        """A store is best-effort: a save lost to a preemption is a later miss, not a broken hand-off."""
        return False

    @property
    def scheduler(self) -> VllmScheduler:
        assert self._scheduler is not None, f"a scheduler-side call on the {self.role.name} connector"
        return self._scheduler

    @property
    def worker(self) -> KVStoreWorker:
        assert self._worker is not None, f"a worker-side call on the {self.role.name} connector"
        return self._worker

    # ---- scheduler side (EngineCore process) --------------------------------------------------
    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before scheduling"
        (block_ids,) = self._kv_cache_manager.get_block_ids(request_id)
        return block_ids

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        transfers, held = self.scheduler.build_connector_meta(scheduler_output)
        return KVStoreConnectorMetadata(transfers, held)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward (which may reuse their blocks): copy out preempted requests' partial
        chunks (VllmScheduler)."""
        assert isinstance(kv_connector_metadata, KVStoreConnectorMetadata), type(kv_connector_metadata)
        self.worker.handle_preemptions(kv_connector_metadata.transfers)

    # ---- worker side (Worker process) ---------------------------------------------------------
    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata), type(meta)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=extract_layer_index)
        caches = [kv_caches[n] for n in names]
        if isinstance(self.worker.paged, VllmCpuLayout):
            _check_cpu_layout(caches[0], self._vllm_config, self.worker.paged)
        self.worker.register_kv_caches(caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta().transfers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in start_load_kv: one blob holds every layer of its chunk."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Saves copy whole chunks out in wait_for_save, once every layer is computed."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta().transfers)
        if self._kv_transfer_config.kv_role == "kv_producer":
            self.worker.flush()  # the decode instance looks the prompt up as soon as we answer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        held = self._meta().held if self.has_connector_metadata() else frozenset()
        return self.worker.get_finished(finished_req_ids & held)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown()
        release_store(self.handle)


def _cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, vllm_config: VllmConfig) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

    return _get_attn_isa(dtype, block_size, head_size, str(vllm_config.cache_config.cache_dtype))


def _layout(vllm_config: VllmConfig) -> PagedLayout:
    """The paged layout vLLM's attention backend will use here: on CPU it depends on the ISA vLLM
    picks (AMX tiles for bf16 with blocks of a multiple of 32 tokens on AMX CPUs)."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu():
        return VllmCudaLayout()
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    isa = _cpu_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), vllm_config)
    return VllmCpuAmxLayout() if isa == "amx" else VllmCpuLayout()


def _check_cpu_layout(cache: torch.Tensor, vllm_config: VllmConfig, layout: VllmCpuLayout) -> None:
    """Write one block with vLLM's own CPU cache writer (for the ISA this machine runs) and read it back
    through `layout`: a kernel whose block layout differs (e.g. another ISA) is refused at startup
    instead of storing wrong KV."""
    from vllm import _custom_ops as ops  # noqa: PLC0415

    _, h, bs, d2 = cache.shape
    isa = _cpu_attn_isa(cache.dtype, bs, d2 // 2, vllm_config)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(bs, h, d2 // 2, generator=gen).to(cache.dtype) for _ in range(2))
    block = torch.zeros(1, h, bs, d2, dtype=cache.dtype)
    k_cache, v_cache = block.view(1, h, 2 * bs, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(bs), isa)
    chunk = layout.gather([block], [0])
    if not (torch.equal(chunk[0, 0], k) and torch.equal(chunk[1, 0], v)):
        raise ConfigError(
            f"vLLM's CPU KV cache layout for ISA {isa!r} is not the {layout.name!r} one KVStoreConnectorV1 "
            "converts"
        )


_CONNECTOR = KVStoreConnectorV1
del KVStoreConnectorV1  # looked up through __getattr__, which checks the VllmConfig being built


def __getattr__(name: str) -> Any:
    """`KVStoreConnectorV1`, after refusing what it cannot serve of the `VllmConfig` vLLM is building
    when it looks the class up (`connectors/vllm_support.py`): `LLM(...)` or `vllm serve` then fails in
    the user's process with one sentence, before a worker starts or a weight loads."""
    if name == "KVStoreConnectorV1":
        config = _vllm_config_being_built()
        if config is not None:
            check_supported(config)
        return _CONNECTOR
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
