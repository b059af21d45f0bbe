"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: multi-head latent attention
(query latent and plain query projection, value heads narrower than the query/key heads,
interleaved RoPE channels), YaRN with DeepSeek's mscale and mscale_all_dim, and after a
dense first layer 8 sigmoid-routed experts in 2 groups (1 kept) with a non-zero balancing
bias, gates times 2.5 and a shared expert; and its multi-token-prediction layer against
transformers' MtpModel, written back bit for bit."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, DEEPSEEK_V3
from kempnerforge.interop.hf import export_hf, import_hf, load_hf_into
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.interop.hf_import import apply_model_overrides
from kempnerforge.model.attention import RopeScaling, rope_tables
from kempnerforge.model.mtp import tokens_ahead
from kempnerforge.model.transformer import Transformer
from tests.support import hf_families as fam
from tests.support.tolerance import reorder_atol, transformer_terms

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
"""DeepSeek's YaRN at the tiny model's scale, its two mscales apart so both show (the
published 1.0 and 1.0 leave the tables unscaled)."""
TINY: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    n_shared_experts=1,
    rope_parameters=YARN,
)
"""The tiny DeepSeek-V3 in transformers' words: 4 heads whose queries and keys are 16
wide (8 without RoPE, 8 with) and values 8, latents of 16."""


MTP_REFERENCES: dict[str, Any] = {}
"""transformers' MtpModel of each folder make_deepseek wrote, by the folder's path."""


def _move_off_init(model: torch.nn.Module, seed: int, prefix: str = "") -> None:
    """Norm gains moved off 1 and balancing biases (buffers, 0 at init) of std 0.3, for
    the parameters and buffers under ``prefix``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            moved = "norm" in name or name.endswith("e_score_correction_bias")
            if name.startswith(prefix) and moved:
                tensor.add_(0.3 * torch.randn(tensor.shape, generator=generator))


def make_deepseek(folder, **keys) -> Any:
    """transformers' tiny model with its norms moved off 1 and a balancing bias of std
    0.3, saved to ``folder`` with one multi-token-prediction layer's tensors beside the
    decoder's, as published checkpoints hold them (add_mtp_layer)."""
    theirs: Any = fam.make_hf_folder(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        folder,
        **{**TINY, **keys},
    )
    _move_off_init(theirs, seed=2, prefix="model.layers.")
    theirs.save_pretrained(folder)
    MTP_REFERENCES[str(folder)] = add_mtp_layer(theirs, folder)
    return theirs


def add_mtp_layer(theirs: Any, folder) -> Any:
    """transformers' MtpModel for ``theirs`` (random, moved off its init), its tensors
    added to the folder under the published names: model.layers.<n>.enorm, hnorm,
    eh_proj, shared_head.norm, copies of embed_tokens and shared_head.head, and its
    decoder layer as transformers' own saver names the layer after the decoder's (a
    model one layer deeper, saved). transformers' save_pretrained writes no MTP layer."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(theirs, 1).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # its constructor leaves the new layer's tensors unset
        for name, tensor in [*mtp.named_parameters(), *mtp.named_buffers()]:
            if name.startswith("layers."):
                gain = "norm" in name and not name.endswith("bias")
                tensor.copy_(torch.ones_like(tensor) if gain else torch.zeros_like(tensor))
                if not gain and not name.endswith("bias"):
                    tensor.normal_(0.0, 0.1, generator=generator)
    _move_off_init(mtp, seed=4, prefix="layers.")
    n = theirs.config.num_hidden_layers
    deeper = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**theirs.config.to_dict(), "num_hidden_layers": n + 1})
    )
    deeper.model.layers[n].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    deeper.save_pretrained(folder / "deeper")
    prefix = f"model.layers.{n}."
    layer = {k: v for k, v in load_file(folder / "deeper" / "model.safetensors").items()}
    added = {k: v for k, v in layer.items() if k.startswith(prefix)}
    module = mtp.layers[0]
    own = {"enorm": module.enorm, "hnorm": module.hnorm, "eh_proj": module.eh_proj}
    own["shared_head.norm"] = module.post_norm
    added.update({f"{prefix}{name}.weight": m.weight.detach().clone() for name, m in own.items()})
    added[f"{prefix}embed_tokens.weight"] = theirs.model.embed_tokens.weight.detach().clone()
    added[f"{prefix}shared_head.head.weight"] = theirs.lm_head.weight.detach().clone()
    for item in (folder / "deeper").iterdir():
        item.unlink()
    (folder / "deeper").rmdir()
    path = folder / "model.safetensors"
    save_file({**load_file(path), **added}, path, metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module", params=["q_latent", "q_proj"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder), with the query
    latent (q_lora_rank 16) and without it (q_lora_rank null)."""
    folder = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    keys = {} if request.param == "q_latent" else {"q_lora_rank": None}
    theirs = make_deepseek(folder, **keys)
    return theirs, fam.imported_model(folder), folder


def test_import_reads_latent_attention_yarn_mscales_and_grouped_routing(pair):
    theirs, ours, _ = pair
    cfg = ours.cfg
    q_rank = theirs.config.q_lora_rank or 0
    assert (cfg.mla_kv_rank, cfg.mla_q_rank) == (16, q_rank)
    assert (cfg.mla_nope_head_size, cfg.mla_rope_head_size, cfg.mla_value_head_size) == (8, 8, 8)
    assert (cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (0.8, 0.6)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_num_groups, cfg.moe_top_groups) == (8, 2, 2, 1)
    assert (cfg.moe_routed_scaling, cfg.moe_shared_experts, cfg.expert_hidden_dim) == (2.5, 1, 16)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    mtp = MTP_REFERENCES[str(pair[2])]  # its own parameters; the embedding and head shared
    mtp_own = sum(p.numel() for n, p in mtp.named_parameters() if n.startswith("layers."))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters()) + mtp_own


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    """transformers builds no MTP layer: it passes over the exported one (model.layers.3)
    and computes our next-token logits."""
    _, ours, folder = pair
    trained = fam.perturbed(fam.imported_model(folder))
    fam.assert_export_loads_in_transformers(
        trained, tmp_path / "out", "DeepseekV3ForCausalLM", passed_over="model.layers.3."
    )
    assert ours.cfg == import_hf(tmp_path / "out")[0]


# --- multi-token prediction --------------------------------------------------------------


def test_import_reads_the_multi_token_prediction_layer(pair):
    _, ours, folder = pair
    assert ours.cfg.mtp_depth == 1
    tensors = load_file(folder / "model.safetensors")
    module = ours.mtp[0]
    for mine, theirs in [
        (module.enorm.weight, "enorm.weight"),
        (module.eh_proj.weight, "eh_proj.weight"),
        (module.norm.weight, "shared_head.norm.weight"),
        (module.block.ffn_norm.weight, "post_attention_layernorm.weight"),
        (module.block.feed_forward.router.expert_bias, "mlp.gate.e_score_correction_bias"),
    ]:
        assert torch.equal(mine, tensors[f"model.layers.3.{theirs}"])


def test_mtp_logits_equal_transformers_mtp_model(pair):
    """Our MTP module's logits are transformers' MtpModel's over the same hidden states:
    depth 1 at position i reads the decoder's normed output at i and token i + 1, and
    predicts token i + 2. transformers rotates by the position of token i + 1, ours by
    i's: a shift of every position, which RoPE's relative angles do not see."""
    theirs, ours, folder = pair
    mtp = MTP_REFERENCES[str(folder)]
    ids = fam.random_ids()
    seq = ids.shape[1]
    with torch.no_grad():
        hidden = theirs(ids, output_hidden_states=True).hidden_states[-1]  # after the norm
        positions = torch.arange(1, seq)[None].expand(ids.shape[0], -1)
        out = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
        want = mtp._project_to_logits(out)
        cos, sin = ours.rope(seq)
        trunk = ours.norm(ours.run_layers(ours.embed(ids), cos, sin))
        ahead = ours.embed(tokens_ahead(ids, 1))
        got = ours.output(ours.mtp[0](trunk, ahead, cos, sin))[:, :-1]
    assert want.abs().max() > 0.5
    terms = transformer_terms(ours.cfg, seq, backward=False)  # the decoder and the module
    atol = reorder_atol(torch.float32, terms, want.abs().max().item())
    assert (got - want).abs().max().item() <= atol


def test_export_writes_the_folder_back_bit_for_bit(pair, tmp_path):
    """Import then export: every tensor of the folder, the MTP layer's (its decoder layer,
    own tensors and copies of the embedding and head) included, comes back bitwise."""
    _, ours, folder = pair
    export_hf(ours, ours.cfg, tmp_path / "out", tokenizer_path="byte")
    before, after = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert any(name.startswith("model.layers.3.mlp.experts.") for name in after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor.float()), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1


def test_a_folder_whose_weights_hold_no_mtp_layer_imports_without_one(pair, tmp_path, log):
    """transformers' own save_pretrained keeps num_nextn_predict_layers = 1 but writes no
    MTP layer: such a folder imports with model.mtp_depth = 0, and says so."""
    theirs, _, _ = pair
    theirs.save_pretrained(tmp_path / "hf")
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    )
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.mtp_depth == 0 and not any(name.startswith("mtp.") for name in state)
    assert "declares 1 multi-token-prediction layers but the weights hold 0" in log.text


def test_import_hf_may_drop_mtp_modules_but_not_add_them(pair):
    _, ours, _ = pair
    assert apply_model_overrides(ours.cfg, ["--model.mtp_depth=0"]).mtp_depth == 0
    with pytest.raises(ConfigError) as info:
        apply_model_overrides(ours.cfg, ["--model.mtp_depth=2"])
    assert info.value.field == "model.mtp_depth"


def test_a_job_without_mtp_loads_the_folder_and_leaves_its_mtp_tensors(pair):
    _, ours, folder = pair
    plain = Transformer(dataclasses.replace(ours.cfg, mtp_depth=0))
    load_hf_into(plain, folder)
    assert plain.mtp is None
    assert torch.equal(plain.output.weight, ours.output.weight)


def test_greedy_generation_with_the_latent_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_the_cache_holds_latents_not_keys_and_values(pair):
    from kempnerforge.model.generation.kv_cache import KVCache

    _, ours, _ = pair
    cache = KVCache.for_model(ours, 10)
    assert [tuple(k.shape) for k in cache.keys] == [(1, 1, 10, 16)] * 3
    assert [tuple(v.shape) for v in cache.values] == [(1, 1, 10, 8)] * 3


def test_yarn_tables_and_logit_scale_are_transformers(pair):
    """Our RoPE tables of the RoPE part are transformers' (attention factor m(0.8) /
    m(0.6)), and the logit multiplier is its softmax scale over 1 / sqrt(16)."""
    theirs, ours, _ = pair
    rotary = theirs.model.rotary_emb
    positions = torch.arange(64)[None]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(8, 64, 10000.0, scaling=RopeScaling.of(ours.cfg))
    torch.testing.assert_close(cos, want_cos[0, :, :4], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0, :, :4], rtol=0, atol=1e-6)
    scaling = theirs.model.layers[0].self_attn.scaling
    assert ours.cfg.attention_logit_multiplier == pytest.approx(scaling * 16**0.5, rel=1e-12)


def deepseek_config(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        dim=32,
        n_layers=3,
        n_heads=4,
        num_experts=8,
        moe_top_k=2,
        moe_router="sigmoid",
        moe_shared_experts=1,
        moe_expert_hidden_dim=16,
        moe_first_dense_layers=1,
        moe_num_groups=2,
        moe_top_groups=1,
        moe_routed_scaling=2.5,
        mla_kv_rank=16,
        mla_q_rank=16,
        mla_nope_head_size=8,
        mla_rope_head_size=8,
        mla_value_head_size=8,
        max_seq_len=64,
    )
    return ModelConfig(**{**fields, **changes})


def test_export_chooses_deepseek_for_latent_attention_and_glm_without_it():
    assert ARCHITECTURES.for_config(deepseek_config()) is DEEPSEEK_V3
    standard = deepseek_config(
        mla_kv_rank=0,
        mla_q_rank=0,
        mla_nope_head_size=0,
        mla_rope_head_size=0,
        mla_value_head_size=0,
    )
    assert ARCHITECTURES.for_config(standard).model_type == "glm4_moe"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(moe_router="softmax", moe_num_groups=1, moe_top_groups=1), "model.moe_router"),
        (dict(n_layers=4, moe_first_dense_layers=0, moe_frequency=2), "model.moe_frequency"),
        (dict(zero_centered_norms=True), "model.zero_centered_norms"),
        (dict(sliding_window=8), "model.sliding_window"),
    ],
    ids=["softmax", "interleaved", "zero-centred", "window"],
)
def test_export_refuses_what_deepseek_v3_cannot_compute(changes, field):
    with pytest.raises(ConfigError) as info:
        DEEPSEEK_V3.check_represents(deepseek_config(**changes))
    assert info.value.field == field


def test_other_classes_refuse_latent_attention_and_deepseek_routing():
    for model_type in ("gpt_oss", "glm4_moe", "qwen3_moe"):
        with pytest.raises(ConfigError) as info:
            ARCHITECTURES.named(model_type).check_represents(deepseek_config())
        assert info.value.field.startswith(("model.mla_", "model.moe_", "model.num_experts"))
    refusal = ARCHITECTURES.named("glm4_moe").matched(deepseek_config())[1]
    assert refusal is not None and refusal.field == "model.mla_kv_rank"


def _rewrite_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(first_k_dense_replace=3), "first_k_dense_replace"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(rope_parameters={**YARN, "attention_factor": 1.5}), "rope_parameters"),
    ],
    ids=["grouped-kv", "bias", "all-dense", "raw-gates", "attention-factor"],
)
def test_import_refuses_what_we_cannot_compute(pair, tmp_path, changes, key):
    _, _, folder = pair
    copy = tmp_path / "hf"
    copy.mkdir()
    for item in folder.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    _rewrite_config(copy, **changes)
    with pytest.raises(HFFolderError) as info:
        import_hf(copy)
    assert f"{key} = " in str(info.value)


def test_another_class_refuses_deepseek_mscales(tmp_path):
    """A GPT-OSS folder with mscale_all_dim: its class scales the tables but not the
    logits, which our field does, so the key is refused."""
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        num_experts=4,
        moe_top_k=2,
        attention_sinks=True,
        moe_router_bias=True,
        moe_expert_bias=True,
        moe_activation="clamped_swiglu",
        rope_scaling="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_seq_len=16,
        max_seq_len=64,
    )
    folder = export_hf(Transformer(cfg), cfg, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    _rewrite_config(folder, rope_parameters={**config["rope_parameters"], "mscale_all_dim": 1.0})
    with pytest.raises(HFFolderError, match="mscale_all_dim"):
        import_hf(folder)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(mla_rope_head_size=7), "model.mla_rope_head_size"),
        (dict(mla_value_head_size=17), "model.mla_value_head_size"),
        (dict(qk_norm="per_head"), "model.qk_norm"),
        (dict(n_kv_heads=2), "model.n_kv_heads"),
        (dict(mla_kv_rank=0), "model.mla_q_rank"),
        (dict(moe_router="softmax"), "model.moe_num_groups"),
        (dict(moe_num_groups=8), "model.moe_num_groups"),
        (dict(moe_top_k=5), "model.moe_top_groups"),
        (dict(moe_first_dense_layers=3), "model.moe_first_dense_layers"),
        (dict(rope_yarn_mscale_all_dim=1.0), "model.rope_yarn_mscale_all_dim"),
    ],
    ids=[
        "odd-rope",
        "wide-values",
        "qk-norm",
        "grouped-kv",
        "sizes-without-latent",
        "groups-softmax",
        "one-expert-groups",
        "top-k-past-groups",
        "all-dense",
        "mscale-without-yarn",
    ],
)
def test_config_refuses_what_latent_attention_and_grouped_routing_cannot_be(changes, field):
    with pytest.raises(ConfigError) as info:
        deepseek_config(**changes)
    assert info.value.field == field
