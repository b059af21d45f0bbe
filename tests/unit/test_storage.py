"""The storage foundation over fsspec's memory:// store: URLs told from paths, byte ranges
with and without read-ahead and cache, a prepared corpus read from a store byte for byte as
from disk, the start-up refusal of store URLs where only local directories work, and the
deadline every store call ends by."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kempnerforge.config.data import DataConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.tokens.store_tokens import StoreReads
from kempnerforge.storage.cache import CACHE_BLOCK_BYTES, BlockCache
from kempnerforge.storage.files import names_in
from kempnerforge.storage.location import is_store_url, is_url, join, local_path
from kempnerforge.storage.ranges import RangeReader
from kempnerforge.storage.stores import StoreError, filesystem
from kempnerforge.training.store_checks import check_stores


def test_urls_are_told_from_local_paths():
    for url in ("s3://b/k", "gs://b", "S3://B/x", "memory://x", "file:///tmp/x", "r2://b"):
        assert is_url(url), url
    for path in ("s3:", "s3:/b", "runs/x", "/abs/x", "./s3/x", "C:\\x"):
        assert not is_url(path), path
    assert not is_store_url("file:///tmp/x") and is_store_url("s3://b")
    assert local_path("file:///tmp/x") == "/tmp/x" and local_path("/tmp/x") == "/tmp/x"
    assert join("s3://b/dir/", "meta.json") == "s3://b/dir/meta.json"
    assert join("dir", "meta.json") == "dir/meta.json"


def _object(root: str, size: int) -> tuple[str, bytes]:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    url = f"{root}/blob.bin"
    filesystem(url).pipe_file(url.removeprefix("memory://"), data)
    return url, data


def test_shuffled_reads_fetch_exactly_their_bytes(memory_root):
    url, data = _object(memory_root, 10_000)
    reader = RangeReader(url, len(data), read_ahead=4096)
    for start in (5000, 100, 9000, 2000):  # no read moves forward from the one before
        assert reader.read(start, start + 65) == data[start : start + 65]
    assert reader.requests == 4


def test_forward_reads_are_served_from_one_read_ahead(memory_root):
    url, data = _object(memory_root, 10_000)
    reader = RangeReader(url, len(data), read_ahead=4096)
    # Windows of 65 bytes at stride 64, as training windows overlap by one token.
    got = [reader.read(s, s + 65) for s in range(0, 64 * 100, 64)]
    assert got == [data[s : s + 65] for s in range(0, 64 * 100, 64)]
    # The first read is exact; then one 4096-byte block per 4096 bytes read forward.
    assert reader.requests == 1 + -(-(64 * 99 + 65 - 64) // (4096 - 65))
    assert reader.requests < 5


def test_no_read_ahead_fetches_every_window(memory_root):
    url, data = _object(memory_root, 2_000)
    reader = RangeReader(url, len(data), read_ahead=0)
    assert [reader.read(s, s + 65) for s in range(0, 640, 64)] == [
        data[s : s + 65] for s in range(0, 640, 64)
    ]
    assert reader.requests == 10


def test_the_block_cache_serves_later_reads_and_stays_within_its_limit(memory_root, tmp_path):
    size = 3 * CACHE_BLOCK_BYTES + 123
    url, data = _object(memory_root, size)
    cache = BlockCache(str(tmp_path / "cache"), 2 * CACHE_BLOCK_BYTES)
    first = RangeReader(url, size, 0, cache, "k")
    assert first.read(10, 20) == data[10:20]
    span = (CACHE_BLOCK_BYTES - 5, CACHE_BLOCK_BYTES + 5)  # across blocks 0 and 1
    assert first.read(*span) == data[span[0] : span[1]]
    assert first.requests == 2  # blocks 0 and 1, each once
    again = RangeReader(url, size, 0, cache, "k")  # another process, the same cache
    assert again.read(*span) == data[span[0] : span[1]] and again.requests == 0
    assert again.read(size - 50, size) == data[-50:] and again.requests == 1  # last block
    assert (
        again.read(2 * CACHE_BLOCK_BYTES + 1, 2 * CACHE_BLOCK_BYTES + 9)
        == data[2 * CACHE_BLOCK_BYTES + 1 : 2 * CACHE_BLOCK_BYTES + 9]
    )
    stored = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in stored) <= 2 * CACHE_BLOCK_BYTES


def _upload(local_dir: str, url: str) -> None:
    filesystem(url).put(local_dir, url.removeprefix("memory://"), recursive=True)


def test_a_corpus_in_a_store_gives_the_windows_it_gives_on_disk(memory_root, token_dirs):
    train, _ = token_dirs
    url = f"{memory_root}/train"
    _upload(train, url)
    on_disk = MemoryMappedDataset(train, 32)
    for reads in (StoreReads(), StoreReads(read_ahead_bytes=0)):
        stored = MemoryMappedDataset(url, 32, store=reads)
        assert len(stored) == len(on_disk)
        for i in [*range(0, 40), len(on_disk) - 1, 7, 3]:
            a, b = on_disk[i], stored[i]
            assert all(np.array_equal(a[k], b[k]) for k in a), i


def _store_requests(dataset: MemoryMappedDataset) -> int:
    """Ranged requests the dataset's open store readers have sent."""
    return sum(m.reader.requests for m in dataset._stream._maps.values() if hasattr(m, "reader"))


@pytest.mark.parametrize("cached", [False, True])
def test_a_batch_is_fetched_in_one_prefetch_and_reads_the_same_samples(
    memory_root, token_dirs, tmp_path, cached
):
    """A batch's windows go out in one read_ranges (the loader's __getitems__), after which
    its reads send nothing; the samples equal one ``dataset[i]`` each and those on disk.
    With the cache, the prefetch fetches the missing blocks only, and a second batch over
    the same blocks none."""
    train, _ = token_dirs
    url = f"{memory_root}/train"
    _upload(train, url)
    on_disk = MemoryMappedDataset(train, 32)
    reads = StoreReads(0, str(tmp_path), 1 << 30) if cached else StoreReads(read_ahead_bytes=0)
    stored = MemoryMappedDataset(url, 32, store=reads)
    batch = [900, 3, len(on_disk) - 1, 450, 3, 77]  # shuffled, one window twice
    stored.prefetch(batch)
    fetched = _store_requests(stored)
    assert fetched == (-(-on_disk.num_tokens * 2 // CACHE_BLOCK_BYTES) if cached else 5)
    samples = [stored[i] for i in batch]
    # Each read came from the prefetch but the repeated window's second, which goes to
    # the store again (to the cache, with one).
    assert _store_requests(stored) == fetched + (0 if cached else 1)
    for i, sample in zip(batch, samples, strict=True):
        assert all(np.array_equal(sample[k], on_disk[i][k]) for k in sample), i
    again = stored.__getitems__(batch)
    assert _store_requests(stored) == fetched + (0 if cached else 1 + 5 + 1)
    assert [list(s["labels"]) for s in again] == [list(on_disk[i]["labels"]) for i in batch]


def test_a_store_directory_without_a_corpus_is_refused_like_one_on_disk(memory_root):
    with pytest.raises(DataError, match="is not a prepared data directory"):
        MemoryMappedDataset(f"{memory_root}/nothing", 32)


def test_an_unknown_protocol_names_what_to_install():
    with pytest.raises(StoreError, match="no client for nosuchstore:// stores"):
        filesystem("nosuchstore://bucket/x")


def test_a_store_url_for_the_run_directory_is_refused_at_start_up():
    config = load_config(None, ["--train.run_dir=s3://bucket/run"])
    with pytest.raises(ConfigError) as caught:
        check_stores(config)
    message = str(caught.value)
    assert message.startswith("train.run_dir = 's3://bucket/run': expected a local or mounted")
    assert "checkpoint.dir" in message and "\n" not in message


def test_a_checkpoint_url_is_probed_by_writing_and_deleting_one_object(memory_root):
    config = load_config(None, [f"--checkpoint.dir={memory_root}/ckpt"])
    check_stores(config)  # the memory store takes any write
    assert names_in(memory_root) in ([], ["ckpt"]) and not names_in(f"{memory_root}/ckpt")


def test_a_data_url_nothing_is_stored_under_is_refused_at_start_up(memory_root):
    config = load_config(None, [f"--data.path={memory_root}/missing"])
    with pytest.raises(ConfigError, match=r"^data\.path = .*nothing is stored under"):
        check_stores(config)


def test_store_read_settings_are_validated_naming_the_field():
    with pytest.raises(ConfigError, match="data.store_read_ahead_mb"):
        DataConfig(store_read_ahead_mb=-1)
    with pytest.raises(ConfigError, match="data.store_read_ahead_mb"):
        DataConfig(store_read_ahead_mb=4096)
    with pytest.raises(ConfigError, match="data.store_cache_gb"):
        DataConfig(store_cache_gb=0.001)
    with pytest.raises(ConfigError, match="data.store_cache_gb"):
        DataConfig(store_cache_gb=-1.0)
    DataConfig(store_cache_gb=0.5, store_read_ahead_mb=0)


def test_a_store_whose_client_is_missing_names_the_extra_to_install():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: its client is not missing")
    with pytest.raises(StoreError, match=r"no client for gs:// stores.*kempnerforge\[cloud\]"):
        filesystem("gs://some-bucket/corpus")


def test_a_synchronous_stores_call_is_abandoned_at_its_deadline(memory_root):
    """memory:// has a synchronous client: a call that outlives its deadline is left on a
    daemon thread (it cannot be cancelled) and the caller goes on."""
    import threading
    import time

    from kempnerforge.storage.deadlines import Deadline
    from kempnerforge.storage.stores import StoreTimeout, store_call

    release = threading.Event()

    def stuck(fs, key):
        release.wait(30)  # a client blocked in a call the store never answers
        return fs.exists(key)

    started = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"did not answer within the limit = 0.3 s"):
        store_call(f"{memory_root}/x", stuck, deadline=Deadline(0.3, "the limit"))
    assert time.monotonic() - started < 2.0  # 0.3 s and scheduling on a shared machine
    (left,) = [t for t in threading.enumerate() if t.name == "kempnerforge-store-call"]
    assert left.daemon  # the interpreter exits without waiting for it
    release.set()
    left.join(5)
    assert not left.is_alive()


def test_a_batch_stops_at_its_first_failure_and_at_its_deadline():
    import threading

    from kempnerforge.storage.deadlines import Deadline, DeadlinePassed, run_parallel

    done: list[int] = []

    def action(item: int) -> None:
        if item == 2:
            raise OSError("refused")
        done.append(item)

    with pytest.raises(OSError, match="refused"):
        run_parallel(action, range(100), workers=1, deadline=Deadline(10, "x"))
    assert done == [0, 1]  # nothing was started after the failure
    hold = threading.Event()
    with pytest.raises(DeadlinePassed) as late:
        run_parallel(lambda _: hold.wait(30), range(5), workers=2, deadline=Deadline(0.2, "x"))
    assert (late.value.unfinished, late.value.total) == (5, 5)
    hold.set()


def test_a_call_ended_by_its_own_bound_at_the_deadline_reports_the_batch_deadline():
    """Each call of a batch is bounded by the batch's deadline, so at a stall the call's
    own timeout and the batch's wait end together: whichever the machine notices first,
    the batch reports its deadline, not the call's own timeout."""
    import time

    from kempnerforge.storage.deadlines import Deadline, DeadlinePassed, run_parallel

    deadline = Deadline(0.2, "x")

    def action(item: int) -> None:
        if item == 1:
            time.sleep(deadline.remaining())  # the stalled call, ended by its bound
            raise TimeoutError("the call's own timeout")

    with pytest.raises(DeadlinePassed) as late:
        run_parallel(action, range(3), workers=3, deadline=deadline)
    assert (late.value.unfinished, late.value.total) == (1, 3)
