"""Test doubles shaped like SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``).

SGLang's real classes need CUDA-side buffer infos and kernels; these carry the same attributes
(``kv_buffer``, ``layout``, ``page_size``, ``layer_num``, ``head_num``/``head_dim`` or
``kv_lora_rank``/``qk_rope_head_dim``/``kv_cache_dim``, ``dtype``, ``size``, ``page_num``) and the
same storage-facing methods (``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``), with the shapes and pointer rules of
SGLang 0.5.23. They are independent of :mod:`hicache_draft.pools` on purpose, so tests can check
that our views and SGLang's metadata agree. For adapter tests and for backend authors.
"""

from __future__ import annotations

import torch

from hicache_draft.transfer import Buffer

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class _HostPoolDouble:
    layout: str
    page_size: int
    layer_num: int
    dtype: torch.dtype
    size: int
    page_num: int
    kv_buffer: torch.Tensor

    def _setup(self, layout: str, page_size: int, num_pages: int, layer_num: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.page_size = page_size
        self.page_num = num_pages
        self.size = num_pages * page_size
        self.layer_num = layer_num
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False

    def _item(self) -> int:
        return self.dtype.itemsize

    def fill_random(self, generator: torch.Generator) -> None:
        """Random bytes everywhere (any dtype, NaN patterns included: tests compare bytes)."""
        raw = self.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))

    def page_bytes(self, index: int) -> bytes:
        """The bytes of ``get_data_page(index, flat=True)``."""
        flat = self.get_data_page(index, flat=True).contiguous().view(-1).view(torch.uint8)
        return bytes(Buffer(flat.data_ptr(), flat.numel(), owner=flat).view())

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError


class MHAHostPoolDouble(_HostPoolDouble):
    """Like SGLang's ``MHATokenToKVPoolHost`` (K and V halves in one ``kv_buffer``)."""

    def __init__(
        self,
        *,
        layer_num: int,
        head_num: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        layout: str = "page_first",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if layout not in MHA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {layout}")
        self._setup(layout, page_size, num_pages, layer_num, dtype)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        L, S, P, ps, H, D = layer_num, self.size, num_pages, page_size, head_num, head_dim
        dims = {
            "layer_first": (2, L, S, H, D),
            "page_first": (2, S, L, H, D),
            "page_first_direct": (2, P, L, ps, H, D),
            "page_head": (2, P, H, ps, L, D),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_size_per_token(self) -> int:
        return 2 * self.head_dim * self.head_num * self.layer_num * self._item()

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        ps = self.page_size
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + ps]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + ps]
        else:
            page = self.kv_buffer[:, index // ps : index // ps + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """K and V pointers per page: per layer (K, V interleaved) for ``layer_first``, else one
        K page and one V page; the V half starts ``layer_num * size * H * D`` items after K."""
        assert len(indices) % self.page_size == 0
        idx = indices.tolist()
        base, it = self.kv_buffer.data_ptr(), self._item()
        hd = self.head_num * self.head_dim
        v_offset = self.layer_num * self.size * hd * it
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for start in idx[:: self.page_size]:
                for layer in range(self.layer_num):
                    k = base + start * hd * it + layer * self.size * hd * it
                    ptrs += [k, k + v_offset]
            size = it * self.page_size * hd
        else:
            for start in idx[:: self.page_size]:
                k = base + start * self.layer_num * hd * it
                ptrs += [k, k + v_offset]
            size = self.layer_num * it * self.page_size * hd
        return ptrs, [size] * len(ptrs)

    def get_split_heads_page_buffer_meta(
        self, indices: torch.Tensor, split_factor: int
    ) -> tuple[list[int], list[int]]:
        """``page_head`` only: K and V pointers of each head group of each page."""
        assert self.layout == "page_head" and self.head_num % split_factor == 0
        idx = indices.tolist()
        base, it = self.kv_buffer.data_ptr(), self._item()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * it
        group = self.head_num // split_factor
        ptrs: list[int] = []
        for start in idx[:: self.page_size]:
            for head in range(0, self.head_num, group):
                k = (base + start * self.layer_num * self.head_num * self.head_dim * it
                     + head * self.page_size * self.layer_num * self.head_dim * it)
                ptrs += [k, k + v_offset]
        size = self.layer_num * it * self.page_size * self.head_num * self.head_dim // split_factor
        return ptrs, [size] * len(ptrs)


class MLAHostPoolDouble(_HostPoolDouble):
    """Like SGLang's ``MLATokenToKVPoolHost`` (one latent row per token and layer)."""

    def __init__(
        self,
        *,
        layer_num: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        page_size: int,
        num_pages: int,
        layout: str = "page_first",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if layout not in MLA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {layout}")
        self._setup(layout, page_size, num_pages, layer_num, dtype)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        L, S, P, ps, d = layer_num, self.size, num_pages, page_size, self.kv_cache_dim
        dims = {
            "layer_first": (L, S, 1, d),
            "page_first": (S, L, 1, d),
            "page_first_direct": (P, L, ps, 1, d),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_size_per_token(self) -> int:
        return self.kv_cache_dim * self._item() * self.layer_num

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        ps = self.page_size
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + ps]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + ps]
        else:
            page = self.kv_buffer[index // ps : index // ps + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """One pointer per layer per page for ``layer_first``, else one per page."""
        assert len(indices) % self.page_size == 0
        idx = indices.tolist()
        base, it, d = self.kv_buffer.data_ptr(), self._item(), self.kv_cache_dim
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for start in idx[:: self.page_size]:
                ptrs += [base + start * d * it + layer * self.size * d * it for layer in range(self.layer_num)]
            size = it * self.page_size * d
        else:
            ptrs = [base + start * self.layer_num * d * it for start in idx[:: self.page_size]]
            size = self.layer_num * it * self.page_size * d
        return ptrs, [size] * len(ptrs)
