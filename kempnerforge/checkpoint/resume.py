"""Reading a checkpoint back: its train state, then model and optimizer through DCP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from kempnerforge.checkpoint.choice import choose, list_candidates
from kempnerforge.checkpoint.coordination import quiet_single_process
from kempnerforge.checkpoint.dcp_metadata import read_dcp_metadata
from kempnerforge.checkpoint.disk_format import DCP_METADATA, load_marker, train_state_name
from kempnerforge.checkpoint.failures import FAILURES, describe_failure, first_cause
from kempnerforge.checkpoint.integrity import checkpoint_problems, train_state_source
from kempnerforge.checkpoint.planner import WeightsOnlyLoadPlanner, refusal
from kempnerforge.checkpoint.reader import AllowListedReader
from kempnerforge.checkpoint.tied_head import rename_head_copy, saved_name
from kempnerforge.core.errors import CheckpointError, incomplete
from kempnerforge.core.logging import get_logger
from kempnerforge.model.contract import FamilyModel
from kempnerforge.model.lora import is_adapter_parameter

logger = get_logger(__name__)


def newest_complete(directory: Path) -> str | None:
    """In one process: the checkpoint ``latest`` names if complete, else the newest
    complete one, else None; every rank's share of each candidate is checked here."""
    candidates = list_candidates(directory, "auto")
    assert candidates is not None
    try:
        return choose(candidates, checkpoint_problems)
    except CheckpointError:
        return None  # only broken checkpoints: nothing to return to


def read_train_state(
    root: Path, rank: int, world_size: int, *, quiet: bool = False
) -> dict[str, Any]:
    """Rank `rank`'s train state in `root`, a checkpoint found complete before.

    The marker is read again (it says which step and how many ranks saved), so a marker
    gone since the check still refuses the load. A rank the saving run did not have takes
    rank 0's train state, with a warning (unless `quiet`: a look at the state before the
    load that will warn).
    """
    marker = require_marker(root)
    saved_world_size = marker["world_size"]
    if saved_world_size != world_size and rank == 0 and not quiet:
        logger.warning(
            "%s was saved by %d ranks and this run has %d: model and optimizer are "
            "resharded, but dataloader positions and RNG are per rank and ranks >= %d "
            "take rank 0's",
            root,
            saved_world_size,
            world_size,
            saved_world_size,
        )
    file = root / train_state_name(train_state_source(rank, saved_world_size))
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            file, f"cannot be read as a weights-only torch file ({refusal(e)})"
        ) from None
    if not isinstance(state, dict) or state.get("step") != marker["step"]:
        raise CheckpointError(file, f"is not the train state of step {marker['step']}")
    return state


def require_marker(root: Path) -> dict[str, Any]:
    """The marker of checkpoint `root`, read again at each load: a checkpoint whose marker
    is gone since it was checked is refused (CheckpointError naming `root`)."""
    marker, problem = load_marker(root)
    if marker is None:
        raise incomplete(root, [str(problem)])
    return marker


def saved_keys(root: Path) -> set[str]:
    """The keys of the DCP entries checkpoint `root` holds ("model.<fqn>", ...)."""
    try:
        return set(read_dcp_metadata(root).state_dict_metadata)
    except Exception as e:
        raise incomplete(root, [f"{DCP_METADATA} (DCP) is unreadable: {e}"]) from None


def load_model_and_optimizer(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: set[str],
    *,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
) -> None:
    """Load the DCP files of `root` (whose keys are `saved`) into model and optimizer.

    The optimizer ends with exactly the checkpoint's state: an entry for every parameter
    the checkpoint has state for, none for the others (frozen when it was written, or not
    yet stepped), whatever the live optimizer held and whichever parameters are frozen
    now. So a resume or rollback across a freeze stage (training/freeze.py) neither loses
    saved moments nor keeps stale ones.
    """
    # get_state_dict creates the optimizer state DCP loads into, but only for an optimizer
    # without state and gradients, and only for parameters that require grad; set_state_dict
    # loads state only into parameters that require grad. So the live state is dropped,
    # every parameter is trainable while the state is created, only those with saved state
    # while it is loaded, and the flags are put back after.
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    trainable = {param: param.requires_grad for param in model.parameters()}
    with_state = _state_fqns(saved)
    # A tied parameter is listed under each of its names; its state may be under any one.
    has_saved_state = {
        id(param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if saved_name(model, state_fqn(name)) in with_state
    }
    try:
        for param in trainable:
            param.requires_grad_(True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        check_model_keys(root, saved, model_sd, partial=is_pipeline_stage(model))
        if not optim_sd.get("state") and with_state:
            raise CheckpointError(root, "the optimizer has no state to load the saved one into")
        rename_head_copy(model, optim_sd, to_saved=True)
        optim_sd = _saved_state_only(optim_sd, with_state)
        to_load: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        read_dcp(root, to_load, "model/optimizer do not load", process_group, no_dist)
        rename_head_copy(model, to_load["optimizer"], to_saved=False)
        for param in trainable:
            param.requires_grad_(id(param) in has_saved_state)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=to_load["model"],
            optim_state_dict=to_load["optimizer"],
        )
    finally:
        for param, flag in trainable.items():
            param.requires_grad_(flag)
    for param in [p for p in optimizer.state if id(p) not in has_saved_state]:
        del optimizer.state[param]


def state_fqn(name: str) -> str:
    """A parameter's name as DCP keys it: without the wrappers compile and activation
    checkpointing put in module paths."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _state_fqns(saved: set[str]) -> set[str]:
    """The parameter FQNs that have optimizer state among the checkpoint's keys."""
    prefix = "optimizer.state."
    return {k[len(prefix) :].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}


def _saved_state_only(optim_sd: dict[str, Any], with_state: set[str]) -> dict[str, Any]:
    """The optimizer state to load: only the parameters the checkpoint has state for.

    A parameter that was frozen when the checkpoint was written (training/freeze.py), or
    unfrozen but not yet stepped, has no optimizer state in it; it must have none after
    the load either, exactly as in the run that wrote the checkpoint, so its entry (made
    up by get_state_dict) is dropped instead of being looked for in the files.
    """
    state = optim_sd.get("state", {})
    kept = {fqn: v for fqn, v in state.items() if fqn in with_state}
    if len(kept) == len(state):
        return optim_sd
    return {**optim_sd, "state": kept}


def load_model_weights(
    root: Path,
    model: torch.nn.Module,
    saved: set[str],
    *,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
) -> None:
    """Load only the ``model`` entries of `root` into `model`; the optimizer's are not read.

    Low-rank adapters (model/lora.py) the checkpoint lacks keep their initial values: a
    run that adds adapters starts from a checkpoint of the model without them (an
    import-hf step_0, a pretraining run). Every other missing entry fails the load.
    """
    model_sd = get_model_state_dict(model)
    check_model_keys(root, saved, model_sd, partial=is_pipeline_stage(model))
    fresh = [k for k in model_sd if is_adapter_parameter(k) and f"model.{k}" not in saved]
    for key in fresh:
        del model_sd[key]
    read_dcp(root, {"model": model_sd}, "the model weights do not load", process_group, no_dist)
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not fresh))


def read_dcp(
    root: Path,
    state_dict: dict[str, Any],
    failure: str,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
) -> None:
    """Load the DCP files of `root` into `state_dict` in place, pickled items weights-only.

    Every DCP load of this package goes through here, and reads ``.metadata`` through the
    allow-list again (it may have changed since the completeness check). A failure raises
    CheckpointError naming `root`: the reader's or the planner's own (a refused metadata
    file or item) as it is, any other after `failure`.
    """
    reader = AllowListedReader(root)
    try:
        with quiet_single_process(no_dist):
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=WeightsOnlyLoadPlanner(root),
                process_group=process_group,
                no_dist=no_dist,
            )
    except FAILURES as e:
        # DCP reports a refused .metadata only as text inside its own AssertionError.
        cause = reader.refusal or first_cause(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(cause.path, cause.problem) from None
        raise CheckpointError(root, f"{failure}: {describe_failure(e)}") from e


def check_model_keys(
    root: Path, saved: set[str], model_sd: dict[str, Any], *, partial: bool = False
) -> None:
    """Raise CheckpointError when `root` holds model entries `model_sd` does not have.

    With ``partial`` (a pipeline stage: some layers, and the embedding or the head) only
    the parts of the model this rank holds are compared, a part being a top-level module
    or one layer: the other stages' entries are theirs to load, not unknown.
    """
    held = {_part(key) for key in model_sd}
    unknown = sorted(
        k
        for k in saved
        if k.startswith("model.")
        and k[6:] not in model_sd
        and (not partial or _part(k[6:]) in held)
    )
    if unknown:
        raise CheckpointError(
            root,
            f"{len(unknown)} saved model entries do not exist in this model (first: "
            f"{unknown[0]}); was it saved from another model config?",
        )


def is_pipeline_stage(model: torch.nn.Module) -> bool:
    """Whether ``model`` is one pipeline rank's stages (it holds part of the model)."""
    return isinstance(model, FamilyModel) and model.pipeline_group is not None


def _part(key: str) -> str:
    """The part of the model a state-dict key belongs to: 'layers.<i>' for a layer's
    entries, else its top-level module ('tok_embeddings', 'norm', 'output', ...)."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]
