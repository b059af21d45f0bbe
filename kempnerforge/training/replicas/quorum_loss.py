"""A replica group that cannot get a quorum (the lighthouse gone or silent): save the last
committed step once for the job, then stop as a preempted run does (exit 75).

When the quorum of a step attempt fails, every group holds the same state: the one its
last committed step left (a commit is all or nothing across the quorum, and an attempt
whose quorum failed has not started its forward). So nothing needs to be redone: the
group that was participant 0 of that quorum writes a checkpoint of it, with its own
process group as every save of the job, unless that step is on disk already, and every
group stops. A relaunch of the job resumes exactly there, as a whole-job restart does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.core.logging import get_logger
from kempnerforge.resilience.hang import CHECKPOINT, watch
from kempnerforge.training.loop import save_checkpoint
from kempnerforge.training.session import TrainingSession

logger = get_logger(__name__)


class QuorumLost(Exception):
    """The quorum of a step attempt failed: torchft could not reach the lighthouse, or the
    lighthouse formed no quorum within fault_tolerance.quorum_timeout_s.

    Raised before the attempt's forward, so the group's state is its last committed
    step's; ReplicaGroup.train catches it and calls stop_after_quorum_loss.
    """

    def __init__(self, group_id: int, step: int, cause: BaseException) -> None:
        super().__init__(
            f"replica group {group_id} got no quorum for step {step} ({cause}); is the "
            "lighthouse (fault_tolerance.lighthouse, TORCHFT_LIGHTHOUSE) running?"
        )
        self.group_id = group_id


@dataclass
class LastCommit:
    """What a group knows about its last committed step when a quorum fails."""

    step: int
    """The loop's step after it (optimizer steps taken)."""
    tokens_seen: int
    was_participant_0: bool
    """Whether this group was participant 0 of that step's quorum: the job's saver."""
    on_disk: bool
    """Whether this group knows a checkpoint of that step is on disk (it resumed from it,
    or wrote it)."""


def stop_after_quorum_loss(
    session: TrainingSession, lost: QuorumLost, last: LastCommit
) -> tuple[int, int]:
    """Save the last committed step if this group is the saver and it is not on disk yet,
    then ask the run to stop as after a stop signal (the CLI exits 75, PREEMPTED).

    Collective within the group (the save); nothing crosses groups, whose quorum is gone.
    Logs a ``replica_quorum_lost`` event. Returns the loop's (step, tokens_seen).
    """
    step, tokens_seen = last.step, last.tokens_seen
    logger.error("%s: stopping at step %d", lost, step)
    saves = last.was_participant_0 and not last.on_disk and step > 0
    session.tracker.log_event(
        step, "replica_quorum_lost", group=lost.group_id, saved=saves, error=str(lost)
    )
    if saves:
        # A checkpoint of the step exactly as the loop writes one, committed before the
        # process exits (in async mode too).
        save_checkpoint(session, step, tokens_seen)
        with watch(CHECKPOINT, step):
            session.checkpointer.wait()
        logger.warning(
            "replica group %d saved step %d for the job: a relaunch resumes there",
            lost.group_id,
            step,
        )
    session.tracker.flush()
    session.shutdown_handler.request("the replica groups' quorum was lost")
    return step, tokens_seen
