"""[dpo]: direct preference optimisation (train.loss_fn = "dpo"): the loss variant, its beta
and label smoothing, and where the reference log-probabilities come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kempnerforge.config.checks import check_choice, check_in_range, check_positive
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
"""The preference losses offered, under TRL's loss_type names: sigmoid (DPO; with
label_smoothing > 0 conservative DPO), robust (rDPO), ipo (IPO, length-normalised as TRL
does), hinge (SLiC's hinge), simpo (SimPO, reference-free, as TRL's CPOTrainer computes it
with cpo_alpha = 0)."""

REFERENCES = ("live", "stored")
"""Where the reference log-probabilities come from: "live", a frozen copy of the
policy's starting weights run forward on every micro-batch; "stored", computed once by that
copy for every window of the corpus and read with the data."""


@dataclass
class DPOConfig:
    beta: float = 0.1
    """The strength of the pull towards the reference (beta in the DPO paper; IPO's tau).
    Larger keeps the policy closer to the reference. In (0, 1000]."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), robust (rDPO), ipo (IPO, log-ratios per response token) or hinge
    (SLiC), as TRL's DPOTrainer computes them; or simpo (SimPO: no reference, each
    response's mean log-probability per token, a target margin dpo.simpo_gamma), as TRL's
    CPOTrainer computes it."""
    label_smoothing: float = 0.0
    """The assumed share of pairs whose preference label is flipped, in [0, 0.5): with
    sigmoid or simpo, the conservative loss (cDPO); with robust, rDPO's noise rate; 0
    otherwise."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma; TRL's simpo_gamma): the loss is -log
    sigmoid(beta * (mean log-prob of chosen - of rejected) - gamma). In [0, 100]; read with
    loss_type = "simpo" only."""
    reference: str = "live"
    """"live": a frozen copy of the starting weights (the model checkpoint.resume_from names,
    or the seed's initialisation without one) gives the reference log-probabilities: one
    more forward per micro-batch and one more copy of the weights (sharded as the policy's)
    on every rank. "stored": the same copy computes every window's once, before the first
    step, into a file under dpo.reference_dir that later launches read back (nothing more
    per step; the copy is freed before training)."""
    reference_dir: str = ""
    """Where dpo.reference = "stored" keeps its values: a directory every rank reads (a
    shared file system on several nodes); "" is a `reference` folder inside data.path. One
    file per corpus, reference weights, model and compute dtype, named by their hash."""

    def __post_init__(self) -> None:
        check_positive("dpo.beta", self.beta, 1000.0)
        check_choice("dpo.loss_type", self.loss_type, DPO_LOSS_TYPES)
        check_in_range("dpo.label_smoothing", self.label_smoothing, 0.0, 0.4999)
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ConfigError(
                "dpo.label_smoothing",
                self.label_smoothing,
                f"0 with dpo.loss_type = {self.loss_type!r}",
                "label smoothing applies to the sigmoid (cDPO), simpo and robust losses only",
            )
        check_in_range("dpo.simpo_gamma", self.simpo_gamma, 0.0, 100.0)
        check_choice("dpo.reference", self.reference, REFERENCES)
        if self.loss_type == "simpo" and self.reference == "stored":
            raise ConfigError(
                "dpo.reference",
                self.reference,
                "'live' (unused) with dpo.loss_type = 'simpo'",
                "SimPO has no reference model, so there is nothing to store",
            )
        if "://" in self.reference_dir:
            raise ConfigError(
                "dpo.reference_dir",
                self.reference_dir,
                "a directory on a file system every rank mounts",
                "stored reference log-probabilities are written and mapped as local files",
            )


def check_dpo_job(config: JobConfig) -> None:
    """train.loss_fn = "dpo" against the rest of the job: a text model, one sequence per
    context-parallel rank, no pipeline, no z-loss (it would join the log-probabilities) and
    an even micro-batch (a pair's two rows travel together)."""
    if config.train.loss_fn != "dpo":
        return
    train, dist = config.train, config.distributed
    rules = [
        (config.is_vlm, "train.loss_fn", "dpo", "a text model", "DPO trains text models"),
        (dist.pp > 1, "distributed.pp", dist.pp, "1 with train.loss_fn = 'dpo'",
         "the pipeline step computes the token loss only; use FSDP or tensor parallelism"),
        (dist.cp > 1, "distributed.cp", dist.cp, "1 with train.loss_fn = 'dpo'",
         "a response's log-probability is summed over its whole sequence on one rank"),
        (train.z_loss_weight > 0, "train.z_loss_weight", train.z_loss_weight,
         "0 with train.loss_fn = 'dpo'", "the z-loss would join the log-probabilities"),
        (train.batch_size % 2 == 1, "train.batch_size", train.batch_size,
         "an even number with train.loss_fn = 'dpo'",
         "a micro-batch holds batch_size / 2 pairs, chosen rows first, then rejected"),
        (config.dpo.reference == "stored" and not config.dpo.reference_dir
         and "://" in config.data.path, "dpo.reference_dir", "",
         "a local directory when data.path is in a store",
         "stored reference log-probabilities are written and mapped as local files"),
        (config.fault_tolerance.enabled, "fault_tolerance.enabled", True,
         "false with train.loss_fn = 'dpo'",
         "replica groups read their own batch stream, which carries no reference"),
    ]  # fmt: skip
    for failed, field, value, expected, hint in rules:
        if failed:
            raise ConfigError(field, value, expected, hint)
