"""Page hashes and key namespaces: stable, collision-free, and isolating."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import Attention, Layout, PoolKind, hex_names_ok, make_key, page_hashes
from hicache_draft.keys import pool_identities

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)


def test_hash_is_chained_sha256_over_uint32_le():
    h = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    first = hashlib.sha256((1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (3).to_bytes(4, "little")
                           + (4).to_bytes(4, "little")).digest()
    second = hashlib.sha256(first + b"".join(i.to_bytes(4, "little") for i in (5, 6, 7, 8))).hexdigest()
    assert h == [first.hex(), second]
    assert page_hashes([1, 2, 3, 4, 5], 4) == h[:1]  # trailing partial page ignored


@given(tokens, st.integers(min_value=1, max_value=8))
def test_prior_continues_the_chain(toks, ps):
    full = page_hashes(toks, ps)
    if len(full) >= 2:
        cut = ps * (len(full) // 2)
        assert page_hashes(toks[:cut], ps) + page_hashes(toks[cut:], ps, prior=full[len(full) // 2 - 1]) == full


def test_hash_is_the_same_in_another_process_with_another_hashseed():
    code = "from hicache_draft import page_hashes; print(page_hashes(list(range(32)), 8)[-1])"
    outs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {page_hashes(list(range(32)), 8)[-1]}


def test_bad_token_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="uint32"):
        page_hashes([1, -1], 2)


dims = st.fixed_dictionaries(
    {
        "pool": st.sampled_from(list(PoolKind)),
        "model": st.sampled_from(["a", "b", "a@rev2"]),
        "dtype": st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]),
        "attention": st.sampled_from(list(Attention)),
        "page_size": st.sampled_from([16, 32, 64]),
        "layers": st.sampled_from([1, 2, 61]),
        "layout": st.sampled_from([Layout.PAGE_FIRST, Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT]),
        "kv_heads": st.sampled_from([4, 8]),
        "head_dim": st.sampled_from([64, 128]),
        "latent_dim": st.sampled_from([512, 576]),
        "tp": st.sampled_from([(0, 1), (0, 2), (1, 2), (3, 4)]),
        "pp": st.sampled_from([(0, 1), (1, 2)]),
    }
)


def _ident(d):
    return pool_identities(
        pool=d["pool"], model=d["model"], dtype=d["dtype"], attention=d["attention"], page_size=d["page_size"],
        layers=d["layers"], layout=d["layout"], kv_heads=d["kv_heads"], head_dim=d["head_dim"],
        latent_dim=d["latent_dim"], tp_rank=d["tp"][0], tp_size=d["tp"][1], pp_rank=d["pp"][0], pp_size=d["pp"][1],
        tp_lcm_size=None, target_model=d.get("target", "target-model"),
    )[0]


@given(dims, dims)
def test_distinct_identities_never_share_a_namespace(a, b):
    ia, ib = _ident(a), _ident(b)
    assert (ia == ib) == (ia.fingerprint() == ib.fingerprint())


@given(dims)
def test_draft_keys_never_equal_target_keys(d):
    h = page_hashes(list(range(16)), 16)[0]
    t = _ident({**d, "pool": PoolKind.KV})
    dr = _ident({**d, "pool": PoolKind.DRAFT})
    assert make_key(h, t.fingerprint()) != make_key(h, dr.fingerprint())


@given(dims, st.sampled_from(["model", "dtype", "page_size"]))
def test_reader_with_other_model_dtype_or_page_size_never_sees_writer(d, dim):
    other = {"model": "zzz", "dtype": "float32", "page_size": 128}[dim]
    assert _ident(d).fingerprint() != _ident({**d, dim: other}).fingerprint()


@given(dims)
def test_mla_keys_are_rank_neutral_and_mha_keys_are_not(d):
    a = _ident({**d, "tp": (0, 2)})
    b = _ident({**d, "tp": (1, 2)})
    if d["attention"] is Attention.MLA:
        assert a.fingerprint() == b.fingerprint()
    else:
        assert a.fingerprint() != b.fingerprint()


def test_split_heads_tp2_and_tp4_share_head_groups():
    common = dict(pool=PoolKind.KV, model="m", dtype="bfloat16", attention=Attention.MHA, page_size=16, layers=2,
                  layout=Layout.PAGE_HEAD, head_dim=64, latent_dim=None, pp_rank=0, pp_size=1, tp_lcm_size=4)
    tp2 = [i.fingerprint() for r in range(2) for i in pool_identities(**common, kv_heads=4, tp_rank=r, tp_size=2)]
    tp4 = [i.fingerprint() for r in range(4) for i in pool_identities(**common, kv_heads=2, tp_rank=r, tp_size=4)]
    assert tp2 == tp4
    assert len(set(tp4)) == 4


_HEXISH = st.text(alphabet="0123456789abcdefABCDEF.g \x00é", max_size=70)


@given(st.lists(st.one_of(_HEXISH, st.text(max_size=8), st.integers(), st.none(), st.binary(max_size=4)), max_size=8))
def test_lower_hex_is_the_page_hash_rule(keys):
    """``_native.lower_hex`` (the adapter's one-pass check of a batch of SGLang page hashes) says
    what the rule says: every key a non-empty str of lowercase hex digits."""
    from hicache_draft import _native

    want = all(isinstance(k, str) and k != "" and set(k) <= set("0123456789abcdef") for k in keys)
    assert _native.lower_hex(keys) is want
    assert _native.lower_hex(tuple(keys)) is want


def test_lower_hex_checks_every_byte_of_long_keys():
    """One bad character anywhere in a long key (past any vector width) fails the batch."""
    from hicache_draft import _native

    good = "0123456789abcdef" * 16
    assert _native.lower_hex([good] * 3)
    for pos in (0, 15, 16, 31, 63, 64, 200, 255):
        bad = good[:pos] + "g" + good[pos + 1:]
        assert not _native.lower_hex([good, bad, good]), pos
    with pytest.raises(TypeError):
        _native.lower_hex(5)  # not a sequence of keys


_HEX = "0123456789abcdef"
_name = st.one_of(
    st.text(max_size=40), st.text(_HEX + ".", max_size=40), st.text(_HEX + ".\n\x00A/é", max_size=40),
    st.integers(), st.none(), st.binary(max_size=8),
)


def _oracle(names: list[object], left_max: int, right_max: int) -> bool:
    """The rule written as a regex, one name at a time: the independent statement of what the
    compiled check must answer."""
    one = rf"[0-9a-f]{{1,{left_max}}}" + (rf"\.[0-9a-f]{{1,{right_max}}}" if right_max else "")
    return bool(names) and all(isinstance(n, str) and re.fullmatch(one, n) is not None for n in names)


@given(st.lists(_name, max_size=5), st.integers(1, 12), st.integers(0, 12))
@settings(max_examples=600, deadline=None)
def test_hex_names_ok_agrees_with_the_rule_as_a_regex(names: list[object], left_max: int, right_max: int) -> None:
    assert hex_names_ok(names, left_max, right_max) is _oracle(names, left_max, right_max)


def test_hex_names_ok_bounds_and_refusals() -> None:
    assert hex_names_ok(["a" * 128 + "." + "b" * 126], 128, 126)
    assert not hex_names_ok(["a" * 129 + "." + "b"], 128, 126)
    assert not hex_names_ok(["a." + "b" * 127], 128, 126)
    assert not hex_names_ok(["ab.cd\n"], 128, 126) and not hex_names_ok(["ab\x00"], 128)
    assert not hex_names_ok(["a.b"], 128) and not hex_names_ok(["a.b.c"], 128, 126) and not hex_names_ok([], 4)
    assert hex_names_ok(("ab", "cd"), 2) and hex_names_ok(iter(["ab"]), 2)  # any iterable of names
    with pytest.raises(ValueError, match="left_max"):
        hex_names_ok(["a"], 0)
