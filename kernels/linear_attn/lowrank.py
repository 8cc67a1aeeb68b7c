"""Low-rank (WY) form of a short segment's transition for the scalar-gated delta families.

For deltanet and gated_deltanet, each token's transition is A_t = g_t (I - b_t k_t k_t^T) with a
scalar gate g_t per head, so a segment of L tokens has

    T = A_L ... A_1 = decay . (I - W^T Kf)      decay = prod g_t,  W, Kf [L, K]

(the scalars commute out; the product of L rank-one updates of I is I minus a rank <= L matrix,
the WY representation). Kf holds the keys; W follows from the recursion, latest token first,

    w_t = b_t (k_t - sum_{s > t} w_s (k_s . k_t)).

When L < K/2 the factors (2 L K numbers) are smaller than T (K^2), and T S is applied without
forming T: T S = decay (S - W^T (Kf S)), O(L K V) instead of O(K^2 V). ``lowrank_dense`` forms T
from the factors: the plain reference the tests compare both against.

Every delta family, kda's per-channel gates included, has the general form entries store
(``LowRankT``, ``transition_factors``): with A_t = (I - b_t k_t k_t^T) D_t (the decay D_t =
diag(exp g_t) first, then the delta step, as kernels.linear_attn.naive runs them) and G_t the
cumulative log-decay (G_0 = 0, per channel; a per-head gate is the same on every channel),

    T = A_L ... A_1 = diag(exp G_L) - P^T Q,      P, Q [L, K]
    q_t = exp(G_t) k_t
    p_t = b_t (exp(G_L - G_t) k_t - sum_{s > t} p_s (k_s . exp(G_s - G_t) k_t))

(move every D_t to the left: A_L ... A_1 = Gamma_L prod_t (I - b_t (Gamma_t^-1 k_t)(Gamma_t k_t)^T),
then the WY recursion above, latest token first, scaled by Gamma_L). Every exponent is <= 0, so
no decay is ever inverted: strong per-channel gates cannot overflow. The recursion is one unit
upper-triangular solve, (I + M) P = R with M[t, s] = b_t (k_s . exp(G_s - G_t) k_t) for s > t.
Stored, the factors cost K + 2 L K numbers per head against K^2 (``lowrank_pays``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOWRANK_FAMILIES = ("deltanet", "gated_deltanet")  # wy_factors: a per-head gate, commuted out
FACTOR_FAMILIES = ("deltanet", "gated_deltanet", "kda")  # transition_factors: every delta family


def wy_factors(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None = None):
    """(decay [B, H], W [B, H, L, K], Kf [B, H, L, K]) of the segment given by k [B, L, H, K]
    (normalised as the model uses them), beta [B, L, H] and g [B, L, H] (log gates; None for
    deltanet). fp32 out (fp64 in stays fp64)."""
    dt = torch.float64 if k.dtype == torch.float64 else torch.float32
    Kf = k.to(dt).transpose(1, 2).contiguous()  # [B, H, L, K]
    b = beta.to(dt).transpose(1, 2)  # [B, H, L]
    L = Kf.shape[2]
    W = torch.zeros_like(Kf)
    gram = Kf @ Kf.transpose(-1, -2)  # [B, H, L, L]: k_s . k_t
    for t in range(L - 1, -1, -1):
        # w_t = b_t (k_t - sum_{s > t} w_s (k_s . k_t))
        later = (W[:, :, t + 1 :] * gram[:, :, t + 1 :, t, None]).sum(2)
        W[:, :, t] = b[:, :, t, None] * (Kf[:, :, t] - later)
    decay = torch.ones(Kf.shape[:2], dtype=dt, device=k.device) if g is None else g.to(dt).sum(1).exp()
    return decay, W, Kf


def apply_lowrank(decay: torch.Tensor, W: torch.Tensor, Kf: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """T S for T = decay (I - W^T Kf) without forming T: decay (S - W^T (Kf S)). S [B, H, K, V]."""
    return decay[..., None, None] * (S - W.transpose(-1, -2) @ (Kf @ S))


def lowrank_dense(decay: torch.Tensor, W: torch.Tensor, Kf: torch.Tensor) -> torch.Tensor:
    """T [B, H, K, K] formed from its factors (the reference of apply_lowrank)."""
    eye = torch.eye(Kf.shape[-1], dtype=Kf.dtype, device=Kf.device)
    return decay[..., None, None] * (eye - W.transpose(-1, -2) @ Kf)


def lowrank_pays(L: int, K: int, itemsize: int = 4, gamma_itemsize: int = 4) -> bool:
    """True when a head's stored factors (P, Q: 2 L K numbers of `itemsize` bytes, gamma: K of
    `gamma_itemsize`) are smaller than its dense K x K T (of `itemsize`); fp32 throughout this
    is 2 L + 1 < K."""
    return 2 * L * K * itemsize + K * gamma_itemsize < K * K * itemsize


@dataclass
class LowRankT:
    """A delta-family transition T = diag(gamma) - P^T Q, fp32: gamma [B, H, K], P and Q
    [B, H, L, K] with L (the rank bound) the number of tokens of the segment. It stands where a
    dense matrix T [B, H, K, K] would (kernels.linear_attn.Summary, an entry's LinearBody): the
    few tensor methods those use are here, and `apply` composes without forming T."""

    gamma: torch.Tensor
    P: torch.Tensor
    Q: torch.Tensor

    def apply(self, S: torch.Tensor) -> torch.Tensor:
        """T S for S [B, H, K, V]: gamma S - P^T (Q S), O(L K V) per head instead of O(K^2 V)."""
        return self.gamma[..., None] * S - self.P.transpose(-1, -2) @ (self.Q @ S)

    def dense(self) -> torch.Tensor:
        """T [B, H, K, K] formed (the plain reference of `apply`)."""
        return torch.diag_embed(self.gamma) - self.P.transpose(-1, -2) @ self.Q

    @property
    def rank(self) -> int:
        return self.P.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.P.device

    @property
    def dtype(self) -> torch.dtype:
        return self.P.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of the dense T it stands for."""
        return torch.Size((*self.gamma.shape, self.gamma.shape[-1]))

    def numel(self) -> int:
        """Numbers stored (gamma, P and Q): what Summary.nbytes counts."""
        return self.gamma.numel() + self.P.numel() + self.Q.numel()

    def element_size(self) -> int:
        return self.P.element_size()

    def map(self, fn) -> "LowRankT":
        return LowRankT(fn(self.gamma), fn(self.P), fn(self.Q))

    def to(self, *args, **kwargs) -> "LowRankT":
        return self.map(lambda t: t.to(*args, **kwargs))

    def float(self) -> "LowRankT":
        return self.map(torch.Tensor.float)

    def double(self) -> "LowRankT":
        return self.map(torch.Tensor.double)

    def contiguous(self) -> "LowRankT":
        return self.map(torch.Tensor.contiguous)

    def select(self, i: int) -> "LowRankT":
        """Entry i of the leading dimension (segment i of a stacked run)."""
        return self.map(lambda t: t[i])

    def padded(self, rank: int) -> "LowRankT":
        """The same T with its rank bound raised to `rank` by zero rows of P and Q (a zero row adds
        nothing to P^T Q): how factors of different ranks are stacked into one run."""
        extra = rank - self.rank
        if extra < 0:
            raise ValueError(f"cannot pad rank {self.rank} down to {rank}")
        if extra == 0:
            return self
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, extra))  # noqa: E731
        return LowRankT(self.gamma, pad(self.P), pad(self.Q))


def stack_transitions(Ts: list) -> "torch.Tensor | LowRankT":
    """The transitions of a run's bodies (each [B, *G, ...], dense tensors or LowRankT), concatenated
    along the leading dimension for kernels.compose.compose_run_states: dense ones as one tensor,
    factored ones as one LowRankT with every rank padded to the largest (`LowRankT.padded`). A run
    mixing both is stacked dense, each factored T formed (L K^2 per head, the order of one dense
    composition step), so the run is still composed in one pass."""
    if not Ts:
        raise ValueError("no transitions to stack")
    low = [isinstance(T, LowRankT) for T in Ts]
    if all(low):
        rank = max(T.rank for T in Ts)
        dtype = Ts[0].dtype if all(T.dtype == Ts[0].dtype for T in Ts) else torch.float32
        parts = [T.padded(rank).to(dtype) for T in Ts]
        return LowRankT(*(torch.cat([getattr(T, f) for T in parts], 0) for f in ("gamma", "P", "Q")))
    dense = [T.dense() if is_low else T for T, is_low in zip(Ts, low)]
    if any(T.dtype != dense[0].dtype for T in dense):
        dense = [T.float() for T in dense]
    return torch.cat(dense, 0)


def transition_factors(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None = None) -> LowRankT:
    """The LowRankT of the segment given by k [B, L, Hk, K] (as the kernels take them; Hk may
    divide the value heads H of beta, as grouped value heads), beta [B, L, H] and the log gates g:
    None (deltanet), [B, L, H] (gated_deltanet) or [B, L, H, K] (kda). Computed in fp64 (the
    solve and the exponent differences), fp32 out; see the module docstring for the algebra."""
    B, L, Hk, K = k.shape
    H = beta.shape[2]
    kd = k.double().repeat_interleave(H // Hk, dim=2) if H != Hk else k.double()
    kf = kd.transpose(1, 2)  # [B, H, L, K]
    b = beta.double().transpose(1, 2)  # [B, H, L]
    if g is None:
        G = kf.new_zeros(B, H, L, 1)
    else:
        gd = g.double() if g.dim() == 4 else g.double().unsqueeze(-1)
        G = gd.transpose(1, 2).cumsum(2)  # [B, H, L, 1 | K]
    Q = G.exp() * kf
    R = b[..., None] * (G[:, :, -1:] - G).exp() * kf
    A = torch.stack([_decayed_gram(kf[:, h], G[:, h]) for h in range(H)], 1)  # [B, H, L, L]
    M = (b[..., None] * A).triu(1)
    eye = torch.eye(L, dtype=M.dtype, device=M.device)
    P = torch.linalg.solve_triangular(eye + M, R, upper=True, unitriangular=True)
    gamma = G[:, :, -1].exp().expand(B, H, K)
    return LowRankT(gamma.float().contiguous(), P.float().contiguous(), Q.float().contiguous())


def _decayed_gram(kf: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """[B, L, L] with [t, s] = k_s . exp(G_s - G_t) k_t for s > t (0 elsewhere) of one head:
    kf [B, L, K], G [B, L, 1 | K]. The exponents are clamped at 0 where s <= t (masked anyway)."""
    diff = (G[:, None, :, :] - G[:, :, None, :]).clamp(max=0.0)  # [B, t, s, 1 | K]: G_s - G_t
    A = torch.einsum("btk,bsk,btsk->bts", kf, kf, diff.exp().expand(-1, -1, -1, kf.shape[-1]))
    return A.triu(1)
