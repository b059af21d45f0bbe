"""Conversations prepare-data leaves out because they cannot be written (the chat template
refuses them, or an assistant turn cannot be found in the render): skipped and counted per
split, or with ``stop`` the first one stops the run."""

from __future__ import annotations

from typing import Any

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.chat import ConversationRefused
from kempnerforge.data.tokens import TokenFileWriter

logger = get_logger(__name__)

REFUSED_KEY = "conversations_refused"
"""meta.json's count of the conversations of a split that were left out as refused."""
# Refusals logged one by one; the rest are only counted (a large file may hold many).
_LOGGED = 5


class RefusedConversations:
    """The refused conversations of each split (0: train, 1: held out)."""

    def __init__(self, stop: bool) -> None:
        self.stop = stop
        self.counts = [0, 0]
        self.first: str | None = None

    def add(self, refusal: ConversationRefused, split: int) -> None:
        """Count ``refusal`` in ``split`` (logging the first few), or stop the run."""
        if self.stop:
            raise DataError(
                f"{refusal}; fix or leave out this conversation (without --stop-on-refused "
                "prepare-data skips such conversations and counts them)"
            )
        self.counts[split] += 1
        self.first = self.first or str(refusal)
        if sum(self.counts) <= _LOGGED:
            logger.warning("skipped a conversation: %s", refusal)

    def meta(self, split: int) -> dict[str, Any]:
        """The meta.json field of ``split``."""
        return {REFUSED_KEY: self.counts[split]}

    def check_not_all(self, writers: list[TokenFileWriter]) -> None:
        """Refuse a split every conversation of which was refused, naming the first reason."""
        for split, writer in enumerate(writers):
            if self.counts[split] and writer.num_documents == 0:
                raise DataError(
                    f"{writer.output_dir}: all {self.counts[split]} conversations were refused; "
                    f"the first: {self.first}"
                )

    def report(self) -> None:
        """One warning with the total, when any were skipped."""
        total = sum(self.counts)
        if total > _LOGGED:
            logger.warning(
                "skipped %d conversations in all (%d logged above); meta.json counts them as "
                "%s; pass --stop-on-refused to stop at the first instead",
                total,
                _LOGGED,
                REFUSED_KEY,
            )
