"""Mamba2 (SSD) mixer shared by NemotronH and Bamba, with the recurrence in kernels.linear_attn.

    zxbcdt = in_proj(x) = [z (I) | xBC (I + 2*G*N) | dt (H)]        I = H*P
    xBC    = silu(causal_conv(xBC))  -> x [H,P], B [G,N], C [G,N]  (groups repeated to heads)
    dt     = clamp(softplus(dt + dt_bias), *dt_limit)              A = -exp(A_log)
    S_t    = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T                  S [H, N, P] (our layout)
    y_t    = S_t^T C_t + D x_t
    out    = out_proj(gated_rmsnorm(y * silu(z)))  (gate before the norm, one norm per group)

The state is the transpose of transformers' [H, P, N] mamba state. `features()` returns what the
recurrence consumes (q = C, k = B, v = dt*x, g = dt*A, beta None) plus what `output()` needs
(z and x for the gate and the D skip) and the new conv tail, so that segment-level code can build
transition operators without running the layer.

dt clamp: transformers clamps dt to `dt_limit` in its chunked (prefill) scan but not in its
single-token recurrent update (like mamba_ssm's `step`); `forward` does the same so that our
logits match theirs. NemotronH's limit is (time_step_min, inf), Bamba's config.time_step_limit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.conv import causal_conv
from common.engine.layers.norm import GatedRMSNorm
from common.engine.state import LinearLayerState
from kernels.linear_attn import linear_attention, operand_dtype, recurrent_step


class Mamba2Mixer(nn.Module):
    family = "mamba2"
    scale = 1.0  # the recurrence's output scale (q = C is not scaled)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, eps: float, proj_bias: bool = False, conv_bias: bool = True,
                 activation: str = "silu", dt_limit: tuple[float, float] | None = None):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba2: {num_heads} heads are not a multiple of n_groups={n_groups}")
        self.hidden = hidden_size
        self.n_heads, self.head_dim = num_heads, head_dim
        self.state_size, self.n_groups = state_size, n_groups
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.kernel = self.conv_kernel = conv_kernel
        self.activation = activation
        lo, hi = dt_limit if dt_limit is not None else (0.0, math.inf)
        self.dt_limit = (float(lo), float(hi))
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.intermediate, eps=eps, group_size=self.intermediate // n_groups,
                                 norm_before_gate=False)
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=proj_bias)

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The channels that enter the short conv (x, B, C), [B, T, conv_dim]."""
        return torch.split(self.in_proj(x), [self.intermediate, self.conv_dim, self.n_heads], dim=-1)[1]

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None, clamp_dt: bool = True):
        """Everything before the recurrence: (q, k, v, g, beta=None, (z, x_heads), new conv tail).

        q = C, k = B [B,T,H,N], v = dt*x [B,T,H,P] in the kernels' operand dtype (fp32 on the torch
        path, the model's on fla); g = dt*A [B,T,H] fp32."""
        Bsz, T, _ = x.shape
        H, P, N, G = self.n_heads, self.head_dim, self.state_size, self.n_groups
        z, xbc, dt = torch.split(self.in_proj(x), [self.intermediate, self.conv_dim, H], dim=-1)
        xbc, tail = causal_conv(xbc.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_tail,
                                act=self.activation)
        xs, b, c = torch.split(xbc.transpose(1, 2), [self.intermediate, G * N, G * N], dim=-1)
        xs = xs.reshape(Bsz, T, H, P)
        op = operand_dtype(x.device, x.dtype)  # fp32 on the torch path, the model's on fla
        b = b.reshape(Bsz, T, G, N).to(op)
        c = c.reshape(Bsz, T, G, N).to(op)
        if G != H:
            b = b.repeat_interleave(H // G, dim=2)
            c = c.repeat_interleave(H // G, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if clamp_dt:
            dt = dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        g = dt * -self.A_log.float().exp()
        v = (xs.float() * dt.unsqueeze(-1)).to(op)
        return c, b, v, g, None, (z, xs), tail

    def output(self, o: torch.Tensor, aux, dtype) -> torch.Tensor:
        """o [B,T,H,P] (the recurrence's output) -> the mixer's output [B,T,hidden]."""
        z, xs = aux
        Bsz, T = o.shape[:2]
        y = o.float() + self.D.float()[:, None] * xs.float()
        y = self.norm(y.reshape(Bsz, T, self.intermediate), z)
        return self.out_proj(y.to(dtype))

    def forward(self, x, state: LinearLayerState | None, ctx=None):
        decode = x.shape[1] == 1 and state is not None
        q, k, v, g, _, aux, tail = self.features(x, None if state is None else state.conv, clamp_dt=not decode)
        if decode:
            o, S = recurrent_step(self.family, q, k, v, g=g, state=state.recurrent, scale=self.scale)
        else:
            S0 = None if state is None else state.recurrent
            o, S = linear_attention(self.family, q, k, v, g=g, initial_state=S0, scale=self.scale)
        return self.output(o, aux, x.dtype), LinearLayerState(tail, S)
