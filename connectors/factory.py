"""Which KV connector an engine gets (vLLM keeps this in its `kv_connector/factory.py`).

`--kv-backend none|kvstore`, or vLLM's `kv_connector` name from `--kv-transfer-config`. Engines import
only this and `kvstore.connectors.base`; the implementation (and the SDK under it) is imported on demand.
"""

from __future__ import annotations

from typing import Any

from kvstore.connectors.base import KVConnectorBase, KVConnectorRole

from kvstore.errors import ConfigError

KV_BACKENDS = ("none", "kvstore")
# vLLM's `kv_connector` names for our connector: the engine's own class and the vLLM V1 class
CONNECTOR_NAMES = {"KVStoreConnector": "kvstore", "KVStoreConnectorV1": "kvstore"}


def backend_for_connector(name: str) -> str:
    """The `--kv-backend` of a vLLM `kv_connector` name."""
    try:
        return CONNECTOR_NAMES[name]
    except KeyError:
        known = ", ".join(sorted(CONNECTOR_NAMES))
        raise ConfigError(f"kv_connector {name!r} is not available here; choose {known}") from None


def create_connector(backend: str, role: KVConnectorRole, config: Any) -> KVConnectorBase | None:
    """`--kv-backend none|kvstore`. None means the engine runs without a connector."""
    if backend == "none":
        return None
    if backend == "kvstore":
        from kvstore.connectors.kvstore import KVStoreConnector  # noqa: PLC0415 (keeps sdk out of `none`)

        return KVStoreConnector(role, config)
    raise ConfigError(f"unknown --kv-backend {backend!r}; choose one of {', '.join(KV_BACKENDS)}")
