"""ServerConfig (host, port, auth, TLS, limits) and the layering shared with StoreConfig.

Precedence, lowest first: defaults < YAML `--config FILE` < KVSTORE_* environment < command-line flags.
One flat YAML file may hold keys of both models (`tiers: [cpu]`, `port: 8100`, ...).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.config import StoreConfig, load_layers, parse_size, read_yaml_mapping
from kvstore.errors import ConfigError

DEFAULT_PORT = 8100


class ServerConfig(BaseModel):
    """How the HTTP server listens and what it lets through."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)  # 0 picks a free port; the bound one is printed
    auth_token: str | None = None
    auth_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_request_size: int = 1 << 30  # a whole batch body; single blobs obey StoreConfig.max_blob_size
    body_timeout: float = 30.0  # seconds to receive a whole body; a stalled one is a truncated body
    sample_interval: float = 5.0  # seconds between store.stats() samples for /v1/stats/history
    history_size: int = 720  # samples kept (an hour at 5 s)
    shutdown_timeout: float = 30.0  # seconds in-flight requests get on SIGTERM
    store_threads: int = 4  # threads running store calls that may touch disk or Redis
    metrics_auth: bool = True  # /metrics needs the token too (Prometheus supports bearer tokens)
    # Without a token: host names (besides IP addresses and localhost) that Host may name; "*" = any
    allowed_hosts: list[str] = Field(default_factory=list)
    access_log: bool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:  # one error type for every bad setting, as StoreConfig.load gives
            raise ConfigError(f"invalid ServerConfig: {e}") from None

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, v: Any) -> Any:
        return [h.strip() for h in v.split(",") if h.strip()] if isinstance(v, str) else v

    @field_validator("max_request_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError("give --auth-token or --auth-token-file, not both")
        if self.sample_interval <= 0 or self.body_timeout <= 0 or self.history_size < 1:
            raise ConfigError("sample_interval and body_timeout must be positive, history_size >= 1")
        return self

    def token(self) -> str | None:
        """The bearer token, read from the file if one is configured (surrounding whitespace dropped)."""
        if self.auth_token_file is not None:
            try:
                token = self.auth_token_file.read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read auth token file {self.auth_token_file}: {e}") from None
            if not token:
                raise ConfigError(f"auth token file {self.auth_token_file} is empty")
            return token
        return self.auth_token or None

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
    """Build both configs from one flat YAML file, the environment and explicit overrides."""
    file_data: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    known = set(StoreConfig.model_fields) | set(ServerConfig.model_fields)
    unknown = set(file_data) | {k for k, v in overrides.items() if v is not None}
    unknown -= known
    if unknown:
        raise ConfigError(f"unknown config keys: {sorted(unknown)}")
    out = []
    for model in (StoreConfig, ServerConfig):
        mine = set(model.model_fields)
        env = load_layers(model, None, env_prefix, {})
        data = {k: v for k, v in file_data.items() if k in mine}
        data.update(env)
        data.update({k: v for k, v in overrides.items() if k in mine and v is not None})
        try:
            out.append(model(**data))
        except ValidationError as e:
            raise ConfigError(f"invalid {model.__name__}: {e}") from None
    store_config, server_config = out
    return store_config, server_config
