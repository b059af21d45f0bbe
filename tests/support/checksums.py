"""Re-recording a checkpoint's checksums after a test changed its files on purpose."""

from __future__ import annotations

from pathlib import Path

from kempnerforge.checkpoint.checksums import checksum_of_bytes, read_checksums, write_checksums


def rerecord_checksums(path: Path, rank: int = 0) -> None:
    """Record the checksums of rank `rank`'s files as they are now in checkpoint `path`,
    as someone editing or planting them would: checksums catch damage, not tampering, so
    a test of what lies behind them (the weights-only loads, the data order's version)
    forges them first."""
    recorded, problem = read_checksums(path, rank)
    assert recorded is not None, problem
    write_checksums(
        path, rank, {name: checksum_of_bytes((path / name).read_bytes()) for name in recorded}
    )
