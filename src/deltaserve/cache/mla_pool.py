"""Paged MLA latent storage: one `[num_pages, page_size // dcp_world, R + Dr]` tensor per MLA layer.

Pages are ref-counted so that the prefix cache can later share full pages between requests.
Invariant: a page is on the free list iff its refcount is 0; page ids are 0..num_pages-1.
Under decode context parallelism (`dcp_world` D > 1) a page still covers `page_size` token
positions (page ids are equal on every rank of a DCP group), but this rank stores only the
positions t with t % D == its DCP rank: position t of the page sits at local row (t % S) // D.
"""

from __future__ import annotations

from collections import deque

import torch


class OutOfPages(RuntimeError):
    """Raised by `allocate` when fewer pages are free than requested (nothing is taken)."""


def _rows_per_page(page_size: int, dcp_world: int) -> int:
    if dcp_world < 1 or page_size % dcp_world:
        raise ValueError(f"page_size {page_size} must be a multiple of the decode-context-parallel size {dcp_world}")
    return page_size // dcp_world


class MlaPagePool:
    def __init__(
        self,
        layer_ids: list[int],
        num_pages: int,
        page_size: int,
        row_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dcp_world: int = 1,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError("MlaPagePool needs at least one page of at least one token")
        self.layer_ids = list(layer_ids)
        self.num_pages, self.page_size, self.row_dim = num_pages, page_size, row_dim
        self.dcp_world = dcp_world
        self.rows_per_page = _rows_per_page(page_size, dcp_world)
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.storage = torch.zeros(
            len(self.layer_ids), num_pages, self.rows_per_page, row_dim, dtype=dtype, device=device
        )
        self._rows = [layer.view(-1, row_dim) for layer in self.storage]  # made once: a step asks per layer
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self.journal = None  # a `SlotJournal` recording page copies for other ranks to replay

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, row_dim: int, dtype: torch.dtype, dcp_world: int = 1) -> int:
        """Bytes one page takes on one rank (1/dcp_world of the page's rows)."""
        return num_layers * _rows_per_page(page_size, dcp_world) * row_dim * dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def rows(self, layer_id: int) -> torch.Tensor:
        """Flat `[num_pages * rows_per_page, R + Dr]` view of one layer; row = page * rows_per_page + local row."""
        return self._rows[self._index[layer_id]]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's rows of page `src` into page `dst` (recorded, if any)."""
        self.storage[:, dst].copy_(self.storage[:, src])
        if self.journal is not None:
            self.journal.copy_page(src, dst)

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise RuntimeError(f"incref of free page {p}")
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise RuntimeError(f"release of free page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """`expected_refs[page]` = number of owners; every other page must be free."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("MLA free list holds a page twice")
        for p in range(self.num_pages):
            want = expected_refs.get(p, 0)
            if self.refcount[p] != want:
                raise AssertionError(f"MLA page {p}: refcount {self.refcount[p]}, owners {want}")
            if (want == 0) != (p in free):
                raise AssertionError(f"MLA page {p}: free-list membership disagrees with refcount")
