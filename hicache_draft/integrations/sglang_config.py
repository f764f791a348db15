"""The adapter's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands a ``dynamic`` backend its whole extra-config as ``storage_config.extra_config``. SGLang's
own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``prefetch_*``, ...)
stay at the top level; hicache-draft's settings live in one object under the key ``"hicache_draft"``
(:class:`AdapterSettings`), so the two never mix. This module imports nothing from SGLang: it reads
``HiCacheStorageConfig`` by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hicache_draft.capabilities import Layout
from hicache_draft.config import HANDOVER_POLL_US, KvDtype, ParallelConfig, PoolShapeConfig
from hicache_draft.errors import ConfigError

SECTION = "hicache_draft"
DRAFT_MODEL_SUFFIX = "#draft"

class LegacyDraftPool(PoolShapeConfig):
    """Shape of the draft host pool for SGLang releases that send draft pages only through the
    generic ``batch_set``/``batch_get`` calls (keys ``{hash}.draft``) and never register the draft
    pool (0.5.15 to 0.5.18). Unused when SGLang registers the pool (0.5.19 and later)."""

    layout: Layout | None = Field(default=None, description="defaults to the target pool's layout")
    kv_dtype: KvDtype | None = Field(default=None, description="defaults to the target pool's dtype")


class AdapterSettings(BaseModel):
    """The ``"hicache_draft"`` object of the extra-config."""

    model_config = ConfigDict(extra="forbid")

    backend: str | None = Field(
        default=None, min_length=1,
        description="entry-point name of the storage backend; unset: the installed backend that declares itself "
        "the default",
    )
    backend_options: dict[str, Any] = Field(default_factory=dict, description="validated by the backend")
    model: str | None = Field(
        default=None, min_length=1, description="target weights identity; defaults to SGLang's model name"
    )
    draft_model: str | None = Field(
        default=None, min_length=1, description=f"draft weights identity; defaults to model + {DRAFT_MODEL_SUFFIX!r}"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=3600, description="bound on every storage call")
    handover_poll_us: int = HANDOVER_POLL_US
    staging_pages: int | None = Field(
        default=None, ge=1, le=4096,
        description="pages per generic-path staging area; default: SGLang's batch (128) within 256 MiB, at least 16",
    )
    legacy_draft_pool: LegacyDraftPool | None = None


def _format(exc: ValidationError) -> ConfigError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = f"{SECTION}.{loc}" if loc else SECTION
    msg = err["msg"].removeprefix("Value error, ")
    return ConfigError(f"invalid SGLang extra-config {field}: {msg}", field=field)


def parse_settings(extra_config: dict[str, Any] | None) -> AdapterSettings:
    """Read the ``"hicache_draft"`` object; :class:`ConfigError` naming the field when invalid."""
    raw = (extra_config or {}).get(SECTION, {})
    if not isinstance(raw, dict):
        raise ConfigError(
            f"invalid SGLang extra-config {SECTION}: expected a JSON object, got {type(raw).__name__}", field=SECTION
        )
    try:
        return AdapterSettings.model_validate(raw)
    except ValidationError as exc:
        raise _format(exc) from None


def interface_v1(extra_config: dict[str, Any] | None) -> bool:
    """Whether SGLang will use the zero-copy ``batch_*_v1`` calls for KV pages (as SGLang reads it)."""
    return bool((extra_config or {}).get("interface_v1", False))


class _Ranks(BaseModel):
    model_config = ConfigDict(extra="ignore")

    attn_cp_rank: int = Field(default=0, ge=0)
    attn_cp_size: int = Field(default=1, ge=1)
    dcp_size: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> _Ranks:
        if self.attn_cp_rank >= self.attn_cp_size:
            raise ValueError(f"attn_cp_rank {self.attn_cp_rank} must be < attn_cp_size {self.attn_cp_size}")
        if self.dcp_size != 1:
            raise ValueError("decode context parallelism (dcp_size > 1) is not supported by hicache-draft")
        return self


@dataclass(frozen=True)
class Placement:
    """Where this process sits and whose weights it serves, as the key namespace needs it.

    ``model``/``draft_model`` carry the attention-CP shard when ``attn_cp_size > 1`` (each CP rank
    holds different bytes for one page). ``split_heads``: SGLang asked for head groups under their
    own keys (``should_split_heads``); ``parallel.tp_lcm_size`` is set only then.
    """

    parallel: ParallelConfig
    model: str
    draft_model: str
    split_heads: bool


def placement(storage_config: object, settings: AdapterSettings) -> Placement:
    """Map SGLang's ``HiCacheStorageConfig`` (read by attribute) to our namespace inputs."""

    def attr(name: str, default: object = None) -> Any:  # noqa: ANN401
        return getattr(storage_config, name, default)

    model = settings.model or attr("model_name")
    if not model:
        raise ConfigError(
            f"SGLang passed no model name; set {SECTION}.model in the extra-config", field=f"{SECTION}.model"
        )
    split = bool(attr("should_split_heads", False))
    try:
        parallel = ParallelConfig(
            tp_rank=attr("tp_rank", 0),
            tp_size=attr("tp_size", 1),
            pp_rank=attr("pp_rank", 0),
            pp_size=attr("pp_size", 1),
            tp_lcm_size=attr("tp_lcm_size") if split else None,
        )
        ranks = _Ranks.model_validate(
            {k: attr(k) for k in ("attn_cp_rank", "attn_cp_size", "dcp_size") if attr(k) is not None}
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "storage_config"
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"unsupported SGLang HiCacheStorageConfig {loc}: {msg}", field=loc) from None
    draft_model = settings.draft_model or f"{model}{DRAFT_MODEL_SUFFIX}"
    if ranks.attn_cp_size > 1:
        tag = f"|cp{ranks.attn_cp_rank}/{ranks.attn_cp_size}"
        model, draft_model = model + tag, draft_model + tag
    return Placement(parallel=parallel, model=str(model), draft_model=draft_model, split_heads=split)
