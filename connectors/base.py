"""The KV Connector contract (docs/design.md §5), after vLLM V1's `KVConnectorBase_V1`.

One object per role. The SCHEDULER-side instance decides what can be loaded from outside the engine
and tells the worker through per-step metadata; the WORKER-side instance moves KV between the paged
cache and the store. In this engine both live in one process, but they share nothing except the
metadata object the scheduler builds and the runner binds, exactly as in vLLM.

Per engine step:
    scheduler: get_num_new_matched_tokens -> allocate blocks -> update_state_after_alloc
               -> build_connector_meta  (passed down with the scheduled batch)
    worker:    bind_connector_metadata -> start_load_kv -> (per layer) wait_for_layer_load,
               forward, save_kv_layer -> wait_for_save -> get_finished -> clear_connector_metadata
    scheduler: request_finished (True = keep the blocks until get_finished reports the save done)
With `load_async`, an admitted request waits (holding its blocks) until `get_finished` reports its
load done, while the other requests keep running; a step with nothing else to do still runs the
worker's transfer calls (no forward), as vLLM's `kv_connector_no_forward` does.

Rules every implementation keeps:
- `get_num_new_matched_tokens` has no side effects; its answer is block-aligned and capped so that
  local + external <= prompt length - 1 (the last prompt token is always recomputed for its logits).
- A block is never freed or reused while a save still reads it.
- A failed or corrupt load is reported by block id (`get_block_ids_with_load_errors`); the engine
  recomputes from the first bad block on, so output never depends on a bad load.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the CLI's --help and --version must not pay torch's import
    import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


# What an engine instance does with external KV (vLLM's `kv_role`): kv_both loads and saves, a
# kv_producer (prefill instance) saves, a kv_consumer (decode instance) only loads.
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
KV_ROLE_ALIASES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}  # engine shorthands


def canonical_kv_role(role: str) -> str:
    """vLLM's role name for a role or one of kvstore-engine's shorthands (both, prefill, decode)."""
    role = KV_ROLE_ALIASES.get(role, role)
    if role not in KV_ROLES:
        choices = ", ".join([*KV_ROLES, *KV_ROLE_ALIASES])
        raise ValueError(f"kv_role must be one of {choices}; got {role!r}")
    return role


class ConnectorRequest(Protocol):
    """What a connector may read of an engine request."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is in the request's blocks

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class KVConnectorMetadata:
    """Opaque per-step message from the scheduler-side to the worker-side connector."""

    payload: dict[str, Any] = field(default_factory=dict)


class KVConnectorBase(ABC):
    def __init__(self, role: KVConnectorRole, config: Any) -> None:
        self.role = role
        self.config = config
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler side -------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens beyond `num_computed_tokens` the store can provide, whether the load is async)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks are allocated for `request`; remember which of them to fill from the store."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Everything the worker must load/save this step; resets the scheduler-side step state."""

    def request_preempted(self, request: ConnectorRequest, block_ids: Sequence[int]) -> None:  # noqa: B027
        """`request` is about to lose `block_ids` to preemption (vLLM tells its connectors through
        `scheduler_output.preempted_req_ids`, after the fact); what to save of them goes out with
        this step's metadata and `handle_preemptions` copies it before the blocks are reused."""

    @abstractmethod
    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks until the save finishes, KV transfer params for a consumer)."""

    # ---- worker side ----------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "bind_connector_metadata() was not called this step"
        return self._metadata

    @abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """One tensor per layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""

    def handle_preemptions(self) -> None:  # noqa: B027 (optional hook, vLLM's name)
        """Before this step's loads and forward: copy out what `request_preempted` asked to keep of
        blocks that this step may overwrite."""

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's external KV into the paged cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s KV for this step is in the cache."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving `layer`'s newly computed KV (may be asynchronous)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the cache to stay unchanged."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose async saves are done, requests whose async loads are done)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def wait_for_finished(self, timeout: float) -> None:
        """An engine with nothing to compute until an asynchronous load lands waits here (at most
        `timeout` seconds) instead of spinning; `get_finished` then reports what finished."""
        time.sleep(timeout)

    def shutdown(self) -> None:  # noqa: B027 (optional hook, like vLLM's)
        """Finish pending work and release resources."""
