"""Intra-chunk linear algebra of the chunked kernels (kernels.linear_attn.chunk): the
per-channel-decayed score matrices, built without overflow, and the unit lower triangular inverse
of the delta rule's UT transform.
"""
from __future__ import annotations

import torch

# Half-range (nats) below which a diagonal block is scored with one midpoint reference.
SAFE_EXP = 20.0
# Log-decays below this are clamped before exp: exp(-80) ~ 1.8e-35 is zero for every purpose
# here, and fp32 exp of arguments below ~-87 takes a slow path (10x) and yields denormals.
EXP_FLOOR = -80.0


def exp_clamped(x: torch.Tensor) -> torch.Tensor:
    """In-place clamped exp of a fresh fp32 tensor."""
    return x.clamp_(min=EXP_FLOOR).exp_()


def vec_scores(rows: list[torch.Tensor], cols: torch.Tensor, b: torch.Tensor, safe: float | None = None):
    """Per-channel-decayed scores A_r[i, j] = sum_k rows_r[i,k] cols[j,k] exp(b[i,k] - b[j,k]).

    rows: list of [M, C, K] fp32, cols [M, C, K] fp32, b [M, C, K] float64 cumulative log-decay
    (non-increasing along C). Returns [R, M, C, C]; only the lower triangle (j <= i) is
    meaningful (the caller masks). C must be a power of two.
    """
    safe = SAFE_EXP if safe is None else safe
    r = len(rows)
    M, C, K = cols.shape
    out = None
    s = C
    while True:
        n = C // s
        bb = b.view(M, n, s, K)
        m = (s - 1) // 2
        if s > 1:
            hr = torch.maximum(bb[:, :, 0] - bb[:, :, m], bb[:, :, m] - bb[:, :, -1]).amax().item()
        if s == 1 or hr <= safe:
            # midpoint reference: |exponents| <= hr, both factors finite and normal in fp32
            er = exp_clamped((bb - bb[:, :, m : m + 1]).float())
            ec = torch.reciprocal(er)
            Rm = torch.empty(r, M, n, s, K, device=cols.device)
            for i, x in enumerate(rows):
                torch.mul(x.view(M, n, s, K), er, out=Rm[i])
            blk = torch.matmul(Rm, (cols.view(M, n, s, K) * ec).transpose(-1, -2))  # [r, M, n, s, s]
            if out is None:  # n == 1: the block is the whole chunk
                return blk.view(r, M, C, C)
            out.view(r, M, n, s, n, s).diagonal(dim1=2, dim2=4).copy_(blk.permute(0, 1, 3, 4, 2))
            return out
        if out is None:
            out = cols.new_zeros(r, M, C, C)
        # off-diagonal half blocks: reference at the boundary, both factors <= 1
        h = s // 2
        ref = bb[:, :, h - 1 : h]
        er = exp_clamped((bb[:, :, h:] - ref).float())
        ec = exp_clamped((ref - bb[:, :, :h]).float())
        Rm = torch.empty(r, M, n, h, K, device=cols.device)
        for i, x in enumerate(rows):
            torch.mul(x.view(M, n, s, K)[:, :, h:], er, out=Rm[i])
        blk = torch.matmul(Rm, (cols.view(M, n, s, K)[:, :, :h] * ec).transpose(-1, -2))  # [r, M, n, h, h]
        out.view(r, M, n, 2, h, n, 2, h).diagonal(dim1=2, dim2=5)[:, :, 1, :, 0].copy_(blk.permute(0, 1, 3, 4, 2))
        s = h


def unit_lower_inv(L: torch.Tensor, base: int = 8) -> torch.Tensor:
    """(I + strict_lower(L))^-1 for L [..., C, C], C a power of two; only the strict lower triangle
    of L is read. Forward substitution on base x base diagonal blocks (row by row, vectorised over
    every block), then 2x2 block doubling: inv([[A, 0], [Cb, D]]) = [[A^-1, 0], [-D^-1 Cb A^-1, D^-1]].
    Faster than batched LAPACK trsm on CPU (one parallel region per step instead of one per
    matrix) and the same arithmetic as forward substitution."""
    *bs, C, _ = L.shape
    base = min(base, C)
    nb = C // base
    Lf = L.reshape(-1, C, C)
    M = Lf.shape[0]
    D = Lf.view(M, nb, base, nb, base).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [M, nb, base, base]
    X = Lf.new_zeros(M, nb, base, base)
    X[..., 0, 0] = 1.0
    for i in range(1, base):
        X[..., i, :i] = torch.matmul(D[..., i : i + 1, :i], X[..., :i, :i]).squeeze(-2).neg_()
        X[..., i, i] = 1.0
    s = base
    while s < C:
        n2 = C // (2 * s)
        Xv = X.view(M, n2, 2, s, s)
        Ai, Di = Xv[:, :, 0], Xv[:, :, 1]
        Cb = Lf.view(M, n2, 2, s, n2, 2, s).diagonal(dim1=1, dim2=4)[:, 1, :, 0].permute(0, 3, 1, 2)
        Y = Lf.new_zeros(M, n2, 2 * s, 2 * s)
        Y[:, :, :s, :s] = Ai
        Y[:, :, s:, s:] = Di
        Y[:, :, s:, :s] = torch.matmul(Di, torch.matmul(Cb, Ai)).neg_()
        X = Y
        s *= 2
    return X.view(*bs, C, C)
