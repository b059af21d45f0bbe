"""How a scored text starts: the way the training documents started, so a task (and the
lm-evaluation-harness model) reads text as the model learnt it.

A prepared corpus is ``[BOS] doc EOS [BOS] doc EOS ...`` (BOS with ``prepare-data --bos``).
What the model saw before a document's first token follows from that and the training's
document masking (data/dataset.py):

- BOS when the documents began with one: it opens each document and predicts its first
  token, masked or not;
- the EOS that ended the document before, for documents without BOS read without document
  masking (a corpus that is not loss-masked): the first token was predicted from it;
- nothing otherwise: document masking gives that EOS to the document it ends, and a
  loss-masked corpus never predicts across a document end, so the first token of a
  document opened it and was never predicted. A text then starts with its own first token,
  which is not scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kempnerforge.config.data import DataConfig
from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.sampling import MixtureDataset
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import is_masked, read_parts

logger = get_logger(__name__)


@dataclass(frozen=True)
class DocumentStart:
    """The tokens a scored text is read after: ``(BOS,)``, ``(EOS,)`` or none (the text's
    own first token opens it, unscored). ``eos_id`` stands in before a first scored token
    that has nothing else before it (an empty context with no start token)."""

    ids: tuple[int, ...]
    eos_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, bos: bool, eos_before: bool = False) -> DocumentStart:
        """BOS when ``bos``, else EOS when ``eos_before``, else no start token."""
        if bos:
            return cls((tokenizer.bos_id,), tokenizer.eos_id)
        return cls((tokenizer.eos_id,) if eos_before else (), tokenizer.eos_id)

    def tokens(self, ids: Sequence[int]) -> list[int]:
        """``ids`` after the start tokens; a lone EOS when both are empty, since a token is
        scored from the tokens before it."""
        return [*self.ids, *ids] or [self.eos_id]

    def describe(self) -> str:
        """What a scored text starts with, for the log."""
        if not self.ids:
            return (
                "its own first token, which is not scored: the training documents had no "
                "BOS and nothing before them (document masking), so the model never "
                "predicted a document's first token"
            )
        if self.ids[0] == self.eos_id:
            return (
                f"EOS (id {self.eos_id}): the training documents had no BOS and followed "
                "the EOS of the one before (no document masking)"
            )
        return f"BOS (id {self.ids[0]}): the training documents began with it"


def training_start(tokenizer: Tokenizer, data_cfg: DataConfig, data: DataPipeline) -> DocumentStart:
    """How the training documents started (module docstring), logged once: from the
    training data ``data`` opened, else from the meta.json of the training sources
    ``data_cfg`` names (a build without training data opens none), else from the built-in
    corpus's settings."""
    metas = _training_metas(data_cfg, data)
    if metas is None:  # a source's meta.json cannot be read: what the pipeline says
        bos, masked = data.bos_per_document, False
    else:
        bos = all(bool(meta["bos_per_document"]) for meta in metas)
        masked = any(is_masked(meta) for meta in metas)
    eos_before = not data_cfg.document_masking and not masked
    start = DocumentStart.of(tokenizer, bos, eos_before)
    logger.info(f"evaluation reads each text after {start.describe()}")
    return start


def _training_metas(data_cfg: DataConfig, data: DataPipeline) -> list[dict[str, Any]] | None:
    """meta.json of each training source (a sharded one's corpus-wide fields); None, with a
    warning, when one cannot be read."""
    if isinstance(data.dataset, MixtureDataset):
        return [source.meta for source in data.dataset.datasets]
    if isinstance(data.dataset, MemoryMappedDataset):
        return [data.dataset.meta]
    paths = [source.path for source in data_cfg.datasets] or [data_cfg.path]
    if not any(paths):
        return [{"bos_per_document": data_cfg.builtin_bos}]  # the built-in corpus
    try:
        return [read_parts(path)[0] for path in paths]
    except DataError as error:
        logger.warning(
            f"cannot read the training data's meta.json ({error}); evaluation starts texts as "
            "the eval sets' documents start"
        )
        return None
