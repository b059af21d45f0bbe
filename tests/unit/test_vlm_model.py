"""The vision-language model: encoders, adapter, gated cross-attention, the two
architectures, initialisation after a meta build, and loading local CLIP/SigLIP towers."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.vlm import AdapterConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.heads.head_loss import HeadLoss
from kempnerforge.model.transformer import Transformer
from kempnerforge.model.vision.adapter import pool_grid
from kempnerforge.model.vision.encoder import build_vision_encoder
from kempnerforge.model.vision.vlm import VisionLanguageModel, build_vlm
from tests.support.tiny import TINY_MODEL
from tests.support.tolerance import assert_reordered_close
from tests.support.vision_towers import save_tiny_clip, save_tiny_siglip

TEXT_LEN = 8
VOCAB = 259
DECODER = [
    *TINY_MODEL,
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=32",
    f"--vlm.max_text_len={TEXT_LEN}",
]
CROSS = ["--vlm.arch=cross_attention", "--vlm.cross_attention_every_n_layers=1"]


def job_of(*overrides: str, encoder: str = "random", path: str = "") -> JobConfig:
    tower = [f"--vision_encoder.type={encoder}"]
    if path:
        tower.append(f"--vision_encoder.path={path}")
    job = load_config(None, [*DECODER, *tower, *overrides])
    job.validate(1)
    return job


def built(job: JobConfig, seed: int = 0) -> VisionLanguageModel:
    """The lead's flow: build on meta, materialize, then initialise from the seed."""
    with torch.device("meta"):
        model = build_vlm(job.model, job.vision_encoder, job.adapter, job.vlm)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def pixels(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def token_ids(batch: int = 2, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, TEXT_LEN), generator=generator)


# --- joint decoder -------------------------------------------------------------------


def test_joint_decoder_returns_text_logits_that_depend_on_the_image() -> None:
    model = built(job_of())
    ids = token_ids()
    logits = model(pixels(seed=1), ids)
    assert isinstance(logits, torch.Tensor)
    assert logits.shape == (2, TEXT_LEN, VOCAB)
    assert model.num_image_tokens == 16
    other = model(pixels(seed=5), ids)
    assert isinstance(other, torch.Tensor)
    # Every text position sees the image, so every one changes with it.
    assert (logits - other).abs().amax(dim=-1).min() > 1e-6


def test_joint_decoder_is_causal_over_the_text() -> None:
    model = built(job_of())
    image, ids = pixels(), token_ids()
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % VOCAB
    before, after = model(image, ids), model(image, changed)
    assert isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
    # Exact: the same kernels on the same shapes; an earlier row reads a later one only
    # through masked scores, whose zero weights add exact zeros.
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_labels_give_the_summed_loss_of_the_text_logits() -> None:
    model = built(job_of())
    image, ids = pixels(), token_ids()
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    loss = model(image, ids, labels=labels)
    assert isinstance(loss, HeadLoss)
    logits = model(image, ids)
    assert isinstance(logits, torch.Tensor)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    # The decoder runs the same ops both ways; the chunked head and its loss sum in other
    # orders: dim into a logit, vocab into its logsumexp, the tokens into the sum.
    cfg = model.decoder.cfg
    terms = cfg.dim + cfg.vocab_size + labels.numel()
    assert_reordered_close(loss.loss_sum, expected, terms=terms)
    loss.loss_sum.backward()
    assert model.adapter.fc1.weight.grad is not None


def test_build_vlm_takes_its_sections_and_needs_vlm_and_an_encoder() -> None:
    job = job_of()
    with torch.device("meta"):
        default = build_vlm(job.model, job.vision_encoder, None, job.vlm)
        pooled = build_vlm(
            job.model, job.vision_encoder, AdapterConfig(type="pool", pool_window=2), job.vlm
        )
    # No [adapter]: the default one, an MLP over every encoder token.
    assert default.adapter.num_output_tokens == default.spec.num_tokens
    assert pooled.adapter.num_output_tokens == default.spec.num_tokens // 4
    for missing in [(job.vision_encoder, None), (None, job.vlm)]:
        encoder, vlm = missing
        with pytest.raises(ValueError, match=r"\[vlm\] and \[vision_encoder\]"):
            build_vlm(job.model, encoder, None, vlm)


def test_meta_build_equals_a_direct_build_with_the_same_seed() -> None:
    job = job_of("--adapter.type=pool")
    torch.manual_seed(3)
    direct = build_vlm(job.model, job.vision_encoder, job.adapter, job.vlm)
    meta = built(job, seed=3)
    for (name, a), (_, b) in zip(
        direct.state_dict().items(), meta.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(direct.decoder.rope_cos, meta.decoder.rope_cos)


def test_wrong_inputs_are_named() -> None:
    model = built(job_of())
    with pytest.raises(ValueError, match=r"pixel_values has shape \(2, 3, 16, 16\)"):
        model(torch.zeros(2, 3, 16, 16), token_ids())
    with pytest.raises(ValueError, match="same batch"):
        model(pixels(batch=3), token_ids())
    with pytest.raises(ValueError, match="labels"):
        model(pixels(), token_ids(), labels=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="model.max_seq_len is 64"):
        model(pixels(), torch.zeros(2, 64 - 16 + 1, dtype=torch.long))


# --- cross-attention -----------------------------------------------------------------


def test_cross_attention_model_at_init_is_the_text_model() -> None:
    model = built(job_of(*CROSS))
    assert model.cross_attention is not None and list(model.cross_attention) == ["0", "1"]
    assert model.num_image_tokens == 0
    text = Transformer(model.cfg)
    text.load_state_dict(model.decoder.state_dict())
    ids = token_ids()
    expected = text(ids)
    assert isinstance(expected, torch.Tensor)
    # Exact: the closed gates add exact zeros to the same decoder ops.
    assert torch.equal(model(pixels(), ids), expected)

    block = model.cross_attention["1"]
    with torch.no_grad():
        block.gate_attn.fill_(0.5)
    opened = model(pixels(), ids)
    assert isinstance(opened, torch.Tensor)
    assert not torch.allclose(opened, expected)
    assert not torch.allclose(opened, model(pixels(seed=9), ids))


def test_cross_attention_blocks_follow_every_nth_layer() -> None:
    job = job_of("--vlm.arch=cross_attention", "--vlm.cross_attention_every_n_layers=2")
    model = built(job)
    assert model.cross_attention is not None and list(model.cross_attention) == ["1"]
    units = model.fsdp_units()
    assert units[0] is model.adapter and units[1] is model.cross_attention["1"]


def test_cross_attention_gates_get_gradients_and_start_at_zero() -> None:
    model = built(job_of(*CROSS))
    assert model.cross_attention is not None
    labels = token_ids(seed=4)
    loss = model(pixels(), token_ids(), labels=labels)
    assert isinstance(loss, HeadLoss)
    loss.loss_sum.backward()
    for block in model.cross_attention.values():
        assert block.gate_attn.item() == 0.0 and block.gate_ffn.item() == 0.0
        assert block.gate_attn.grad is not None and block.gate_attn.grad.abs().item() > 0


# --- encoders and adapter ------------------------------------------------------------


def test_random_encoder_is_the_same_for_every_seed() -> None:
    job = job_of()
    first, second = built(job, seed=0), built(job, seed=1)
    for (name, a), (_, b) in zip(
        first.encoder.state_dict().items(), second.encoder.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not torch.equal(first.adapter.fc1.weight, second.adapter.fc1.weight)
    assert not torch.equal(
        first.decoder.layers["0"].attention.wq.weight,
        second.decoder.layers["0"].attention.wq.weight,
    )
    features = first.encoder(pixels())
    assert features.shape == (2, 16, 64)
    assert {n for n, _ in first.encoder.named_parameters()} == {
        "patch_embedding.weight",
        "patch_embedding.bias",
        "position_embedding",
        "norm.weight",
        "norm.bias",
    }


def test_pool_adapter_averages_the_grid() -> None:
    model = built(job_of("--adapter.type=pool", "--adapter.pool_window=2"))
    assert model.adapter.num_output_tokens == 4 and model.num_image_tokens == 4
    logits = model(pixels(), token_ids())
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, TEXT_LEN, VOCAB)
    tokens = torch.arange(16.0).view(1, 16, 1)  # a 4 x 4 grid, row-major
    assert pool_grid(tokens, grid=4, window=2).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]


# --- pretrained towers ---------------------------------------------------------------


def reference_features(path: str, kind: str, whole_model: bool) -> torch.Tensor:
    """The tower's tokens as transformers computes them from the same directory."""
    from transformers import CLIPModel, CLIPVisionModel, SiglipModel, SiglipVisionModel

    classes = {
        ("clip", False): CLIPVisionModel,
        ("clip", True): CLIPModel,
        ("siglip", False): SiglipVisionModel,
        ("siglip", True): SiglipModel,
    }
    model = classes[kind, whole_model].from_pretrained(path, local_files_only=True)
    tower = model.vision_model if whole_model else model
    with torch.no_grad():
        hidden = tower(pixel_values=pixels()).last_hidden_state
    return hidden[:, 1:] if kind == "clip" else hidden


@pytest.mark.parametrize(
    ("kind", "whole_model"), [("clip", False), ("clip", True), ("siglip", False)]
)
def test_pretrained_tower_matches_transformers(tmp_path, kind: str, whole_model: bool) -> None:
    save = save_tiny_clip if kind == "clip" else save_tiny_siglip
    path = save(tmp_path / kind, whole_model=whole_model)
    model = built(job_of(encoder=kind, path=path))
    with torch.no_grad():
        ours = model.encoder(pixels())
    # Our tower and transformers' sum in different orders. The chain: the patch embedding
    # (3 * 8 * 8), the first norm (32), per layer (2) the norm, q/k/v, the scores (16), the
    # softmax and values (17 tokens each), the output, the norm, fc1 (32 each but the
    # scores) and fc2 (64), and the last norm (32).
    terms = 3 * 8 * 8 + 32 + 2 * (6 * 32 + 16 + 2 * 17 + 64) + 32
    assert_reordered_close(ours, reference_features(path, kind, whole_model), terms=terms)
    assert ours.shape == (2, 16, 32)
    assert len(model.encoder.blocks()) == 2
    units = model.own_dtype_fsdp_units()
    assert units[:2] == model.encoder.blocks() and units[2] is model.encoder.tower
    logits = model(pixels(), token_ids())
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, TEXT_LEN, VOCAB)


def test_bf16_tower_keeps_bf16_while_the_adapter_is_fp32(tmp_path) -> None:
    path = save_tiny_clip(tmp_path / "clip", dtype=torch.bfloat16)
    model = built(job_of(encoder="clip", path=path))
    assert {p.dtype for p in model.encoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.adapter.parameters()} == {torch.float32}
    assert model.encoder(pixels()).dtype == torch.bfloat16
    logits = model(pixels(), token_ids())
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32


def rewrite_checkpoint(path: str, change) -> str:
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_a_missing_tower_tensor_is_named(tmp_path) -> None:
    path = save_tiny_clip(tmp_path / "clip", whole_model=True)
    name = "vision_model.encoder.layers.1.mlp.fc2.weight"
    file = rewrite_checkpoint(path, lambda tensors: tensors.pop(name))
    with pytest.raises(ConfigError) as info:
        built(job_of(encoder="clip", path=path))
    assert info.value.field == "vision_encoder.path"
    assert f"{file} has no tensor {name!r} (shape (32, 64))" in str(info.value)


def test_a_mis_shaped_tower_tensor_is_named(tmp_path) -> None:
    path = save_tiny_siglip(tmp_path / "siglip")
    name = "embeddings.position_embedding.weight"

    def shorten(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:9].clone()

    file = rewrite_checkpoint(path, shorten)
    with pytest.raises(ConfigError) as info:
        built(job_of(encoder="siglip", path=path))
    message = str(info.value)
    assert f"tensor {name!r} in {file} has shape (9, 32)" in message
    assert "(16, 32)" in message


def test_a_tower_without_weights_is_named(tmp_path) -> None:
    path = save_tiny_clip(tmp_path / "clip")
    (tmp_path / "clip" / "model.safetensors").unlink()
    job = job_of(encoder="clip", path=path)
    with torch.device("meta"):
        encoder = build_vision_encoder(job.vision_encoder, job.vision_spec())  # type: ignore[arg-type]
    encoder.to_empty(device="cpu")
    with pytest.raises(ConfigError, match="model.safetensors or .* pytorch_model.bin"):
        encoder.init_weights()


def as_torch_bin(path: str) -> None:
    tensors = load_file(f"{path}/model.safetensors")
    torch.save(tensors, f"{path}/pytorch_model.bin")
    os.remove(f"{path}/model.safetensors")


def as_two_shards(path: str) -> None:
    tensors = load_file(f"{path}/model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, f"{path}/{file}", metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.remove(f"{path}/model.safetensors")


@pytest.mark.parametrize("convert", [as_torch_bin, as_two_shards])
def test_a_tower_saved_as_torch_bin_or_shards_loads_the_same(tmp_path, convert) -> None:
    path = save_tiny_clip(tmp_path / "clip", whole_model=True)
    job = job_of(encoder="clip", path=path)
    with torch.no_grad():
        expected = built(job).encoder(pixels())
        convert(path)
        assert torch.equal(built(job).encoder(pixels()), expected)
