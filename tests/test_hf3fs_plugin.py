"""The hf3fs stub: discovery, declaration, option validation, and an honest refusal to start."""

from __future__ import annotations

import string

import pytest
from hicache_draft_hf3fs import HF3FS_CAPABILITIES, Hf3fsBackend, Hf3fsOptions
from hypothesis import given
from hypothesis import strategies as st

from hicache_draft import (
    Attention,
    BackendContext,
    BackendSetupError,
    Buffer,
    Component,
    ConfigError,
    Layout,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    Store,
    discover_backends,
    get_backend,
)
from hicache_draft.plugins import validate_backend_class
from hicache_draft.store import validate_options

GOOD = {"mount_point": "/mnt/3fs", "namespace": "deepseek-v3"}


def test_discovered_through_its_entry_point_with_its_declaration():
    info = discover_backends(refresh=True)["hf3fs"]
    assert info.ok, info.error
    assert info.distribution == "hicache-draft-hf3fs"
    assert info.cls is Hf3fsBackend
    assert info.capabilities == HF3FS_CAPABILITIES
    assert validate_backend_class("hf3fs", Hf3fsBackend) == HF3FS_CAPABILITIES


def test_declaration_matches_what_3fs_supports():
    caps = HF3FS_CAPABILITIES
    kv, draft = caps.pools[PoolKind.KV], caps.pools[PoolKind.DRAFT]
    assert kv.attention == {Attention.MHA, Attention.MLA}
    assert draft.attention == {Attention.MLA}, "an MHA draft page (K+V) does not fit a 3FS slot sized for one buffer"
    assert kv.zero_copy_layouts == draft.zero_copy_layouts == {Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT}
    assert kv.max_buffers_per_page == 2  # K and V, each in its own slot
    assert draft.max_buffers_per_page == 1
    assert caps.split_heads is False
    # extra pools get one-buffer slots: target indexers fit; target windows (MHA K+V) and states do not
    assert kv.components == {Component.KV, Component.INDEXER}
    assert draft.components == set(Component)  # MLA only and one buffer per page, so windows are MLA
    summary = caps.summary()
    assert summary["pools"]["draft"]["attention"] == ["mla"]
    assert summary["pools"]["kv"]["max_buffers_per_page"] == 2


def test_valid_options_with_defaults():
    opts = validate_options("hf3fs", Hf3fsBackend, GOOD)
    assert isinstance(opts, Hf3fsOptions)
    assert (opts.mount_point, opts.namespace, opts.file_size_gib, opts.entries) == ("/mnt/3fs", "deepseek-v3", 64, 8)
    assert opts.metadata_server_url is None
    assert str(opts.root) == "/mnt/3fs/deepseek-v3"
    full = validate_options("hf3fs", Hf3fsBackend, {**GOOD, "mount_point": "/mnt/3fs/", "metadata_server_url":
                                                     "http://meta.local:18000", "file_size_gib": 8, "entries": 32})
    assert full.mount_point == "/mnt/3fs"
    assert full.metadata_server_url == "http://meta.local:18000"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"mount_point": "mnt/3fs"}, "mount_point", "absolute path"),
        ({"mount_point": "/mnt/../etc"}, "mount_point", "'..'"),
        ({"mount_point": "/"}, "mount_point", "not '/'"),
        ({"mount_point": "/mnt/\x003fs"}, "mount_point", "NUL"),
        ({"namespace": "a/b"}, "namespace", "pattern"),
        ({"namespace": ""}, "namespace", "pattern"),
        ({"namespace": "x" * 65}, "namespace", "pattern"),
        ({"file_size_gib": 0}, "file_size_gib", "greater than or equal to 1"),
        ({"entries": 0}, "entries", "greater than or equal to 1"),
        ({"metadata_server_url": "meta:18000"}, "metadata_server_url", "http://"),
        ({"metadata_server_url": "ftp://meta"}, "metadata_server_url", "http://"),
        ({"metadata_server_url": "http://"}, "metadata_server_url", "with a host"),
        ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
    ],
)
def test_bad_options_name_the_field(change, field, words):
    with pytest.raises(ConfigError) as err:
        validate_options("hf3fs", Hf3fsBackend, {**GOOD, **change})
    assert err.value.field == f"backend_options.{field}"
    assert f"backend_options.{field}" in str(err.value)
    assert "'hf3fs'" in str(err.value)
    assert words in str(err.value)


@pytest.mark.parametrize("missing", ["mount_point", "namespace"])
def test_mount_point_and_namespace_are_required(missing):
    opts = dict(GOOD)
    del opts[missing]
    with pytest.raises(ConfigError) as err:
        validate_options("hf3fs", Hf3fsBackend, opts)
    assert err.value.field == f"backend_options.{missing}"
    assert "Field required" in str(err.value)


@given(st.text(alphabet=string.ascii_letters + string.digits + "._-/ ", min_size=0, max_size=70))
def test_namespace_is_accepted_only_as_a_plain_directory_name(name):
    plain = (
        0 < len(name) <= 64 and name[0].isalnum() and all(c.isalnum() or c in "._-" for c in name)
    )
    try:
        validate_options("hf3fs", Hf3fsBackend, {**GOOD, "namespace": name})
    except ConfigError as exc:
        assert not plain, f"{name!r} refused: {exc}"
        assert exc.field == "backend_options.namespace"
    else:
        assert plain, f"{name!r} accepted"


@pytest.fixture
def usrbio_absent(monkeypatch):
    import hicache_draft_hf3fs.backend as mod

    real = mod.importlib.util.find_spec
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name, *a: None if name == mod.USRBIO_MODULE else real(
        name, *a))


def test_opening_it_fails_clearly_and_says_what_a_deployment_needs(tmp_path, usrbio_absent):
    with pytest.raises(BackendSetupError) as err:
        Store.open("hf3fs", {"mount_point": str(tmp_path), "namespace": "ns"})
    msg = str(err.value)
    assert "3FS I/O is not implemented" in msg
    assert "stub" in msg and "stores nothing" in msg
    assert "hf3fs-py-usrbio" in msg and "hf3fs_py_usrbio" in msg and "here: not installed" in msg
    assert repr(str(tmp_path)) in msg and "a directory, but not a mount point" in msg
    assert "metadata_server_url: none configured" in msg
    assert "hicache-draft check" in msg


def test_refusal_reports_a_missing_mount_and_the_metadata_service(monkeypatch):
    import hicache_draft_hf3fs.backend as mod

    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name, *a: object())  # as if the client were there
    opts = Hf3fsOptions(mount_point="/nonexistent/3fs-mount", namespace="ns", metadata_server_url="https://meta")
    with pytest.raises(BackendSetupError) as err:
        Hf3fsBackend(opts, BackendContext())
    assert "'/nonexistent/3fs-mount' (here: missing)" in str(err.value)
    assert "hf3fs_py_usrbio; here: installed" in str(err.value)
    assert "3FS I/O is not implemented" in str(err.value), "a present client does not make the stub store anything"
    assert "metadata_server_url: https://meta" in str(err.value)


def test_bad_options_are_refused_before_the_stub_message():
    with pytest.raises(ConfigError):
        Store.open("hf3fs", {"mount_point": "relative", "namespace": "ns"})


def test_hooks_never_report_anything_stored():
    backend = object.__new__(Hf3fsBackend)  # bypass the refusing constructor
    data = bytearray(b"\x01" * 32)
    page = Page(key="ab.cd", group="ab", namespace="cd", buffers=(Buffer.of(data),))
    transfers = [PageTransfer(PoolKind.KV, [page, page]), PageTransfer(PoolKind.DRAFT, [page])]
    assert backend.page_set(transfers) == {PoolKind.KV: [PageResult.FAILED] * 2, PoolKind.DRAFT: [PageResult.FAILED]}
    assert backend.page_get(transfers) == {PoolKind.KV: [PageResult.FAILED] * 2, PoolKind.DRAFT: [PageResult.FAILED]}
    assert backend.page_exists({PoolKind.KV: ["ab.cd"], PoolKind.DRAFT: []}) == {PoolKind.KV: 0, PoolKind.DRAFT: 0}
    assert data == bytearray(b"\x01" * 32)


def test_get_backend_returns_the_declaration_without_constructing():
    info = get_backend("hf3fs")
    assert info.cls is Hf3fsBackend and info.capabilities is HF3FS_CAPABILITIES
