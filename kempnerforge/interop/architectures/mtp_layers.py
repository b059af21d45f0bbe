"""Multi-token-prediction layers as DeepSeek-V3 and GLM-4-MoE store them: MTP module k is
``model.layers.<num_hidden_layers + k>``, a whole decoder layer (named as the decoder's, its
feed-forward always MoE) plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and
copies of the shared ``embed_tokens`` and ``shared_head.head`` (our mtp.<k>.*, model/mtp.py).

The decoder layer's tensors are mapped by the architecture's own per-layer code over a
*flat* config: the decoder's n_layers plus the MTP blocks as further MoE layers, whose state
holds each MTP block under ``layers.<n_layers + k>``. So no per-layer rule exists twice.

Import always maps them: model.mtp_depth is num_nextn_predict_layers (cut to the layers the
weights hold), so an export writes them back bit for bit and an imported DeepSeek-V3 goes on
training its MTP modules. They never change the next-token function, so a job that does not
want them drops them without an import option: ``import-hf --model.mtp_depth=0``, or a
training job with model.mtp_depth = 0 built from the folder (its tensors are then unused).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.interop.architectures.config_keys import HFConfig
from kempnerforge.interop.architectures.tensor_names import HFTensors

logger = get_logger(__name__)

State = dict[str, torch.Tensor]

_OWN = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("norm.weight", "shared_head.norm.weight"),
)
"""(our name under mtp.<k>., its name under model.layers.<n + k>.) of a module's own
tensors besides its decoder layer."""
_SHARED = (
    ("tok_embeddings.weight", "embed_tokens.weight"),
    ("output.weight", "shared_head.head.weight"),
)
"""(our shared tensor, its per-module copy): the embedding and the head every module uses."""


def mtp_depth_field(hf: HFConfig) -> int:
    """model.mtp_depth of num_nextn_predict_layers (absent: 1, the classes' default; the
    folder's weights may hold fewer, see held_mtp_depth)."""
    depth = hf.get_int("num_nextn_predict_layers", 1)
    if depth < 0:
        raise hf.error("num_nextn_predict_layers", "expected 0 or more MTP layers")
    return depth


def flat_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its MTP blocks as decoder layers n_layers .. n_layers + depth - 1, all
    MoE (the classes' MTP layers always are), for the per-layer tensor maps; the decoder's
    MoE layers are its last (both classes require it), so they stay where they are."""
    if not cfg.mtp_depth:
        return cfg
    return dataclasses.replace(
        cfg,
        n_layers=cfg.n_layers + cfg.mtp_depth,
        mtp_depth=0,
        moe_frequency=1,
        moe_first_dense_layers=cfg.n_layers - cfg.num_moe_layers,
    )


def mtp_block_is_flat_layer(cfg: ModelConfig) -> bool:
    """Whether our MTP block (built as the last decoder layer) is what the flat config's
    layer after the decoder is: an MoE block when the decoder's last layer is."""
    return not cfg.mtp_depth or cfg.is_moe_layer(cfg.n_layers - 1)


def flat_state(state: State, cfg: ModelConfig) -> State:
    """Our state with each MTP block's tensors renamed mtp.<k>.block.* -> layers.<n + k>.*
    (the modules' own tensors keep their names)."""
    pattern = re.compile(r"^mtp\.(\d+)\.block\.")
    out: State = {}
    for name, tensor in state.items():
        found = pattern.match(name)
        if found:
            name = f"layers.{cfg.n_layers + int(found.group(1))}.{name[found.end() :]}"
        out[name] = tensor
    return out


def nested_state(state: State, cfg: ModelConfig) -> State:
    """The inverse of flat_state: layers.<n + k>.* back to mtp.<k>.block.*."""
    out: State = {}
    for name, tensor in state.items():
        if name.startswith("layers."):
            index_text, rest = name[len("layers.") :].split(".", 1)
            index = int(index_text)
            if index >= cfg.n_layers:
                name = f"mtp.{index - cfg.n_layers}.block.{rest}"
        out[name] = tensor
    return out


def mtp_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """Each module's own tensors and its copies of the shared embedding and head, under the
    published names (vLLM and SGLang read the copies from the module's own layer)."""
    out: State = {}
    for k in range(cfg.mtp_depth):
        hf = f"model.layers.{cfg.n_layers + k}."
        out.update({hf + theirs: state[f"mtp.{k}.{ours}"] for ours, theirs in _OWN})
        out.update({hf + copy: state[shared].clone() for shared, copy in _SHARED})
    return out


def mtp_tensors_from_hf(source: HFTensors, state: State, cfg: ModelConfig) -> State:
    """Each module's own tensors; its copies of the embedding and head are checked against
    the decoder's (``state`` holds them): ours are shared, so a copy that differs cannot be
    kept, and is named in a warning."""
    out: State = {}
    dim = cfg.dim
    shapes = {"eh_proj.weight": (dim, 2 * dim)}
    for k in range(cfg.mtp_depth):
        hf = f"model.layers.{cfg.n_layers + k}."
        for ours, theirs in _OWN:
            out[f"mtp.{k}.{ours}"] = source.take(hf + theirs, shapes.get(ours, (dim,)))
        for shared, copy in _SHARED:
            if hf + copy not in source.tensors:
                continue  # a folder may leave the copies out: they are the decoder's
            if not torch.equal(source.take(hf + copy, state[shared].shape), state[shared]):
                logger.warning(
                    "%s: %s differs from the decoder's own; the multi-token-prediction "
                    "module shares the decoder's (model/mtp.py), so the copy is dropped",
                    source.folder,
                    hf + copy,
                )
    return out


def held_mtp_depth(cfg: ModelConfig, source: HFTensors) -> ModelConfig:
    """``cfg`` with model.mtp_depth cut to the MTP layers the folder's weights hold.

    config.json's num_nextn_predict_layers says how many the published model has, but a
    folder saved by transformers (which builds no MTP layers) keeps the key and drops the
    tensors: that folder imports without them, with a warning, instead of failing.
    """
    held = 0
    while held < cfg.mtp_depth:
        if f"model.layers.{cfg.n_layers + held}.eh_proj.weight" not in source.tensors:
            break
        held += 1
    if held < cfg.mtp_depth:
        logger.warning(
            "%s: config.json declares %d multi-token-prediction layers but the weights hold "
            "%d; importing with model.mtp_depth = %d",
            source.folder,
            cfg.mtp_depth,
            held,
            held,
        )
        cfg = dataclasses.replace(cfg, mtp_depth=held)
    return cfg
