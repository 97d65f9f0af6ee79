"""Moves near the hardware: dss's disk tier against direct file I/O on the same disk, in one run.

With pages shaped like an 8B model's KV (16 tokens of 128 KiB each: 2 MiB pages, so one 1K-token
turn is 64 pages, 128 MiB), in two stores on the same disk — sealed (``encrypt=True``, the
default) and plain (``encrypt=False``) — it measures:

* **write**: a 1K-token commit (64 pages in one call) and the same turn saved the way vLLM's
  worker saves it (``save_pages`` of the pages each step filled: 64 when the prompt is
  prefilled in one step, 32 with 512-token chunked prefill; then the commit of the tokens),
  each against a direct write + fsync of the same number of bytes to one new file;
* **read**: a long session's pages read back (``resume``, then ``read_pages``) in a fresh
  process whose page cache was emptied of the store's files (``posix_fadvise(DONTNEED)``),
  against a direct sequential read of the same segment files in a fresh process, cold too;
* **sealing**: how much slower the sealed store is than the plain one, for both;
* **pages per I/O**: pages moved by each ``pread`` of a read (disk -> host, a promotion) and
  by each ``writev`` of a segment (host -> disk, a demotion).

Contenders run interleaved, repeated (each kind of write by the two stores back to back, in the
order A B B A, so neither goes first more often; the kinds in an order rotated by round, so none
always follows the most writes); the figures are medians of per-round ratios
(this is a shared machine). The bars: read >= 60 % of the direct read, write >= 70 % of the
direct write + fsync, sealing < 10 % of either, 8-16 pages per I/O. Rerun with::

    PYTHONPATH=. .venv/bin/python benchmarks/disk.py [--dir FOLDER] [--rounds 5] [--session-tokens 8192]

``--dir`` picks the disk (default: a temporary folder under the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pagecache
from progress import track

import dss

PAGE_TOKENS = 16
TOKEN_KV_BYTES = 128 << 10
"""KV bytes of one token of an 8B model (32 layers, 8 KV heads of 128, K and V, bf16)."""
PAGE_BYTES = PAGE_TOKENS * TOKEN_KV_BYTES
TURN_TOKENS = 1024
SAVE_CHUNKS = {"save": 64, "save/chunked": 32}
"""Engine saves: pages per ``save_pages`` call. vLLM's worker saves the pages each step filled;
a 1K-token prefill in one step fills 64, in 512-token chunks (chunked prefill) 32 per step."""
LAYOUT = dss.Layout(name="bench-8b", page_tokens=PAGE_TOKENS, page_bytes=PAGE_BYTES, model="llama-8b", dtype="bf16")
_BLOCK = random.Random(0).randbytes(PAGE_BYTES)


def payload(tag: int, index: int) -> bytes:
    """A page's bytes: random, distinct per page (the head names it)."""
    head = f"{tag}:{index}:".encode().ljust(64, b".")
    return head + _BLOCK[64:]


def tokens_of(tag: int, count: int) -> list[int]:
    return [(tag * 7919 + i) % 50_000 for i in range(count)]


def open_store(folder: Path, keys: Path, encrypt: bool) -> dss.Store:
    return dss.open(
        folder,
        master_key_file=keys,
        encrypt=encrypt,
        disk_bytes="64GiB",
        host_bytes="8GiB",
        segment_bytes="256MiB",
        compact_auto=False,
    )


def direct_write(folder: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file and fsync it (the baseline of writes)."""
    data = _BLOCK * (size // PAGE_BYTES) + _BLOCK[: size % PAGE_BYTES]
    path = folder / "direct.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def segment_bytes(store: dss.Store) -> int:
    return sum(store.disk.files().values())


def write_round(stores: dict[str, dss.Store], scratch: Path, tag: int) -> dict[str, float]:
    """One round of writes: each kind of write (a turn committed in one call, saved 64 or 32
    pages a call; the kinds in an order rotated by round) by the sealed and the plain store back
    to back, twice, in the order A B B A (A alternating by round and by kind), each followed by
    the direct write of the same bytes;
    a store's figure is the sum of its two. The two stores being close in time, and each going
    first as often as second, keeps their ratio (the sealing cost) out of this shared machine's
    swings and out of whatever going first costs."""
    out: dict[str, float] = dict.fromkeys(
        (
            f"{kind}/{part}"
            for kind in ("commit", *SAVE_CHUNKS)
            for name in stores
            for part in (name, f"{name}/bytes", f"direct/{name}")
        ),
        0.0,
    )
    order = list(stores.items())
    sessions: list[tuple[dss.Store, str]] = []
    kinds = ("commit", *SAVE_CHUNKS)
    for k in ((tag + i) % len(kinds) for i in range(len(kinds))):  # each kind first, second, last in turn
        kind = kinds[k]
        seed = tag + 1000 * k
        tokens = tokens_of(seed, TURN_TOKENS)
        first, second = order if (tag + k) % 2 == 0 else order[::-1]
        for n, (name, store) in enumerate((first, second, second, first)):
            session = f"{kind}-{tag}-{n}"
            store.create_session(session, layout=LAYOUT)
            sessions.append((store, session))
            pages = {i: payload(seed, i) for i in range(TURN_TOKENS // PAGE_TOKENS)}
            per_call = SAVE_CHUNKS.get(kind, 0)
            chunks = (
                [{i: pages[i] for i in range(low, low + per_call)} for low in range(0, len(pages), per_call)]
                if per_call
                else []
            )
            before = segment_bytes(store)
            start = time.perf_counter()
            if per_call:
                for chunk in chunks:
                    store.save_pages(session, tokens[: (max(chunk) + 1) * PAGE_TOKENS], chunk)
                store.commit(session, tokens)
            else:
                store.commit(session, tokens, pages)
            out[f"{kind}/{name}"] += time.perf_counter() - start
            written = segment_bytes(store) - before
            out[f"{kind}/{name}/bytes"] += written
            out[f"{kind}/direct/{name}"] += direct_write(scratch, written)
    for store, session in sessions:
        store.delete_session(session)
    return out


def build_long_session(store: dss.Store, num_tokens: int) -> None:
    """One session of ``num_tokens`` tokens, committed turn by turn with every page."""
    store.create_session("long", layout=LAYOUT)
    tokens = tokens_of(1, num_tokens)
    for end in range(TURN_TOKENS, num_tokens + 1, TURN_TOKENS):
        first = (end - TURN_TOKENS) // PAGE_TOKENS
        store.commit("long", tokens[:end], {i: payload(1, i) for i in range(first, end // PAGE_TOKENS)})


def child_read(folder: Path, keys: Path, encrypt: bool, num_tokens: int) -> dict[str, float]:
    """In a fresh process: empty the page cache of the store's files, then read the long session."""
    store = open_store(folder, keys, encrypt)
    try:
        pagecache.drop(sorted((folder / "segments").iterdir()))
        tokens = tokens_of(1, num_tokens)
        start = time.perf_counter()
        result = store.resume("long", tokens)
        payloads = store.read_pages(result.pages)
        elapsed = time.perf_counter() - start
        assert all(p is not None for p in payloads) and len(payloads) == num_tokens // PAGE_TOKENS
        assert payloads[-1] == payload(1, len(payloads) - 1)
        io = store.disk.io
        return {
            "seconds": elapsed,
            "bytes": sum(len(p) for p in payloads if p is not None),
            "preads": io.reads,
            "pages_read": io.pages_read,
        }
    finally:
        store.close()


def child_direct(folder: Path) -> dict[str, float]:
    """In a fresh process: empty the page cache of the files, then read them sequentially."""
    files = sorted((folder / "segments").iterdir())
    pagecache.drop(files)
    total = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            total += f.readinto(buf) or 0
    return {"seconds": time.perf_counter() - start, "bytes": total}


def in_child(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=os.environ, check=False
    )
    if out.returncode:
        raise SystemExit(f"the measuring process failed:\n{out.stderr}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="Folder on the disk to measure (default: ./tmp-*).")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds of each measurement.")
    parser.add_argument("--session-tokens", type=int, default=8192, help="Tokens of the long session read back.")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "read":
            result = child_read(Path(rest[0]), Path(rest[1]), rest[2] == "1", int(rest[3]))
        else:
            result = child_direct(Path(rest[0]))
        print(json.dumps(result))
        return
    root = Path(tempfile.mkdtemp(prefix="tmp-disk-bench-", dir=args.dir or Path.cwd()))
    try:
        run(root, args.rounds, args.session_tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, rounds: int, session_tokens: int) -> None:
    keys = root / "keys" / "master.key"
    folders = {"sealed": root / "sealed", "plain": root / "plain"}
    stores = {name: open_store(folder, keys, name == "sealed") for name, folder in folders.items()}
    writes: list[dict[str, float]] = []
    for tag in track(range(rounds + 1), "writing turns"):
        result = write_round(stores, root, tag + 10)
        if tag:  # the first round warms up
            writes.append(result)
    demotion = {name: (s.disk.io.pages_written / max(1, s.disk.io.writes)) for name, s in stores.items()}
    for name, store in stores.items():
        build_long_session(store, session_tokens)
        store.close()
    reads: list[dict[str, float]] = []
    for k in track(range(rounds), "reading the long session cold"):
        row: dict[str, float] = {}
        names = ["sealed", "plain"] if k % 2 == 0 else ["plain", "sealed"]  # neither always goes first
        for name in names:
            row[f"direct/{name}"] = in_child("direct", str(folders[name]))["seconds"]
            row[f"read/{name}"] = in_child(
                "read", str(folders[name]), str(keys), "1" if name == "sealed" else "0", str(session_tokens)
            )["seconds"]
        reads.append(row)
    sample = in_child("read", str(folders["sealed"]), str(keys), "1", str(session_tokens))
    report(writes, reads, demotion, sample, session_tokens)


def median_ratio(rows: list[dict[str, float]], num: str, den: str) -> float:
    return statistics.median(r[num] / r[den] for r in rows)


def report(
    writes: list[dict[str, float]],
    reads: list[dict[str, float]],
    demotion: dict[str, float],
    sample: dict[str, float],
    session_tokens: int,
) -> None:
    mib = 1 << 20
    lines = []
    kinds = [("commit", "write: 1K-token commit (64 pages, one call)")] + [
        (kind, f"write: 1K-token turn saved {n} pages a call, then commit") for kind, n in SAVE_CHUNKS.items()
    ]
    for kind, label in kinds:
        for name in ("sealed", "plain"):
            speed = statistics.median(r[f"{kind}/{name}/bytes"] / r[f"{kind}/{name}"] for r in writes) / mib
            direct = statistics.median(r[f"{kind}/{name}/bytes"] / r[f"{kind}/direct/{name}"] for r in writes) / mib
            ratio = median_ratio(writes, f"{kind}/direct/{name}", f"{kind}/{name}")
            lines.append((f"{label}, {name}", speed, direct, ratio))
    size = session_tokens // PAGE_TOKENS * PAGE_BYTES
    for name in ("sealed", "plain"):
        speed = statistics.median(size / r[f"read/{name}"] for r in reads) / mib
        direct = statistics.median(size / r[f"direct/{name}"] for r in reads) / mib
        ratio = median_ratio(reads, f"direct/{name}", f"read/{name}")
        lines.append((f"read: {session_tokens}-token session, cold, {name}", speed, direct, ratio))
    print(
        f"pages of {PAGE_BYTES // 1024} KiB ({PAGE_TOKENS} tokens of {TOKEN_KV_BYTES // 1024} KiB); "
        f"{len(writes)} write rounds, {len(reads)} read rounds; medians"
    )
    print(f"{'measurement':58} {'dss MiB/s':>10} {'direct MiB/s':>13} {'dss/direct':>11}")
    for label, speed, direct, ratio in lines:
        print(f"{label:58} {speed:10.0f} {direct:13.0f} {ratio:10.0%}")
    for kind, _ in kinds:
        cost = median_ratio(writes, f"{kind}/sealed", f"{kind}/plain") - 1
        print(f"sealing cost, {kind}: {cost:+.1%} time")
    print(f"sealing cost, read: {median_ratio(reads, 'read/sealed', 'read/plain') - 1:+.1%} time")
    print(
        f"pages per I/O: promotion (disk -> host) {sample['pages_read'] / max(1, sample['preads']):.1f} "
        f"({int(sample['preads'])} preads for {int(sample['pages_read'])} pages); demotion (host -> disk) "
        + ", ".join(f"{name} {v:.1f}" for name, v in demotion.items())
        + " per writev"
    )


if __name__ == "__main__":
    main()
