"""Expert weights and the grouped SwiGLU that runs every expert in one matmul per projection
(with per-expert biases and GPT-OSS's clamped SwiGLU where the model asks for them).

Tokens reach the experts sorted by expert, as one (rows, dim) tensor and a count per
expert. The three projections then run as grouped matmuls over all experts at once
(``torch._grouped_mm`` where this PyTorch has it for the device and the shapes), or as a
batched matmul over rows padded to the largest group otherwise: never a Python loop over
tokens or experts. ``looped_swiglu`` is the per-expert loop, kept as the reference the
tests and the benchmark compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.eager import run_eagerly
from kempnerforge.model.grad_identity import scaled_grad
from kempnerforge.model.moe.tensor_split import added_once, local

EXPERT_COMPUTE = ("auto", "grouped_mm", "padded_bmm", "looped")
"""How GroupedExperts computes: 'looped' (one matmul per expert) is the reference the tests
and the benchmark compare with, not a choice for training."""


@dataclass(frozen=True)
class ExpertActivation:
    """The routed experts' gated activation of (gate, up) (model.moe_activation)."""

    kind: str = "swiglu"
    """'swiglu': silu(gate) * up. 'clamped_swiglu' (GPT-OSS): gate clamped to at most
    ``limit``, up to within +-``limit``, then (up + 1) * gate * sigmoid(alpha * gate)."""
    limit: float = 7.0
    alpha: float = 1.702

    @classmethod
    def of(cls, cfg: ModelConfig) -> ExpertActivation:
        return cls(cfg.moe_activation, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


SWIGLU = ExpertActivation()
"""The default activation: silu(gate) * up."""

ExpertBiases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(b1, b3, b2): the experts' gate and up biases (experts, hidden) and down bias (experts,
dim)."""


class GroupedExperts(nn.Module):
    """``num_experts`` gated experts stored as three stacked weights (and, with ``bias``,
    three stacked biases).

    w1 and w3 are (experts, dim, hidden), w2 (experts, hidden, dim): each expert's slice
    is the transpose of the dense SwiGLU's nn.Linear weights, laid out so rows @ w[e]
    needs no transpose. Under expert parallelism the weights (and biases) are DTensors
    sharded on the expert dimension and each rank computes its own experts
    (``local_weights``).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        bias: bool = False,
        activation: ExpertActivation = SWIGLU,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        """Gate projections (passed through the activation's gate)."""
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        """Up projections (multiplied by the gate)."""
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        """Down projections into the residual stream; their init is depth-scaled."""
        self.b1: nn.Parameter | None = None
        """Gate biases (experts, hidden) under model.moe_expert_bias, as b3 and b2."""
        self.b3: nn.Parameter | None = None
        """Up biases (experts, hidden)."""
        self.b2: nn.Parameter | None = None
        """Down biases (experts, dim), weighted by the gate with the rest of the output."""
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.activation = activation
        """model.moe_activation and its constants; not state."""
        self.compute = "auto"
        """One of EXPERT_COMPUTE (see grouped_swiglu); not state."""
        self.grad_scale = 1.0
        """Factor on the weights' gradients (1 / ep under expert parallelism: see
        distributed/expert_parallel.py); not state."""
        self.adds_down_bias = True
        """Whether this rank adds the down biases b2: under tensor parallelism each rank's
        output is a partial sum and one rank adds them (model/moe/tensor_split.py); not
        state."""

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the experts this rank computes, as plain tensors."""
        weights = self._local_scaled((self.w1, self.w3, self.w2))
        return weights[0], weights[1], weights[2]

    def local_biases(self) -> ExpertBiases | None:
        """(b1, b3, b2) of the experts this rank computes, as plain tensors; None without."""
        if self.b1 is None or self.b3 is None or self.b2 is None:
            return None
        biases = self._local_scaled((self.b1, self.b3, self.b2))
        return biases[0], biases[1], added_once(biases[2], self.adds_down_bias)

    def _local_scaled(self, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        values = [local(p) for p in params]
        if self.grad_scale != 1.0:
            values = [scaled_grad(p, self.grad_scale) for p in values]
        return values

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.local_weights()
        return grouped_swiglu(
            rows,
            counts,
            w1,
            w3,
            w2,
            self.compute,
            biases=self.local_biases(),
            activation=self.activation,
        )


def grouped_swiglu(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    compute: str = "auto",
    *,
    biases: ExpertBiases | None = None,
    activation: ExpertActivation = SWIGLU,
) -> torch.Tensor:
    """The gated feed-forward of each row through its expert (SwiGLU unless
    ``activation`` says otherwise, with ``biases`` when given): rows (N, dim) sorted by
    expert, counts (E,).

    Row i belongs to the expert whose block of ``counts`` covers it; rows past the last
    block (counts summing to less than N: assignments a capacity limit dropped) belong to
    no expert, and their outputs are zero, with no gradient. Under autocast the
    weights are cast to the autocast dtype, as nn.Linear would be. 'auto' takes
    ``torch._grouped_mm`` where it runs for this device, dtype and shape (grouped_mm_runs),
    else a batched matmul over rows padded to the largest group (one host read of the
    counts). The grouped matmul reads nothing to the host.
    """
    if rows.shape[0] == 0:
        # No row here (a rank whose experts got no token): the weights still join the
        # graph, so backward gives them a zero gradient like every other rank's.
        b1, b3, b2 = biases if biases is not None else (None, None, None)
        gate, up = rows @ w1[0], rows @ w3[0]
        if b1 is not None and b3 is not None:
            gate, up = gate + b1[0], up + b3[0]
        out = activation(gate, up) @ w2[0]
        return out if b2 is None else out + b2[0]
    dtype = _compute_dtype(rows)
    rows, w1, w3, w2 = (t.to(dtype) for t in (rows, w1, w3, w2))
    if biases is not None:
        biases = (biases[0].to(dtype), biases[1].to(dtype), biases[2].to(dtype))
    method = compute if compute != "auto" else _auto_method(rows, w1)
    if method == "grouped_mm":
        return _grouped_mm_experts(rows, counts, w1, w3, w2, biases, activation)
    if method not in ("padded_bmm", "looped"):
        raise ValueError(f"expert compute: one of {EXPERT_COMPUTE}, not {compute!r}")
    if method == "padded_bmm":
        grouped_rows, width = (int(v) for v in torch.stack([counts.sum(), counts.max()]).tolist())
        weights = (w1, w3, w2)
        out = _padded_swiglu(rows[:grouped_rows], counts, weights, width, biases, activation)
    else:
        grouped_rows = int(counts.sum())
        out = looped_swiglu(
            rows[:grouped_rows], counts, w1, w3, w2, biases=biases, activation=activation
        )
    return F.pad(out, (0, 0, 0, rows.shape[0] - grouped_rows))


def _grouped_mm_experts(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    biases: ExpertBiases | None,
    activation: ExpertActivation,
) -> torch.Tensor:
    """grouped_swiglu through torch._grouped_mm; each row's bias is its expert's, found
    by a search of the offsets on the device (no host read)."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    # Rows past the last group (dropped by a capacity limit) are zeroed on the way in
    # and out: the kernel leaves their outputs unwritten, and where() passes no
    # gradient to them, so no host read is needed to cut them off.
    index = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int32)
    grouped = (index < offsets[-1])[:, None]
    rows = torch.where(grouped, rows, 0)
    gate, up = _grouped_mm(rows, w1, offsets), _grouped_mm(rows, w3, offsets)
    if biases is None:
        return torch.where(grouped, _grouped_mm(activation(gate, up), w2, offsets), 0)
    last = counts.shape[0] - 1
    expert_of_row = torch.searchsorted(offsets, index, right=True).clamp(max=last)
    # where(), not a product: the unwritten rows' gradients may be anything, and a
    # product would carry 0 * NaN into the biases.
    b1, b3, b2 = (torch.where(grouped, b[expert_of_row], 0) for b in biases)
    out = _grouped_mm(activation(gate + b1, up + b3), w2, offsets)
    return torch.where(grouped, out + b2, 0)


def looped_swiglu(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    biases: ExpertBiases | None = None,
    activation: ExpertActivation = SWIGLU,
) -> torch.Tensor:
    """The same result as grouped_swiglu with one matmul per expert (the reference)."""
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        part = rows[start : start + count]
        start += count
        gate, up = part @ w1[expert], part @ w3[expert]
        if biases is not None:
            gate, up = gate + biases[0][expert], up + biases[1][expert]
        out = activation(gate, up) @ w2[expert]
        outputs.append(out if biases is None else out + biases[2][expert])
    return torch.cat(outputs)


def _compute_dtype(rows: torch.Tensor) -> torch.dtype:
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return rows.dtype


def _auto_method(rows: torch.Tensor, weight: torch.Tensor) -> str:
    """'grouped_mm' where this PyTorch runs it (grouped_mm_runs), else 'padded_bmm'."""
    if not hasattr(torch, "_grouped_mm"):
        return "padded_bmm"
    capability = None
    if rows.device.type == "cuda":
        capability = torch.cuda.get_device_capability(rows.device)
    inner = tuple(weight.shape[1:])
    if grouped_mm_runs(rows.device.type, capability, rows.dtype, inner):
        return "grouped_mm"
    return "padded_bmm"


GROUPED_MM_MIN_CAPABILITY = (8, 0)
"""The CUDA compute capability from which torch.nn.functional.grouped_mm documents bf16
grouped matmuls. Devices of 9.0 and 10.x take torch's fused kernel; 8.x devices (A100)
take torch's own per-group matmuls, which still compute only the routed rows, unlike the
padded path whose cost grows with the largest group."""


def grouped_mm_runs(
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    inner_dims: tuple[int, ...],
) -> bool:
    """Whether torch._grouped_mm takes rows of ``dtype`` on this device, following torch's
    rule: any dtype on CPU; bf16 on a CUDA device of capability 8.0 or later (the
    documented condition and the compiler's shape rule); and on every device each inner
    dimension (``inner_dims``, the weights' shape after the expert dimension) a multiple
    of 16 bytes, the alignment its stride checks ask for."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any((size * itemsize) % 16 for size in inner_dims):
        return False
    if device_type == "cpu":
        return True
    if device_type != "cuda" or capability is None:
        return False
    return dtype == torch.bfloat16 and tuple(capability) >= GROUPED_MM_MIN_CAPABILITY


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped matmul's
    backward refuses the expanded (stride 0) gradients a plain .sum() produces."""

    @staticmethod
    def forward(ctx: object, tensor: torch.Tensor) -> torch.Tensor:
        # The same storage as a new tensor, not a view: FSDP warns about a unit whose
        # output is a view (an in-place op on it would skip its backward hook).
        return tensor.detach()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _eager_grouped_mm(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    # A private op (no stable name yet), looked up at run time.
    grouped_mm = getattr(torch, "_grouped_mm")  # noqa: B009
    out = grouped_mm(rows.contiguous(), weight.contiguous(), offs=offsets)
    return _ContiguousGrad.apply(out)


_grouped_mm = run_eagerly(_eager_grouped_mm)
"""The grouped matmul, run eagerly inside a compiled block: the compiler's shape rules for
this op accept bf16 only (the CUDA kernel's rule), while the CPU kernel also runs fp32."""


def _padded_swiglu(
    rows: torch.Tensor,
    counts: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    width: int,
    biases: ExpertBiases | None = None,
    activation: ExpertActivation = SWIGLU,
) -> torch.Tensor:
    """Rows scattered into an (E, width, dim) block, ``width`` the largest group, three
    batched matmuls, rows gathered back. Padding rows are zeros and are never gathered
    back, so they add nothing to any gradient (with biases their outputs are not zero,
    but nothing reads them)."""
    w1, w3, w2 = weights
    experts = counts.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=rows.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[expert_of_row]
    padded = rows.new_zeros(experts, width, rows.shape[1])
    padded = padded.index_put((expert_of_row, slot), rows)
    gate, up = torch.bmm(padded, w1), torch.bmm(padded, w3)
    if biases is not None:
        gate, up = gate + biases[0][:, None], up + biases[1][:, None]
    out = torch.bmm(activation(gate, up), w2)
    if biases is not None:
        out = out + biases[2][:, None]
    return out[expert_of_row, slot]
