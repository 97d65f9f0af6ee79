"""Layer-by-layer copies for synchronous loads and saves, overlapped with the forward pass on CUDA.

vLLM calls the connector around every attention layer: ``wait_for_layer_load(layer)`` before
it and ``save_kv_layer(layer, ...)`` after it. :class:`LayerwiseCopier` uses them so that
page copies overlap the forward pass:

* **load** (:meth:`LayerwiseCopier.load`, from ``start_load_kv`` before the forward): the
  pages are read from the store into reused page rows (decrypted straight into them),
  rearranged in one pass into a pinned host buffer by layer, then every layer's part is
  copied to the device and scattered into its blocks on a load stream of its own, with one
  CUDA event per layer; :meth:`LayerwiseCopier.wait_layer` makes the forward's stream wait
  for that layer's event only, so layer 0 computes while the later layers still copy.
* **save** (:meth:`LayerwiseCopier.save_layer`, after each layer's forward): the save
  stream waits for the forward's stream (the layer's new KV is written), then gathers the
  layer's blocks of this step's save jobs into a pinned host buffer without blocking the
  forward; :meth:`LayerwiseCopier.finish_saves` (from ``wait_for_save``) waits for the
  copies and returns the pages. A layer vLLM did not report is copied there.

Pinned buffers grow to the largest step seen and are reused; a step's load buffer is not
refilled before the previous step's copies out of it have finished. On other devices the
same steps run at once, in order (no streams); the CPU connector copies whole pages
instead (:mod:`dss_adapters.vllm.copy`), with the same results.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch
from dss_adapters.vllm.copy import BlockCopier, RowBuffer
from dss_adapters.vllm.loader import LoadOutcome, read_staged
from dss_adapters.vllm.meta import NO_BLOCK

import dss


class LayerwiseCopier:
    """One worker's layer-by-layer copies (see the module docstring)."""

    def __init__(self, copier: BlockCopier, layer_names: Sequence[str]) -> None:
        self.copier = copier
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.is_cuda = copier.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device=copier.device) if self.is_cuda else None
        self.save_stream = torch.cuda.Stream(device=copier.device) if self.is_cuda else None
        self._buffers: dict[str, torch.Tensor] = {}
        self.staging = RowBuffer(copier.page_bytes)
        """The page rows a load reads into (the store decrypts straight into them)."""
        self._load_events: dict[int, torch.cuda.Event] = {}
        self._save_ids: list[list[int]] | None = None
        self._saved_layers: set[int] = set()

    # -- loads -----------------------------------------------------------------------------

    def load(self, store: dss.Store, page_ids: Sequence[bytes], block_ids: Sequence[Sequence[int]]) -> LoadOutcome:
        """Read the pages and start copying them into ``block_ids[group][k]``, layer by layer.

        Returns once the copies are queued (CUDA) or done (other devices); pages the store
        cannot return are in the outcome's ``failed_pages`` and are not copied.
        """
        start = time.perf_counter()
        staged, blocks, outcome = read_staged(store, self.staging, page_ids, block_ids, "")
        count = len(staged)
        if count:
            if self.load_stream is not None:
                self.load_stream.synchronize()  # the previous step's copies out of the buffer
            layers, layer_bytes = len(self.copier.layers), self.copier.layer_bytes
            buffer = self._buffer("load", count)
            # page rows to layer-major (each layer's part contiguous, for one copy per layer): one pass
            buffer[:, :count] = torch.from_numpy(staged).view(count, layers, layer_bytes).transpose(0, 1)
            self._start_layers(buffer, blocks)
        outcome.seconds = time.perf_counter() - start
        return outcome

    def wait_layer(self, layer_name: str) -> None:
        """Make the forward's stream wait until this layer's pages of the step are in (CUDA)."""
        i = self.index.get(layer_name)
        event = self._load_events.pop(i, None) if i is not None else None
        if event is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(event)

    def _start_layers(self, buffer: torch.Tensor, block_ids: list[list[int]]) -> None:
        copier = self.copier
        if self.load_stream is not None:
            self.load_stream.wait_stream(torch.cuda.current_stream(copier.device))
        for i, layer in enumerate(copier.layers):
            blocks = block_ids[copier.groups[i]]
            rows = [k for k, block in enumerate(blocks) if block != NO_BLOCK]
            if not rows:
                continue
            with torch.cuda.stream(self.load_stream) if self.load_stream is not None else nullcontext():
                part = buffer[i, : len(blocks)].to(copier.device, non_blocking=True)
                if len(rows) < len(blocks):
                    part = part[torch.tensor(rows, device=copier.device)]
                index = torch.tensor([blocks[k] for k in rows], dtype=torch.long).to(copier.device, non_blocking=True)
                layer.index_copy_(0, index, part.view(layer.dtype).reshape(len(rows), *layer.shape[1:]))
                if self.load_stream is not None:
                    event = torch.cuda.Event()
                    event.record(self.load_stream)
                    self._load_events[i] = event

    # -- saves -----------------------------------------------------------------------------

    def save_layer(self, layer_name: str, jobs: Sequence[Sequence[Sequence[int]]]) -> None:
        """Start copying this layer's blocks of the step's save jobs (``jobs[j][group][k]``) out."""
        i = self.index.get(layer_name)
        if i is None:
            return
        if self._save_ids is None:
            self._save_ids = [[b for job in jobs for b in job[g]] for g in range(len(jobs[0]))]
        self._copy_out(i)

    def finish_saves(self, jobs: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
        """Wait for this step's save copies; ``[pages, page_bytes]`` uint8, the jobs' pages in order."""
        if self._save_ids is None:
            self._save_ids = [[b for job in jobs for b in job[g]] for g in range(len(jobs[0]))]
        for i in range(len(self.copier.layers)):
            if i not in self._saved_layers:
                self._copy_out(i)
        if self.save_stream is not None:
            self.save_stream.synchronize()
        count = len(self._save_ids[0])
        buffer = self._buffers["save"][:, :count]
        out = buffer.permute(1, 0, 2).contiguous().numpy().reshape(count, -1)
        self._save_ids, self._saved_layers = None, set()
        return out

    def _copy_out(self, i: int) -> None:
        assert self._save_ids is not None
        copier = self.copier
        blocks = self._save_ids[copier.groups[i]]
        buffer = self._buffer("save", len(blocks))
        layer = copier.layers[i]
        if self.save_stream is not None:
            self.save_stream.wait_stream(torch.cuda.current_stream(copier.device))
        with torch.cuda.stream(self.save_stream) if self.save_stream is not None else nullcontext():
            index = torch.tensor(blocks, dtype=torch.long).to(copier.device, non_blocking=True)
            rows = layer.index_select(0, index).reshape(len(blocks), -1).view(torch.uint8)
            buffer[i, : len(blocks)].copy_(rows, non_blocking=self.save_stream is not None)
        self._saved_layers.add(i)

    def _buffer(self, kind: str, rows: int) -> torch.Tensor:
        """A ``[layers, >= rows, layer_bytes]`` uint8 host buffer (pinned on CUDA), reused while big enough."""
        buffer = self._buffers.get(kind)
        if buffer is None or buffer.shape[1] < rows:
            size = max(rows, 2 * buffer.shape[1] if buffer is not None else rows)
            buffer = torch.empty(
                (len(self.copier.layers), size, self.copier.layer_bytes), dtype=torch.uint8, pin_memory=self.is_cuda
            )
            self._buffers[kind] = buffer
        return buffer
