"""Multi-token prediction's rules against the rest of the job (model.mtp_depth > 0): the
layouts and model kinds its training head runs in; run by JobConfig.validate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

_REFUSED_LAYOUTS = {
    "pp": "the MTP modules need the embedding (first stage) and the head (last stage) "
    "together, which pipeline stages split",
    "cp": "module k reads the token k positions ahead, which context parallelism puts on "
    "another rank at each shard's end",
    "tp": "the MTP modules' projection and blocks have no tensor-parallel plan yet",
}
"""The [distributed] degrees that must stay 1 with multi-token prediction, and why."""


def check_mtp_job(config: JobConfig) -> None:
    """With model.mtp_depth > 0: a text-only job, without pipeline, context or tensor
    parallelism (FSDP, HSDP and expert parallelism shard the MTP modules like blocks),
    and sequences long enough for every depth to have a target."""
    model, dist = config.model, config.distributed
    if not model.mtp_depth:
        return
    if config.vlm is not None:
        raise ConfigError(
            "model.mtp_depth",
            model.mtp_depth,
            "0 for a vision-language job ([vlm])",
            "multi-token prediction trains a text model's decoder only",
        )
    for axis, why in _REFUSED_LAYOUTS.items():
        degree = getattr(dist, axis)
        if degree > 1:
            raise ConfigError(
                f"distributed.{axis}",
                degree,
                f"1 with multi-token prediction (model.mtp_depth = {model.mtp_depth})",
                f"{why}; set model.mtp_depth = 0 or use FSDP and expert parallelism",
            )
    seq_len = config.train.seq_len
    if model.mtp_depth > seq_len - 2:
        raise ConfigError(
            "model.mtp_depth",
            model.mtp_depth,
            f"at most train.seq_len - 2 = {seq_len - 2}",
            "depth k predicts the token k + 1 past the next, which must lie in the sequence",
        )
