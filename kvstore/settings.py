"""How every kvstore command reads its settings: one loader, one size parser, one error style.

Layers, lowest first: the model's defaults < a YAML file (`--config FILE`, else `$KVSTORE_CONFIG`)
< `KVSTORE_<FIELD>` environment variables < explicit values (command-line flags, keyword arguments).
A YAML file is one flat mapping; a command that builds several models (the server: StoreConfig and
ServerConfig) takes each key for the model that has it, and a key no model has is an error (a typo
never passes silently). Environment values are strings that pydantic converts (`KVSTORE_TTL=60`,
`KVSTORE_TIERS=cpu,disk`, `KVSTORE_REDIS_CLUSTER=true`); unknown `KVSTORE_*` variables are ignored.

Sizes use pydantic's `ByteSize` rules everywhere: `512MB` is 512×10⁶, `512MiB` is 512×2²⁰, a plain
number is bytes, units are case-insensitive (b, kb, mb, gb, tb, kib, mib, gib, tib, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ByteSize, TypeAdapter, ValidationError

from kvstore.errors import ConfigError

ENV_PREFIX = "KVSTORE_"
CONFIG_ENV = "KVSTORE_CONFIG"
SIZE_EXAMPLES = "sizes look like 512MiB, 8GiB, 500MB or a number of bytes"
_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_size(value: Any) -> int:
    """Bytes from an int or a `ByteSize` string ('8GiB' -> 8589934592, '512MB' -> 512000000)."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r} ({SIZE_EXAMPLES})")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise ConfigError(f"not a size: {value!r} ({SIZE_EXAMPLES})") from None
    if size < 0:
        raise ConfigError(f"a size cannot be negative, got {value!r}")
    return size


Size = Annotated[int, BeforeValidator(parse_size)]  # a byte count; accepts '8GiB'-style strings


def default_data_dir() -> Path:
    """Where kvstore keeps data by default: `$KVSTORE_DATA_DIR`, else ~/.cache/kvstore/data."""
    return Path(os.environ.get("KVSTORE_DATA_DIR", Path.home() / ".cache" / "kvstore" / "data"))


def read_token(token: str | None, token_file: str | Path | None) -> str | None:
    """A bearer token given inline or in a file (surrounding whitespace dropped); None for no auth.
    Either is checked by `check_token`: a token no HTTP client could send is refused here."""
    if token_file is not None:
        try:
            text = Path(token_file).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror or e if isinstance(e, OSError) else "it is not UTF-8 text"
            raise ConfigError(f"cannot read token file {token_file}: {why}") from None
        if not text:
            raise ConfigError(f"token file {token_file} is empty")
        return check_token(text, f"token file {token_file}")
    return check_token(token, "the auth token") if token else None


def check_token(token: str, source: str) -> str:
    """`token`, if it is one line of printable ASCII without spaces (what an `Authorization: Bearer`
    header can carry); else a ConfigError that names `source` and what is wrong, never the token or
    any part of it (the message reaches logs)."""
    lines = len(token.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    bad = next((ch for ch in token if not "!" <= ch <= "~"), None)
    if bad is not None:
        kind = (
            f"{lines} lines" if lines > 1 else "a space or tab" if bad in " \t"
            else "a control character" if bad.isascii() else "a non-ASCII character"
        )  # fmt: skip
        raise ConfigError(
            f"{source} holds {kind}: a bearer token is one line of printable ASCII without spaces, "
            "e.g. made by `openssl rand -hex 32` (the token is not shown)"
        )
    return token


def human_error(e: ValidationError, what: str) -> ConfigError:
    """One readable sentence per bad setting, instead of pydantic's multi-line report."""
    return human_errors(e.errors(), what)


def human_errors(errors: Sequence[Any], what: str) -> ConfigError:
    """`human_error` of pydantic's error dicts (those of several models together)."""
    return ConfigError(f"invalid {what}: " + "; ".join(human_parts(errors)))


def human_parts(errors: Sequence[Any]) -> list[str]:
    """One sentence per pydantic error dict."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "__root__")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown setting {loc!r}")
            continue
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
        if msg.startswith(("not a size", "a size")) or shown in msg:
            shown = ""
        parts.append(f"{loc}: {msg}{shown}" if loc else f"{msg}{shown}")
    return parts


def build(model: type[BaseModel], data: Mapping[str, Any], what: str | None = None) -> Any:
    """`model(**data)`, with any validation failure turned into one ConfigError sentence."""
    try:
        return model(**data)
    except ValidationError as e:
        raise human_error(e, what or model.__name__) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML config file that must hold a mapping; ConfigError otherwise."""
    try:
        loaded = yaml.safe_load(Path(path).expanduser().read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping of setting: value")
    return {str(k): v for k, v in loaded.items()}


def config_file(path: str | Path | None) -> Path | None:
    """The explicit file, else `$KVSTORE_CONFIG`, else None."""
    if path is not None:
        return Path(path)
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else None


def env_values(fields: Sequence[str], prefix: str = ENV_PREFIX) -> dict[str, str]:
    """`PREFIX<FIELD>` variables that are set (and not empty), by field name."""
    out = {}
    for name in fields:
        value = os.environ.get(prefix + name.upper())
        if value is not None and value != "":
            out[name] = value
    return out


def unknown_keys(keys: set[str], known: set[str], where: str) -> ConfigError:
    hints = []
    for k in sorted(keys):
        close = difflib.get_close_matches(k, known, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigError(f"unknown setting{'s' if len(keys) > 1 else ''} in {where}: {', '.join(hints)}")


def setting_names(model: type, env: bool = False) -> list[str]:
    """The settings of a pydantic model or a dataclass (its init fields); a model may widen them with
    `setting_names()` and, for the environment (`env`), `env_names()` (StoreConfig: its tiers' blocks
    and flat settings)."""
    hook = getattr(model, "env_names" if env else "setting_names", None)
    if hook is not None:
        return list(hook())
    if dataclasses.is_dataclass(model):
        return [f.name for f in dataclasses.fields(model) if f.init]
    return list(model.model_fields)


def load_settings(
    models: Sequence[type],
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env_prefix: str | None = ENV_PREFIX,
    use_config_env: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Build each model (pydantic, or a dataclass that validates itself) from defaults < YAML <
    environment < `overrides` (None values are ignored).

    `path` None falls back to `$KVSTORE_CONFIG` when `use_config_env`; `env_prefix` None skips the
    environment. `defaults` replace the models' own defaults (the lowest layer). A key of the file or
    of `overrides` that none of `models` has is a ConfigError naming it.
    """
    path = config_file(path) if use_config_env else (Path(path) if path is not None else None)
    file_data = read_yaml_mapping(path) if path is not None else {}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    known = set().union(*(setting_names(m) for m in models))
    if set(file_data) - known:
        raise unknown_keys(set(file_data) - known, known, str(path))
    if set(given) - known:
        raise unknown_keys(set(given) - known, known, "the arguments")
    out = []
    for model in models:
        mine = setting_names(model)
        merge = getattr(model, "merge_layer", None) or (lambda lower, upper: {**lower, **upper})
        data = merge({}, {k: v for k, v in (defaults or {}).items() if k in mine})
        data = merge(data, {k: v for k, v in file_data.items() if k in mine})
        if env_prefix is not None:
            data = merge(data, env_values(setting_names(model, env=True), env_prefix))
        data = merge(data, {k: v for k, v in given.items() if k in mine})
        out.append(model(**data) if dataclasses.is_dataclass(model) else build(model, data))
    return out


def check_port_free(host: str, port: int) -> None:
    """ConfigError (one line for the user) when `host:port` cannot be bound now. Commands call it before
    slow start-up work (opening a disk tier, loading a model), so a taken port fails in a second."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            s.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is in use; stop what holds it or choose another --port"
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
