"""The 3FS declaration, with the reason for every field (see the README for the sources).

* Target ``kv``: MHA and MLA. Zero-copy for ``page_first`` and ``page_first_direct``, where an MLA
  page is one contiguous region and an MHA page is two (K, V), each stored in its own fixed-size
  slot (SGLang keys them ``{hash}-k`` / ``{hash}-v``): hence ``max_buffers_per_page=2``.
  ``layer_first`` (2·L or L small regions per page) and ``page_head`` go through the generic path:
  the page is copied into one contiguous buffer and written to one slot sized for the whole page
  (SGLang's hf3fs sizes slots ``size_per_token * page_size`` for ``layer_first``).
* ``draft``: MLA only. 3FS page files have fixed slots, and a registered extra pool gets slots of
  ``ksize_per_token * page_size`` bytes: one buffer. An MLA page (ksize == size) fits; an MHA page
  is K plus V, twice the slot, so it cannot be stored at all (not zero-copy, not generic).
  Zero-copy pages must be a single buffer (``max_buffers_per_page=1``); the generic path copies an
  MLA page (also ``layer_first``) into one slot-sized buffer.
* Components. A pool other than the target ``kv`` is registered as an extra pool with its own
  file of one-buffer slots (``ksize_per_token * page_size``: the whole page wherever ksize ==
  size, as for MLA, indexer and state pages). Target role: ``kv`` and ``indexer`` (an indexer page
  in ``page_first`` / ``page_first_direct`` is one buffer of ``L * row`` bytes, zero-copy into one
  slot; ``layer_first`` is ``L`` rows, copied through staging into one buffer). ``window`` (SWA) and
  ``state`` (Mamba) are *not* declared for the target role: its ``max_buffers_per_page = 2`` (the
  K/V slots of the target pool) and its MHA attention would send an MHA window page (K plus V,
  twice a one-buffer slot) or a two-array state page (two buffers) zero-copy into a one-buffer
  slot. Draft role: every component, MLA only, one buffer per page: indexer and MLA window pages
  in ``page_first*`` are zero-copy, ``layer_first`` pages and state pages of several arrays (one
  buffer per array) go through the generic path into one slot-sized buffer.
* ``generic=True``: usrbio moves every byte through the backend's own registered Iov (shared,
  IB-registered memory), so a controller staging buffer is as good a source as the host pool.
* ``split_heads=False``: a page's head groups cannot be stored under their own keys.
* ``persistent=True``: pages live in 3FS files and the key-to-slot map in the metadata service.
* ``shared=True``: every rank and server mounts the same 3FS.
"""

from __future__ import annotations

from hicache_draft import Attention, Capabilities, Component, Layout, PoolCapability, PoolKind

ZERO_COPY_LAYOUTS = frozenset({Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT})

HF3FS_CAPABILITIES = Capabilities(
    pools={
        PoolKind.KV: PoolCapability(
            attention=frozenset({Attention.MHA, Attention.MLA}),
            components=frozenset({Component.KV, Component.INDEXER}),
            zero_copy_layouts=ZERO_COPY_LAYOUTS,
            generic=True,
            max_buffers_per_page=2,
            note="a 3FS target slot holds the K or the V half of a kv page, an extra pool's slot one buffer: "
            "no target window (SWA) or state (Mamba) pools",
        ),
        PoolKind.DRAFT: PoolCapability(
            attention=frozenset({Attention.MLA}),
            components=frozenset(Component),
            zero_copy_layouts=ZERO_COPY_LAYOUTS,
            generic=True,
            max_buffers_per_page=1,
            note="a 3FS draft slot holds one buffer; an MHA draft page is K plus V, twice the slot",
        ),
    },
    split_heads=False,
    persistent=True,
    shared=True,
)
