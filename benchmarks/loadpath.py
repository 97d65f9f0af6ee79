"""The vLLM connector's CPU load path against the hardware it runs on, measured in one run.

A prompt of ``--tokens`` tokens of SmolLM2-135M's KV (30 layers, 3 KV heads of 64, bf16: pages of
32 tokens, 720 KiB) is stored, then loaded again and again into a CPU KV cache shaped like vLLM's
(a ``[blocks, 3, 32, 128]`` bf16 tensor per layer), with the page cache warm:

* ``fed`` — what a disk load does now (``dss_adapters.vllm.loader.load_pages`` with a
  ``RowBuffer``): ``read_pages(into=..., ready=...)`` decrypts each page straight into one reused
  buffer of page rows, and each disk read's pages are copied in (one copy per page of all its
  layers, the cache being one allocation as vLLM's) by a second thread while the store reads and
  decrypts the next;
* ``fed, pread`` — the same from a store opened with ``disk_map_reads=False``: the page files are
  copied out of the OS page cache with ``pread`` before they are decrypted, where ``fed`` maps
  them and decrypts from the page cache;
* ``staged`` — what a disk load did before: the same reads, then one copy per layer for all the
  pages once every page is read;
* ``per page`` — the named baseline: ``read_pages`` returns a ``bytes`` object per page, copied in
  with one memcpy per page and layer (3,840 for 4K tokens; the path a load wholly from the
  worker's RAM still takes, since its pages are ``bytes`` already);
* ``hardware`` — the same bytes with no dss code, one step after the other: the segment files
  read with ``preadv`` into one buffer (page cache warm), AES-GCM ``decrypt_into`` of every page
  on one core, one copy per layer. Not a floor: ``fed`` overlaps those steps and, mapping the
  files, skips the first copy.

(Here the layers of every contender but ``fed`` lie at uneven steps in memory, so ``per page``
keeps its memcpy per page and layer; ``fed`` loads into a cache laid out as vLLM's.) Then the
same pages, as ``bytes`` in memory, copied in as a load wholly from the worker's RAM copies
them:

* ``per layer`` — the named baseline, what such a load did before: one memcpy per page and layer;
* ``per page`` — what an asynchronous one does when the layers lie at even steps, as in vLLM's
  CPU cache (one allocation for every layer): one copy per page of all its layers
  (``BlockCopier.scatter``);
* ``split`` — what a synchronous one does now: the same copies, half of them in a second thread
  (``BlockCopier.scatter_split``);
* ``memcpy`` — the floor: one copy of as many contiguous bytes.

Each contender runs from a sealed store (the default) and from one opened with
``encrypt=False``; ``sealing cost`` is how much longer the sealed load takes. Contenders run
interleaved, rounds alternating which goes first; the figures are medians. Rerun with::

    PYTHONPATH=. .venv/bin/python benchmarks/loadpath.py [--tokens 4096] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from dss_adapters.vllm.copy import BlockCopier, RowBuffer, copy_layer
from dss_adapters.vllm.loader import load_pages, read_staged

import dss

PAGE_TOKENS, LAYERS, HEADS, HEAD = 32, 30, 3, 64
LAYER_BYTES = HEADS * PAGE_TOKENS * 2 * HEAD * 2
PAGE_BYTES = LAYERS * LAYER_BYTES
LAYOUT = dss.Layout(name="smollm2-like", page_tokens=PAGE_TOKENS, page_bytes=PAGE_BYTES, model="bench", dtype="bf16")
_BLOCK = random.Random(0).randbytes(PAGE_BYTES)


def payload(i: int) -> bytes:
    return str(i).encode().ljust(64, b".") + _BLOCK[64:]


def build(folder: Path, keys: Path, encrypt: bool, pages: int) -> list[bytes]:
    """A store holding one session of ``pages`` pages; their ids."""
    with dss.open(folder, master_key_file=keys, encrypt=encrypt, compact_auto=False) as store:
        store.create_session("s", layout=LAYOUT)
        tokens = list(range(pages * PAGE_TOKENS))
        store.commit("s", tokens, {i: payload(i) for i in range(pages)})
        return [bytes(p.page_id) for p in store.resume("s", tokens).pages]


def hardware(
    folder: Path, buffer: memoryview, sealed: list[bytes], aead: AESGCM, rows: np.ndarray, caches: list[np.ndarray]
) -> None:
    """Read the segment files into ``buffer`` (reused, as dss reuses its read buffers), decrypt
    ``sealed`` (pages sealed under ``aead`` with a zero nonce; none for a plain store) into
    ``rows``, copy all the rows in by layer."""
    at = 0
    for path in sorted((folder / "segments").iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            while got := os.preadv(fd, [buffer[at:]], 0 if at == 0 else at):
                at += got
        finally:
            os.close(fd)
    for k, blob in enumerate(sealed):
        aead.decrypt_into(b"\0" * 12, blob, b"", memoryview(rows[k]))
    blocks = np.arange(5, 5 + len(rows))
    for i, cache in enumerate(caches):
        copy_layer(cache, blocks, rows[:, i * LAYER_BYTES : (i + 1) * LAYER_BYTES])


def staged(
    store: dss.Store, copier: BlockCopier, ids: list[bytes], block_ids: list[list[int]], req_id: str, rows: RowBuffer
) -> None:
    """The staged load before its copies overlapped the reads: read every page, then copy."""
    staged_rows, blocks, _ = read_staged(store, rows, ids, block_ids, req_id)
    copier.scatter_rows(staged_rows, blocks)


def run(tokens: int, rounds: int) -> dict[str, list[float]]:
    pages = tokens // PAGE_TOKENS
    root = Path(tempfile.mkdtemp(prefix="dss-bench-loadpath-"))
    keys = root / "master.key"
    blocks = pages + 10
    copier = BlockCopier(cache(blocks, even=False), [0] * LAYERS, blocks, PAGE_BYTES)
    even = BlockCopier(cache(blocks, even=True), [0] * LAYERS, blocks, PAGE_BYTES)
    assert copier.host_views is not None and copier.stacked is None and even.stacked is not None
    block_ids = [list(range(5, 5 + pages))]
    staging, aead = RowBuffer(PAGE_BYTES), AESGCM(os.urandom(32))
    sealed = [aead.encrypt(b"\0" * 12, payload(i), b"") for i in range(pages)]
    times: dict[str, list[float]] = {}
    stores = {}
    for name, encrypt in (("sealed", True), ("plain", False)):
        ids = build(root / name, keys, encrypt, pages)
        store = dss.open(root / name, master_key_file=keys, compact_auto=False, host_bytes=0)
        copying = dss.open(root / name, master_key_file=keys, compact_auto=False, host_bytes=0, disk_map_reads=False)
        stores[name], stores[f"{name}, pread"] = store, copying
        jobs: dict[str, Callable[[], object]] = {
            "fed": partial(load_pages, store, even, ids, block_ids, "bench", staging),
            "fed, pread": partial(load_pages, copying, even, ids, block_ids, "bench", staging),
            "staged": partial(staged, store, copier, ids, block_ids, "bench", staging),
            "per page": partial(load_pages, store, copier, ids, block_ids, "bench"),
            "hardware": partial(
                hardware,
                root / name,
                memoryview(bytearray(sum(f.stat().st_size for f in (root / name / "segments").iterdir()))),
                sealed if encrypt else [],
                aead,
                staging.rows(pages),
                copier.host_views,
            ),
        }
        for label, job in jobs.items():
            job()  # warm: page cache, buffers
            times[f"{label}/{name}"] = []
        for r in range(rounds):
            order = list(jobs.items()) if r % 2 == 0 else list(jobs.items())[::-1]
            for label, job in order:
                start = time.perf_counter()
                job()
                times[f"{label}/{name}"].append(time.perf_counter() - start)
        want = payload(pages - 1)[7 * LAYER_BYTES : 8 * LAYER_BYTES]
        for check, load, source in ((copier, staged, store), (even, load_pages, store), (even, load_pages, copying)):
            check.host_views[7][5 + pages - 1] = 0
            load(source, check, ids, block_ids, "check", staging)
            assert check.host_views[7][5 + pages - 1].tobytes() == want, f"{load.__name__} copied wrong bytes"
    for store in stores.values():
        store.close()
    in_memory = [payload(i) for i in range(pages)]
    source, floor = np.frombuffer(b"".join(in_memory), dtype=np.uint8), np.empty(pages * PAGE_BYTES, dtype=np.uint8)
    ram: dict[str, Callable[[], object]] = {
        "per layer": partial(copier.scatter, in_memory, block_ids),
        "per page": partial(even.scatter, in_memory, block_ids),
        "split": partial(even.scatter_split, in_memory, block_ids),
        "memcpy": partial(np.copyto, floor, source),
    }
    for label, job in ram.items():
        job()
        times[f"{label}/ram"] = []
    for r in range(rounds):
        for label, job in list(ram.items()) if r % 2 == 0 else list(ram.items())[::-1]:
            start = time.perf_counter()
            job()
            times[f"{label}/ram"].append(time.perf_counter() - start)
    for view, label in ((copier, "per layer"), (even, "per page"), (even, "split")):
        for layer in view.host_views or []:
            layer[5 : 5 + pages] = 0
        ram[label]()
        assert view.gather(block_ids)[0].tobytes() == in_memory[0], f"{label} from RAM put wrong bytes"
        assert view.gather([[5 + pages - 1]])[0].tobytes() == in_memory[-1], f"{label} from RAM put wrong bytes"
    return times


def cache(blocks: int, *, even: bool) -> list[torch.Tensor]:
    """The layers' KV caches, views of one buffer as vLLM allocates them: one after another
    (``even``), or with a gap after the first layer (uneven steps: copied a layer at a time)."""
    size = blocks * LAYER_BYTES
    gap = 0 if even else 4096
    flat = torch.zeros(LAYERS * size + gap, dtype=torch.uint8)
    starts = [i * size + (gap if i else 0) for i in range(LAYERS)]
    return [flat[a : a + size].view(torch.bfloat16).view(blocks, HEADS, PAGE_TOKENS, 2 * HEAD) for a in starts]


def report(times: dict[str, list[float]], tokens: int, rounds: int) -> None:
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mb = tokens // PAGE_TOKENS * PAGE_BYTES / 1e6
    print(
        f"\nLoading {tokens} tokens of SmolLM2-135M-shaped KV ({mb:.0f} MB) into a CPU KV cache, page cache warm; "
        f"ms, median of {rounds}"
    )
    print(
        "| store | per page (baseline) | staged | fed, pread | fed | hardware | per page / fed | staged / fed "
        "| fed, pread / fed | fed / hardware |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("sealed", "plain"):
        labels = ("per page", "staged", "fed, pread", "fed", "hardware")
        base, after, copied, fed, hw = (ms[f"{label}/{name}"] for label in labels)
        print(
            f"| {name} | {base:.1f} | {after:.1f} | {copied:.1f} | {fed:.1f} | {hw:.1f} | {base / fed:.2f}x "
            f"| {after / fed:.2f}x | {copied / fed:.2f}x | {fed / hw:.2f}x |"
        )
    cost = {label: ms[f"{label}/sealed"] / ms[f"{label}/plain"] - 1 for label in ("per page", "staged", "fed")}
    print(
        f"\nsealing cost on the read path: fed {cost['fed']:+.0%}, staged {cost['staged']:+.0%}, "
        f"per page {cost['per page']:+.0%}"
    )
    layer, page, split, floor = (ms[f"{label}/ram"] for label in ("per layer", "per page", "split", "memcpy"))
    print(f"\nThe same pages from RAM (bytes in memory) into the cache; ms, median of {rounds}")
    print(
        "| per layer (baseline) | per page | split | memcpy | per layer / split | per page / split | split / memcpy |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {layer:.1f} | {page:.1f} | {split:.1f} | {floor:.1f} | {layer / split:.2f}x | {page / split:.2f}x "
        f"| {split / floor:.2f}x |"
    )
    print(f"rerun: PYTHONPATH=. .venv/bin/python benchmarks/loadpath.py --tokens {tokens} --rounds {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens loaded (whole pages of 32)")
    parser.add_argument("--rounds", type=int, default=9, help="measured loads per contender and store")
    args = parser.parse_args()
    if args.tokens < PAGE_TOKENS or args.rounds < 1:
        parser.error("--tokens must be at least 32 and --rounds at least 1")
    report(run(args.tokens, args.rounds), args.tokens, args.rounds)


if __name__ == "__main__":
    main()
