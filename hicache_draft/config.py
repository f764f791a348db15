"""Configuration: pydantic models, loaded from a TOML or JSON file and overridden by environment.

Environment variables use the prefix ``HICACHE_DRAFT_`` and ``__`` for nesting, e.g.
``HICACHE_DRAFT_BACKEND=mooncake``, ``HICACHE_DRAFT_PARALLEL__TP_RANK=3``,
``HICACHE_DRAFT_BACKEND_OPTIONS__ROOT=/mnt/kv``. Environment wins over the file.
"""

from __future__ import annotations

import json
import os
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hicache_draft.capabilities import Attention, Component, HitPolicy, Layout, PoolKind
from hicache_draft.errors import ConfigError

ENV_PREFIX = "HICACHE_DRAFT_"

KvDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]
"""KV dtypes by name (torch's names). Data only: torch is imported where tensors are made
(:meth:`hicache_draft.PoolSpec.torch_dtype`), so loading a config never needs it."""

KV_DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
"""Bytes per element of each :data:`KvDtype`."""
assert set(KV_DTYPE_SIZES) == set(get_args(KvDtype))


class OnMiss(StrEnum):
    """What a prefetch does when draft pages are missing.

    ``shorten``: the restorable prefix is min(target hit, draft hit). ``target_only``: restore the
    longer target prefix and report the draft-cold pages.
    """

    SHORTEN = "shorten"
    TARGET_ONLY = "target_only"


class PrefetchPolicy(StrEnum):
    """How long a prefetch may keep the caller waiting.

    ``best_effort``: take what has arrived when the caller asks; ``wait_complete``: wait for all
    of it (still bounded by ``timeout_s``); ``timeout``: wait at most ``prefetch_timeout_s``.
    """

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class NamespaceConfig(_Strict):
    """Identity of what is stored: every field here changes the bytes of a page."""

    model: str = Field(min_length=1, description="identity of the target weights (name or name@revision)")
    draft_model: str | None = Field(
        default=None, description="identity of the draft weights; required when the draft is enabled"
    )
    kv_dtype: KvDtype = Field(default="bfloat16", description="dtype of the target KV cache")
    page_size: int = Field(default=64, ge=1, le=1 << 16, description="tokens per page")


class ParallelConfig(_Strict):
    """This process's place in the tensor/pipeline-parallel group."""

    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    pp_rank: int = Field(default=0, ge=0)
    pp_size: int = Field(default=1, ge=1)
    tp_lcm_size: int | None = Field(
        default=None, ge=1, description="> tp_size turns on split heads (pages shared across TP sizes)"
    )

    @model_validator(mode="after")
    def _ranks(self) -> ParallelConfig:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} must be < pp_size {self.pp_size}")
        if self.tp_lcm_size is not None and self.tp_lcm_size % self.tp_size:
            raise ValueError(f"tp_lcm_size {self.tp_lcm_size} must be a multiple of tp_size {self.tp_size}")
        return self

    @property
    def split_factor(self) -> int:
        """Head groups per rank: ``tp_lcm_size / tp_size`` (1 means no split)."""
        return (self.tp_lcm_size or self.tp_size) // self.tp_size


class PoolShapeConfig(_Strict):
    """Shape of one host pool."""

    attention: Attention = Attention.MHA
    layers: int = Field(default=1, ge=1)
    kv_heads: int | None = Field(default=None, ge=1, description="mha: KV heads held by this rank")
    head_dim: int | None = Field(default=None, ge=1, description="mha: head dimension")
    latent_dim: int | None = Field(default=None, ge=1, description="mla: kv_lora_rank + rope dim")

    @model_validator(mode="after")
    def _shape(self) -> PoolShapeConfig:
        if not getattr(self, "enabled", True):
            return self
        if self.attention is Attention.MHA and (self.kv_heads is None or self.head_dim is None):
            raise ValueError("attention 'mha' needs kv_heads and head_dim")
        if self.attention is Attention.MLA and self.latent_dim is None:
            raise ValueError("attention 'mla' needs latent_dim")
        return self


class TargetConfig(PoolShapeConfig):
    """The target model's host pool."""

    layout: Layout = Layout.PAGE_FIRST

    @model_validator(mode="after")
    def _layout(self) -> TargetConfig:
        if self.layout is Layout.PAGE_HEAD and self.attention is Attention.MLA:
            raise ValueError("layout 'page_head' is MHA-only (an MLA page has no heads)")
        return self


class DraftConfig(PoolShapeConfig):
    """The draft model's host pool; it uses the target pool's host slots."""

    enabled: bool = True
    kv_dtype: KvDtype | None = Field(default=None, description="draft KV dtype; defaults to namespace.kv_dtype")
    layout: Layout | None = Field(default=None, description="defaults to the target's layout where valid")
    on_miss: OnMiss = OnMiss.SHORTEN

    @model_validator(mode="after")
    def _layout(self) -> DraftConfig:
        if self.layout is Layout.PAGE_HEAD and self.attention is Attention.MLA:
            raise ValueError("layout 'page_head' is MHA-only (an MLA page has no heads)")
        return self


class Role(StrEnum):
    """A pool's role as the config says it: the target's or the draft's."""

    TARGET = "target"
    DRAFT = "draft"

    @property
    def kind(self) -> PoolKind:
        return PoolKind.KV if self is Role.TARGET else PoolKind.DRAFT


_KNOWN_EXTRA = {
    "indexer": (Role.TARGET, Component.INDEXER), "draft_indexer": (Role.DRAFT, Component.INDEXER),
    "swa": (Role.TARGET, Component.WINDOW), "draft_swa": (Role.DRAFT, Component.WINDOW),
    "mamba": (Role.TARGET, Component.STATE),
}
"""SGLang's extra pool names and what they are (the same table as ``hicache_draft.pools.KNOWN_POOLS``)."""


class ExtraPoolConfig(_Strict):
    """One more pool (``[[pools]]``): a DSA indexer, a sliding window, a recurrent state, ...

    The controller indexes it by the target pool's host slots and stores it with the target and
    draft pages of each batch. Draft-role pools are used only when ``[draft] enabled = true``."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$", description="pool name (SGLang's: indexer, draft_indexer, "
                      "swa, draft_swa, mamba; others need role and component)")
    role: Role | None = Field(default=None, description="target or draft; defaults from a known name")
    component: Component | None = Field(default=None, description="indexer, window, state or kv; defaults from a "
                                        "known name")
    layers: int = Field(default=1, ge=1)
    row_bytes: list[int] | None = Field(
        default=None, min_length=1, description="indexer/state pools: bytes of one page in one layer, per array"
    )
    attention: Attention | None = Field(default=None, description="window/kv pools: mha or mla")
    kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)
    latent_dim: int | None = Field(default=None, ge=1)
    kv_dtype: KvDtype | None = Field(default=None, description="window/kv pools; defaults to the role's KV dtype")
    layout: Layout | None = Field(default=None, description="defaults to the target's layout where valid")
    hit_policy: HitPolicy | None = Field(default=None, description="defaults: trailing_pages for window and state")
    window_pages: int | None = Field(default=None, ge=1, description="trailing_pages pools: pages a hit needs")
    sharded: bool | None = Field(default=None, description="each TP rank holds different bytes (default: mha and "
                                 "state pools)")

    @model_validator(mode="after")
    def _shape(self) -> ExtraPoolConfig:
        if self.name in ("kv", "draft"):
            raise ValueError(f"pool {self.name!r} is configured by [{'target' if self.name == 'kv' else 'draft'}]")
        known = _KNOWN_EXTRA.get(self.name)
        if known is None and (self.role is None or self.component is None):
            raise ValueError(f"pool {self.name!r} is not a known pool name: give its role and component")
        comp = self.component or (known[1] if known else Component.KV)
        if comp.has_attention:
            if self.row_bytes is not None:
                raise ValueError(f"pool {self.name!r}: row_bytes is for indexer and state pools")
            if self.attention is None:
                raise ValueError(f"pool {self.name!r} ({comp.value}) needs attention (mha or mla)")
            if self.attention is Attention.MHA and (self.kv_heads is None or self.head_dim is None):
                raise ValueError(f"pool {self.name!r}: attention 'mha' needs kv_heads and head_dim")
            if self.attention is Attention.MLA and self.latent_dim is None:
                raise ValueError(f"pool {self.name!r}: attention 'mla' needs latent_dim")
            if self.attention is Attention.MHA and self.sharded is False:
                raise ValueError(f"pool {self.name!r}: an MHA pool is sharded by heads (sharded = false is wrong)")
        else:
            if self.row_bytes is None or any(r < 1 for r in self.row_bytes):
                raise ValueError(f"pool {self.name!r} ({comp.value}) needs row_bytes: the bytes of one page in one "
                                 "layer, per array, each >= 1")
            if self.attention is not None or self.kv_dtype is not None:
                raise ValueError(f"pool {self.name!r} ({comp.value}) holds bytes: attention and kv_dtype do not apply")
            if self.layout is Layout.PAGE_HEAD:
                raise ValueError(f"pool {self.name!r}: layout 'page_head' is for MHA pools only")
        if self.layout is Layout.PAGE_HEAD and self.attention is Attention.MLA:
            raise ValueError(f"pool {self.name!r}: layout 'page_head' is MHA-only (an MLA page has no heads)")
        return self

    @property
    def effective_role(self) -> Role:
        known = _KNOWN_EXTRA.get(self.name)
        return self.role or (known[0] if known else Role.TARGET)

    @property
    def effective_component(self) -> Component:
        known = _KNOWN_EXTRA.get(self.name)
        return self.component or (known[1] if known else Component.KV)


class MetricsConfig(_Strict):
    """Metrics export (``[metrics]``). Prometheus needs the ``hicache-draft[prometheus]`` extra."""

    prometheus_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve Prometheus metrics on this port (+ tp_rank, so each rank of a host has its own); "
        "0 picks a free port; unset: no exporter",
    )
    prometheus_addr: str = Field(default="127.0.0.1", min_length=1, description="address the exporter binds")

    def port_for(self, tp_rank: int) -> int | None:
        """The port this rank serves on (``prometheus_port + tp_rank``; 0 stays 0), or None."""
        if self.prometheus_port is None:
            return None
        return self.prometheus_port + tp_rank if self.prometheus_port else 0


HANDOVER_POLL_US: Any = Field(
    default=100, ge=0, le=10_000,
    description="microseconds a caller polls for its storage call's result, and an idle worker thread for the next "
    "call, before sleeping (without the GIL, yielding the CPU between polls); 0: sleep at once, for hosts "
    "short of CPU",
)
"""The ``handover_poll_us`` field of the config and of the SGLang adapter's settings."""


class Config(_Strict):
    """The whole configuration (the TOML file's top level)."""

    backend: str | None = Field(
        default=None, min_length=1,
        description="entry-point name of the storage backend; unset: the installed backend that declares itself "
        "the default",
    )
    backend_options: dict[str, Any] = Field(default_factory=dict, description="validated by the backend")
    namespace: NamespaceConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    target: TargetConfig
    draft: DraftConfig = Field(default_factory=lambda: DraftConfig(enabled=False))
    pools: list[ExtraPoolConfig] = Field(
        default_factory=list, description="more pools beyond the target and draft KV ([[pools]])"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=3600, description="bound on every storage call")
    handover_poll_us: int = HANDOVER_POLL_US
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = Field(default=2.0, gt=0, le=3600)
    batch_pages: int = Field(default=128, ge=1, le=4096, description="pages per batched storage call")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _cross(self) -> Config:
        if self.draft.enabled and not self.namespace.draft_model:
            raise ValueError("namespace.draft_model is required when draft.enabled is true")
        names = [p.name for p in self.pools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"pool {dup!r} is configured twice in [[pools]]")
        split = self.parallel.split_factor
        if split > 1:
            for name, pool in (("target", self.target), ("draft", self.draft)):
                if name == "draft" and not self.draft.enabled:
                    continue
                if pool.attention is Attention.MHA and pool.kv_heads is not None and pool.kv_heads % split:
                    raise ValueError(
                        f"{name}.kv_heads {pool.kv_heads} is not divisible by the split factor "
                        f"tp_lcm_size/tp_size = {split}"
                    )
        return self

    @property
    def draft_layout(self) -> Layout:
        """The draft pool's effective layout."""
        if self.draft.layout is not None:
            return self.draft.layout
        if self.target.layout is Layout.PAGE_HEAD and self.draft.attention is Attention.MLA:
            return Layout.PAGE_FIRST_DIRECT
        return self.target.layout

    @property
    def draft_dtype(self) -> str:
        return self.draft.kv_dtype or self.namespace.kv_dtype


def _format_error(exc: ValidationError, source: str) -> ConfigError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    where = f"{loc}: " if loc else ""
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    label = f"invalid config {source}" if source else "invalid config"
    return ConfigError(f"{label}: {where}{msg}{more}", field=loc or None)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:  # noqa: ANN401
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _env_value(raw: str) -> Any:  # noqa: ANN401
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def apply_env(data: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Overlay ``HICACHE_DRAFT_*`` variables (``__`` nests, values parsed as JSON when they can be)."""
    env = os.environ if environ is None else environ
    merged = json.loads(json.dumps(data))
    skip = {"HICACHE_DRAFT_LOAD_PLUGINS", "HICACHE_DRAFT_DISABLE_PLUGINS", "HICACHE_DRAFT_CONFIG"}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in skip:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if path:
            _set_path(merged, path, _env_value(raw))
    return merged


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a ``.toml`` or ``.json`` file into a dict; :class:`ConfigError` on failure."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}", field=None) from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse config file {str(p)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table/object at the top level")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    data: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build a :class:`Config` from a file (or a dict) plus environment overrides.

    Raises :class:`ConfigError` with one message naming the field and the reason.
    """
    base: dict[str, Any] = dict(data or {})
    source = ""
    if path is not None:
        base = read_config_file(path)
        source = str(path)
    merged = apply_env(base, environ)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise _format_error(exc, source) from None
