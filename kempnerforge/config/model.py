"""[model]: the shape of the decoder-only Transformer. Its rules and its parameter count
live in config/model_rules.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kempnerforge.config.model_rules import (
    FFN_ACTIVATIONS as FFN_ACTIVATIONS,
)
from kempnerforge.config.model_rules import (
    LAYER_TYPES as LAYER_TYPES,
)
from kempnerforge.config.model_rules import (
    MAX_MULTIPLIER as MAX_MULTIPLIER,
)
from kempnerforge.config.model_rules import (
    MOE_ACTIVATIONS as MOE_ACTIVATIONS,
)
from kempnerforge.config.model_rules import (
    MOE_AUX_LEVELS as MOE_AUX_LEVELS,
)
from kempnerforge.config.model_rules import (
    MOE_BIAS_SCHEDULES as MOE_BIAS_SCHEDULES,
)
from kempnerforge.config.model_rules import (
    MOE_ROUTERS as MOE_ROUTERS,
)
from kempnerforge.config.model_rules import (
    NORM_PLACEMENTS as NORM_PLACEMENTS,
)
from kempnerforge.config.model_rules import (
    QK_NORMS as QK_NORMS,
)
from kempnerforge.config.model_rules import (
    ROPE_SCALINGS as ROPE_SCALINGS,
)
from kempnerforge.config.model_rules import (
    check_model,
    count_params,
)
from kempnerforge.config.model_rules import (
    yarn_mscale as yarn_mscale,
)


@dataclass
class ModelConfig:
    dim: int = 256
    """Width of the residual stream (hidden size), in channels; 1 to 2**31 - 1."""
    n_layers: int = 4
    """Number of Transformer blocks; 1 to 65,536."""
    n_heads: int = 4
    """Number of attention (query) heads; unless model.head_size is set, must divide dim
    and give an even head size."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; must divide n_heads. None
    means n_heads (plain MHA)."""
    head_size: int | None = None
    """Channels per attention head when it is not dim / n_heads (Hugging Face's
    ``head_dim``: Qwen3 uses 128 at every width, so n_heads * head_size may differ from
    dim); even, since RoPE rotates pairs; 2 to 2**31 - 1. None derives dim / n_heads."""
    qk_norm: str = "none"
    """RMSNorm of the queries and keys before RoPE, keeping attention logits bounded.
    'per_head': one gain of head size shared by every head, each head normalised on its
    own (Qwen3). 'projection': gains over the whole query projection (n_heads heads) and
    the whole key projection (kv heads), each token's projection normalised as one vector
    (OLMo 2). 'none': no norm (Llama)."""
    norm_placement: str = "pre"
    """Where each block's RMSNorms sit. 'pre': on each sublayer's input, h = x +
    attention(norm(x)) (Llama). 'post': on each sublayer's output before the residual
    add, h = x + norm(attention(x)), with no norm on the inputs (OLMo 2). 'sandwich': on
    both, h = x + norm(attention(norm(x))), four norms per block (Gemma 2 and 3)."""
    vocab_size: int = 259
    """Rows of the embedding table, in tokens; must be >= the tokenizer's vocabulary (byte
    tokenizer: 259); at most 2**31 - 1."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover, in tokens; train.seq_len must not exceed it;
    at most 2**31 - 1."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama-3 uses 500000); > 0 and at most 1e10."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square inside RMSNorm; > 0 and at most 1."""
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden size, in channels (1 to 2**31 - 1); None derives it from dim,
    ffn_multiplier and multiple_of."""
    ffn_multiplier: float = 1.0
    """Scales the derived SwiGLU hidden size 8/3 * dim (Llama-3 8B uses 1.3); > 0 and at
    most 16. The derived size must stay at most 2**31 - 1."""
    multiple_of: int = 256
    """The derived SwiGLU hidden size is rounded up to a multiple of this; 1 to 2**31 - 1."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Std of the normal init; output projections are further scaled by 1/sqrt(2 * n_layers).
    > 0 and at most 1."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 is a dense model. 0 to 2**31 - 1."""
    moe_top_k: int = 2
    """Experts each token is sent to; 1 to num_experts."""
    moe_frequency: int = 1
    """Every Nth block is an MoE block (block i when (i + 1) % N == 0), the others dense;
    1 makes every block MoE. 1 to n_layers."""
    moe_router: str = "softmax"
    """'softmax': softmax over experts, top-k, balanced by the auxiliary loss (Switch /
    Mixtral). 'sigmoid': sigmoid scores, top-k chosen on score + a balancing bias that is
    nudged after each step towards uniform load, with no auxiliary loss needed
    (DeepSeek-V3); the bias never enters the gate weights or the gradients."""
    moe_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek-style), each of
    moe_expert_hidden_dim; 0 to 64."""
    moe_expert_hidden_dim: int | None = None
    """SwiGLU hidden size of one expert, in channels; None uses the dense hidden size.
    Fine-grained experts use a fraction of it (e.g. hidden_dim / 4 with 4x the experts)."""
    moe_capacity_factor: float | None = None
    """None: dropless, every routed token is computed. A number > 0 caps each expert at
    ceil(factor * tokens * top_k / num_experts) token slots per micro-batch; assignments
    past it are dropped (first choices keep priority) and counted in moe/dropped_share."""
    moe_aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss num_experts * sum_i f_i * P_i (1.0 when
    balanced); 0 to 1000. With the sigmoid router it is usually 0 or tiny."""
    moe_aux_loss_level: str = "token"
    """'token': f_i and P_i over all tokens of the micro-batch on every data-parallel rank
    (the load counts are summed over ranks, so every layout trains the same). 'sequence':
    over each sequence, then averaged (DeepSeek-V3's sequence-wise loss)."""
    moe_router_z_loss_weight: float = 0.0
    """Weight of the router z-loss mean(logsumexp(router logits)^2); 0 to 1000."""
    moe_bias_update_rate: float = 0.001
    """Sigmoid router: how far each expert's balancing bias moves per step, towards the
    mean load (sign rule); 0 freezes it. 0 to 1."""
    moe_bias_schedule: str = "constant"
    """Sigmoid router: 'constant', 'linear_warmup' (rate grows over the first 10% of
    train.max_steps) or 'cosine_decay' (rate decays to 0 at train.max_steps)."""

    sliding_window: int = 0
    """Sliding-window attention: a query of a sliding layer sees its own position and the
    sliding_window - 1 positions before it (Hugging Face's ``sliding_window``); which
    layers slide is model.sliding_window_pattern's or model.layer_types'. 0: no window,
    every layer sees the whole causal past. 0 to 2**31 - 1."""
    sliding_window_pattern: int = 0
    """With model.sliding_window: every Nth layer (layer i when (i + 1) % N == 0) attends
    to the whole causal past and the others through the window (Gemma 3: 6; Gemma 2 and
    GPT-OSS alternate: 2); 0 makes every layer slide (Mistral). 0, or 2 to n_layers."""
    layer_types: list[str] = field(default_factory=list)
    """Each layer's attention, Hugging Face's ``layer_types``: n_layers entries of
    'sliding_attention' (through model.sliding_window) or 'full_attention'; it then
    replaces model.sliding_window_pattern (which must stay 0). Empty: the pattern
    decides."""

    zero_centered_norms: bool = False
    """Store every RMSNorm gain as its offset from 1: the norm scales by 1 + weight and the
    weights start at 0 (Gemma). The function is the same as a plain gain of 1 + weight,
    but a gain near 1 kept as its small offset keeps its precision in bf16, and weight
    decay pulls it towards 1 instead of 0."""
    ffn_activation: str = "silu"
    """The gate's nonlinearity in the dense gated feed-forward, w2(act(w1 x) * w3 x):
    'silu' (SwiGLU: Llama, Qwen, Mistral, OLMo) or 'gelu_tanh' (GeGLU with the tanh
    approximation of GELU: Gemma). MoE experts compute SiLU, so an MoE model keeps
    'silu'."""
    attention_scale_size: int | None = None
    """Attention logits are q.k / sqrt(attention_scale_size) instead of / sqrt(head
    size) (Gemma 3's query_pre_attn_scalar: 168 for 27B, whose heads are 128 wide); the
    queries are scaled by sqrt(head size / attention_scale_size) after RoPE, so every
    attention kernel keeps its default scale. None: the head size. 1 to 2**31 - 1."""
    embedding_multiplier: float = 1.0
    """The token embedding's output is multiplied by this, rounded to the activations'
    dtype first (Gemma: sqrt(dim), which bf16 rounds, e.g. 55.43 to 55.5 at width 3072).
    > 0 and at most 1e4."""
    attention_sinks: bool = False
    """A learned sink logit per query head (GPT-OSS): one more entry in each softmax
    denominator whose value is zero, so a head may attend to nothing. Under tensor
    parallelism the sinks are split with the heads."""
    attention_bias: bool = False
    """Biases on the query, key, value and output projections (Hugging Face's
    ``attention_bias``: GPT-OSS, Qwen2)."""
    moe_router_bias: bool = False
    """A bias on the router's logits, one per expert, learned like its weights (GPT-OSS);
    not the sigmoid router's balancing bias."""
    moe_expert_bias: bool = False
    """Biases on the routed experts' gate, up and down projections (GPT-OSS); the down
    bias is weighted by the gate like the rest of the expert's output."""
    moe_activation: str = "swiglu"
    """The routed experts' gated activation. 'swiglu': silu(gate) * up. 'clamped_swiglu'
    (GPT-OSS): gate clamped to at most model.moe_swiglu_limit and up to within +-limit,
    then (up + 1) * gate * sigmoid(model.moe_swiglu_alpha * gate). Shared experts and
    dense layers keep SwiGLU."""
    moe_swiglu_limit: float = 7.0
    """'clamped_swiglu': the clamp on the gate (above) and on up (both sides); > 0 and at
    most 1e6."""
    moe_swiglu_alpha: float = 1.702
    """'clamped_swiglu': the gain inside the gate's sigmoid; > 0 and at most 1e3."""
    rope_scaling: str = "none"
    """How RoPE's frequencies are stretched past the length a model was trained at.
    'none': plain RoPE. 'linear': every inverse frequency divided by
    model.rope_scaling_factor (positions interpolated; Gemma 3's global layers, factor
    8). 'yarn' (GPT-OSS, DeepSeek-V3): YaRN, the low frequencies divided by
    model.rope_scaling_factor, the high ones kept, a ramp between them (the
    model.rope_yarn_beta_* rotations over model.rope_original_max_seq_len), and the cos
    and sin tables scaled by 0.1 * ln(factor) + 1."""
    rope_scaling_factor: float = 1.0
    """How many times the trained context RoPE scaling stretches; 1 with
    model.rope_scaling 'none', >= 1 and at most 1e4 otherwise."""
    rope_original_max_seq_len: int = 0
    """The context length the model was pre-trained at before scaling (Hugging Face's
    ``original_max_position_embeddings``), in tokens; 0 with model.rope_scaling 'none',
    1 to 2**31 - 1 for 'yarn'."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations over the original length above which a frequency is kept as it is
    (Hugging Face's ``beta_fast``); > 0."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully divided by the factor
    (``beta_slow``); > 0 and below model.rope_yarn_beta_fast."""
    rope_yarn_truncate: bool = True
    """YaRN: round the ramp's ends to whole channels (Hugging Face's ``truncate``, true
    unless a config says otherwise; GPT-OSS says false)."""
    rope_local_theta: float = 0.0
    """RoPE base of the sliding-window layers, without model.rope_scaling (Gemma 3's
    rope_local_base_freq, 10000, beside a global rope_theta of 1e6); > 0 needs sliding
    layers (model.sliding_window). 0: every layer rotates by model.rope_theta."""
    rope_yarn_mscale: float = 0.0
    """YaRN (DeepSeek's ``mscale``): with model.rope_yarn_mscale_all_dim also set, the cos
    and sin tables are scaled by m(mscale) / m(mscale_all_dim) instead of m(1), where
    m(s) = 0.1 * s * ln(factor) + 1 (DeepSeek-V3: 1 and 1, so the tables are unscaled).
    0: unset, as Hugging Face's absent key. 0 to 1e3; 0 unless model.rope_scaling is
    'yarn'."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN (DeepSeek's ``mscale_all_dim``): every attention logit is multiplied by
    m(mscale_all_dim) ** 2 (folded into the queries), besides the tables' scale above.
    0: unset. 0 to 1e3; 0 unless model.rope_scaling is 'yarn'."""

    mla_kv_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3's MLA, Hugging Face's
    ``kv_lora_rank``): each position's keys and values are decompressed from one latent
    vector of this width (normalised), plus one RoPE key part shared by every head; the
    cached decoder stores only these. 0: standard attention (every model.mla_* field 0).
    With it model.n_kv_heads is unset or n_heads, model.head_size unset, and model.qk_norm,
    model.attention_bias, model.attention_sinks and model.attention_scale_size at their
    defaults. 0 to 2**31 - 1."""
    mla_q_rank: int = 0
    """MLA: the queries' latent width (``q_lora_rank``): x -> q_a -> RMSNorm -> q_b.
    0: one query projection (``q_lora_rank`` null). 0 to 2**31 - 1."""
    mla_nope_head_size: int = 0
    """MLA: channels per query and key head without RoPE (``qk_nope_head_dim``); 0 to
    2**31 - 1."""
    mla_rope_head_size: int = 0
    """MLA: channels per query head rotated by RoPE, and of the key's RoPE part shared by
    all heads (``qk_rope_head_dim``); even, > 0 with MLA. A head's query and key are
    mla_nope_head_size + mla_rope_head_size wide and the logits are scaled by one over
    that width's square root."""
    mla_value_head_size: int = 0
    """MLA: channels per value head (``v_head_dim``), the output projection's input per
    head; > 0 and at most the query/key head width with MLA."""

    moe_num_groups: int = 1
    """Group-limited routing (DeepSeek-V3's ``n_group``): the experts are cut into this
    many equal groups, and a token chooses its top k only within the model.moe_top_groups
    groups whose two best biased scores sum highest. 1: no groups. More than 1 needs the
    sigmoid router, a divisor of model.num_experts with at least 2 experts a group."""
    moe_top_groups: int = 1
    """Group-limited routing: how many groups a token may choose from (``topk_group``); 1
    to model.moe_num_groups, and they must hold at least model.moe_top_k experts."""
    moe_routed_scaling: float = 1.0
    """The routed experts' gate values are multiplied by this after any renormalisation
    (DeepSeek-V3's ``routed_scaling_factor``, 2.5); shared experts are not scaled. > 0
    and at most 1e3."""
    moe_first_dense_layers: int = 0
    """The first this many blocks are dense whatever model.moe_frequency says (DeepSeek-V3's
    ``first_k_dense_replace``, 3); a block after them is MoE when model.moe_frequency
    chooses it. 0 to n_layers - 1."""

    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3's MTP), a training-only head: this many modules
    in sequence after the last block, module k predicting the token k + 1 positions past
    the next one from its predecessor's hidden state and the embedding of token k ahead
    (model/mtp.py). 0: off, no parameters. 0 to 2**31 - 1 (DeepSeek-V3: 1)."""
    mtp_loss_weight: float = 0.3
    """The multi-token-prediction loss's weight (the report's lambda): the objective gains
    mtp_loss_weight / mtp_depth times the modules' summed cross-entropies, normalised like
    the main loss (DeepSeek-V3: 0.3, then 0.1 for the last 4.8T tokens). 0 to 1000."""

    def __post_init__(self) -> None:
        check_model(self)

    @property
    def is_mla(self) -> bool:
        """True when attention is multi-head latent attention (model.mla_kv_rank > 0)."""
        return self.mla_kv_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and key) head: head_dim, or under MLA its parts without and
        with RoPE together."""
        if self.is_mla:
            return self.mla_nope_head_size + self.mla_rope_head_size
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Width of one value head: head_dim, or under MLA model.mla_value_head_size."""
        return self.mla_value_head_size if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Channels of a head RoPE rotates: the whole head, or under MLA its RoPE part."""
        return self.mla_rope_head_size if self.is_mla else self.head_dim

    @property
    def attention_logit_multiplier(self) -> float:
        """What every attention logit is multiplied by beyond 1 / sqrt(query head width)
        and model.attention_scale_size: YaRN's m(mscale_all_dim) ** 2 when
        model.rope_yarn_mscale_all_dim is set, else 1."""
        if self.rope_scaling != "yarn" or not self.rope_yarn_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_scaling_factor, self.rope_yarn_mscale_all_dim) ** 2

    @property
    def kv_heads(self) -> int:
        """Key/value heads in force (n_kv_heads, or n_heads when unset)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: model.head_size, or dim / n_heads when unset."""
        return self.dim // self.n_heads if self.head_size is None else self.head_size

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: explicit, or Llama's 2/3 * 4 * dim * multiplier, rounded up."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3 * self.ffn_multiplier)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def rope_kinds(self) -> int:
        """How many RoPE tables the model keeps: 2 when sliding layers rotate by their own
        base (model.rope_local_theta), else 1."""
        return 2 if self.rope_local_theta else 1

    def layer_rope(self, index: int) -> int:
        """Which RoPE table layer ``index`` rotates by: 1 for a sliding layer with its own
        base (model.rope_local_theta), else 0 (model.rope_theta and model.rope_scaling)."""
        return 1 if self.rope_local_theta and self.layer_window(index) else 0

    @property
    def block_norms(self) -> int:
        """RMSNorms on a block's residual branches: 4 for 'sandwich', else 2."""
        return 4 if self.norm_placement == "sandwich" else 2

    def layer_window(self, index: int) -> int:
        """The sliding window of layer ``index`` (0-based); 0 when it attends to the whole
        causal past."""
        if not self.sliding_window:
            return 0
        if self.layer_types:
            slides = self.layer_types[index] == "sliding_attention"
        else:
            pattern = self.sliding_window_pattern
            slides = not pattern or (index + 1) % pattern != 0
        return self.sliding_window if slides else 0

    @property
    def expert_hidden_dim(self) -> int:
        """SwiGLU hidden size of one routed or shared expert."""
        if self.moe_expert_hidden_dim is not None:
            return self.moe_expert_hidden_dim
        return self.hidden_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE feed-forward."""
        if index < self.moe_first_dense_layers:
            return False
        return self.is_moe and (index + 1) % self.moe_frequency == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def is_moe(self) -> bool:
        """True when blocks use mixture-of-experts feed-forward layers."""
        return self.num_experts > 0

    def num_params(self) -> int:
        """Exact parameter count of the decoder this config builds, a tied matrix once.

        Counts what kempnerforge.model.transformer creates, without building it: the token
        embedding, per block the attention projections (wq and wo dim x n_heads *
        head_dim, wk and wv dim x kv_heads * head_dim, their biases with
        model.attention_bias), the sinks (one per head, model.attention_sinks), the query
        and key norms' gains (model.qk_norm), or under multi-head latent attention its
        projections and latent norms (_latent_attention_params), the feed-forward (three
        SwiGLU matrices dim x hidden_dim; in an MoE block the router dim x num_experts,
        its bias, plus every routed and shared expert's three matrices and a routed
        expert's biases), two
        RMSNorm gains (four for model.norm_placement = 'sandwich'), then the final norm
        and the output head unless tied, and each multi-token-prediction module (a block
        built as the last, two norms, a 2 * dim x dim projection and its head's norm).
        Cheap enough to size memory at build time before any tensor exists.
        """
        return count_params(self, active=False)

    def num_active_params(self) -> int:
        """Parameters one token passes through: as num_params, but an MoE block counts its
        router, top_k routed experts and the shared experts only. Equal to num_params for
        a dense model; FLOPs and MFU are computed from it."""
        return count_params(self, active=True)
