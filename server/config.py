"""ServerConfig (host, port, auth, TLS, limits), built with StoreConfig by `kvstore.settings`.

Precedence, lowest first: defaults < YAML (`--config FILE`, else `$KVSTORE_CONFIG`) < KVSTORE_*
environment < command-line flags. One flat YAML file holds keys of both models (`tiers: [cpu]`,
`port: 8100`, ...).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.events import parse_kv_events_config
from kvstore.settings import Size, human_error, load_settings, read_token

DEFAULT_PORT = 8100


class ServerConfig(BaseModel):
    """How the HTTP server listens and what it lets through."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)  # 0 picks a free port; the bound one is printed
    auth_token: str | None = Field(None, repr=False)  # never in a repr, a log line or an error
    auth_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_request_size: Size = 1 << 30  # a whole batch body; single blobs obey StoreConfig.max_blob_size
    body_timeout: float = 30.0  # seconds to receive a whole body; a stalled one is a truncated body
    header_timeout: float = 10.0  # seconds from a request's first byte to its last header line
    keepalive_timeout: float = 30.0  # seconds an idle connection (or one that never sends) stays open
    max_connections: int = Field(1024, ge=1)  # beyond: a fast 503 (also kept under RLIMIT_NOFILE)
    # memory for request bodies being received or stored at once, all connections together (beyond:
    # 503 + Retry-After; a body holds ~2x its size while read): RSS stays within idle + capacity + this
    max_body_bytes_in_flight: Size = 2 << 30
    sample_interval: float = 5.0  # seconds between store.stats() samples for /v1/stats/history
    history_size: int = 720  # samples kept (an hour at 5 s)
    shutdown_timeout: float = 30.0  # seconds in-flight requests get on SIGTERM
    store_threads: int = 4  # threads running store calls that may touch disk or Redis
    metrics_auth: bool = True  # /metrics needs the token too (Prometheus supports bearer tokens)
    # Without a token: host names (besides IP addresses and localhost) that Host may name; "*" = any
    allowed_hosts: list[str] = Field(default_factory=list)
    access_log: bool = False
    # The binary data plane on the same port (kvstore.protocol.dataplane) and same-host shared memory for it
    # (kvstore.protocol.shm): segments total at most shm_budget bytes (0 turns shared memory off).
    dataplane: bool = True
    shm_budget: Size = 1 << 30
    shm_max_segment: Size = 512 << 20
    # after answering a client on this host, the loop polls for its next request this long before it
    # sleeps (kvstore.server.idle_poll: a sleeping thread's wake-up costs tens of µs on a VM); 0: never
    poll_us: float = Field(200.0, ge=0, lt=100_000)
    engine_metrics: list[str] = Field(default_factory=list)  # engines' /metrics URLs the dashboard reads
    # vLLM's KVEventsConfig (JSON text, or a mapping in YAML): publish each tier's chunks as KV events
    kv_events_config: str | dict[str, Any] | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:  # one error type for every bad setting, as StoreConfig gives
            raise human_error(e, "server settings") from None

    @field_validator("allowed_hosts", "engine_metrics", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v  # "a,b", or a list of such (a repeated flag)
        if isinstance(items, list) and all(isinstance(i, str) for i in items):
            return [h.strip() for i in items for h in i.split(",") if h.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError("give --auth-token or --auth-token-file, not both")
        parse_kv_events_config(self.kv_events_config)  # ConfigError names what is wrong
        if self.sample_interval <= 0 or self.body_timeout <= 0 or self.history_size < 1:
            raise ConfigError("sample_interval and body_timeout must be positive, history_size >= 1")
        if self.header_timeout <= 0 or self.keepalive_timeout <= 0 or self.max_body_bytes_in_flight <= 0:
            raise ConfigError(
                "header_timeout, keepalive_timeout and max_body_bytes_in_flight must be positive"
            )
        return self

    def token(self) -> str | None:
        """The bearer token, read from the file if one is configured (surrounding whitespace dropped)."""
        return read_token(self.auth_token, self.auth_token_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"cannot load TLS cert/key: {e}") from None
        return ctx

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


def load_configs(
    path: str | Path | None = None, env_prefix: str = "KVSTORE_", **overrides: Any
) -> tuple[StoreConfig, ServerConfig]:
    """Both configs from one flat YAML file (or `$KVSTORE_CONFIG`), the environment and overrides."""
    store_config, server_config = load_settings(
        [StoreConfig, ServerConfig], path, overrides, env_prefix=env_prefix
    )
    return store_config, server_config
