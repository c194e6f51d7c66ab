"""`kvstore-server`: serve a tiered KV-cache store over HTTP.

Flags override KVSTORE_* environment variables, which override `--config FILE` (YAML; default
$KVSTORE_CONFIG), which overrides the defaults (tiers cpu,disk under ~/.cache/kvstore/data/disk,
127.0.0.1:8100, no auth). Every setting has a flag: `--cpu-capacity 8GiB` is `cpu_capacity: 8GiB` in
YAML and KVSTORE_CPU_CAPACITY=8GiB in the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from kvstore.server.config import ServerConfig, load_configs
from pydantic.fields import FieldInfo

from kvstore import __version__
from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError
from kvstore.settings import check_port_free, parse_size
from kvstore.tier_registry import tier_specs

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# the flags users reach for, with their help; every other setting gets a flag from its field name below
STORE_FLAGS = {
    "tiers": "ordered tiers, any of {tiers} (default cpu,disk)",
    "cpu_capacity": "bytes the cpu tier may hold, e.g. 16GiB (default {default})",
    "disk_capacity": "bytes the disk tier may hold, e.g. 1TiB (default {default})",
    "gpu_capacity": "bytes the gpu tier may hold, e.g. 8GiB (default {default})",
    "disk_path": "directory of the disk tier (default ~/.cache/kvstore/data/disk)",
    "redis_url": "redis://host:port/db (Valkey works too); for a Cluster, any node plus --redis-cluster",
    "write_policy": "through: lower tiers before the ack; back: a background queue (default {default})",
    "ttl": "seconds a blob lives (default: until evicted)",
    "codec": "codec of tensors put through the local SDK: raw, fp8, int4, kivi4, kivi2, or one of those +ans "
    "(default {default})",
    "tier_codec": "a codec per tier, e.g. cpu=raw,disk=kivi4,redis=kivi4+ans: a blob is re-encoded once where it "
    "enters such a tier (default {default}: none, blobs kept as they come)",
    "max_blob_size": "largest single blob accepted, e.g. 512MiB (default {default})",
    "redis_prefix": "prefix of every Redis key (default kvstore:)",
    "redis_cluster": "the Redis URL names Cluster nodes",
    "state_dir": "directory for what must survive a restart: deletes/replaces a redis or fs outage left to replay "
    "(default ~/.cache/kvstore/data/state)",
    "write_back_queue": "blobs waiting for lower tiers (write_policy back) before writes to them drop (default 256)",
    "admission_hits": "a blob reaches lower tiers only after this many hits (default 0: always)",
    "lz4": "lz4 after the codec, for tensors put through the local SDK (rarely pays on KV)",
    "miss_log_keys": "recently written keys remembered to tell evicted/expired misses apart (default 65536)",
    "cpu_memory": "where the cpu tier keeps its blobs: arena (shared memory that clients on this host read "
    "without a copy), pinned (page-locked, for a GPU tier in this server; needs CUDA) or plain; default {default}: "
    "arena while shared memory is on (--shm-budget), else pinned with CUDA and plain without",
    "redis_max_invalidated": "deletes and replaces a Redis outage may leave to replay when it answers again; "
    "past that they are a 503 (default {default})",
    "redis_wait_replicas": "a put is stored in redis only once this many replicas of its primary have it "
    "(WAIT, up to 1 s; else the 201 leaves redis out); 0: the primary's ack (default {default})",
    "fs_path": "directory of the fs tier, which several servers share (NFS, Lustre); needed with fs in --tiers",
    "fs_capacity": "bytes of blobs the fs directory may hold, all servers together (default {default})",
    "fs_max_age": "seconds a blob in the fs directory may go unused before a sweep removes it (default: no limit)",
    "fs_sweep_interval": "seconds between this server's sweeps of the fs directory: age, capacity, leftovers "
    "(default {default})",
    "fs_fsync": "a put to fs is acknowledged once its file and its rename are on disk (default {default})",
    "fs_max_invalidated": "deletes and replaces an fs outage may leave to replay when the directory answers "
    "again; past that they are a 503 (default {default})",
}
SERVER_FLAGS = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to bind (default 8100; 0 picks a free one)",
    "auth_token_file": "file holding the bearer token clients must send (make one: openssl rand -hex 32 > token)",
    "auth_token": "the bearer token itself (prefer --auth-token-file: flags show in `ps`)",
    "tls_cert": "PEM certificate: serve HTTPS",
    "tls_key": "PEM private key of --tls-cert",
    "allowed_hosts": "without a token: host names clients may use besides IPs and localhost (comma list; * = any)",
    "engine_metrics": "an engine's URL whose /metrics the dashboard reads (repeatable or comma list)",
    "sample_interval": "seconds between dashboard samples (default 5)",
    "shutdown_timeout": "seconds in-flight requests get on SIGTERM (default 30)",
    "max_request_size": "largest batch body accepted, e.g. 4GiB (default {default})",
    "max_body_bytes_in_flight": "request body bytes being received at once, e.g. 1GiB (then 503; default {default})",
    "max_connections": "open connections (then a fast 503; default 1024)",
    "header_timeout": "seconds for a request's headers (default 10)",
    "keepalive_timeout": "seconds an idle connection stays (default 30)",
    "body_timeout": "seconds to receive a whole body (default 30)",
    "history_size": "dashboard samples kept (default 720: an hour at 5 s)",
    "store_threads": "threads for store calls that may touch disk or Redis (default 4)",
    "metrics_auth": "/metrics needs the token too (default {default}; --no-metrics-auth opens it)",
    "access_log": "log every request",
    "dataplane": "the binary data plane on the port, for the SDK (default {default}; --no-dataplane: HTTP only)",
    "shm_budget": "shared memory for clients on this host, all segments together, e.g. 4GiB (0: off; default {default})",
    "shm_max_segment": "largest shared-memory segment one client gets (default {default})",
    "kv_events_config": "publish every tier's stored/evicted chunks as vLLM KV events (off by default), vLLM's "
    'KVEventsConfig JSON: \'{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kvstore-events", '
    '"replay_endpoint": "ipc:///tmp/kvstore-events-replay"}\'; with --auth-token the events need it too (CURVE); '
    'kvstore\'s own fields: bind (true: bind e.g. tcp://127.0.0.1:5557), auth ("curve"/"none"), token_file, '
    "reconcile_s (default 30)",
    "poll_us": "µs the loop polls for a same-host client's next request before sleeping (default 200; 0: off)",
}


def show_default(value: Any, size: bool = False) -> str:
    """A default as a person writes it: sizes in binary units (4GiB), ~ for the home directory, on/off;
    "" when there is none to show (None, an empty list)."""
    if value is None or value == []:
        return ""
    if size:
        return _show_size(int(value))
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path):
        home = str(Path.home())
        return "~" + str(value)[len(home) :] if str(value).startswith(home + "/") else str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _show_size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def store_fields() -> dict[str, FieldInfo]:
    """StoreConfig's fields and every registered tier's settings as flat names (`--redis-url` is the
    redis block's `url`: kvstore.config)."""
    fields = dict(StoreConfig.model_fields)
    for name, spec in tier_specs().items():
        fields.update({f"{name}_{f}": info for f, info in spec.settings.model_fields.items()})
    return fields


def _add_model_flags(
    group: argparse._ArgumentGroup, fields: dict[str, FieldInfo], helps: dict[str, str]
) -> None:
    """One flag per field, in the order of `helps`, then the rest; all default to None so the YAML and
    environment layers show through."""
    for name in [*(n for n in helps if n in fields), *(n for n in fields if n not in helps)]:
        field = fields[name]
        default = field.default if field.default_factory is None else field.default_factory()
        shown = show_default(
            default, size=any(getattr(m, "func", None) is parse_size for m in field.metadata)
        )
        help_text = helps.get(name) or field.description or name.replace("_", " ")  # test_cli: none missing
        help_text = help_text.replace("{tiers}", ",".join(tier_specs()))
        if "{default}" in help_text:
            help_text = help_text.replace("{default}", shown)
        elif "default" not in help_text and shown:
            help_text += f" (default {shown})"
        if field.annotation in (bool, "bool"):
            group.add_argument(
                _flag(name), action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif name == "engine_metrics":
            group.add_argument(_flag(name), action="append", metavar="URL", help=help_text)
        else:
            group.add_argument(_flag(name), metavar=name.split("_")[-1].upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of store and server settings (default $KVSTORE_CONFIG)"
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    _add_model_flags(p.add_argument_group("store"), store_fields(), STORE_FLAGS)
    _add_model_flags(p.add_argument_group("server"), dict(ServerConfig.model_fields), SERVER_FLAGS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level") and v is not None}
    try:
        store_config, config = load_configs(args.config, **overrides)
        config.token()  # fail early on an unreadable token file
        config.ssl_context()
        check_port_free(config.host, config.port)  # before the disk tier is opened and indexed
    except KVStoreError as e:
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2

    from kvstore.server.runner import install_uvloop, serve  # noqa: PLC0415 (after argument errors are reported)

    def ready(url: str) -> None:
        print(f"kvstore-server listening on {url}", flush=True)  # tests and scripts read the port here

    install_uvloop()
    try:
        asyncio.run(serve(store_config, config, on_ready=ready))
    except KVStoreError as e:
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port was taken between the check and the bind
        print(f"kvstore-server: cannot serve: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
