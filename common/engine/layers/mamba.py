"""Mamba (v1) mixer as Jamba uses it, with the recurrence in kernels.linear_attn (family "mamba").

    [u | z]  = in_proj(x)                                       u, z [B, T, I]   (I inner channels)
    u        = silu(causal_conv(u))
    [r|B|C]  = x_proj(u);  r, B, C := dt_norm(r), b_norm(B), c_norm(C)   (Jamba's extra RMSNorms)
    dt       = softplus(dt_proj.weight @ r + dt_proj.bias)      [B, T, I]     A = -exp(A_log) [I, N]
    h_t      = exp(dt_t A) h_{t-1} + dt_t B_t u_t               h [I, N] per sequence
    y_t      = h_t C_t + D u_t;     out = out_proj(y * silu(z))

`features()` returns the family contract (q = C, k = B expanded to I heads, v = dt*u [B,T,I,1],
g = dt*A [B,T,I,N], beta None) plus (z, u) for `output()` and the new conv tail, so that segment
code builds the diagonal transition operator (T[i, n] = exp(A[i, n] sum dt_i)) without running
the layer. The state is [B, I, N, 1]: transformers' [B, I, N] with a unit value axis.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.conv import causal_conv
from common.engine.layers.norm import RMSNorm
from common.engine.state import LinearLayerState
from kernels.linear_attn import linear_attention, mamba_features, recurrent_step


class MambaMixer(nn.Module):
    family = "mamba"
    scale = 1.0

    def __init__(self, hidden_size: int, intermediate: int, state_size: int, dt_rank: int, conv_kernel: int,
                 eps: float, proj_bias: bool = False, conv_bias: bool = True, inner_norms: bool = True,
                 activation: str = "silu"):
        super().__init__()
        self.hidden = hidden_size
        self.intermediate, self.state_size, self.dt_rank = intermediate, state_size, dt_rank
        self.kernel = self.conv_kernel = conv_kernel
        self.activation = activation
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate, bias=proj_bias)
        self.conv1d = nn.Conv1d(intermediate, intermediate, conv_kernel, groups=intermediate, bias=conv_bias)
        self.x_proj = nn.Linear(intermediate, dt_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(dt_rank, intermediate, bias=True)
        self.A_log = nn.Parameter(torch.empty(intermediate, state_size))
        self.D = nn.Parameter(torch.empty(intermediate))
        self.out_proj = nn.Linear(intermediate, hidden_size, bias=proj_bias)
        if inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, eps)
            self.b_layernorm = RMSNorm(state_size, eps)
            self.c_layernorm = RMSNorm(state_size, eps)
        else:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = None

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The channels that enter the short conv (u), [B, T, I]."""
        return self.in_proj(x)[..., : self.intermediate]

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None):
        """(q, k, v, g, beta=None, (z, u), new conv tail); see the module docstring."""
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u, tail = causal_conv(u.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_tail,
                              act=self.activation)
        u = u.transpose(1, 2)
        r, b, c = torch.split(self.x_proj(u), [self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.dt_layernorm is not None:
            r, b, c = self.dt_layernorm(r), self.b_layernorm(b), self.c_layernorm(c)
        # transformers: dt_proj.weight @ r, then + bias in fp32 and softplus
        dt = F.softplus(F.linear(r, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        q, k, v, g = mamba_features(u, dt, -torch.exp(self.A_log.float()), b, c)
        return q, k, v, g, None, (z, u), tail

    def output(self, o: torch.Tensor, aux, dtype) -> torch.Tensor:
        """o [B,T,I,1] (the recurrence's output) -> the mixer's output [B,T,hidden]."""
        z, u = aux
        y = o[..., 0].float() + self.D.float() * u.float()
        y = y * F.silu(z.float())
        return self.out_proj(y.to(dtype))

    def forward(self, x, state: LinearLayerState | None, ctx=None):
        q, k, v, g, _, aux, tail = self.features(x, None if state is None else state.conv)
        if x.shape[1] == 1 and state is not None:
            o, S = recurrent_step(self.family, q, k, v, g=g, state=state.recurrent, scale=self.scale)
        else:
            S0 = None if state is None else state.recurrent
            o, S = linear_attention(self.family, q, k, v, g=g, initial_state=S0, scale=self.scale)
        return self.output(o, aux, x.dtype), LinearLayerState(tail, S)
