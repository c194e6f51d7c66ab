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

import hashlib
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.grouped_layout import GroupedLayout
from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.kv_worker import KVStoreWorker
from kvstore.connectors.layouts import PagedLayout, VllmCpuAmxLayout, VllmCpuLayout, VllmCudaLayout
from kvstore.connectors.meta import StepTransfers
from kvstore.connectors.mla_layout import VllmMlaLayout
from kvstore.connectors.shard import Shard
from kvstore.connectors.store_handle import StoreHandle, acquire_store, release_store
from kvstore.connectors.vllm_scheduler import VllmScheduler
from kvstore.connectors.vllm_stats import (
    KVStoreConnectorStats,
    KVStorePromMetrics,
    StatsDelta,
    hit_source,
    samples,
    tier_label,
)
from kvstore.connectors.vllm_support import check_supported
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.model_executor.models.utils import extract_layer_index
from vllm.transformers_utils.repo_utils import get_hf_file_to_dict
from vllm.v1.metrics.cache_hit_source import CacheHitSource

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
_KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
              "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # fmt: skip


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
    mla = bool(getattr(mc, "use_mla", False))
    num_layers = model_layout(raw, model=mc.model, kv_dtype=kv_dtype)["num_layers"]
    # fp8: the layers' k/v scales are part of every key (an engine with other scales never reads them)
    scales = (
        scales_digest(expected_kv_scales(vllm_config, num_layers)) if kv_dtype.startswith("float8") else ""
    )
    layout = model_layout(raw, model=mc.model, kv_dtype=kv_dtype, kv_scales=scales, mla=mla)
    pp = vllm_config.parallel_config.pipeline_parallel_size
    stages = tuple(_pp_layers(layout["num_layers"], rank, pp) for rank in range(pp)) if pp > 1 else ()
    return KVTransferConfig(
        **{**base.model_dump(), "layout": layout, "block_size": cc.block_size,
           "pp_stages": stages}
    )  # fmt: skip


def scales_digest(scales: list[tuple[float, float]]) -> str:
    """`KVLayout.kv_scales` of an fp8 cache quantised per tensor: each layer's (k_scale, v_scale)."""
    data = np.asarray(scales, dtype="<f4").tobytes()
    return "tensor:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def expected_kv_scales(vllm_config: VllmConfig, num_layers: int) -> list[tuple[float, float]]:
    """The per-tensor (k_scale, v_scale) vLLM quantises each layer's fp8 KV cache with, as the scheduler
    side can know them (vLLM's BaseKVCacheMethod): 1.0 for a checkpoint without a quantization config;
    else the checkpoint's `...layers.N....k_scale` / `v_scale` tensors (one alone: the larger for both;
    none: 1.0). The workers check these against the scales their layers really use at startup."""
    scales = [(1.0, 1.0)] * num_layers
    mc = vllm_config.model_config
    if getattr(mc, "quantization", None) is None:
        return scales
    found: dict[int, dict[str, float]] = {}
    for path in sorted(Path(str(mc.model)).glob("*.safetensors")):
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = re.search(r"layers\.(\d+)\..*\b(k|v|kv)_scale$", name)
                if m:
                    found.setdefault(int(m.group(1)), {})[m.group(2)] = float(
                        f.get_tensor(name).float().max()
                    )
    for layer, got in found.items():
        if 0 <= layer < num_layers:
            k, v = got.get("k", got.get("kv")), got.get("v", got.get("kv"))
            if k is None or v is None:
                k = v = max(x for x in (k, v) if x is not None)
            scales[layer] = (k, v)
    return scales


def _pp_layers(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """The layers [a, b) vLLM gives pipeline stage `rank` of `size` (VLLM_PP_LAYER_PARTITION or even)."""
    from vllm.distributed.utils import get_pp_indices  # noqa: PLC0415

    return tuple(get_pp_indices(num_layers, rank, size))


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


class KVStoreConnectorV1(KVConnectorBase_V1, SupportsHMA):
    """Reached through this module's `__getattr__` (see the end of the module).

    `SupportsHMA`: vLLM keeps its hybrid KV cache manager on. Sliding-window layers then get their own
    block tables (blocks out of the window are vLLM's null block): every group's layers move with their
    own blocks (`layouts.GroupedLayout`), a load fills a window layer's window only, and a failed load
    fails its request whole (vLLM takes no block ids from a hybrid model), through
    `get_transfer_results`: loads are asynchronous then. A model with Mamba / linear-attention state
    gets no hits and saves nothing (one log line): kvstore does not store that state.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._groups = _groups(kv_cache_config)
        self.config = transfer_config(vllm_config)
        if len(self._groups.specs) > 1 and not self.config.load_async:  # failures go whole, through a wait
            self.config = self.config.model_copy(update={"load_async": True})
        self.handle: StoreHandle = acquire_store(self.config, TOKEN_HINT)
        self._scheduler: VllmScheduler | None = None
        self._worker: KVStoreWorker | None = None
        try:
            if role is KVConnectorRole.SCHEDULER:
                self._scheduler = VllmScheduler(KVStoreScheduler(self.config, self.handle), self._block_ids)
            else:
                self._worker = KVStoreWorker(
                    self.config, self.handle, paged=_layout(vllm_config), shard=_shard(self.config)
                )
                self._worker.fail_whole_requests = len(self._groups.specs) > 1
        except BaseException:
            release_store(self.handle)
            raise
        # vLLM CPU's reference CPU_MLA backend cannot attend over a prefix it did not compute in the same
        # pass (vLLM turns its own prefix caching off for it): a loaded latent would change the answer
        self._saves_only = _prefix_unusable(vllm_config)
        if self._saves_only and role is KVConnectorRole.SCHEDULER:
            logger.warning(
                "KVStoreConnectorV1: vLLM's CPU MLA backend cannot use a prefix it did not compute (vLLM "
                "turned its own prefix caching off for it): no store hits for %s, saves only (the AMX MLA "
                "backend, bf16 on AMX CPUs, loads)",
                vllm_config.model_config.model,
            )
        if self._groups.stateful and role is KVConnectorRole.SCHEDULER:
            logger.warning(
                "KVStoreConnectorV1: %s has Mamba / linear-attention layers whose state kvstore does not "
                "store: no store hits and no saves for it (vLLM computes every prompt)",
                vllm_config.model_config.model,
            )
        self._closed = False
        self._tiers = _store_tiers(self.handle)
        self._stats = StatsDelta(tier_label(self._tiers), _counts_tokens(self._worker))
        logger.info(
            "KVStoreConnectorV1 (%s, %s): store %s, codec %s, chunk %d tokens, layout %s",
            role.name, self._kv_transfer_config.kv_role, self.config.store_url, self.config.codec,
            self.config.chunk_size, self.config.layout,
        )  # fmt: skip

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
    def _block_ids(self, request_id: str) -> list[int] | list[tuple[int, ...]]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before scheduling"
        return block_table(self._kv_cache_manager.get_block_ids(request_id))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self._groups.stateful or self._saves_only:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tier kind of the store (`vllm_stats.hit_source`): HOST, DISK, or unspecified."""
        return {hit_source(self._tiers): num_external_tokens} if num_external_tokens else {}

    def take_events(self) -> list[KVCacheEvent]:
        """BlockStored for the chunks handed to the saver, BlockRemoved for the partials they replace."""
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        """Forget what this connector remembers of lookups (vLLM's `reset_prefix_cache(reset_connector=
        True)`); the store is shared by other engines: its chunks stay (`kvstore-cli` or the server's
        API empty it)."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not self._groups.stateful:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        if self._groups.stateful:
            return KVStoreConnectorMetadata()
        transfers, held = self.scheduler.build_connector_meta(scheduler_output)
        return KVStoreConnectorMetadata(transfers, held)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._groups.stateful:
            return False, None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager: one block table per KV cache group."""
        if self._groups.stateful:
            return False, None
        return self.scheduler.request_finished(request, block_table(block_ids))

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
        if self._groups.stateful:
            return  # nothing is stored or loaded for a model with Mamba / linear-attention state
        names = sorted(kv_caches, key=extract_layer_index)
        caches = [kv_caches[n] for n in names]
        if len(self._groups.specs) > 1:  # vLLM's hybrid manager: a block table per group
            layer_groups = [self._groups.group_of[n] for n in names]
            self.worker.set_paged(GroupedLayout(self.worker.paged, layer_groups, self._groups.windowed))
        if self.config.layout.kv_scales:
            _check_kv_scales(names, self._vllm_config, self.config.layout.num_layers)
        paged = getattr(self.worker.paged, "inner", self.worker.paged)
        if isinstance(paged, VllmCpuLayout):
            _check_cpu_layout(caches[0], self._vllm_config, paged)
        elif isinstance(paged, VllmMlaLayout) and caches[0].device.type == "cpu":
            _check_mla_layout(caches[0], paged)
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
        sent, recved, _ = self._transfer_results(finished_req_ids)
        return sent or None, recved or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Done saves and loads; a load that failed (hybrid models: whole) is in `failed_recving` too."""
        sent, recved, failed = self._transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recved, failed_recving=failed
        )

    def _transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        if self._worker is None or self._groups.stateful:
            return set(), set(), set()
        held = self._meta().held if self.has_connector_metadata() else frozenset()
        return self.worker.transfer_results(finished_req_ids & held)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's loads and saves since its last report (TP rank 0 of each stage reports)."""
        if self._worker is None or not self._worker.shard.stores:
            return None
        return self._stats.take(samples(self.handle.metrics))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown()
        release_store(self.handle)


def _prefix_unusable(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's attention here cannot consume a loaded prefix: an MLA model on vLLM CPU with its
    prefix caching off (the platform turns it off for the reference CPU_MLA backend, whose prefill
    attends over the new tokens only)."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    mc = vllm_config.model_config
    return bool(
        current_platform.is_cpu()
        and getattr(mc, "use_mla", False)
        and not vllm_config.cache_config.enable_prefix_caching
    )


@dataclass(frozen=True)
class _Groups:
    """vLLM's KV cache groups as the connector uses them."""

    specs: tuple[Any, ...] = ()
    group_of: dict[str, int] = field(default_factory=dict)  # layer name -> its group's index
    windowed: frozenset[int] = frozenset()  # sliding-window groups
    stateful: bool = False  # a group holds Mamba / linear-attention state, not per-token KV


def _groups(kv_cache_config: KVCacheConfig | None) -> _Groups:
    if kv_cache_config is None:
        return _Groups()
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec  # noqa: PLC0415

    groups = kv_cache_config.kv_cache_groups
    return _Groups(
        specs=tuple(g.kv_cache_spec for g in groups),
        group_of={name: i for i, g in enumerate(groups) for name in g.layer_names},
        windowed=frozenset(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)),
        stateful=any(not isinstance(g.kv_cache_spec, AttentionSpec) for g in groups),
    )


def block_table(groups: Sequence[Sequence[int]]) -> list[int] | list[tuple[int, ...]]:
    """A request's blocks: its one group's ids, or with vLLM's hybrid manager one tuple per block
    position holding each group's id there (`layouts.GroupedLayout`)."""
    if len(groups) == 1:
        return list(groups[0])
    assert len({len(g) for g in groups}) == 1, [len(g) for g in groups]
    return list(zip(*groups, strict=True))


def _store_tiers(handle: StoreHandle) -> tuple[str, ...]:
    """The tiers of the kvstore-server (its /v1/stats), for the metrics' `tier` label and CacheHitSource;
    () when it does not answer (then "store" and unspecified)."""
    try:  # the lookup client (short timeout) where there is one: a hung store does not hold the start
        client = handle.lookups if handle.lookups is not None else handle.store
        return tuple(str(t.get("name")) for t in client.stats().get("tiers", ()))
    except Exception:  # the store may be down at startup: the connector starts all the same
        return ()


def _counts_tokens(worker: KVStoreWorker | None) -> bool:
    """Whether this worker counts loaded tokens: the first PP stage's (every stage loads the same ones)."""
    return worker is None or worker.shard.layers is None or worker.shard.layers[0] == 0


def _shard(config: KVTransferConfig) -> Shard:
    """This worker's part of a stored chunk: its TP rank's heads, its PP stage's layers (connectors/shard.py)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415

    tp, pp = get_tp_group(), get_pp_group()
    group = tp.cpu_group if current_platform.is_cpu() else tp.device_group
    layers = config.pp_stages[pp.rank_in_group] if config.pp_stages else None
    mla = config.layout.kv_format == "mla"  # one latent, the same on every rank: stored once
    return Shard(tp.rank_in_group, tp.world_size, config.layout.num_kv_heads, mla, group, layers)


def _cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, vllm_config: VllmConfig) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

    return _get_attn_isa(dtype, block_size, head_size, str(vllm_config.cache_config.cache_dtype))


def _check_kv_scales(names: list[str], vllm_config: VllmConfig, num_layers: int) -> None:
    """The fp8 scales this worker's layers really use are the ones its keys were made with."""
    from vllm.config import get_layers_from_vllm_config  # noqa: PLC0415
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: PLC0415

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)
    if len(layers) != len(names):  # the forward context is the current config's
        from vllm.config import get_current_vllm_config  # noqa: PLC0415

        layers = get_layers_from_vllm_config(get_current_vllm_config(), AttentionLayerBase, names)
    want = expected_kv_scales(vllm_config, num_layers)
    for name in names:
        layer = layers[name]
        have = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
        if have != want[extract_layer_index(name)]:
            raise ConfigError(
                f"KVStoreConnectorV1 cannot tell the fp8 k/v scales vLLM uses ({name}: {have}, the checkpoint "
                f"suggests {want[extract_layer_index(name)]}): set --kv-cache-dtype auto, or drop "
                "--kv-transfer-config"
            )


def _check_mla_layout(cache: torch.Tensor, layout: VllmMlaLayout) -> None:
    """Write one block with vLLM's own CPU MLA cache writer and read it back through `layout`."""
    # AMX MLA writes with this op (bf16 only); the reference CPU_MLA backend writes rows in Python
    op = getattr(torch.ops._C, "concat_and_cache_mla_cpu", None) if cache.dtype == torch.bfloat16 else None
    bs, d = cache.shape[-2], cache.shape[-1]
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(bs, d, generator=gen).to(cache.dtype)
    block = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype)
    if op is not None:  # AMX MLA's writer; the reference CPU_MLA writes rows in Python: flat[slot] = latent
        op(
            latent[:, : d - 64].contiguous(),
            latent[:, d - 64 :].contiguous(),
            block.view(1, bs, d),
            torch.arange(bs),
        )
    else:
        block.view(-1, d)[torch.arange(bs)] = latent
    if not torch.equal(layout.gather([block], [0])[0, 0, :, 0], latent):
        raise ConfigError("vLLM's MLA KV cache layout is not the one KVStoreConnectorV1 converts")


def _layout(vllm_config: VllmConfig) -> PagedLayout:
    """The paged layout vLLM's attention backend will use here: on CPU it depends on the ISA vLLM
    picks (AMX tiles for bf16 with blocks of a multiple of 32 tokens on AMX CPUs)."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        return VllmMlaLayout()
    if not current_platform.is_cpu():
        return VllmCudaLayout()
    isa = _cpu_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), vllm_config)
    return VllmCpuAmxLayout() if isa == "amx" else VllmCpuLayout()


def _check_cpu_layout(cache: torch.Tensor, vllm_config: VllmConfig, layout: VllmCpuLayout) -> None:
    """Write one block with vLLM's own CPU cache writer (for the ISA this machine runs) and read it back
    through `layout`: a kernel whose block layout differs (e.g. another ISA) is refused at startup
    instead of storing wrong KV. An fp8 cache (uint8 to the connector) is written from the model's
    dtype at scale 1 and read back within fp8's rounding (vLLM's conversion rounds its own way)."""
    from vllm import _custom_ops as ops  # noqa: PLC0415

    _, h, bs, d2 = cache.shape
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    fp8 = cache.dtype == torch.uint8
    dtype = vllm_config.model_config.dtype if fp8 else cache.dtype
    isa = _cpu_attn_isa(dtype, bs, d2 // 2, vllm_config)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(bs, h, d2 // 2, generator=gen).to(dtype) for _ in range(2))
    block = torch.zeros(1, h, bs, d2, dtype=cache.dtype)
    k_cache, v_cache = block.view(1, h, 2 * bs, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(bs), isa, 1.0, 1.0, cache_dtype)
    chunk = layout.gather([block], [0])
    if fp8:
        fp8_dtype = torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        got = chunk.view(fp8_dtype).float()
        same = all(
            bool(((got[i, 0] - want.float()).abs() <= want.float().abs() / 4 + 1e-2).all())
            for i, want in ((0, k), (1, v))
        )
    else:
        same = torch.equal(chunk[0, 0], k) and torch.equal(chunk[1, 0], v)
    if not same:
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
