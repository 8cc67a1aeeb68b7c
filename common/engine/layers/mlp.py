import torch
from torch import nn
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}") from None


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(act(gate(x)) * up(x)). Names follow the HF checkpoints."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class QwenSparseMoe(nn.Module):
    """Softmax top-k router + experts + sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int,
                 shared_intermediate: int, norm_topk_prob: bool = True, act: str = "silu"):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        # Checkpoints name them mlp.experts.{e}.{gate,up,down}_proj.weight.
        self.experts = nn.ModuleList(GatedMLP(hidden, moe_intermediate, act) for _ in range(num_experts))
        self.shared_expert = GatedMLP(hidden, shared_intermediate, act) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in torch.unique(top_idx).tolist():
            tok, slot = torch.where(top_idx == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * top_w[tok, slot, None].to(h.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.view(shape)
