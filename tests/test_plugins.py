"""Discovery, validation and selection of backend plugins."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import EntryPoint
from typing import ClassVar

import pytest
from click.testing import CliRunner

import hicache_draft.plugins as plugins_mod
from hicache_draft import (
    Attention,
    Buffer,
    Capabilities,
    Page,
    PageResult,
    PageTransfer,
    PluginError,
    PoolCapability,
    PoolKind,
    StorageBackend,
    Store,
    UnknownBackendError,
    discover_backends,
    get_backend,
    hookimpl,
    register_backend,
    unregister_backend,
)
from hicache_draft.cli import main as cli_main
from hicache_draft.metrics import CallTimer
from hicache_draft.testing import MemoryBackend
from tests.helpers import fake_distribution

CAPS = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset({Attention.MHA}))})


class Throwaway(StorageBackend):
    api_version = 2
    capabilities: ClassVar[Capabilities] = CAPS

    @hookimpl
    def page_set(self, transfers):
        return {t.pool: [True] * len(t.pages) for t in transfers}

    @hookimpl
    def page_get(self, transfers):
        return {t.pool: [1] * len(t.pages) for t in transfers}  # MISS as an int

    @hookimpl
    def page_exists(self, queries):
        return {p: 0 for p in queries}


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the entry points of the backends group with the given ones, and refresh discovery."""
    installed: list[EntryPoint] = []

    def fake(group=None, **kw):
        assert group == plugins_mod.ENTRY_POINT_GROUP
        return list(installed)

    monkeypatch.setattr(plugins_mod, "entry_points", fake)
    yield installed
    monkeypatch.undo()
    discover_backends(refresh=True)


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=plugins_mod.ENTRY_POINT_GROUP)


def test_throwaway_plugin_registered_then_removed():
    register_backend("throwaway", Throwaway)
    try:
        info = get_backend("throwaway")
        assert info.ok and info.capabilities == CAPS
        with Store.open("throwaway") as store:
            assert store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
    finally:
        unregister_backend("throwaway")
    with pytest.raises(UnknownBackendError):
        get_backend("throwaway")


def test_misspelt_argument_is_refused_by_name():
    class Misspelt(Throwaway):
        @hookimpl
        def page_set(self, transfer):  # should be "transfers"
            return {}

    with pytest.raises(PluginError, match=r"(?s)misspelt.*transfer"):
        register_backend("misspelt", Misspelt)


def test_unknown_hook_is_refused():
    class UnknownHook(Throwaway):
        @hookimpl
        def page_sett(self, transfers):
            return {}

    with pytest.raises(PluginError, match="page_sett"):
        register_backend("unknownhook", UnknownHook)


def test_incompatible_api_version_refused_with_reason():
    class Future(Throwaway):
        api_version = 99

    with pytest.raises(PluginError, match=r"'future'.*version 99"):
        register_backend("future", Future)


def test_invalid_capabilities_refused():
    class NoKv(Throwaway):
        capabilities = {"pools": {"draft": {"attention": ["mha"]}}}  # type: ignore[assignment]

    with pytest.raises(PluginError, match="kv"):
        register_backend("nokv", NoKv)


def test_missing_required_hook_refused():
    class NoExists(StorageBackend):
        api_version = 2
        capabilities = CAPS

        @hookimpl
        def page_set(self, transfers):
            return {}

        @hookimpl
        def page_get(self, transfers):
            return {}

    with pytest.raises(PluginError, match="page_exists"):
        register_backend("noexists", NoExists)


def test_broken_plugin_is_reported_and_others_still_load(fake_entry_points):
    fake_entry_points += [
        _ep("good", "hicache_draft.testing.memory:MemoryBackend"),
        _ep("broken", "hicache_draft_does_not_exist.module:Backend"),
        _ep("notaclass", "hicache_draft.testing.memory:all_layouts"),
    ]
    found = discover_backends(refresh=True)
    assert found["good"].ok
    assert "import of" in (found["broken"].error or "")
    assert "must name a class" in (found["notaclass"].error or "")
    with pytest.raises(PluginError, match="broken"):
        get_backend("broken")


def test_unknown_backend_lists_installed(fake_entry_points):
    fake_entry_points.append(_ep("good", "hicache_draft.testing.memory:MemoryBackend"))
    discover_backends(refresh=True)
    with pytest.raises(UnknownBackendError, match=r"'nope'.*installed backends: good") as err:
        get_backend("nope")
    assert err.value.field == "backend"


def test_allow_and_block_lists(fake_entry_points, monkeypatch):
    fake_entry_points += [
        _ep("a", "hicache_draft.testing.memory:MemoryBackend"),
        _ep("b", "hicache_draft.testing.memory:MemoryBackend"),
    ]
    monkeypatch.setenv("HICACHE_DRAFT_LOAD_PLUGINS", "a")
    assert set(discover_backends(refresh=True)) == {"a"}
    monkeypatch.delenv("HICACHE_DRAFT_LOAD_PLUGINS")
    monkeypatch.setenv("HICACHE_DRAFT_DISABLE_PLUGINS", "b")
    found = discover_backends(refresh=True)
    assert found["a"].ok and not found["b"].ok
    assert "HICACHE_DRAFT_DISABLE_PLUGINS" in (found["b"].error or "")


def test_discovery_is_idempotent(fake_entry_points):
    fake_entry_points.append(_ep("a", "hicache_draft.testing.memory:MemoryBackend"))
    first = discover_backends(refresh=True)
    second = discover_backends()
    assert first.keys() == second.keys()
    assert first["a"] is second["a"]
    assert json.dumps([i.as_dict() for i in second.values()])


def test_observer_wrapper_sees_calls_without_backend_knowing():
    timer = CallTimer()
    MemoryBackend.reset()
    store = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": "obs"}, observers=[timer])
    try:
        store.page_exists({PoolKind.KV: ["x.y", "z.w"]})
        store.page_set([])
    finally:
        store.close()
        MemoryBackend.reset()
    assert timer.calls == {"page_exists": 1}
    assert timer.pages["page_exists"] == 2


def test_backend_exceptions_and_bad_results_become_failures():
    class Raising(Throwaway):
        @hookimpl
        def page_exists(self, queries):
            raise OSError("disk on fire")

        @hookimpl
        def page_set(self, transfers):
            return {t.pool: [] for t in transfers}  # wrong length

    register_backend("raising", Raising)
    try:
        with Store.open("raising") as store:
            assert store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
            buf = bytearray(8)
            page = Page(key="a.b", group="a", namespace="b", buffers=(Buffer.of(buf),))
            assert store.page_set([PageTransfer(PoolKind.KV, [page])]) == {PoolKind.KV: [PageResult.FAILED]}
    finally:
        unregister_backend("raising")


# -- real entry points of throwaway distributions ---------------------------------------------------

GOOD_MODULE = """
from hicache_draft.testing.memory import MemoryBackend

class Good(MemoryBackend):
    pass
"""

DEFAULT_MODULE = """
from typing import ClassVar
from hicache_draft.testing.memory import MemoryBackend

class Default(MemoryBackend):
    default: ClassVar[bool] = True
"""


@pytest.fixture
def dists(tmp_path, monkeypatch):
    """Write throwaway installed distributions onto a fresh ``sys.path`` entry; discovery refreshed."""
    import sys

    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    written: list[str] = []

    def add(name, eps, modules):
        fake_distribution(root, name, {plugins_mod.ENTRY_POINT_GROUP: eps}, modules)
        written.extend(modules)

    yield add
    monkeypatch.undo()
    for module in written:
        sys.modules.pop(module, None)
    discover_backends(refresh=True)


def test_a_plugin_that_raises_anything_at_import_or_validation_breaks_only_itself(dists, tmp_path):
    dists("hicache-draft-exits", {"exits": "hcd_exits:Backend"}, {"hcd_exits": "raise SystemExit(3)\n"})
    dists("hicache-draft-cancels", {"cancels": "hcd_cancels:Backend"},
          {"hcd_cancels": "import asyncio\nraise asyncio.CancelledError()\n"})
    dists("hicache-draft-exits-late", {"exitslate": "hcd_exits_late:Backend"}, {"hcd_exits_late": """
        from hicache_draft.testing.memory import MemoryBackend

        class _Meta(type):
            @property
            def capabilities(cls):
                raise SystemExit("validation exits")

        class Backend(MemoryBackend, metaclass=_Meta):
            pass
    """})
    dists("hicache-draft-good", {"good": "hcd_good:Good"}, {"hcd_good": GOOD_MODULE})
    found = discover_backends(refresh=True)
    assert "SystemExit" in found["exits"].error and "import of 'hcd_exits:Backend'" in found["exits"].error
    assert "CancelledError" in found["cancels"].error
    assert "SystemExit: validation exits" in found["exitslate"].error
    assert found["good"].ok and found["file"].ok
    res = CliRunner().invoke(cli_main, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["exits"]["distribution"] == "hicache-draft-exits" and "SystemExit" in rows["exits"]["error"]
    assert rows["good"]["error"] is None
    cfg = tmp_path / "c.toml"
    cfg.write_text('backend = "good"\n[backend_options]\nspace = "x"\n[namespace]\nmodel = "m"\n'
                   '[target]\nkv_heads = 1\nhead_dim = 8\n')
    assert CliRunner().invoke(cli_main, ["check", str(cfg)]).exit_code == 0
    with Store.open("good", {"space": "exits"}) as store:
        assert store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
    with pytest.raises(PluginError, match="SystemExit"):
        Store.open("exits")


def test_a_name_published_by_two_distributions_is_refused_naming_both(dists):
    dists("hicache-draft-dup-one", {"dup": "hcd_dup_one:Good"}, {"hcd_dup_one": GOOD_MODULE})
    dists("hicache-draft-dup-two", {"dup": "hcd_dup_two:Good"}, {"hcd_dup_two": GOOD_MODULE})
    info = discover_backends(refresh=True)["dup"]
    assert not info.ok
    for who in ("hicache-draft-dup-one 1.0 (hcd_dup_one:Good)", "hicache-draft-dup-two 1.0 (hcd_dup_two:Good)"):
        assert who in info.error
    with pytest.raises(PluginError, match=r"(?s)'dup'.*hicache-draft-dup-one.*hicache-draft-dup-two"):
        get_backend("dup")
    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(cli_main, ["backends", "--json"]).stdout)}
    assert "2 distributions" in rows["dup"]["error"]


def test_unknown_backend_suggests_the_closest_installed_name_and_invents_no_package():
    register_backend("memory", MemoryBackend)
    try:
        with pytest.raises(UnknownBackendError) as err:
            get_backend("memroy")
        msg = str(err.value)
        assert "did you mean 'memory'?" in msg and "installed backends:" in msg and "file" in msg
        assert "pip install" not in msg and "hicache-draft-memroy" not in msg
        with pytest.raises(UnknownBackendError) as far:
            get_backend("zzzzzz")
        assert "did you mean" not in str(far.value) and "pip install" not in str(far.value)
    finally:
        unregister_backend("memory")


def test_the_default_backend_is_the_one_that_declares_itself_default(dists, monkeypatch):
    assert get_backend().name == "file"  # the file plugin declares itself; the core names no backend
    dists("hicache-draft-other-default", {"otherdefault": "hcd_other_default:Default"},
          {"hcd_other_default": DEFAULT_MODULE})
    dists("hicache-draft-good", {"good": "hcd_good:Good"}, {"hcd_good": GOOD_MODULE})
    monkeypatch.setenv("HICACHE_DRAFT_DISABLE_PLUGINS", "file")
    discover_backends(refresh=True)
    assert get_backend().name == "otherdefault"
    with Store.open(None, {"space": "default"}) as store:
        assert store.name == "otherdefault"
    monkeypatch.delenv("HICACHE_DRAFT_DISABLE_PLUGINS")
    discover_backends(refresh=True)
    both = r"2 installed backends declare themselves the default: 'file' \(hicache-draft-file [^)]*\), "
    with pytest.raises(PluginError, match=both + r"'otherdefault' \(hicache-draft-other-default"):
        get_backend()
    monkeypatch.setenv("HICACHE_DRAFT_LOAD_PLUGINS", "good")
    discover_backends(refresh=True)
    with pytest.raises(UnknownBackendError, match=r"no installed backend declares itself the default; install "
                                                  r"the embedded default \(pip install hicache-draft-file\)"):
        get_backend()


PROBE = '''
import sys

def test_nothing_of_the_kit_is_loaded(request):
    loaded = sorted(m for m in sys.modules if m.startswith("hicache_draft.testing"))
    names = [n for n, p in request.config.pluginmanager.list_name_plugin()
             if n == "hicache_draft" or "hicache_draft.testing" in str(getattr(p, "__name__", n))]
    assert not loaded and not names, (loaded, names)
'''

USES_KIT = '''
from hicache_draft import PoolKind

def test_fixture_of_the_kit(hicache_memory_store):
    assert hicache_memory_store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
'''


def _pytest(where, *args):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=where, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_kit_is_opt_in_like_pytester(tmp_path):
    """A pytest run of another project in this environment loads none of the kit; asking for it
    (``-p`` or ``pytest_plugins``) gives its fixtures."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "pytest.ini").write_text("[pytest]\n")
    (other / "test_probe.py").write_text(PROBE)
    (other / "test_uses_kit.py").write_text(USES_KIT)
    code, out = _pytest(other, "test_probe.py", "test_uses_kit.py")
    assert code != 0 and "1 passed" in out and "fixture 'hicache_memory_store' not found" in out, out
    code, out = _pytest(other, "-p", "hicache_draft.testing.plugin", "test_uses_kit.py")
    assert code == 0, out
    (other / "conftest.py").write_text('pytest_plugins = ["hicache_draft.testing.plugin"]\n')
    code, out = _pytest(other, "test_uses_kit.py")
    assert code == 0, out


def test_every_hook_is_documented_in_the_readme_with_its_arguments():
    """In the style of datasette's hook documentation test: the README's hook table names every
    hookspec of the contract, each with exactly its arguments, in order."""
    import inspect
    import re
    from pathlib import Path

    from hicache_draft import hookspecs

    specs = {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
    }
    assert {"page_set", "page_get", "page_exists", "host_memory", "call_done"} <= set(specs)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| hook | what it does |"):]
    table = table[: table.index("\n\n")]
    documented = {
        m.group(1): [a.strip() for a in m.group(2).split(",") if a.strip()]
        for m in re.finditer(r"^\| `(\w+)\(([^)]*)\)` \|", table, flags=re.M)
    }
    assert documented == specs


def test_a_hook_argument_with_a_default_is_refused_at_registration() -> None:
    """pluggy passes an argument that has a default to a hook implementation only from 1.6 on: on
    older releases such a hook silently runs without it (the file backend's read_records and
    write_records were never passed on the GPU host's pluggy). Registration refuses it, naming it."""

    class Defaulted(MemoryBackend):
        @hookimpl
        def page_get(self, transfers, deadline, finished=None):  # noqa: ANN001, ANN201
            return super().page_get(transfers)

    with pytest.raises(PluginError, match=r"hook page_get gives argument\(s\) finished a default"):
        register_backend("defaulted", Defaulted)
    for name in ("file", "mooncake", "hf3fs", "sqlite"):  # the installed backends pass
        assert get_backend(name).ok
