"""The core's benchmarks run on a CPU machine too (the copies are then host copies): every step is
measured, its ratios are printed, and the pipeline's own checks hold. No speed is asserted here:
ratios are read from the benchmark's output, on the machine that matters."""

from __future__ import annotations

from hicache_draft.bench.pipeline import Shape, format_report, run_pipeline
from hicache_draft.bench.verification import measure


def test_pipeline_bench_measures_every_step_and_restores_exact_bytes(tmp_path):
    rep = run_pipeline(root=tmp_path, pages=12, shape=Shape.quick(), backend="file", ceiling_threads=2)
    assert rep.checks == {
        "backup stored every page": True, "prefetch restored every page": True, "restored bytes equal": True,
    }
    steps = [r[0] for r in rep.rows()]
    assert steps == ["d2h", "backup", "prefetch", "h2d", "ceiling write", "ceiling rewrite", "ceiling read"]
    rows = {s: (g, r, c) for s, g, r, c in rep.rows()}
    assert rows["d2h"][1] == 1.0 and all(g > 0 for g, _, _ in rows.values())
    assert rows["backup"][2] is not None and rows["prefetch"][2] is not None
    text = format_report(rep)
    assert "x d2h" in text and "x ceiling" in text and "restored bytes equal: yes" in text
    assert rep.as_dict()["steps"][1]["step"] == "backup"


def test_verification_bench_reads_back_what_it_stored(tmp_path):
    cost = measure("file", {"root": str(tmp_path / "root")}, page_bytes=64 << 10, pages=16, rounds=2)
    assert cost.store_s > 0 and cost.bare_s > 0 and cost.unverified_s > 0
    assert "unverified" in cost.row() and "the core over the bare hook" in cost.row()
    assert "% of page_get" in cost.row()
    # the one-thread run: at least 2 MiB of records (all 16 pages here), read plain and read and checked
    assert cost.run_pages == 16 and cost.run_read_s > 0 and cost.run_checked_s > 0
    assert "run of 16 pages" in cost.row() and "floor" in cost.row()


def test_the_unverified_variant_is_the_store_call_without_the_check(tmp_path):
    """``unverified`` is the same Store.page_get with only the check left out: it reads through the
    core's threads as the verified call does (the pages come back), a rotten page comes back OK from
    it and CORRUPT from the real store, and a store whose verifier was swapped verifies again after."""
    import os

    from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store, make_key
    from hicache_draft.bench.verification import _Unverified

    ns = "ef" * 12
    store = Store.open("file", {"root": str(tmp_path / "root")})
    try:
        data = [os.urandom(64 << 10) for _ in range(4)]
        groups = [f"{i:064x}" for i in range(4)]
        pages = [Page(make_key(g, ns), g, ns, (Buffer.of(bytearray(d)),)) for g, d in zip(groups, data, strict=True)]
        assert store.page_set([PageTransfer(PoolKind.KV, pages)])[PoolKind.KV] == [PageResult.OK] * 4
        seg = max((p for p in (tmp_path / "root").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        blob = bytearray(seg.read_bytes())
        at = blob.find(data[2][:64])
        blob[at + 1000] ^= 0xFF  # page 2's payload rots on disk
        seg.write_bytes(bytes(blob))

        def read() -> tuple[list[PageResult], list[bytes]]:
            into = [Page(p.key, p.group, ns, (Buffer.of(bytearray(64 << 10)),)) for p in pages]
            got, _ = store.page_get([PageTransfer(PoolKind.KV, into)])
            return got[PoolKind.KV], [bytes(p.buffers[0].view()) for p in into]

        store._verifier = _Unverified
        results, read_back = read()
        assert results == [PageResult.OK] * 4 and read_back[:2] == data[:2] and read_back[2] != data[2]
        del store._verifier
        results, read_back = read()
        assert results == [PageResult.OK, PageResult.OK, PageResult.CORRUPT, PageResult.OK]
    finally:
        store.close()


def test_verification_bench_runs_every_read_as_the_store_runs_calls(tmp_path, monkeypatch):
    """The verified, the unverified and the bare read all run on the store's worker threads: the
    bounded call's hand-over is paid by each, so it is never counted as verification (it ran the
    bare hook in the caller's thread once, which counted the hand-over as verification)."""
    import threading

    from hicache_draft.bench import verification
    from hicache_draft.hookspecs import hookimpl
    from hicache_draft.store import Store

    threads: list[str] = []

    class Spy:
        @hookimpl(wrapper=True)
        def page_get(self, transfers):
            threads.append(threading.current_thread().name)
            return (yield)

    real = Store.open
    monkeypatch.setattr(verification.Store, "open",
                        lambda name, options=None, context=None: real(name, options, context, observers=[Spy()]))
    measure("file", {"root": str(tmp_path / "root")}, page_bytes=16 << 10, pages=4, rounds=2)
    assert len(threads) == 6, threads
    assert all(name.startswith("hicache-draft-file") for name in threads), threads


def test_bench_commands_print_their_ratios(tmp_path):
    from click.testing import CliRunner

    from hicache_draft.cli import main

    out = CliRunner().invoke(main, ["bench", "pipeline", "--quick", "--pages", "8", "--root", str(tmp_path),
                                    "--threads", "2"])
    assert out.exit_code == 0, out.output
    assert "x d2h" in out.output and "backup" in out.output and "restored bytes equal: yes" in out.output
    out = CliRunner().invoke(main, ["bench", "verify", "--page-kib", "16", "--pages", "8", "--rounds", "1"])
    assert out.exit_code == 0, out.output
    assert "% of page_get" in out.output and "hash alone" in out.output and "floor" in out.output
    bad = CliRunner().invoke(main, ["bench", "verify", "--option", "nonsense"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output


def test_the_ceiling_moves_the_pages_own_bytes_from_and_into_their_memory(tmp_path, monkeypatch):
    """The pipeline's filesystem ceiling writes and reads every page once per pass, one call per
    page, straight from and into the page's own memory (not a reused buffer the CPU keeps cached),
    and the bytes come back as they were."""
    import ctypes
    import os

    from hicache_draft import Buffer
    from hicache_draft.bench import pipeline

    data = bytearray(os.urandom(7 * 3000))
    before = bytes(data)
    whole = Buffer.of(data)
    pages = [Buffer(whole.ptr + i * 3000, 3000, whole) for i in range(7)]
    calls: dict[str, list[tuple[int, int]]] = {"pwritev": [], "preadv": []}
    for name in calls:
        real = getattr(os, name)

        def spy(fd, views, off, _real=real, _name=name):
            calls[_name].extend((ctypes.addressof((ctypes.c_ubyte * v.nbytes).from_buffer(v)), v.nbytes) for v in views)
            return _real(fd, views, off)

        monkeypatch.setattr(os, name, spy)
    secs = pipeline._ceiling(tmp_path, pages, threads=3)
    assert len(secs) == 3 and all(s > 0 for s in secs)
    want = sorted((p.ptr, p.nbytes) for p in pages)
    assert sorted(calls["pwritev"]) == sorted(want * 2) and sorted(calls["preadv"]) == want
    assert bytes(data) == before and not list(tmp_path.iterdir())  # its files are removed
