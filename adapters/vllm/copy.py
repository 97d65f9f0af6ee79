"""Copies between a worker's KV cache and page bytes, whole pages at a time.

A page is the concatenation of one block per layer, in page-layer order; layer ``i`` uses
the block table of its KV cache group, so a copy takes block ids per group
(``block_ids[group][k]`` for the page's ``k``-th row). ``NO_BLOCK`` leaves that layer's
part of the page alone (a sliding-window block outside the window, or a state-space
layer's block at a page boundary the request does not go on from: not loaded). Layers
may differ in bytes per block: a state-space layer's part is its state, without the
padding vLLM adds to make its blocks as large as an attention layer's.

On the CPU copies go through numpy views of the cache (measured 6x faster for 255 pages of
256 KiB than torch ``index_copy_`` through a staging tensor): pages read into a
:class:`RowBuffer` (the store decrypts straight into its rows) go in with one copy per layer
for all of a load's pages (:meth:`BlockCopier.scatter_rows`, :func:`copy_layer`), or for
each batch of them as the store reports it read, in a thread of the copier's that copies while
the store reads the next (:meth:`BlockCopier.feed`; numpy lets go of the GIL while it
copies), other
payloads (a load from the worker's RAM, a save) with one copy per page when the layers lie at
even steps from one another, as in vLLM's CPU cache (else one per page and layer) — a page a
tier keeps at a lower precision dequantized first into a page buffer reused page after page
(:attr:`BlockCopier.decodes`, CPU layouts only); on other devices torch ops do it. Pages on
their way in pass through a
:class:`~dss_adapters.staging.StagingPool`: on CUDA pinned host buffers, reused, copied with
``non_blocking=True`` on the pool's stream (so a copy in a background thread never waits
for, or holds up, the forward pass) and tracked by a CUDA event — :meth:`BlockCopier.start_scatter`
returns that :class:`~dss_adapters.staging.Transfer` at once, and the asynchronous loader
reports a load finished when it is done; on a CPU cache the numpy views (or, for a cache
they cannot take, the same staged path with plain memory) copy at once and the transfer is
done when it returns. The layer-by-layer CUDA path of synchronous loads and saves is
:mod:`dss_adapters.vllm.cuda`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

import numpy as np
import torch
from dss_adapters.dequantize import dequantize_into
from dss_adapters.staging import DONE, Staged, StagingPool, Transfer
from dss_adapters.vllm.formats import CPU_PAGE_FORMAT
from dss_adapters.vllm.meta import NO_BLOCK

import dss
from dss import ConfigError


def copy_layer(cache: np.ndarray, blocks: np.ndarray, part: np.ndarray) -> None:
    """One layer's bytes of a load's pages into their KV blocks, in one copy:
    ``cache[blocks[k]] = part[k]`` (``cache``: the layer's ``[num_blocks, layer_bytes]`` uint8
    view; ``part``: ``[pages, layer_bytes]``, a strided slice of the staged rows). The one
    place a conversion on the way in (dequantization, say) would go."""
    cache[blocks] = part


class RowBuffer:
    """A reusable host buffer of page rows that a load reads its pages into (grown to the
    largest load seen, so its memory is not faulted in again for every load). Not thread-safe:
    one per loading thread."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self._data = np.empty((0, page_bytes), dtype=np.uint8)

    def rows(self, count: int) -> np.ndarray:
        """``[count, page_bytes]`` uint8 rows (their previous contents unspecified)."""
        if len(self._data) < count:
            self._data = np.empty((count, self.page_bytes), dtype=np.uint8)
        return self._data[:count]


SPLIT_PAGES = 8
"""Pages from which :meth:`BlockCopier.scatter_split` shares the copies with a second thread
(``benchmarks/loadpath.py``: 128 pages of 720 KiB, 10.6 ms in one thread, 7.8 in two; not
measured for loads of a few pages, which are not worth handing over)."""


class BlockCopier:
    """Whole-page copies for one worker's layers (see the module docstring)."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        groups: Sequence[int],
        num_blocks: int,
        page_bytes: int,
        layout: dss.Layout | None = None,
    ) -> None:
        """``layers[i]``: layer ``i``'s KV cache with the block dimension first (blocks may lie
        further apart than their bytes, as vLLM pads a state-space layer's);
        ``groups[i]``: its KV cache group. ``ConfigError`` unless the layers' blocks add up
        to ``page_bytes``. ``layout``: the pages' layout; when it is one whose pages a tier
        can encode (vLLM's CPU backend) and the cache takes numpy views, encoded copies are
        dequantized on their way in (:attr:`decodes`)."""
        sizes = [t[0].numel() * t.element_size() for t in layers]
        if sum(sizes) != page_bytes:
            raise ConfigError(
                f"a KV block of all {len(layers)} layers has {sum(sizes)} bytes; the layout says {page_bytes}"
            )
        self.layers = list(layers)
        self.groups = list(groups)
        self.layer_sizes = sizes
        """Bytes of one block of each layer (a state-space layer's state, without vLLM's padding)."""
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.uniform = len(set(sizes)) == 1
        self.layer_bytes = sizes[0]
        """Bytes of one block of a layer, when :attr:`uniform` (the layer-by-layer CUDA path needs that)."""
        self.page_bytes = page_bytes
        self.device = layers[0].device
        self.host_views: list[np.ndarray] | None = None
        """Per layer, ``[num_blocks, layer_sizes[i]]`` uint8 numpy views of the KV cache (CPU only)."""
        if all(t.device.type == "cpu" and t[0].is_contiguous() for t in layers):
            self.host_views = [t.flatten(1).view(torch.uint8).numpy() for t in layers]
        self.stacked = _stacked(self.host_views, self.groups) if self.host_views is not None else None
        """``[layers, num_blocks, layer_bytes]`` uint8: every layer's blocks in one numpy view,
        when the layers lie at even steps from one another and share one block table (as in
        vLLM's CPU cache, one allocation): a page then goes in or out with one copy, not one
        per layer."""
        self.staging = StagingPool(self.device) if self.host_views is None else None
        """Host buffers of pages on their way in (pinned on CUDA); ``None`` with numpy views."""
        encodable = layout is not None and dict(layout.fields).get("format") == CPU_PAGE_FORMAT
        self.decodes: dss.Layout | None = layout if encodable and self.host_views is not None else None
        """The layout whose encoded copies :meth:`start_scatter` dequantizes (``None``: it
        copies exact pages only)."""
        self._buffers = threading.local()
        """Per thread (the engine's, the loader's): a page buffer and its float32 scratch."""
        self._feeder: tuple[int, ThreadPoolExecutor] | None = None
        """The copier's thread (:meth:`feed`, :meth:`scatter_split`), and the process that made it."""

    def gather(self, block_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """``[pages, page_bytes]`` uint8: the pages held in these blocks (none may be ``NO_BLOCK``)."""
        count = len(block_ids[0])
        out = np.empty((count, self.page_bytes), dtype=np.uint8)
        if self.stacked is not None:
            pages = out.reshape(count, len(self.layers), -1)
            for k, block in enumerate(block_ids[self.groups[0]]):
                pages[k] = self.stacked[:, block]
            return out
        for i, layer in enumerate(self.layers):
            start, end = self.offsets[i], self.offsets[i] + self.layer_sizes[i]
            blocks = block_ids[self.groups[i]]
            if self.host_views is not None:
                view = self.host_views[i]
                for k, block in enumerate(blocks):
                    out[k, start:end] = view[block]
                continue
            index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            out[:, start:end] = layer.index_select(0, index).reshape(count, -1).view(torch.uint8).cpu().numpy()
        return out

    def scatter(self, payloads: Sequence[bytes | memoryview], block_ids: Sequence[Sequence[int]]) -> None:
        """Write ``payloads[k]`` (every layer's bytes, in page-layer order) into the blocks
        ``block_ids[group][k]``; a layer whose block is ``NO_BLOCK`` is skipped. The copies are
        complete when it returns (:meth:`start_scatter`, then wait)."""
        self.start_scatter(payloads, block_ids).wait()

    def scatter_rows(self, rows: np.ndarray, block_ids: Sequence[Sequence[int]]) -> Transfer:
        """:meth:`start_scatter` of staged pages (``rows[k]`` goes to ``block_ids[group][k]``):
        with the layers :attr:`stacked`, one copy per page of all its layers; with other numpy
        views, one :func:`copy_layer` per layer for all the pages (a row plan made once per
        group); elsewhere through the staging pool. (Both numpy copies take the same time;
        only the first lets go of the GIL while it copies, which :meth:`feed` needs.)"""
        if self.stacked is not None:
            self._stack(rows, block_ids[self.groups[0]])
            return DONE
        if self.host_views is None:
            return self.start_scatter(list(rows), block_ids)
        plans = [_row_plan(group) for group in block_ids]
        for i, view in enumerate(self.host_views):
            keep, blocks = plans[self.groups[i]]
            if len(blocks):
                part = rows[:, self.offsets[i] : self.offsets[i] + self.layer_sizes[i]]
                copy_layer(view, blocks, part if keep is None else part[keep])
        return DONE

    def feed(self, rows: np.ndarray, block_ids: Sequence[Sequence[int]]) -> RowFeed | None:
        """A :class:`RowFeed` of ``rows`` (``rows[k]`` goes to ``block_ids[group][k]`` once
        reported), copying in this copier's thread; ``None`` without numpy views of the cache
        (the staged rows then go in with :meth:`scatter_rows` once all are read)."""
        if self.host_views is None:
            return None
        return RowFeed(self, self._thread(), rows, block_ids)

    def scatter_split(self, payloads: Sequence[bytes | memoryview], block_ids: Sequence[Sequence[int]]) -> Transfer:
        """:meth:`start_scatter` for a load the engine waits for (no forward pass runs beside
        it): with the layers :attr:`stacked` and at least :data:`SPLIT_PAGES` pages, this
        copier's thread copies the second half of the pages while the caller copies the first
        (numpy lets go of the GIL while it copies); complete when it returns."""
        if self.stacked is None or len(payloads) < SPLIT_PAGES:
            return self.start_scatter(payloads, block_ids)
        blocks = block_ids[self.groups[0]]
        half = len(payloads) // 2
        other = self._thread().submit(self._stack, payloads[half:], blocks[half:])
        try:
            self._stack(payloads[:half], blocks[:half])
        finally:
            other.exception()  # wait: its copies write the same cache
        other.result()
        return DONE

    def _thread(self) -> ThreadPoolExecutor:
        """This copier's copy thread (a fresh one in a process forked from the one that made it)."""
        if self._feeder is None or self._feeder[0] != os.getpid():
            self._feeder = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-copy"))
        return self._feeder[1]

    def start_scatter(self, payloads: Sequence[bytes | memoryview], block_ids: Sequence[Sequence[int]]) -> Transfer:
        """:meth:`scatter`, returning once the copies are queued: on CUDA they run on the
        staging pool's stream and are complete when the returned transfer is done; elsewhere
        they are complete already (the transfer is done)."""
        if self.stacked is not None:
            self._stack(payloads, block_ids[self.groups[0]])
            return DONE
        if self.host_views is not None:
            for k, payload in enumerate(payloads):
                source = self._exact(payload)
                for i, view in enumerate(self.host_views):
                    block = block_ids[self.groups[i]][k]
                    if block != NO_BLOCK:
                        view[block] = source[self.offsets[i] : self.offsets[i] + self.layer_sizes[i]]
            return DONE
        assert self.staging is not None
        staged = self.staging.stage(payloads, list(zip(self.offsets, self.layer_sizes)))
        return self.staging.copy(staged, lambda staged: self._copy_in(staged, block_ids))

    def _stack(self, pages: Sequence[bytes | memoryview] | np.ndarray, blocks: Sequence[int]) -> None:
        """Each page (staged rows, or payloads made :meth:`_exact`) into block ``blocks[k]`` of
        every layer, one copy each through :attr:`stacked`; a ``NO_BLOCK`` page is skipped."""
        assert self.stacked is not None
        for block, page in zip(blocks, pages):
            if block != NO_BLOCK:
                source = page if isinstance(page, np.ndarray) else self._exact(page)
                self.stacked[:, block] = source.reshape(len(self.layers), -1)

    def _exact(self, payload: bytes | memoryview) -> np.ndarray:
        """A payload as the page's exact bytes: itself (a view) when exact, else its encoded
        copy dequantized into the KV dtype, into a page buffer reused page after page (in
        the CPU's cache, from which the layers are copied into their blocks as an exact
        page's are: no copy per layer beyond an exact page's)."""
        if len(payload) == self.page_bytes or self.decodes is None:
            return np.frombuffer(payload, dtype=np.uint8)
        parts = dss.page_views(payload, self.decodes)
        assert parts is not None
        buffers = self._buffers
        if getattr(buffers, "page", None) is None:
            shape = parts.shape
            buffers.page = torch.empty(shape.num_parts, shape.rows, shape.head_dim, dtype=self.layers[0].dtype)
            buffers.wide = torch.empty(buffers.page.numel())
        dequantize_into(parts, buffers.page, buffers.wide)
        return buffers.page.view(-1).view(torch.uint8).numpy()

    def _copy_in(self, staged: Staged, block_ids: Sequence[Sequence[int]]) -> None:
        """Each layer's part of the staged pages to the device in one copy, then into its blocks."""
        for i, layer in enumerate(self.layers):
            blocks = block_ids[self.groups[i]]
            rows = [k for k, block in enumerate(blocks) if block != NO_BLOCK]
            if not rows:
                continue
            part = staged.parts[i].to(self.device, non_blocking=True)
            if len(rows) < staged.num_pages:
                part = part[torch.tensor(rows).to(self.device, non_blocking=True)]
            index = torch.tensor([blocks[k] for k in rows], dtype=torch.long).to(self.device, non_blocking=True)
            layer.index_copy_(0, index, part.view(layer.dtype).reshape(len(rows), *layer.shape[1:]))


class RowFeed:
    """The rows of one staged load, copied into their blocks batch by batch as they are
    reported read (:meth:`ready`, the ``ready`` of ``Store.read_pages``), in the copier's
    thread, while the caller reads the next batch. Rows never reported are never copied.
    :meth:`finish` waits for every copy queued, and must be called once reading is over."""

    def __init__(
        self, copier: BlockCopier, thread: ThreadPoolExecutor, rows: np.ndarray, block_ids: Sequence[Sequence[int]]
    ) -> None:
        self.copier = copier
        self.thread = thread
        self.rows = rows
        self.block_ids = block_ids
        self._copies: list[Future[Transfer]] = []

    def ready(self, indexes: list[int]) -> None:
        """Queue the copy of these rows (each reported once, its bytes final)."""
        self._copies.append(self.thread.submit(self._copy, indexes))

    def _copy(self, indexes: list[int]) -> Transfer:
        """Copy rows in (in the copier's thread): a run of rows as a view of them, other rows
        gathered first."""
        first = indexes[0]
        run = indexes == list(range(first, first + len(indexes)))
        rows = self.rows[first : first + len(indexes)] if run else self.rows[indexes]
        return self.copier.scatter_rows(rows, [[group[k] for k in indexes] for group in self.block_ids])

    def finish(self) -> None:
        """Wait for every copy queued; raises what one raised (a bug), after all are done."""
        copies, self._copies = self._copies, []
        for copy in copies:
            copy.exception()
        for copy in copies:
            copy.result()


def _stacked(views: Sequence[np.ndarray], groups: Sequence[int]) -> np.ndarray | None:
    """One ``[layers, num_blocks, layer_bytes]`` view of the layers' ``[num_blocks,
    layer_bytes]`` views, when they have one shape and strides, start at even steps from one
    another and use one block table; else ``None``. Its element ``[i, b]`` is then exactly
    layer ``i``'s block ``b`` (it touches no byte between the layers; their tensors keep
    their memory alive)."""
    first = views[0]
    if len(set(groups)) != 1 or any(v.shape != first.shape or v.strides != first.strides for v in views):
        return None
    starts = [v.__array_interface__["data"][0] for v in views]
    step = starts[1] - starts[0] if len(starts) > 1 else 0
    if first.strides[1] != 1 or (len(starts) > 1 and step == 0):
        return None
    if any(b - a != step for a, b in pairwise(starts)):
        return None
    return np.lib.stride_tricks.as_strided(first, (len(views), *first.shape), (step, *first.strides), writeable=True)


def _row_plan(blocks: Sequence[int]) -> tuple[np.ndarray | None, np.ndarray]:
    """For one group's block ids: the rows to copy (``None``: all) and their blocks, skipping
    ``NO_BLOCK``."""
    ids = np.asarray(blocks, dtype=np.int64)
    mask = ids != NO_BLOCK
    if mask.all():
        return None, ids
    return np.flatnonzero(mask), ids[mask]
