"""The DCP storage reader every load here uses: ``.metadata`` is unpickled through an allow-list.

torch's FileSystemReader reads ``.metadata`` with plain ``pickle.load``, so a file swapped in
after the completeness check would still run code inside ``dcp.load``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from kempnerforge.checkpoint.dcp_metadata import read_dcp_metadata
from kempnerforge.checkpoint.disk_format import DCP_METADATA
from kempnerforge.core.errors import CheckpointError

Span = tuple[str, int, int]
"""(relative path, offset, length) of one DCP item."""
FETCHERS: dict[Path, Callable[[list[Span]], None]] = {}
"""Checkpoints staged from an object store (store_reads.fetch_share), by local path: each
maps to what fetches the items a load reads outside the files its check fetched (another
rank's item: a replicated tensor, or any item when the layout changed) before DCP reads
them."""


class AllowListedReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` goes through ``dcp_metadata.read_dcp_metadata``.

    A ``.metadata`` the allow-list refuses (or that cannot be read) raises CheckpointError
    naming the checkpoint. DCP catches what read_metadata raises and reports only its text,
    so the first such error is also kept in `refusal` for the caller to raise as it is.
    """

    def __init__(self, checkpoint: str | os.PathLike[str]) -> None:
        super().__init__(checkpoint)
        self.refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's DCP metadata, tagged with this load's id as torch's reader does."""
        root = Path(self.path)
        if kwargs.get("rank") is not None:
            # DCP falls back to a rank's own metadata file when the global one fails; a save
            # here never writes one, and reading it would bypass the failure just recorded.
            raise self._refuse(CheckpointError(root, "has no rank-local DCP metadata to read"))
        try:
            metadata = read_dcp_metadata(root)
        except Exception as e:
            raise self._refuse(
                CheckpointError(root, f"{DCP_METADATA} (DCP) is unreadable: {e}")
            ) from None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read of this rank's items, after fetching their files from the store
        when the checkpoint is staged from one (FETCHERS)."""
        fetch = FETCHERS.get(Path(self.path))
        if fetch is not None:
            infos = [self.storage_data[item.storage_index] for item in plan.items]
            fetch([(info.relative_path, info.offset, info.length) for info in infos])
        return super().read_data(plan, planner)

    def _refuse(self, error: CheckpointError) -> CheckpointError:
        if self.refusal is None:
            self.refusal = error
        return error
