"""Checking an output directory before prepare-data writes a corpus into it: new, empty, or
one prepare-data wrote before, never a directory of other files."""

from __future__ import annotations

from pathlib import Path

from kempnerforge.core.errors import DataError
from kempnerforge.data.tokens.token_file import META_FILE, TOKENS_FILE
from kempnerforge.data.tokens.token_flags import FLAGS_FILE
from kempnerforge.storage.files import names_in
from kempnerforge.storage.location import is_store_url


def check_output_dir(output_dir: str, option: str) -> None:
    """``output_dir`` can take a prepared corpus: it is new, empty, or one written before.

    Anything else there (a file, or a directory of other files) is refused, naming
    ``option``, the command-line option that gave the path, rather than mixed with a corpus.
    """
    what_to_do = "name a new or empty directory, or one prepare-data wrote before to rewrite it"
    if is_store_url(output_dir):
        _check_foreign(output_dir, names_in(output_dir), option, what_to_do)
        return
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise DataError(f"{option} {output_dir} is a file, not a directory; {what_to_do}")
    if not path.exists():
        # mkdir would fail on a file standing where a parent directory should be.
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise DataError(
                f"{option} {output_dir}: {blocking} is a file, not a directory; {what_to_do}"
            )
        return
    _check_foreign(output_dir, [entry.name for entry in path.iterdir()], option, what_to_do)


def _check_foreign(output_dir: str, names: list[str], option: str, what_to_do: str) -> None:
    """Refuse an output directory holding entries (``names``) prepare-data did not write."""
    foreign = sorted(name for name in names if not _is_prepared_entry(name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise DataError(
            f"{option} {output_dir} is a directory holding other files ({shown}), not a "
            f"prepared data directory; {what_to_do}"
        )


def _is_prepared_entry(name: str) -> bool:
    """Whether ``name`` is one prepare-data writes: its outputs or their temporary files
    (left behind only by a killed run)."""
    return name in (TOKENS_FILE, META_FILE, FLAGS_FILE) or name.startswith(
        (f".{TOKENS_FILE}.tmp-", f".{META_FILE}.tmp-", f".{FLAGS_FILE}.tmp-")
    )
