"""A hook that shows whether a run's process went through Python's finalisation."""

from __future__ import annotations

import atexit
import os
import pathlib

from kempnerforge.config.job import JobConfig
from kempnerforge.training.hooks import TrainingHook

ATEXIT_DIR_ENV = "KF_TEST_ATEXIT_DIR"


class MarkAtExit(TrainingHook):
    """Registers an atexit handler that writes ``$KF_TEST_ATEXIT_DIR/atexit-rank<R>``:
    the file exists after the process only if the interpreter finalised."""

    def on_train_begin(self, config: JobConfig) -> None:
        path = pathlib.Path(os.environ[ATEXIT_DIR_ENV]) / f"atexit-rank{os.environ.get('RANK', 0)}"
        atexit.register(path.write_text, "finalised\n")
