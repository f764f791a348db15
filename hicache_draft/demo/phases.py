"""The runs of one model pair, each meant to run in its own fresh process.

* ``first``: prefill the prompt, speculatively decode, copy the finished pages device -> host
  pool (L1 -> L2) and back them up to storage (L2 -> L3) through the controller.
* ``after_restart``: prefetch the prompt's longest stored prefix (L3 -> L2), copy every restored
  pool into the device pools (L2 -> L1), prefill only the rest, decode; check the logits against a
  full recompute in this process.
* ``control_no_draft`` (dense pairs): the same restart with draft offload off: the target prefix
  comes back, the draft's does not (its device KV for the prefix stays empty, as a server that
  skipped the prefix would leave it).

The DSA pair runs ``first`` with a config whose ``[[pools]]`` lacks the target ``indexer`` pool (it
backs up KV, draft KV and the draft indexer), then three restarts:

* ``control_no_target_indexer``: the config declares the indexer pool, whose pages are not in
  storage: ``indexer`` is an ``all_pages`` pool, so the hit is 0 and the whole prompt is prefilled.
  Like any server after a miss, it then backs up every pool, the target indexer included.
* ``after_restart``: everything restored, as above.
* ``control_no_draft_indexer``: the config's ``[[pools]]`` lacks ``draft_indexer``: the controller
  restores the draft KV but not the draft's indexer cache, which stays empty for the prefix
  (SGLang #28895).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from hicache_draft.capabilities import PoolKind
from hicache_draft.config import Config
from hicache_draft.controller import CacheController
from hicache_draft.demo.models import TinyLM
from hicache_draft.demo.paged import SeqKV, device_to_host, host_to_device, index_to_device, index_to_host
from hicache_draft.demo.pairs import PairName, make_pair, make_prompt
from hicache_draft.demo.spec_decode import SpecEngine
from hicache_draft.pools import HostPool
from hicache_draft.transfer import Buffer

Progress = Callable[[str], None]


class Phase(StrEnum):
    FIRST = "first"
    AFTER_RESTART = "after_restart"
    CONTROL = "control_no_draft"
    CONTROL_NO_TARGET_INDEXER = "control_no_target_indexer"
    CONTROL_NO_DRAFT_INDEXER = "control_no_draft_indexer"


RESTORE_PHASES = {
    PairName.MHA: (Phase.AFTER_RESTART, Phase.CONTROL),
    PairName.MLA: (Phase.AFTER_RESTART, Phase.CONTROL),
    PairName.DSA: (Phase.CONTROL_NO_TARGET_INDEXER, Phase.AFTER_RESTART, Phase.CONTROL_NO_DRAFT_INDEXER),
}
"""Each pair's restarts, in the order they run (after ``first``)."""

_Copy = Callable[[HostPool, int, SeqKV, int], None]
_Save = Callable[[SeqKV, int, HostPool, int], None]
# Which model's device pool each host pool belongs to, and how its pages move (L1 <-> L2).
_MOVES: dict[str, tuple[str, _Save, _Copy]] = {
    PoolKind.KV: ("target", device_to_host, host_to_device),
    PoolKind.DRAFT: ("draft", device_to_host, host_to_device),
    "indexer": ("target", index_to_host, index_to_device),
    "draft_indexer": ("draft", index_to_host, index_to_device),
}


@dataclass(frozen=True)
class Job:
    """Everything a fresh process needs to run one phase (JSON-ready through :meth:`as_dict`)."""

    phase: Phase
    pair: PairName  # an Attention names the dense pairs
    seed: int
    config: dict[str, Any]
    prompt_tokens: int
    period: int
    decode_tokens: int
    draft_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "pair", PairName(self.pair))

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value, "pair": self.pair.value, "seed": self.seed, "config": self.config,
            "prompt_tokens": self.prompt_tokens, "period": self.period, "decode_tokens": self.decode_tokens,
            "draft_tokens": self.draft_tokens,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Job:
        return cls(
            phase=Phase(raw["phase"]), pair=PairName(raw["pair"]), seed=int(raw["seed"]),
            config=dict(raw["config"]), prompt_tokens=int(raw["prompt_tokens"]), period=int(raw["period"]),
            decode_tokens=int(raw["decode_tokens"]), draft_tokens=int(raw["draft_tokens"]),
        )


def device() -> torch.device:
    """Where the demo's device pools and models live: CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (to compare logits across processes, bit for bit)."""
    flat = t.detach().to("cpu").contiguous().view(torch.uint8).view(-1)
    raw = bytes(Buffer(flat.data_ptr(), flat.numel(), owner=flat).view())
    return hashlib.sha256(raw).hexdigest()


class _Setup:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.config = Config.model_validate(job.config)
        self.page_size = self.config.namespace.page_size
        self.pair = make_pair(job.pair, job.seed)
        self.prompt = make_prompt(job.prompt_tokens, job.period, job.seed)
        dev = device()
        self.target = TinyLM(self.pair.target, dev)
        self.draft = TinyLM(self.pair.draft, dev)
        self.max_tokens = job.prompt_tokens + job.decode_tokens + job.draft_tokens + 2
        self.host_pages = -(-self.max_tokens // self.page_size)

    def engine(self) -> SpecEngine:
        return SpecEngine(self.target, self.draft, self.page_size, self.max_tokens, self.job.seed)


def run_phase(job: Job, progress: Progress) -> dict[str, Any]:
    """Run one phase and return its JSON-ready result."""
    s = _Setup(job)
    progress("opening storage")
    with CacheController.from_config(s.config, num_pages=s.host_pages) as ctrl:
        plan = {str(k): v.as_dict() for k, v in ctrl.plan.items()}
        out = _first(s, ctrl, progress) if job.phase is Phase.FIRST else _restart(s, ctrl, progress)
        out["io_paths"] = plan
        out["metrics"] = ctrl.metrics.snapshot()
    out["phase"] = job.phase.value
    return out


def _seq(engine: SpecEngine, pool: str) -> SeqKV:
    return engine.target if _MOVES[pool][0] == "target" else engine.draft


def _backup(s: _Setup, ctrl: CacheController, engine: SpecEngine, progress: Progress) -> dict[str, int]:
    """Copy the finished pages of every pool the controller has into its host pool, back them up."""
    pages = engine.full_pages()
    progress(f"back up {pages} pages")
    slots = [i * s.page_size for i in range(pages)]
    for name in ctrl.bindings:
        host = ctrl.host_pool(name)
        save = _MOVES[name][1]
        for i, slot in enumerate(slots):
            save(_seq(engine, name), i, host, slot)
    res = ctrl.backup(engine.tokens[: pages * s.page_size], slots)
    return {str(k): v for k, v in res.pages_written.items()}


def _first(s: _Setup, ctrl: CacheController, progress: Progress) -> dict[str, Any]:
    engine = s.engine()
    progress(f"prefill {len(s.prompt)} tokens")
    t_logits, _ = engine.prefill(s.prompt)
    progress(f"decode {s.job.decode_tokens} tokens")
    stats = engine.decode(s.job.decode_tokens, s.job.draft_tokens)
    return {
        "accept_length": stats.accept_length,
        "verify_steps": stats.steps,
        "generated": stats.tokens[: s.job.decode_tokens],
        "pages_backed_up": _backup(s, ctrl, engine, progress),
        "next_logits_sha256": digest(t_logits),
    }


def _restart(s: _Setup, ctrl: CacheController, progress: Progress) -> dict[str, Any]:
    ps = s.page_size
    usable = (len(s.prompt) - 1) // ps  # keep at least one prompt token to prefill
    slots = [i * ps for i in range(usable)]
    progress(f"prefetch up to {usable} pages")
    res = ctrl.prefetch(s.prompt[: usable * ps], slots)
    pages = res.pages
    engine = s.engine()
    restored: dict[str, int] = {}
    for name in ctrl.bindings:
        # A pool whose offload is off (draft offload disabled) restores nothing, whatever is stored.
        n = min(res.restored.get(name, 0), pages)
        copy = _MOVES[name][2]
        for i in range(n):
            copy(ctrl.host_pool(name), slots[i], _seq(engine, name), i)
        restored[str(name)] = n
    skipped = pages * ps
    progress(f"prefill {len(s.prompt) - skipped} tokens (skip {skipped})")
    t_logits, d_logits = engine.prefill(s.prompt, cached=skipped)
    out: dict[str, Any] = {
        "restored_pages": restored,
        "hit": {str(k): v for k, v in res.hit.items()},
        "prefill_tokens_skipped": skipped,
        "prefill_tokens_computed": len(s.prompt) - skipped,
        "next_logits_sha256": digest(t_logits),
    }
    if s.job.phase is Phase.AFTER_RESTART:
        progress("recompute from scratch for the check")
        out["check"] = _check(s, engine, pages, restored, t_logits, d_logits)
    progress(f"decode {s.job.decode_tokens} tokens")
    stats = engine.decode(s.job.decode_tokens, s.job.draft_tokens)
    out.update(
        accept_length=stats.accept_length, verify_steps=stats.steps, generated=stats.tokens[: s.job.decode_tokens]
    )
    if s.job.phase is Phase.CONTROL_NO_TARGET_INDEXER:  # a miss: what was computed is written back
        out["pages_backed_up"] = _backup(s, ctrl, engine, progress)
    return out


def _check(
    s: _Setup, restored: SpecEngine, pages: int, pools: dict[str, int], t_logits: torch.Tensor,
    d_logits: torch.Tensor,
) -> dict[str, bool]:
    """Recompute everything from scratch with the same chunks (the restored prefix, then the
    rest) and compare bit for bit: every restored pool's pages against recomputed ones, and the
    next-token logits of both models."""
    fresh = s.engine()
    prefix = pages * s.page_size
    if prefix:
        fresh.compute_prefix(s.prompt, prefix)
    t_ref, d_ref = fresh.prefill(s.prompt, cached=prefix)

    def same(name: str) -> bool:
        a, b = _seq(restored, name), _seq(fresh, name)
        if name in (PoolKind.KV, PoolKind.DRAFT):
            return all(torch.equal(a.pool.page_canonical(a.table[i]), b.pool.page_canonical(b.table[i]))
                       for i in range(pools.get(name, 0)))
        return all(torch.equal(a.pool.index_rows(a.table[i]), b.pool.index_rows(b.table[i]))
                   for i in range(pools.get(name, 0)))

    checks = {"target_kv_bytes": same(PoolKind.KV), "draft_kv_bytes": same(PoolKind.DRAFT)}
    if s.pair.sparse:
        checks.update(target_indexer_bytes=same("indexer"), draft_indexer_bytes=same("draft_indexer"))
    checks.update(target_logits=torch.equal(t_logits, t_ref), draft_logits=torch.equal(d_logits, d_ref))
    return checks
