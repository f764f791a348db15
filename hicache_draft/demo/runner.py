"""Runs the demo: for each model pair, its phases, each in a fresh process on one storage."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_draft.config import Config, apply_env, read_config_file
from hicache_draft.demo.pairs import Pair, PairName, make_pair, pair_config
from hicache_draft.demo.phases import RESTORE_PHASES, Job, Phase
from hicache_draft.demo.report import pair_report
from hicache_draft.errors import HiCacheDraftError
from hicache_draft.plugins import get_backend

OnStep = Callable[[PairName, Phase, str], None]


def phases(pair: PairName) -> tuple[Phase, ...]:
    """The runs of ``pair``, in order: ``first`` then its restarts."""
    return (Phase.FIRST, *RESTORE_PHASES[PairName(pair)])


def phase_configs(base: dict[str, Any], pair: Pair, page_size: int) -> dict[Phase, Config]:
    """The config of each run of ``pair``: what differs between its runs is which pools are offloaded.

    Dense pairs: draft offload on, and off for the control. The DSA pair: run 1 without the target
    ``indexer`` pool (so its pages are not in storage at the first restart), the controls without
    one indexer pool each, the others with both."""
    if not pair.sparse:
        on = pair_config(base, pair, page_size, draft_offload=True)
        return {Phase.FIRST: on, Phase.AFTER_RESTART: on,
                Phase.CONTROL: pair_config(base, pair, page_size, draft_offload=False)}
    full = pair_config(base, pair, page_size, draft_offload=True)
    return {
        Phase.FIRST: pair_config(base, pair, page_size, draft_offload=True, pools=["draft_indexer"]),
        Phase.CONTROL_NO_TARGET_INDEXER: full,
        Phase.AFTER_RESTART: full,
        Phase.CONTROL_NO_DRAFT_INDEXER: pair_config(base, pair, page_size, draft_offload=True, pools=["indexer"]),
    }


class DemoError(HiCacheDraftError):
    """A demo phase failed, timed out, or the demo was asked for something impossible."""


@dataclass
class DemoOptions:
    """What ``hicache-draft demo`` was asked for (defaults finish well under a minute on 2 cores)."""

    backend: str | None = None
    config_path: str | None = None
    root: str | None = None
    pairs: tuple[PairName, ...] = tuple(PairName)
    prompt_tokens: int = 1000
    period: int = 128
    decode_tokens: int = 64
    draft_tokens: int = 4
    page_size: int | None = None
    seed: int = 1
    phase_timeout_s: float = 300.0
    jobs: int = 2  # pairs run side by side (each pair's runs stay in order)
    environ: dict[str, str] | None = field(default=None, repr=False)

    def validate(self) -> None:
        try:
            self.pairs = tuple(PairName(p) for p in self.pairs)
        except ValueError:
            raise DemoError(f"--pair: the pairs are {', '.join(PairName)}, not {list(self.pairs)}") from None
        if not self.pairs:
            raise DemoError("--pair: no pair to run")
        if self.draft_tokens < 1:
            raise DemoError("--draft-tokens must be >= 1")
        if self.decode_tokens < 2:
            raise DemoError("--decode-tokens must be >= 2")
        if not 2 <= self.period <= 256:
            raise DemoError("--period must be in [2, 256] (the demo vocabulary has 256 tokens)")
        if self.prompt_tokens < 2 * self.period:
            raise DemoError(f"--prompt-tokens {self.prompt_tokens} must hold two periods (>= {2 * self.period})")
        if self.jobs < 1:
            raise DemoError("--jobs must be >= 1")
        if self.seed < 0:
            raise DemoError("--seed must be >= 0")


def base_config(opts: DemoOptions, scratch: Path) -> tuple[dict[str, Any], bool]:
    """The user's config (file + environment) with ``--backend`` / ``--root`` applied, and whether
    its store is temporary (lives in ``scratch``).

    The backend is asked for its scratch options (:meth:`~hicache_draft.StorageBackend.scratch_options`)
    for ``--root`` or, without it, for ``scratch`` (a temporary directory): the user's options win over
    the scratch ones, ``--root``'s win over the user's. A backend that offers none runs only on the
    options its config gives.
    """
    data: dict[str, Any] = read_config_file(opts.config_path) if opts.config_path else {}
    data = apply_env(data, opts.environ)
    written_for = data.get("backend")  # None: the installed default
    info = get_backend(opts.backend or written_for)
    assert info.cls is not None
    user = dict(data.get("backend_options") or {})
    if opts.backend and opts.backend != written_for and not (written_for is None and info.default):
        user = {}  # options written for another backend
    where = Path(opts.root) if opts.root is not None else scratch
    offered = info.cls.scratch_options(where)
    if offered is None:
        if opts.root is not None or not user:
            raise DemoError(
                f"backend {info.name!r} offers no scratch options for the demo (StorageBackend.scratch_options); "
                "give its [backend_options] in a --config file"
            )
        options, temporary = user, False
    elif opts.root is not None:
        options, temporary = {**user, **offered}, False
    else:
        options, temporary = {**offered, **user}, any(k not in user for k in offered)
    data["backend"] = info.name
    data["backend_options"] = options
    return data, temporary


def run_job(job: Job, timeout_s: float, on_step: Callable[[str], None]) -> dict[str, Any]:
    """Run one phase in a new Python process; bounded by ``timeout_s``."""
    env = dict(os.environ)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS when on CUDA
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_draft.demo.worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str] = []

    def pump_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def pump_err() -> None:
        assert proc.stderr is not None
        errors.extend(proc.stderr)

    readers = [threading.Thread(target=pump_out, daemon=True), threading.Thread(target=pump_err, daemon=True)]
    for t in readers:
        t.start()
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(job.as_dict()))
    proc.stdin.close()
    deadline = time.monotonic() + timeout_s
    result: dict[str, Any] | None = None
    failure: str | None = None
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoError(f"{job.pair.value} {job.phase.value}: no result within {timeout_s:g}s") from None
            if line is None:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a stray print from a library
            if event.get("event") == "progress":
                on_step(str(event.get("step", "")))
            elif event.get("event") == "result":
                result = event["result"]
            elif event.get("event") == "error":
                failure = str(event.get("message"))
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (DemoError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
        raise
    for t in readers:
        t.join(timeout=5)
    if failure is not None:
        raise DemoError(f"{job.pair.value} {job.phase.value}: {failure}")
    if result is None or proc.returncode != 0:
        tail = "".join(errors)[-2000:].strip()
        raise DemoError(
            f"{job.pair.value} {job.phase.value}: the process exited with status {proc.returncode}"
            + (f":\n{tail}" if tail else "")
        )
    return result


def run_demo(opts: DemoOptions, on_step: OnStep | None = None) -> dict[str, Any]:
    """Run every requested pair and return the report (``pairs`` and the run's settings)."""
    opts.validate()
    step = on_step or (lambda _a, _p, _s: None)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hicache-draft-demo-") as scratch:
        base, temporary = base_config(opts, Path(scratch))
        page_size = opts.page_size or int((base.get("namespace") or {}).get("page_size") or 16)
        info = get_backend(base["backend"])
        assert info.capabilities is not None

        def one_pair(name: PairName) -> dict[str, Any]:
            pair = make_pair(name, opts.seed)
            configs = phase_configs(base, pair, page_size)
            results: dict[Phase, dict[str, Any]] = {}
            for phase in phases(name):
                job = Job(
                    phase=phase, pair=name, seed=opts.seed,
                    config=configs[phase].model_dump(mode="json"), prompt_tokens=opts.prompt_tokens,
                    period=opts.period, decode_tokens=opts.decode_tokens, draft_tokens=opts.draft_tokens,
                )
                step(name, phase, "starting a new process")
                results[phase] = run_job(job, opts.phase_timeout_s, lambda s, p=phase: step(name, p, s))
                step(name, phase, "done")
            return pair_report(pair, configs[Phase.AFTER_RESTART], results)

        for name in opts.pairs:  # fail early, in this process, on a config the pair cannot use
            phase_configs(base, make_pair(name, opts.seed), page_size)
        # The pairs use different model identities, hence different keys: they may share the store at
        # once when the backend declares it may be used by several processes at once.
        workers = min(opts.jobs, len(opts.pairs)) if info.capabilities.shared else 1
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            pairs = list(pool.map(one_pair, opts.pairs))
        return {
            "backend": base["backend"],
            "backend_options": base["backend_options"],
            "persistent": info.capabilities.persistent,
            "temporary_store": temporary,
            "page_size": page_size,
            "prompt_tokens": opts.prompt_tokens,
            "period": opts.period,
            "decode_tokens": opts.decode_tokens,
            "draft_tokens": opts.draft_tokens,
            "seed": opts.seed,
            "elapsed_s": round(time.monotonic() - started, 2),
            "pairs": pairs,
        }
