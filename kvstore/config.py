"""Store configuration: `StoreConfig`, layered by `kvstore.settings` (defaults < YAML < KVSTORE_* env <
arguments). Sizes accept pydantic `ByteSize` strings ('8GiB', '500MB').

Each registered tier (kvstore.tier_registry) has its own settings block: in YAML `redis: {url: ...,
prefix: ...}`; flat, `redis_url: ...` (also the flag `--redis-url` and `KVSTORE_REDIS_URL`). Both forms
are accepted everywhere; given both in one layer, the flat one wins. `config.tier("redis")` is the
block; `config.redis_url` reads the same field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvstore.errors import ConfigError
from kvstore.settings import (
    Size,
    default_data_dir,
    human_errors,
    human_parts,
    load_settings,
    parse_size,
    read_yaml_mapping,
)
from kvstore.tier_registry import reserve_settings, tier_spec, tier_specs
from kvstore.tier_settings import CpuMemory

__all__ = ["CpuMemory", "StoreConfig", "TierName", "default_data_dir", "parse_size", "read_yaml_mapping"]


def _known_tier(name: str) -> str:
    tier_spec(name)  # ConfigError (a ValueError) naming the known tiers
    return name


TierName = Annotated[str, AfterValidator(_known_tier)]  # a registered tier's name


def flat_settings() -> dict[str, tuple[str, str]]:
    """Every tier's flat setting name -> (tier, field): `redis_url` -> ("redis", "url")."""
    return {flat: (name, f) for name, spec in tier_specs().items() for flat, f in spec.flat_names().items()}


def fold_blocks(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with every flat tier setting moved into its tier's block (the flat value wins)."""
    flat = flat_settings()
    specs = tier_specs()
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k in specs and isinstance(v, BaseModel):
            v = v.model_dump()
        if k in specs and isinstance(v, Mapping):
            out[k] = {**out.get(k, {}), **v}
        elif k not in flat:
            out[k] = v
    for k, v in data.items():
        if k in flat:
            tier, f = flat[k]
            block = out.get(tier)
            out[tier] = {**(block if isinstance(block, Mapping) else {}), f: v}
    return out


class StoreConfig(BaseModel):
    """How a tiered store is built. Sizes accept '8GiB'-style strings."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[TierName] = Field(default_factory=lambda: ["cpu", "disk"])
    # what must survive a restart besides the blobs: the shared tiers' pending invalidations (§10)
    state_dir: Path = Field(default_factory=lambda: default_data_dir() / "state")
    write_policy: Literal["through", "back"] = "through"
    write_back_queue: int = 256  # blobs waiting for lower tiers before puts start to drop
    admission_hits: int = 0  # a blob reaches lower tiers only after this many hits (0: always)
    ttl: float | None = None  # seconds; None keeps blobs until evicted
    codec: str = "raw"  # default codec when a tensor (not a blob) is put
    # a codec per tier, "cpu=raw,disk=kivi4,redis=kivi4+ans": a blob is re-encoded once where it
    # enters such a tier (kvstore.codecs.transcode); tiers not named keep blobs as they come
    tier_codec: dict[str, str] = Field(default_factory=dict)
    lz4: bool = False
    max_blob_size: Size = 256 * 2**20
    miss_log_keys: int = Field(1 << 16, ge=0)  # recently written keys remembered to explain misses
    _blocks: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise human_errors(e.errors(), "store settings") from None

    @model_validator(mode="wrap")
    @classmethod
    def _with_blocks(cls, data: Any, handler: Any) -> Any:
        """The tiers' blocks (flat settings folded in) validated by their tiers' models, the rest by
        this model; every bad setting named in one ConfigError, a flat setting as `tier_field`."""
        if not isinstance(data, Mapping):
            return handler(data)
        folded = fold_blocks(data)
        specs = tier_specs()
        errors: list[dict[str, Any]] = []
        blocks: dict[str, BaseModel] = {}
        for name, spec in specs.items():
            given = folded.pop(name, None) or {}
            try:
                blocks[name] = spec.settings(**given)
            except ValidationError as e:
                for err in e.errors():
                    loc = err.get("loc", ())
                    flat = f"{name}_{loc[0]}" if loc else name
                    errors.append({**err, "loc": (flat, *loc[1:])})
        try:
            model = handler(folded)
        except ValidationError as e:
            errors = [*e.errors(), *errors]
        if errors:  # one error for them all (StoreConfig.__init__ turns it into one ConfigError)
            raise ValueError("; ".join(human_parts(errors)))
        model._blocks = blocks
        return model

    def tier(self, name: str) -> Any:
        """The settings block of tier `name` (its spec's model; defaults where nothing was given)."""
        block = self._blocks.get(name)
        if block is None:  # a tier registered after this config was made
            block = self._blocks[name] = tier_spec(name).settings()
        return block

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            where = flat_settings().get(name)
            if where is not None:
                return getattr(self.tier(where[0]), where[1])
        return super().__getattr__(name)  # type: ignore[misc]

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The fields and every tier's block (`{"redis": {"url": ...}, ...}`): `StoreConfig(**dump)`
        is the same config."""
        out = super().model_dump(**kwargs)
        out.update({name: block.model_dump(**kwargs) for name, block in sorted(self._blocks.items())})
        return out

    def model_dump_json(self, **kwargs: Any) -> str:  # type: ignore[override]
        import json  # noqa: PLC0415

        return json.dumps(self.model_dump(mode="json", **kwargs), sort_keys=True)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> StoreConfig:
        """A copy; `update` may name fields, flat tier settings (`cpu_memory`) or blocks."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self)(**{**self.model_dump(), **update})

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if not v or len(set(v)) != len(v):
            raise ConfigError(f"tiers must be a non-empty list without repeats, got {v!r}")
        return v

    @field_validator("tier_codec", mode="before")
    @classmethod
    def _tier_codec(cls, v: Any) -> Any:
        if isinstance(v, str):
            pairs = [p.partition("=") for p in v.split(",") if p.strip()]
            if any(not sep or not t.strip() or not c.strip() for t, sep, c in pairs):
                raise ConfigError(f"tier_codec is tier=codec[,tier=codec...], got {v!r}")
            return {t.strip(): c.strip() for t, _, c in pairs}
        return v

    @classmethod
    def setting_names(cls) -> list[str]:
        """Every name a layer may use (kvstore.settings): the fields, each tier's block and its flat
        settings."""
        return [*cls.model_fields, *tier_specs(), *flat_settings()]

    @classmethod
    def env_names(cls) -> list[str]:
        """The names read from `KVSTORE_<NAME>` variables: the fields and the flat tier settings."""
        return [*cls.model_fields, *flat_settings()]

    @classmethod
    def merge_layer(cls, lower: dict[str, Any], upper: Mapping[str, Any]) -> dict[str, Any]:
        """`upper` over `lower`, the tiers' blocks merged field by field (a flat setting of a higher
        layer beats the same field of a lower layer's block, and the other way round)."""
        out = fold_blocks(lower)
        for k, v in fold_blocks(upper).items():
            out[k] = {**out[k], **v} if k in tier_specs() and isinstance(out.get(k), Mapping) else v
        return out

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        env_prefix: str = "KVSTORE_",
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> StoreConfig:
        """Defaults < YAML file < KVSTORE_* environment < explicit overrides (see kvstore.settings)."""
        (config,) = load_settings(
            [cls], path, overrides, env_prefix=env_prefix, use_config_env=False, defaults=defaults
        )
        return config


reserve_settings(StoreConfig.model_fields)
