"""Optimizers (AdamW forms, Lion, Muon, Schedule-free) and learning-rate schedulers, built
from the [optimizer] and [scheduler] sections."""
