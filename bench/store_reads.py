"""Tokens per second read from a corpus in an S3 store (moto's server on this host) against
the same corpus on disk, through MemoryMappedDataset as training reads it.

Writes a synthetic prepared corpus of `--tokens` uint16 ids, uploads it to a local moto
server (the real client stack: s3fs, botocore, HTTP), and reads `--batches` batches of
`--batch-size` windows of `--seq-len` + 1 tokens in five settings, each in a fresh dataset:
disk (memory maps); store shuffled, one ranged request per window one after another, and a
batch at a time as the loader reads (__getitems__: the batch's requests sent together);
store in file order (the read-ahead of `--read-ahead-mb`); and store shuffled through a
local block cache, timed on its second pass (cache filled by the first). One JSON line per
setting: seconds, tokens_per_sec, requests (ranged reads sent). A local server has almost
no latency: `--latency-ms` puts a proxy in front of it that adds a store's round trip to
every request, which is what sending a batch's requests together saves.

    python bench/store_reads.py [--tokens 20000000] [--batches 50] [--batch-size 8]
        [--latency-ms 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kempnerforge.data.dataset import MemoryMappedDataset  # noqa: E402
from kempnerforge.data.sampling.permutation import KeyedPermutation  # noqa: E402
from kempnerforge.data.tokenizer import ByteTokenizer  # noqa: E402
from kempnerforge.data.tokens.store_tokens import StoreReads, StoreTokens  # noqa: E402
from kempnerforge.data.tokens.token_file import TokenFileWriter  # noqa: E402


def write_corpus(directory: str, num_tokens: int) -> None:
    """Documents of random byte ids, 200 to 2000 tokens each, up to ``num_tokens``."""
    rng = np.random.default_rng(0)
    with TokenFileWriter(directory, ByteTokenizer()) as writer:
        written = 0
        while written < num_tokens:
            doc = rng.integers(0, 256, int(rng.integers(200, 2000)), dtype=np.uint16)
            writer.add_document(doc)
            written += len(doc) + 1
        writer.finish(1)


class LatencyProxy:
    """A TCP proxy on a free local port in front of ``target`` that holds every chunk a
    client sends for ``latency_s`` before passing it on: a store's round-trip time, which
    a local server lacks. Each connection has its own threads, so concurrent requests wait
    concurrently, as they would on a network."""

    def __init__(self, target: tuple[str, int], latency_s: float) -> None:
        self.target, self.latency_s = target, latency_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delayed: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if delayed:
                    time.sleep(self.latency_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()


def requests_of(dataset: MemoryMappedDataset) -> int:
    maps = dataset._stream._maps.values()
    return sum(m.reader.requests for m in maps if isinstance(m, StoreTokens))


def timed(
    dataset: MemoryMappedDataset, indices: list[int], seq_len: int, batch_size: int = 0
) -> dict:
    """Read ``indices`` one window at a time, or (``batch_size``) a batch at a time as the
    loader does, through __getitems__ (its windows fetched together)."""
    start = time.perf_counter()
    if batch_size:
        for first in range(0, len(indices), batch_size):
            dataset.__getitems__(indices[first : first + batch_size])
    else:
        for i in indices:
            dataset[i]
    seconds = time.perf_counter() - start
    tokens = len(indices) * seq_len
    return {
        "seconds": round(seconds, 3),
        "tokens_per_sec": round(tokens / seconds),
        "requests": requests_of(dataset),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--read-ahead-mb", type=int, default=8)
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="round-trip time added to every request (a proxy in front of the local server)",
    )
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    if args.latency_ms > 0:
        host, port = "127.0.0.1", LatencyProxy((host, port), args.latency_ms / 1000).port
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_EC2_METADATA_DISABLED="true",
        )
        from kempnerforge.storage.stores import filesystem

        local = f"{tmp}/corpus"
        write_corpus(local, args.tokens)
        fs = filesystem("s3://bench")
        fs.mkdir("bench")
        fs.put(local, "bench/corpus", recursive=True)
        url = "s3://bench/corpus"
        count = args.batches * args.batch_size
        reads = StoreReads(read_ahead_bytes=args.read_ahead_mb << 20)
        size = len(MemoryMappedDataset(local, args.seq_len))
        permutation = KeyedPermutation(size, 1234)
        shuffled = [permutation(i) for i in range(min(count, size))]
        in_order = list(range(min(count, size)))
        cached = StoreReads(0, f"{tmp}/cache", 4 << 30)
        rows = {
            "disk, shuffled": timed(
                MemoryMappedDataset(local, args.seq_len), shuffled, args.seq_len
            ),
            "store, shuffled, a window at a time": timed(
                MemoryMappedDataset(url, args.seq_len, store=reads), shuffled, args.seq_len
            ),
            "store, shuffled, a batch at a time": timed(
                MemoryMappedDataset(url, args.seq_len, store=reads),
                shuffled,
                args.seq_len,
                args.batch_size,
            ),
            "store, in order (read-ahead)": timed(
                MemoryMappedDataset(url, args.seq_len, store=reads), in_order, args.seq_len
            ),
        }
        timed(MemoryMappedDataset(url, args.seq_len, store=cached), shuffled, args.seq_len)
        rows["store, shuffled, cached (second pass)"] = timed(
            MemoryMappedDataset(url, args.seq_len, store=cached), shuffled, args.seq_len
        )
        for setting, row in rows.items():
            print(json.dumps({"setting": setting, "windows": len(shuffled), **row}))
    server.stop()


if __name__ == "__main__":
    main()
