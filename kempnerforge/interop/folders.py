"""Writing an output folder whole or not at all: export and import-hf build theirs under
a temporary name and rename it at the end, so a failure leaves no half-written model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from kempnerforge.core.errors import ConfigError


def new_folder(path: str, field: str) -> Path:
    """``path`` as a folder to write: it must not exist, or be an empty directory; else a
    ConfigError naming ``field``, the flag or config field that gave it."""
    folder = Path(path)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(
            field,
            path,
            "a new or empty directory",
            "it already holds files; choose another path or remove them",
        )
    return folder


class staged:
    """Context manager: a sibling ``<out>.partial`` folder renamed to ``out`` on success and
    removed on failure, so ``out`` never holds a half-written model. ``out`` is a folder
    new_folder accepted."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.staging = out.with_name(out.name + ".partial")

    def __enter__(self) -> Path:
        if self.staging.exists():
            shutil.rmtree(self.staging)  # left by an earlier failed attempt
        self.staging.mkdir(parents=True)
        return self.staging

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        if self.out.exists():
            self.out.rmdir()  # empty (checked by new_folder)
        os.replace(self.staging, self.out)
