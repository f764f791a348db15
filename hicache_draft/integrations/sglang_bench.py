"""What the SGLang adapter adds to the backend's own time: ``hicache-draft bench sglang``.

One run, one store, the same pages: for each backend, page size and path SGLang takes, the
adapter's call (as SGLang's controllers make it, over SGLang's own ``MHATokenToKVPoolHost``) is
timed against the :class:`~hicache_draft.Store` call that moves the same pages in the same batch
(keys, buffers and transfers built beforehand, as a caller that already holds them would). Rounds
alternate which of the two goes first; each row's ratio is the median of the per-round ratios
(adapter / backend, paired within a round), printed with their range, the median times and the
goal (:data:`GOAL`: the adapter adds at most 10% to the backend's own time).

Backends: the installed default (the file backend in a checkout) and ``memory``, the in-process
test backend (:class:`hicache_draft.testing.MemoryBackend`, registered for the run when no backend
of that name is installed), whose calls cost little, so the adapter's own time shows most there.

Ops: ``set`` (fresh pages each round on each side), ``get`` and ``exists`` (the pages the adapter
just stored), ``exists-cold`` (the pages the backend's own call stored, with the adapter's key
cache emptied before each query: a hit query for pages another server wrote; its Store call is
handed storage keys made anew, untimed, before each call, as new strings it has not hashed yet,
which is what any adapter hands it for hashes it never saw).
``generic`` set and get copy every page through staging memory (the backend gets registered
memory, and a late read never lands in SGLang's tensors), which the baseline does not: their rows
also give that copy's own time and the goal is checked against backend + copy (the floor).
Likewise an existence query: the Store call is handed its storage keys ready, while any adapter
makes them from SGLang's page hashes first (one string per page and pool) and hands the Store
strings it made on its own thread; the ``exists`` rows time that too, in one call (the adapter's
rule: :func:`~hicache_draft.integrations.sglang.page_groups` and the bindings'
:meth:`~hicache_draft.PoolBinding.keys`, then the Store call with what it made, released within
the call: "keys + backend"), and the goal is checked against it (each Store call of a few
tens of microseconds on a small VM is mostly the hand-over to its worker thread, so the few
microseconds of making and handing over the strings weigh, and time apart they add up to less than
they cost in one call).
Every row also times the adapter's call alone, with each Store call it makes answered at once
(nothing moved, so a set's pages stay fresh for its real call), in the same round: the adapter's
own work with caches as cold as its real call finds them, keys and staging copies included, printed
as a share of the backend's call. A set's hashes are new to the adapter, so its key cache is
emptied before each of the set's two calls, as before exists-cold's. (A zero-copy call's pages are
built by the Store, with their headers, as the baseline's are copied to attach theirs: that pass is
the Store's on both sides and not in this row.) It is not what the goal is checked on (it leaves out
what the adapter's call costs the backend's), but it tells the adapter's work from the machine's noise.

Paths: ``v1`` (``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists``: target pages zero-copy by
host index), ``v2`` (``batch_set_v2`` / ``batch_get_v2`` / ``batch_exists_v2`` with a DRAFT
sidecar: target and draft pages in one backend call) and ``generic`` (``batch_set`` /
``batch_get`` with SGLang's flat data pages; its baseline moves the same flat pages).

SGLang is imported the way the real-SGLang tests import it: in a source checkout, through
``tests/sglang_real/bootstrap.py`` (the release's own modules with the smallest shims); inside an
SGLang environment, as it is. Run ``python -m hicache_draft.integrations.sglang_bench`` or
``hicache-draft bench sglang``.
"""

from __future__ import annotations

import cProfile
import dataclasses
import importlib
import importlib.util
import inspect
import io
import pstats
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT_MODEL = "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B"
PATHS = ("v1", "v2", "generic")
OPS = ("set", "get", "exists", "exists-cold")
EXISTS_REPEAT = 50
"""Existence queries per timing (each is tens of microseconds)."""
GOAL = 1.10
"""The adapter's time / the backend's own time (issue 15): at most 10% more."""
MEMORY = "memory"
DEFAULT_BACKENDS = (None, MEMORY)
"""``None``: the installed default backend."""


@dataclass(frozen=True)
class PageShape:
    """An MHA target page (bf16) and its one-layer draft page."""

    label: str
    layers: int
    heads: int
    head_dim: int
    page_size: int
    draft_layers: int = 1

    @property
    def page_nbytes(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * self.page_size * 2


SHAPES = {
    "64k": PageShape("64 KiB", layers=4, heads=8, head_dim=128, page_size=4),
    "1m": PageShape("1 MiB", layers=32, heads=8, head_dim=128, page_size=8),
}


# -- SGLang ---------------------------------------------------------------------------------------


def checkout_bootstrap() -> Path | None:
    """``tests/sglang_real/bootstrap.py`` of the source checkout this package runs from, if any."""
    path = Path(__file__).resolve().parents[2] / "tests" / "sglang_real" / "bootstrap.py"
    return path if path.is_file() else None


def import_sglang(bootstrap: Path | None) -> None:
    """Make SGLang's host pools importable: through ``bootstrap`` (its ``install`` for the
    installed release) unless ``sglang`` is already imported (inside an SGLang process)."""
    if "sglang" in sys.modules or bootstrap is None:
        return
    from hicache_draft.integrations.sglang_loader import sglang_version

    release = sglang_version()
    if release is None:
        from hicache_draft.integrations.sglang_loader import SGLangMissingError

        raise SGLangMissingError("the SGLang benchmark needs the 'sglang' package")
    spec = importlib.util.spec_from_file_location("_hicache_sglang_bootstrap", bootstrap)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install(release)


def sglang_mha_host_pool(shape: PageShape, pages: int, layout: str, layers: int | None = None) -> Any:  # noqa: ANN401
    """SGLang's own ``MHATokenToKVPoolHost`` (``pin_memory=False``) over a CPU device pool of
    ``pages`` pages; the constructor's parameters are read from its signature."""
    memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    try:
        host_mod = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    except ImportError:  # releases before pool_host/
        host_mod = importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
    import torch

    tokens = pages * shape.page_size
    device = memory_pool.MHATokenToKVPool(
        size=tokens, page_size=shape.page_size, dtype=torch.bfloat16, head_num=shape.heads,
        head_dim=shape.head_dim, layer_num=layers or shape.layers, device="cpu", enable_memory_saver=False,
    )
    cls = host_mod.MHATokenToKVPoolHost
    params = inspect.signature(cls.__init__).parameters
    arg = device.get_device_pool_infos()[0].buffer_info if list(params)[1] == "buffer_info" else device
    kw: dict[str, Any] = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": shape.page_size,
                          "layout": layout, "pin_memory": False, "device": "cpu"}
    optional = {"device_capacity_tokens": device.size, "start_layer": device.start_layer,
                "end_layer": device.end_layer}
    kw.update({k: v for k, v in optional.items() if k in params})
    return cls(arg, **kw)


def storage_config(extra: dict[str, Any]) -> Any:  # noqa: ANN401
    """SGLang's ``HiCacheStorageConfig`` for one TP rank (fields this release has)."""
    from hicache_draft.integrations.sglang_loader import load_storage_module

    sg = load_storage_module()
    values: dict[str, Any] = {
        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
        "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": True,
        "model_name": MODEL, "extra_config": extra,
    }
    names = {f.name for f in dataclasses.fields(sg.HiCacheStorageConfig)}
    return sg.HiCacheStorageConfig(**{k: v for k, v in values.items() if k in names})


# -- measuring --------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (path, page size, op): the adapter's and the backend's own seconds per round."""

    path: str
    page: str
    op: str
    backend: str = "default"
    adapter: list[float] = field(default_factory=list)
    store: list[float] = field(default_factory=list)
    copy: list[float] = field(default_factory=list)  # generic set/get: the staging copies alone
    keyed: list[float] = field(default_factory=list)  # exists: keys made from SGLang's hashes + the Store call
    hook: list[float] = field(default_factory=list)  # exists: the backend's hook called in this thread
    alone: list[float] = field(default_factory=list)  # the adapter's call with every Store call answered at once

    @property
    def ratios(self) -> list[float]:
        """adapter / backend in each round (the two timed back to back)."""
        return [a / s for a, s in zip(self.adapter, self.store, strict=True)]

    @property
    def ratio(self) -> float:
        """The median of the per-round ratios."""
        return statistics.median(self.ratios)

    @property
    def least(self) -> list[float]:
        """Per round, the least any adapter of this path spends: backend + the generic path's
        staging copy (timed apart: large copies), or an existence query's storage keys made from
        SGLang's hashes and the Store call handed them (timed as one call); the backend alone for
        the rest."""
        if self.copy:
            return [s + c for s, c in zip(self.store, self.copy, strict=True)]
        return self.keyed or self.store

    @property
    def floor(self) -> float:
        """The median per-round :attr:`least` / backend: what no adapter of this path goes below
        (1.0 when it has no work of its own)."""
        if self.least is self.store:
            return 1.0
        return statistics.median([f / s for f, s in zip(self.least, self.store, strict=True)])

    @property
    def over_floor(self) -> float:
        """The median per-round adapter / :attr:`least`: what the goal is checked on."""
        return statistics.median([a / f for a, f in zip(self.adapter, self.least, strict=True)])

    @property
    def meets_goal(self) -> bool:
        return self.over_floor <= GOAL

    @property
    def alone_share(self) -> float:
        """The median per-round adapter alone / backend: the adapter's own work (its call with the
        Store answering at once, timed in the same round: caches as cold as the real call finds
        them), keys and staging copies included, against the backend's Store call. Not what the goal
        is checked on: it leaves out what the adapter's call costs the backend's (the fresh strings
        it hands over), and it includes work any adapter does (see :attr:`least`)."""
        return statistics.median([a / s for a, s in zip(self.alone, self.store, strict=True)])

    def line(self) -> str:
        rs = self.ratios
        verdict = "ok" if self.meets_goal else "OVER"
        alone = (f" (alone {statistics.median(self.alone) * 1e3:.3f} ms = {self.alone_share:.2f} of backend)"
                 if self.alone else "")
        text = (f"{self.backend:<7} {self.path:<8} {self.page:>7} {self.op:<11} "
                f"adapter {statistics.median(self.adapter) * 1e3:8.3f} ms{alone}  "
                f"backend {statistics.median(self.store) * 1e3:8.3f} ms  ratio {self.ratio:5.2f} "
                f"(rounds {min(rs):.2f}-{max(rs):.2f})")
        if self.copy:
            return (text + f"  staging copy {statistics.median(self.copy) * 1e3:.3f} ms, floor {self.floor:.2f}: "
                    f"ratio to backend + copy {self.over_floor:5.2f}, goal <= {GOAL:.2f} {verdict}")
        hook = f", its hook alone {statistics.median(self.hook) * 1e3:.3f} ms" if self.hook else ""
        if self.keyed:
            return (text + f"  keys + backend {statistics.median(self.keyed) * 1e3:.3f} ms{hook}, floor "
                    f"{self.floor:.2f}: ratio to keys + backend {self.over_floor:5.2f}, goal <= {GOAL:.2f} {verdict}")
        return text + f"  goal <= {GOAL:.2f} {verdict}{hook}"

    def as_dict(self) -> dict[str, Any]:
        out = {"backend": self.backend, "path": self.path, "page": self.page, "op": self.op, "ratio": self.ratio,
               "adapter_s": statistics.median(self.adapter), "backend_s": statistics.median(self.store),
               "ratio_min": min(self.ratios), "ratio_max": max(self.ratios), "goal": GOAL,
               "checked_ratio": self.over_floor, "meets_goal": self.meets_goal}
        if self.copy:
            out["copy_s"], out["floor"] = statistics.median(self.copy), self.floor
        if self.keyed:
            out["keyed_s"], out["floor"] = statistics.median(self.keyed), self.floor
        if self.hook:
            out["hook_s"] = statistics.median(self.hook)
        if self.alone:
            out["alone_s"], out["alone_share"] = statistics.median(self.alone), self.alone_share
        return out


@dataclass
class Report:
    rows: list[Row]
    pages: int
    rounds: int
    backends: list[str]
    layout: str
    release: str
    checks: dict[str, bool]
    profile: str = ""

    def text(self) -> str:
        head = (f"SGLang {self.release} adapter vs the backend's own Store calls: backends "
                f"{', '.join(self.backends)}, layout {self.layout}, {self.pages} pages per call, {self.rounds} "
                f"alternating rounds (ratio: the median of the per-round ratios; goal <= {GOAL:.2f})")
        lines = [head, *(r.line() for r in self.rows)]
        over = [f"{r.backend}/{r.path}/{r.page}/{r.op}" for r in self.rows if not r.meets_goal]
        lines.append(f"goal <= {GOAL:.2f}: {len(self.rows) - len(over)} of {len(self.rows)} rows met"
                     + (f"; over: {', '.join(over)}" if over else ""))
        bad = [k for k, ok in self.checks.items() if not ok]
        lines.append("checks: all pages moved and found" if not bad else f"checks FAILED: {', '.join(bad)}")
        if self.profile:
            lines.append(self.profile)
        return "\n".join(lines)


class _Case:
    """One path at one page size: the adapter's call and the Store call for the same pages."""

    def __init__(self, path: str, adapter: Any, kv: Any, draft: Any | None, pages: int, ps: int) -> None:  # noqa: ANN401
        import torch

        from hicache_draft.capabilities import PoolKind
        from hicache_draft.integrations.sglang import PoolName, PoolTransfer
        from hicache_draft.keys import make_key
        from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer
        from hicache_draft.workers import DONE

        self.path, self.adapter, self.kv, self.draft = path, adapter, kv, draft
        self.store = adapter.store
        self.pages, self.ps = pages, ps
        self.indices = kv.alloc(pages * ps)
        assert self.indices is not None, "host pool full"
        self.slots = [int(self.indices[i * ps]) for i in range(pages)]
        self._torch, self._PoolKind, self._PoolName, self._PoolTransfer = torch, PoolKind, PoolName, PoolTransfer
        self._make_key, self._Buffer, self._Page, self._PageTransfer = make_key, Buffer, Page, PageTransfer
        self._PageResult, self._done = PageResult, DONE
        self.flats: list[Any] = []
        self.dummies: list[Any] = []
        self._area: Any = None
        if path == "generic":
            self.flats = [kv.get_data_page(s) for s in self.slots]
            self.dummies = [kv.get_dummy_flat_data_page() for _ in self.slots]

    def staging_copy(self, op: str) -> Callable[[], bool]:
        """The generic path's own copies of the same pages (flat pages into a staging area on set,
        back out on get), with no storage call."""
        torch = self._torch
        if self._area is None:  # made and touched once, as the adapter's staging area is
            nbytes = self.flats[0].numel() * self.flats[0].element_size()
            self._area = torch.zeros(self.pages * nbytes, dtype=torch.uint8)
        area = self._area
        raw = [f.view(-1).view(torch.uint8) for f in (self.flats if op == "set" else self.dummies)]
        pieces = list(area.split(raw[0].numel()))

        def copy_set() -> bool:
            torch.cat(raw, out=area)
            return True

        def copy_get() -> bool:
            for dst, src in zip(raw, pieces, strict=True):
                dst.copy_(src)
            return True

        return copy_set if op == "set" else copy_get

    def forget_keys(self) -> None:
        """Empty the adapter's key cache (the next query is one for hashes it never saw)."""
        for cache in self.adapter.key_caches.values():
            cache.clear()

    # -- what each side is handed ---------------------------------------------------------------
    def _sidecars(self, keys: list[str], with_indices: bool) -> list[Any]:
        return [self._PoolTransfer(name=self._PoolName.DRAFT, keys=keys,
                                   host_indices=self.indices if with_indices else None,
                                   indices_from_pool=self._PoolName.KV)]

    def store_transfers(self, keys: list[str], op: str) -> list[Any]:
        """The transfers the Store call gets: the adapter's keys and the same buffers."""
        out = []
        kinds = [self._PoolKind.KV] + ([self._PoolKind.DRAFT] if self.path == "v2" else [])
        for kind in kinds:
            view = self.adapter.bindings[kind]
            pages = []
            for i, key in enumerate(keys):
                group = key.lower()
                ns = view.namespaces[0]
                if self.path == "generic":
                    t = (self.flats if op == "set" else self.dummies)[i]
                    bufs: tuple[Any, ...] = (self._Buffer(t.data_ptr(), t.numel() * t.element_size(), owner=t),)
                else:
                    bufs = view.host.page_buffers(self.slots[i])
                pages.append(self._Page(self._make_key(group, ns), group, ns, bufs))
            out.append(self._PageTransfer(kind, pages, self.path != "generic"))
        return out

    def store_queries(self, keys: list[str]) -> dict[Any, list[str]]:
        kinds = [self._PoolKind.KV] + ([self._PoolKind.DRAFT] if self.path == "v2" else [])
        return {k: [self._make_key(key.lower(), self.adapter.bindings[k].namespaces[0]) for key in keys] for k in kinds}

    # -- the calls, each returning whether every page went through ---------------------------------
    def adapter_call(self, op: str, keys: list[str]) -> Callable[[], bool]:
        a, n = self.adapter, len(keys)
        if self.path == "v1":
            if op == "set":
                return lambda: all(a.batch_set_v1(keys, self.indices))
            if op == "get":
                return lambda: all(a.batch_get_v1(keys, self.indices))
            return lambda: a.batch_exists(keys) == n
        if self.path == "v2":
            kv = self._PoolTransfer(name=self._PoolName.KV, keys=keys, host_indices=self.indices)
            if op == "set":
                return lambda: all(all(v) for v in a.batch_set_v2([kv, *self._sidecars(keys, True)]).values())
            if op == "get":
                return lambda: all(all(v) for v in a.batch_get_v2([kv, *self._sidecars(keys, True)]).values())
            side = self._sidecars(keys, False)
            return lambda: a.batch_exists_v2(keys, side).kv_hit_pages == n
        if op == "set":
            return lambda: bool(a.batch_set(keys, self.flats))
        if op == "get":
            return lambda: all(t is not None for t in a.batch_get(keys, self.dummies))
        return lambda: a.batch_exists(keys) == n

    def alone_call(self, op: str, keys: list[str]) -> Callable[[], bool]:
        """The adapter's call with every Store call it makes answered at once (all pages OK, all
        keys stored; nothing moved): the adapter's own work."""
        call = self.adapter_call(op, keys)
        store = self.store
        ok = self._PageResult.OK
        done = self._done

        def answered(transfers: Sequence[Any], timeout_s: float | None = None) -> tuple[dict[str, list[Any]], Any]:
            return {t.pool: [ok] * len(t.pages) for t in transfers}, done

        def exists(queries: dict[str, Sequence[str]], timeout_s: float | None = None) -> dict[str, int]:
            return {pool: len(ks) for pool, ks in queries.items()}

        def alone() -> bool:
            store.page_get = store.page_set_tracked = answered  # on the instance, for this call only
            store.page_exists = exists
            try:
                return call()
            finally:
                del store.page_get, store.page_set_tracked, store.page_exists

        return alone

    def keyed_call(self, keys: list[str]) -> Callable[[], bool]:
        """The storage keys of an existence query made from SGLang's page hashes by the adapter's
        rule (:func:`~hicache_draft.integrations.sglang.page_groups`, then each pool binding's
        :meth:`~hicache_draft.PoolBinding.keys`), then the Store call handed them (released
        within the call): the least any adapter does for the query."""
        from hicache_draft.integrations.sglang import page_groups

        bindings = [self.adapter.bindings[k] for k in self.store_queries(keys)]
        s, n = self.store, len(keys)

        def call() -> bool:
            groups = page_groups(keys)
            return all(c == n for c in s.page_exists({b.name: b.keys(groups) for b in bindings}).values())

        return call

    def hook_call(self, keys: list[str]) -> Callable[[], bool]:
        """The backend's ``page_exists`` hook for the same queries, called in this thread: the
        backend's own work, without the Store's bounded hop to its worker threads."""
        queries, hook = self.store_queries(keys), self.store.pm.hook.page_exists
        return lambda: all(c == len(keys) for c in hook(queries=queries, deadline=time.monotonic() + 60).values())

    def fresh_store_query(self, keys: list[str]) -> tuple[Callable[[], bool], Callable[[], None]]:
        """``exists-cold``'s Store call and what runs (untimed) before each: the storage keys made
        anew as new strings (never hashed yet) and released by the call, as any adapter hands the
        Store the keys of hashes it never saw; a query handed the same strings each time would
        find their hashes already computed, which no query for another server's pages does."""
        s, held = self.store, []

        def make() -> None:
            held.append(self.store_queries(keys))

        def call() -> bool:
            queries = held.pop()
            return all(c == len(keys) for c in s.page_exists(queries).values())

        return call, make

    def store_call(self, op: str, keys: list[str]) -> Callable[[], bool]:
        from hicache_draft.transfer import PageResult

        s = self.store
        if op.startswith("exists"):
            queries = self.store_queries(keys)
            return lambda: all(c == len(keys) for c in s.page_exists(queries).values())
        transfers = self.store_transfers(keys, op)
        ok = PageResult.OK
        if op == "set":
            return lambda: all(r is ok for rs in s.page_set_tracked(transfers)[0].values() for r in rs)
        return lambda: all(r is ok for rs in s.page_get(transfers)[0].values() for r in rs)


def _keys(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


def _timed(
    fn: Callable[[], bool], reps: int = 1, before: Callable[[], None] | None = None,
    prof: cProfile.Profile | None = None,
) -> tuple[float, bool]:
    """Mean seconds of ``reps`` calls (``before`` runs untimed ahead of each) and whether all succeeded."""
    total, ok = 0.0, True
    for _ in range(reps):
        if before is not None:
            before()
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        ok = fn() and ok
        total += time.perf_counter() - t0
        if prof is not None:
            prof.disable()
    return total / reps, ok


def backend_options(backend: str | None, directory: Path) -> dict[str, Any]:
    """Options for a throwaway store of ``backend`` under ``directory``: the backend's own scratch
    options, or a fresh space of the in-process ``memory`` backend (registered here when no
    installed backend has that name)."""
    from hicache_draft.bench.pipeline import scratch_options

    if backend == MEMORY:
        from hicache_draft.errors import UnknownBackendError
        from hicache_draft.plugins import get_backend, register_backend
        from hicache_draft.testing import MemoryBackend

        try:
            cls = get_backend(MEMORY).cls
        except UnknownBackendError:
            cls = register_backend(MEMORY, MemoryBackend, distribution="hicache-draft (testing)").cls
        if cls is MemoryBackend:
            return {"space": secrets.token_hex(8)}
    return scratch_options(backend, directory)


def measure(
    *,
    pages: int = 128,
    rounds: int = 7,
    shapes: Sequence[str] = tuple(SHAPES),
    paths: Sequence[str] = PATHS,
    layout: str = "page_first",
    backends: Sequence[str | None] = DEFAULT_BACKENDS,
    root: Path | None = None,
    bootstrap: Path | None = None,
    profile: bool = False,
) -> Report:
    """Run the benchmark (see the module docstring) on each of ``backends`` (``None``: the
    installed default), each store made by :func:`backend_options` under ``root`` (a temporary
    directory when None)."""
    import_sglang(bootstrap if bootstrap is not None else checkout_bootstrap())
    import torch

    from hicache_draft.integrations import sglang as adapter_mod
    from hicache_draft.integrations.sglang_loader import sglang_version
    from hicache_draft.plugins import get_backend

    prof = cProfile.Profile() if profile else None
    rows: list[Row] = []
    checks: dict[str, bool] = {}
    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hicache-draft-sglang-bench-", dir=root) as tmp:
        for backend in backends:
            for label in shapes:
                shape = SHAPES[label]
                for path in paths:
                    opts = backend_options(backend, Path(tmp) / f"{backend or 'default'}-{label}-{path}")
                    name = get_backend(backend).name
                    if name not in names:
                        names.append(name)
                    section: dict[str, Any] = {"backend": name, "backend_options": opts, "draft_model": DRAFT_MODEL}
                    extra = {"interface_v1": path != "generic", "hicache_draft": section}
                    adapter = adapter_mod.HiCacheDraftStorage(storage_config(extra), None)
                    try:
                        kv = sglang_mha_host_pool(shape, pages, layout)
                        kv.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
                        adapter.register_mem_pool_host(kv)
                        draft = None
                        if path == "v2":
                            draft = sglang_mha_host_pool(shape, pages, layout, layers=shape.draft_layers)
                            draft.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
                            adapter.register_mem_host_pool_v2(kv, adapter_mod.PoolName.KV)
                            adapter.register_mem_host_pool_v2(draft, adapter_mod.PoolName.DRAFT)
                        adapter.on_host_pools_registered()
                        case = _Case(path, adapter, kv, draft, pages, shape.page_size)
                        rows.extend(_rounds(case, name, shape.label, rounds, checks, prof))
                    finally:
                        adapter.close()
    text = ""
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        text = out.getvalue()
    return Report(rows=rows, pages=pages, rounds=rounds, backends=names, layout=layout,
                  release=sglang_version() or "?", checks=checks, profile=text)


def _drop_earlier_rounds(store: Any) -> Callable[[], None] | None:  # noqa: ANN401
    """For the in-process memory backend: drop the pages of earlier rounds before each round (they
    live in this process: 1 MiB pages would take gigabytes); other backends keep theirs."""
    from hicache_draft.testing import MemoryBackend

    backend = store.backend
    if not isinstance(backend, MemoryBackend):
        return None

    def drop() -> None:
        for key in backend.keys():  # noqa: SIM118  (its stored keys, a list: not a dict)
            backend.drop(key)
        MemoryBackend.calls.clear()

    return drop


def _rounds(
    case: _Case, backend: str, page: str, rounds: int, checks: dict[str, bool], prof: cProfile.Profile | None
) -> list[Row]:
    rows = {op: Row(case.path, page, op, backend) for op in OPS}
    drop = _drop_earlier_rounds(case.store)
    for r in range(-1, rounds):  # round -1 warms up and is not counted
        if drop is not None:
            drop()
        adapter_keys, store_keys = _keys(case.pages), _keys(case.pages)
        for op in OPS:
            keys = store_keys if op in ("set", "exists-cold") else adapter_keys
            # a set's hashes are new (its keys never remembered), as are exists-cold's
            cold = case.forget_keys if op in ("set", "exists-cold") else None
            store_side = case.fresh_store_query(keys) if op == "exists-cold" else (case.store_call(op, keys), None)
            calls = [
                ("adapter", case.adapter_call(op.removesuffix("-cold"), adapter_keys if op == "set" else keys), cold),
                ("store", *store_side),
            ]
            if case.path == "generic" and op in ("set", "get"):
                calls.append(("copy", case.staging_copy(op), None))
            calls.append(("alone", case.alone_call(op.removesuffix("-cold"), adapter_keys if op == "set" else keys),
                          cold))
            if op.startswith("exists"):
                calls.append(("keyed", case.keyed_call(keys), None))
            if op == "exists":
                calls.append(("hook", case.hook_call(keys), None))
            if r % 2:
                calls.reverse()
            reps = EXISTS_REPEAT if op.startswith("exists") else 1
            for side, fn, before in calls:
                dt, ok = _timed(fn, reps, before, prof if side == "adapter" else None)
                name = f"{backend}/{case.path}/{page}/{op}/{side}"
                checks[name] = checks.get(name, True) and ok
                if r >= 0:
                    getattr(rows[op], side).append(dt)
    return list(rows.values())


@click.command("sglang")
@click.option("--pages", type=click.IntRange(min=1), default=128, show_default=True,
              help="Pages per call (SGLang's STORAGE_BATCH_SIZE is 128).")
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--page", "shapes", type=click.Choice(list(SHAPES)), multiple=True,
              help="Page sizes (repeatable; default: all).")
@click.option("--path", "paths", type=click.Choice(PATHS), multiple=True, help="Paths (repeatable; default: all).")
@click.option("--layout", type=click.Choice(["layer_first", "page_first", "page_first_direct", "page_head"]),
              default="page_first", show_default=True)
@click.option("--backend", "backend_names", multiple=True,
              help="Backend (repeatable; default: the installed default and the in-process 'memory').")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for the scratch store (default: the system's temporary directory).")
@click.option("--bootstrap", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="The SGLang bootstrap to run first (default: the checkout's tests/sglang_real/bootstrap.py).")
@click.option("--profile", is_flag=True, help="Also print cProfile's top functions of the adapter's calls.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def sglang_command(pages: int, rounds: int, shapes: tuple[str, ...], paths: tuple[str, ...], layout: str,
                   backend_names: tuple[str, ...], root: Path | None, bootstrap: Path | None, profile: bool,
                   as_json: bool) -> None:
    """The SGLang adapter's time against the backend's own (same pages, same store, same run)."""
    import json

    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    rep = measure(pages=pages, rounds=rounds, shapes=shapes or tuple(SHAPES), paths=paths or PATHS, layout=layout,
                  backends=backend_names or DEFAULT_BACKENDS, root=root, bootstrap=bootstrap, profile=profile)
    if as_json:
        click.echo(json.dumps({"release": rep.release, "backends": rep.backends, "layout": rep.layout,
                               "pages": rep.pages, "rounds": rep.rounds, "goal": GOAL, "checks": rep.checks,
                               "rows": [r.as_dict() for r in rep.rows]}, indent=2))
    else:
        click.echo(rep.text())
    if not all(rep.checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    sglang_command()
