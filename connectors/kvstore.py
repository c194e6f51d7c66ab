"""`KVStoreConnector`: the engine's KV connector backed by a kvstore (docs/design.md §5).

    engine blocks --(copy out, encode with the codec)--> store chunks --(verify, decode)--> blocks

One instance per role, like vLLM: `KVConnectorRole.SCHEDULER` decides what to load and save
(`kvstore.connectors.kv_scheduler`), `KVConnectorRole.WORKER` moves the bytes (`kvstore.connectors.kv_worker`). Both
share one store connection per process (`kvstore.connectors.store_handle`). `config` is a
`KVTransferConfig` whose `layout` the engine has filled in (`KVTransferConfig.for_engine`), or
the same fields as a plain mapping (`layout` a mapping of `kvstore.keys.KVLayout` fields).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from kvstore.connectors.base import ConnectorRequest, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_scheduler import KVStoreScheduler
from kvstore.connectors.kv_worker import KVStoreWorker
from kvstore.connectors.meta import StepTransfers
from kvstore.connectors.metrics import ConnectorMetrics
from kvstore.connectors.store_handle import acquire_store, release_store

from kvstore.errors import ConfigError

_TRANSFERS = "kvstore_transfers"


class KVStoreConnector(KVConnectorBase):
    def __init__(self, role: KVConnectorRole, config: KVTransferConfig | Mapping[str, Any]) -> None:
        if isinstance(config, Mapping):  # from an engine that only knows connectors.base: plain fields
            config = KVTransferConfig.from_mapping(config)  # (under them: KVSTORE_* environment)
        if not isinstance(config, KVTransferConfig):
            raise ConfigError(f"KVStoreConnector needs a KVTransferConfig, got {type(config).__name__}")
        if config.layout is None:
            raise ConfigError(
                "KVTransferConfig.layout is unset: build it with KVTransferConfig.for_engine(...)"
            )
        super().__init__(role, config)
        self.handle = acquire_store(config)
        try:
            if role is KVConnectorRole.SCHEDULER:
                self._scheduler: KVStoreScheduler | None = KVStoreScheduler(config, self.handle)
                self._worker: KVStoreWorker | None = None
            else:
                self._scheduler = None
                self._worker = KVStoreWorker(config, self.handle)
        except BaseException:
            release_store(self.handle)
            raise
        self._closed = False

    @property
    def metrics(self) -> ConnectorMetrics:
        return self.handle.metrics

    @property
    def scheduler(self) -> KVStoreScheduler:
        assert self._scheduler is not None, f"a scheduler-side call on the {self.role.name} connector"
        return self._scheduler

    @property
    def worker(self) -> KVStoreWorker:
        assert self._worker is not None, f"a worker-side call on the {self.role.name} connector"
        return self._worker

    # ---- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata({_TRANSFERS: self.scheduler.build_connector_meta(scheduler_output)})

    def request_preempted(self, request: ConnectorRequest, block_ids: Sequence[int]) -> None:
        self.scheduler.request_preempted(request, block_ids)

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---- worker side ----------------------------------------------------------------------------
    def _transfers(self) -> StepTransfers:
        return self._get_connector_metadata().payload.get(_TRANSFERS) or StepTransfers()

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self) -> None:
        self.worker.handle_preemptions(self._transfers())

    def start_load_kv(self, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._transfers())

    def wait_for_layer_load(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._transfers())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def wait_for_finished(self, timeout: float) -> None:
        self.worker.wait_for_finished(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every save handed out so far (tests, benchmarks and shutdown use it)."""
        if self._worker is not None:
            self._worker.flush(timeout)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown()
        release_store(self.handle)
