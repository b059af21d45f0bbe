"""The tensor names every architecture here shares with ours, and HFTensors, which hands a
folder's tensors out by name with their shapes checked.

Llama, Mistral, Qwen3, OLMo 2, Mixtral, Qwen2-MoE and GLM-4-MoE compute the same attention
block as our Transformer (with the query and key norms and the norm placement the decoder
options choose), so their embedding, attention, norm and head tensors (and a dense layer's
feed-forward) map one to one:

- RoPE: both rotate the two halves of each head (channel i with channel i + head_dim / 2)
  with inverse frequencies theta ** (-2i / head_dim), so q and k need no permutation;
- RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, eps inside the root;
- attention: softmax(q k^T / sqrt(head_dim)) v, query head h reading key/value head
  h // (n_heads / n_kv_heads), no biases; a query or key norm before RoPE, over each
  head or over the whole projection, with the same RMSNorm;
- SwiGLU: our w2(silu(w1 x) * w3 x) is down_proj(silu(gate_proj x) * up_proj x).

Both store nn.Linear weights as (out, in), so these tensors are copied, never transposed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.hf_files import CONFIG_JSON, HFFolderError
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer


def outer_pairs(tied: bool) -> list[tuple[str, str]]:
    """(our name, Hugging Face name) of the embedding, final norm and (untied) head."""
    pairs = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
    ]
    if not tied:
        pairs.append(("output.weight", "lm_head.weight"))
    return pairs


BLOCK_NORMS = {
    "pre": (("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")),
    "post": (
        ("attention_post_norm", "post_attention_layernorm"),
        ("ffn_post_norm", "post_feedforward_layernorm"),
    ),
    "sandwich": (
        ("attention_norm", "input_layernorm"),
        ("attention_post_norm", "post_attention_layernorm"),
        ("ffn_norm", "pre_feedforward_layernorm"),
        ("ffn_post_norm", "post_feedforward_layernorm"),
    ),
}
"""(our name, Hugging Face name) of a block's norms, by model.norm_placement. The names
follow the place, not the order: Llama's post_attention_layernorm normalises the
feed-forward's input, OLMo 2's and Gemma's the attention's output."""


def block_pairs(cfg: ModelConfig, index: int) -> list[tuple[str, str]]:
    """(our name, Hugging Face name) of layer ``index``'s attention (with its query and key
    norms when model.qk_norm has them: self_attn.q_norm / k_norm in every class that has
    them: Qwen3, OLMo 2, Gemma 3) and its norms."""
    ours, hf = f"layers.{index}.", f"model.layers.{index}."
    pairs = [(f"{ours}attention.w{p}.weight", f"{hf}self_attn.{p}_proj.weight") for p in "qkvo"]
    if cfg.qk_norm != "none":
        pairs += [
            (f"{ours}attention.{p}_norm.weight", f"{hf}self_attn.{p}_norm.weight") for p in "qk"
        ]
    for our_norm, hf_norm in BLOCK_NORMS[cfg.norm_placement]:
        pairs.append((f"{ours}{our_norm}.weight", f"{hf}{hf_norm}.weight"))
    return pairs


def swiglu_pairs(ours: str, hf: str) -> list[tuple[str, str]]:
    """(our name, HF name) of one SwiGLU: w1 = gate_proj, w3 = up_proj, w2 = down_proj."""
    return [
        (f"{ours}.w1.weight", f"{hf}.gate_proj.weight"),
        (f"{ours}.w3.weight", f"{hf}.up_proj.weight"),
        (f"{ours}.w2.weight", f"{hf}.down_proj.weight"),
    ]


def dense_ffn_pairs(index: int) -> list[tuple[str, str]]:
    """(our name, HF name) of the dense feed-forward of layer ``index``."""
    return swiglu_pairs(f"layers.{index}.feed_forward", f"model.layers.{index}.mlp")


def shared_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor copied under Llama's names: the embedding, final
    norm and head, each layer's attention and norms, and the feed-forward of each dense
    layer (every layer of a dense model; an MoE layer's tensors are its architecture's)."""
    pairs = outer_pairs(cfg.tie_embeddings)
    for index in range(cfg.n_layers):
        pairs += block_pairs(cfg, index)
        if not cfg.is_moe_layer(index):
            pairs += dense_ffn_pairs(index)
    return pairs


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our state dict's tensor shapes for ``cfg``, from a model built on the meta device."""
    with on_meta():
        model = Transformer(cfg)
    return {name: value.shape for name, value in model.state_dict().items()}


class HFTensors:
    """The tensors of one folder, handed out by name with their shape checked.

    Every tensor taken is remembered, so ``check_all_used`` can refuse a folder that holds
    weights its architecture would silently ignore (a bias, an extra layer).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], folder: str | os.PathLike[str]) -> None:
        self.tensors = tensors
        self.folder = Path(folder)
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """Tensor ``name`` as fp32, or an HFFolderError naming it when absent or mis-shaped."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise HFFolderError(
                self.folder,
                f"the tensor {name} is missing from the weights; the folder is incomplete "
                f"or its {CONFIG_JSON} describes another model",
            )
        if tuple(tensor.shape) != tuple(shape):
            raise HFFolderError(
                self.folder,
                f"the tensor {name} has shape {tuple(tensor.shape)}, but {CONFIG_JSON} "
                f"implies {tuple(shape)}",
            )
        self.used.add(name)
        return tensor.to(torch.float32)

    def ignore(self, name: str) -> None:
        """Mark ``name`` as known but not needed (a tied head saved anyway)."""
        if name in self.tensors:
            self.used.add(name)

    def ignore_prefixes(self, prefixes: tuple[str, ...]) -> None:
        """Mark every tensor whose name starts with one of ``prefixes`` as known but not
        needed (layers past the decoder, for instance)."""
        self.used.update(n for n in self.tensors if prefixes and n.startswith(prefixes))

    def check_all_used(self) -> None:
        """Refuse tensors no mapping took, except RoPE tables some folders carry."""
        left = sorted(
            n for n in self.tensors if n not in self.used and not n.endswith("rotary_emb.inv_freq")
        )
        if left:
            raise HFFolderError(
                self.folder,
                f"holds {len(left)} tensors this layout has no place for (first: {left[0]}); "
                f"its {CONFIG_JSON} does not describe them, so the model cannot be imported "
                "exactly",
            )


def take_pairs(
    source: HFTensors,
    pairs: list[tuple[str, str]],
    shapes: dict[str, torch.Size],
    into: dict[str, torch.Tensor],
) -> None:
    """Copy each HF tensor of ``pairs`` into ``into`` under our name, shapes checked."""
    for ours, hf in pairs:
        into[ours] = source.take(hf, shapes[ours])


def tie_head(cfg: ModelConfig, state: dict[str, torch.Tensor], source: HFTensors) -> None:
    """A tied model's head is its embedding (a copy of lm_head in the folder is ignored)."""
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
        source.ignore("lm_head.weight")
