"""Split heads: a tp_size=2 writer with tp_lcm_size=4 (two head groups per rank, page_head layout)
and a tp_size=4 reader share pages head group for head group."""

from hicache_draft import Layout, PageResult, PoolKind

from .conftest import make_rig


def test_tp2_writer_and_tp4_reader_share_head_groups(open_store, new_groups):
    store = open_store()
    assert store.capabilities.split_heads
    g = new_groups(3)
    writers = [make_rig(layout=Layout.PAGE_HEAD, kv_heads=4, tp_rank=r, tp_size=2, tp_lcm_size=4) for r in range(2)]
    for w in writers:
        assert w.split == 2 and len(set(w.namespaces)) == 2
        w.fill_random()
        store.register_pool(w.registration())
        pages = [p for part in range(2) for p in w.pages(g, [0, 1, 2], part)]
        assert store.page_set([w.transfer(pages)])[PoolKind.KV] == [PageResult.OK] * 6
    readers = [make_rig(layout=Layout.PAGE_HEAD, kv_heads=2, tp_rank=r, tp_size=4, tp_lcm_size=4) for r in range(4)]
    for q, rd in enumerate(readers):
        assert rd.namespaces == [writers[q // 2].namespaces[q % 2]]
        store.register_pool(rd.registration())
        got, _ = store.page_get([rd.transfer(rd.pages(g, [5, 6, 7]))])
        assert got[PoolKind.KV] == [PageResult.OK] * 3
        for src, dst in ((0, 5), (1, 6), (2, 7)):
            assert rd.page_bytes(dst) == writers[q // 2].page_bytes(src, part=q % 2)
    # a reader without split heads (tp_size=4, no tp_lcm_size) names other keys: nothing is shared
    plain = make_rig(layout=Layout.PAGE_HEAD, kv_heads=2, tp_rank=0, tp_size=4)
    got, _ = store.page_get([plain.transfer(plain.pages(g, [0, 1, 2]))])
    assert plain.namespaces != readers[0].namespaces or got[PoolKind.KV] == [PageResult.OK] * 3
