"""[checkpoint]: when and where the run saves itself, and what it resumes from."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_STEPS, check_at_least, check_choice, check_positive
from kempnerforge.config.distributed import MAX_TIMEOUT_S
from kempnerforge.core.errors import ConfigError

ASYNC_MODES = ("disabled", "async")


@dataclass
class CheckpointConfig:
    interval: int = 100
    """Save every N optimizer steps; 0 saves only at the end of the run; at most 2**62 - 1."""
    dir: str = ""
    """Checkpoint directory; empty means <train.run_dir>/checkpoints. A URL
    (s3://bucket/prefix, any fsspec protocol) saves into an object store: each save is
    written to staging_dir first and uploaded from there (docs/fault-tolerance.md)."""
    staging_dir: str = ""
    """With dir a store URL: the local directory each save is written to before its upload,
    and resumes read their share into (also a resume_from URL's checkpoint, in a folder of
    its own); empty means <train.run_dir>/checkpoint_staging. Node-local disk is fastest;
    it holds at most one save and one resume at a time."""
    store_timeout_s: float = 600.0
    """With dir (or resume_from) a store URL: seconds each store operation of a save or
    resume may take, its retries included (the checks before a save, a rank's uploads, the
    commit, a listing, a rank's fetch); past it a save counts as failed (a
    checkpoint_failed event, 'latest' unchanged) and a resume stops naming the store; above
    0. docs/fault-tolerance.md lists every operation's worst case."""
    store_connections: int = 8
    """With dir a store URL: files a rank uploads or downloads at once (large files also go
    in parts); at least 1."""
    resume_from: str = "auto"
    """Where a run without checkpoints of its own starts: 'auto' (nothing to load), 'none',
    a checkpoint path (absolute, or a name such as step_30 inside dir), or a store URL (a
    checkpoint, s3://bucket/prefix/step_30; a checkpoints prefix or its latest: the newest
    complete one there). Once the run has
    a complete checkpoint in dir it always resumes from its newest one (broken ones are
    skipped with a warning), whatever this says; 'none' always starts at step 0."""
    load_weights_only: bool = False
    """Start a new run from resume_from's model weights only: fresh optimizer, scheduler and
    data position, step 0. Ignored (with a log line) once the run has checkpoints of its
    own: a requeued run resumes fully from its newest."""
    allow_config_change: bool = False
    """Resume even when a field that changes what the saved state means (model, seq_len,
    batch, seed, precision, loss, tokenizer, document masking, phases) differs from the
    checkpoint's; each change is logged. See docs/fault-tolerance.md for every field."""
    reset_optimizer: bool = False
    """On resume, load the weights, step, schedule position and data position but start the
    optimizer state afresh (logged); needed to resume with another optimizer.name."""
    async_mode: str = "disabled"
    """'disabled' (the loop waits for each save) or 'async' (the write happens in the
    background while training goes on; at most one save is in flight)."""
    keep_last_n: int = 0
    """Keep only the newest N checkpoints; 0 keeps all; at most 2**62 - 1. The one 'latest'
    names is never deleted."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (in optimizer steps),
    whatever keep_last_n says; 0 marks none; at most 2**62 - 1."""

    memory_interval: int = 0
    """Also copy each rank's share of the training state to node-local shared memory every
    N optimizer steps (the memory tier, docs/fault-tolerance.md): a restart after a worker
    or every worker of a node died resumes from the newest copy every rank holds, if it is
    newer than the newest checkpoint, at memory speed. 0 turns it off. Costs one more copy
    of the rank's share in host memory per kept copy (2)."""
    memory_peer: bool = True
    """With the memory tier on a job of several nodes, also send each rank's copy to the
    same local rank on the next node, which keeps it in its host memory: a restart after a
    whole node was lost (its processes and its tmpfs) resumes from those copies. Costs one
    more copy of another rank's share in host memory per kept copy, and the network
    transfer of each copy (on a background thread). Off, or on one node: local copies only."""
    memory_dir: str = ""
    """Where the memory tier's copies live: a tmpfs that outlives the training processes;
    empty means /dev/shm/kempnerforge (the system's temporary directory where there is no
    /dev/shm). Each run keeps its copies in a folder of its own there, removed when the run
    ends."""

    max_failed_saves: int = 3
    """A save on the schedule that fails (full disk, I/O error, permission) is logged as a
    checkpoint_failed event and training goes on, 'latest' unchanged; after this many
    failed saves in a row the run stops with exit code 1. 1 stops at the first failure.
    A save a stop needs (a stop signal, the end of the run) that fails always stops the
    run. At least 1, at most 2**62 - 1."""

    def __post_init__(self) -> None:
        for name in ("interval", "keep_last_n", "keep_every", "memory_interval"):
            check_at_least(f"checkpoint.{name}", getattr(self, name), 0, MAX_STEPS)
        check_at_least("checkpoint.max_failed_saves", self.max_failed_saves, 1, MAX_STEPS)
        check_at_least("checkpoint.store_connections", self.store_connections, 1, 1024)
        check_positive("checkpoint.store_timeout_s", self.store_timeout_s, MAX_TIMEOUT_S)
        check_choice("checkpoint.async_mode", self.async_mode, ASYNC_MODES)
        if not self.resume_from:
            raise ConfigError(
                "checkpoint.resume_from", self.resume_from, "'auto', 'none' or a checkpoint path"
            )
