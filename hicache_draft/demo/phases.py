"""The three runs of one model pair, each meant to run in its own fresh process.

* ``first``: prefill the prompt, speculatively decode, copy the finished pages device -> host
  pool (L1 -> L2) and back them up to storage (L2 -> L3) through the controller.
* ``after_restart``: prefetch the prompt's longest stored prefix (L3 -> L2), copy it into the
  device pools (L2 -> L1), prefill only the rest, decode; check the logits against a full
  recompute in this process.
* ``control_no_draft``: the same restart with draft offload off: the target prefix comes back,
  the draft's does not (its device KV for the prefix stays empty, as a server that skipped the
  prefix would leave it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from hicache_draft.capabilities import Attention, PoolKind
from hicache_draft.config import Config
from hicache_draft.controller import CacheController
from hicache_draft.demo.models import TinyLM
from hicache_draft.demo.paged import device_to_host, host_to_device
from hicache_draft.demo.pairs import make_pair, make_prompt
from hicache_draft.demo.spec_decode import SpecEngine
from hicache_draft.transfer import Buffer

Progress = Callable[[str], None]


class Phase(StrEnum):
    FIRST = "first"
    AFTER_RESTART = "after_restart"
    CONTROL = "control_no_draft"


@dataclass(frozen=True)
class Job:
    """Everything a fresh process needs to run one phase (JSON-ready through :meth:`as_dict`)."""

    phase: Phase
    attention: Attention
    seed: int
    config: dict[str, Any]
    prompt_tokens: int
    period: int
    decode_tokens: int
    draft_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value, "attention": self.attention.value, "seed": self.seed, "config": self.config,
            "prompt_tokens": self.prompt_tokens, "period": self.period, "decode_tokens": self.decode_tokens,
            "draft_tokens": self.draft_tokens,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Job:
        return cls(
            phase=Phase(raw["phase"]), attention=Attention(raw["attention"]), seed=int(raw["seed"]),
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
        self.pair = make_pair(job.attention, job.seed)
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
        plan = {k.value: v.as_dict() for k, v in ctrl.plan.items()}
        out = _first(s, ctrl, progress) if job.phase is Phase.FIRST else _restart(s, ctrl, progress)
        out["io_paths"] = plan
        out["metrics"] = ctrl.metrics.snapshot()
    out["phase"] = job.phase.value
    return out


def _first(s: _Setup, ctrl: CacheController, progress: Progress) -> dict[str, Any]:
    engine = s.engine()
    progress(f"prefill {len(s.prompt)} tokens")
    t_logits, _ = engine.prefill(s.prompt)
    progress(f"decode {s.job.decode_tokens} tokens")
    stats = engine.decode(s.job.decode_tokens, s.job.draft_tokens)
    pages = engine.full_pages()
    progress(f"back up {pages} pages")
    slots = [i * s.page_size for i in range(pages)]
    for i, slot in enumerate(slots):
        device_to_host(engine.target, i, ctrl.target_pool, slot)
        if ctrl.draft_pool is not None:
            device_to_host(engine.draft, i, ctrl.draft_pool, slot)
    res = ctrl.backup(engine.tokens[: pages * s.page_size], slots)
    return {
        "accept_length": stats.accept_length,
        "verify_steps": stats.steps,
        "generated": stats.tokens[: s.job.decode_tokens],
        "pages_backed_up": {k.value: v for k, v in res.pages_written.items()},
        "next_logits_sha256": digest(t_logits),
    }


def _restart(s: _Setup, ctrl: CacheController, progress: Progress) -> dict[str, Any]:
    ps = s.page_size
    usable = (len(s.prompt) - 1) // ps  # keep at least one prompt token to prefill
    slots = [i * ps for i in range(usable)]
    progress(f"prefetch up to {usable} pages")
    res = ctrl.prefetch(s.prompt[: usable * ps], slots)
    pages = res.pages
    draft_pages = res.restored.get(PoolKind.DRAFT, 0) if ctrl.draft_pool is not None else 0
    engine = s.engine()
    for i in range(pages):
        host_to_device(ctrl.target_pool, slots[i], engine.target, i)
    for i in range(draft_pages):
        assert ctrl.draft_pool is not None
        host_to_device(ctrl.draft_pool, slots[i], engine.draft, i)
    skipped = pages * ps
    progress(f"prefill {len(s.prompt) - skipped} tokens (skip {skipped})")
    t_logits, d_logits = engine.prefill(s.prompt, cached=skipped)
    out: dict[str, Any] = {
        "restored_pages": {PoolKind.KV.value: pages, PoolKind.DRAFT.value: draft_pages},
        "prefill_tokens_skipped": skipped,
        "prefill_tokens_computed": len(s.prompt) - skipped,
        "next_logits_sha256": digest(t_logits),
    }
    if s.job.phase is Phase.AFTER_RESTART:
        progress("recompute from scratch for the check")
        out["check"] = _check(s, engine, pages, draft_pages, t_logits, d_logits)
    progress(f"decode {s.job.decode_tokens} tokens")
    stats = engine.decode(s.job.decode_tokens, s.job.draft_tokens)
    out.update(
        accept_length=stats.accept_length, verify_steps=stats.steps, generated=stats.tokens[: s.job.decode_tokens]
    )
    return out


def _check(
    s: _Setup, restored: SpecEngine, pages: int, draft_pages: int, t_logits: torch.Tensor, d_logits: torch.Tensor
) -> dict[str, bool]:
    """Recompute everything from scratch with the same chunks (the restored prefix, then the
    rest) and compare bit for bit: restored KV pages against recomputed ones, and the next-token
    logits of both models."""
    fresh = s.engine()
    prefix = pages * s.page_size
    if prefix:
        fresh.compute_prefix(s.prompt, prefix)
    t_ref, d_ref = fresh.prefill(s.prompt, cached=prefix)
    kv_ok = all(
        torch.equal(restored.target.pool.page_canonical(restored.target.table[i]),
                    fresh.target.pool.page_canonical(fresh.target.table[i]))
        for i in range(pages)
    )
    draft_ok = all(
        torch.equal(restored.draft.pool.page_canonical(restored.draft.table[i]),
                    fresh.draft.pool.page_canonical(fresh.draft.table[i]))
        for i in range(draft_pages)
    )
    return {
        "target_kv_bytes": kv_ok,
        "draft_kv_bytes": draft_ok,
        "target_logits": torch.equal(t_logits, t_ref),
        "draft_logits": torch.equal(d_logits, d_ref),
    }
