"""Chunked torch implementations of every linear-attention family (fp32 inside).

Same contract as :mod:`kernels.linear_attn.naive` (read its docstring):

    S_t = (I - beta_t k_t k_t^T)^delta . diag(exp g_t) . S_{t-1} + b_t k_t v_t^T,   o_t = scale . S_t^T q_t

Within a chunk of C tokens (b = cumulative log-decay from the chunk start, Gamma_t = diag(exp b_t))
every family is written as

    S_t  = Gamma_t S_0 + sum_{j<=t} Gamma_t Gamma_j^-1 k_j d_j^T
    o_t  = scale [ (Gamma_t q_t)^T S_0 + sum_{j<=t} (q_t^T Gamma_t Gamma_j^-1 k_j) d_j^T ]

with d = b.v for the plain families and, for the delta families, the WY / UT form
(I + L) d = beta v - beta Gamma k S_0, L_tj = beta_t k_t^T Gamma_t Gamma_j^-1 k_j (j < t),
i.e. d = U - W S_0 with U = (I+L)^-1 beta v and W = (I+L)^-1 beta Gamma k.

Gates:
* scalar gates (retnet [H], mamba2 / gated_deltanet [B,T,H]) use the exact pairwise decay matrix
  exp(b_i - b_j) [C, C] per head (cheap);
* per-channel gates (gla, kda [B,T,H,K]) cannot factor the decay out of the k-sum. The intra-chunk
  score matrix is built by a binary block decomposition: an off-diagonal half block (rows in the
  second half, columns in the first) uses the boundary between them as reference, so both factors
  exp(b_i - b_ref) and exp(b_ref - b_j) are <= 1 (never overflow); diagonal blocks use their
  midpoint as reference once its half-range is below ``SAFE_EXP`` nats (exact in fp32, no
  overflow), and are split further otherwise (down to single tokens), so arbitrarily strong
  decays stay finite and exact.
Cumulative log-decays are summed in float64 (cheap, [T, H(, K)]), so near-diagonal decays of a
fast-decaying chunk keep full fp32 precision.

The matrix transition operator of the delta families (T_C with S(C|S0) = T_C S0 + S(C|0)) is
computed in the same pass when asked for: the state is augmented with K extra columns started at
the identity and fed zero values, so the UT transform is shared (see ``chunk_with_transition``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .families import FAMILY
from .intra import EXP_FLOOR, SAFE_EXP, exp_clamped, unit_lower_inv, vec_scores


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _chunk_len(T: int, chunk_size: int) -> int:
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return min(chunk_size, _next_pow2(max(T, 1)))


def _to_chunks(x: torch.Tensor, N: int, C: int, dtype=torch.float32, scale: float | None = None) -> torch.Tensor:
    """[B, T, H(, D)] -> fresh contiguous [N, B*H, C(, D)] in ``dtype``, zero padded, in one pass."""
    B, T, H = x.shape[:3]
    tail = tuple(x.shape[3:])
    buf = torch.empty((N, B, H, C) + tail, dtype=dtype, device=x.device)
    perm = (1, 0, 3, 2) + tuple(range(4, 4 + len(tail)))
    bp = buf.permute(perm)  # [B, N, C, H(, D)] view of buf
    full, r = divmod(T, C)
    if full:
        bp[:, :full].copy_(x[:, : full * C].reshape((B, full, C, H) + tail))
    if r:
        bp[:, full, :r].copy_(x[:, full * C :])
        bp[:, full, r:].zero_()
    if scale is not None and scale != 1.0:
        buf.mul_(scale)  # (contiguous: much faster than writing a scaled permuted view)
    return buf.view((N, B * H, C) + tail)


def _from_chunks(x: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """[N, B*H, C, D] -> [B, T, H, D]."""
    N, _, C, D = x.shape
    return x.view(N, B, H, C, D).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :T]


def default_chunk_size(family_or_delta, device="cpu") -> int:
    """Chunk size the dispatchers use: 32 for the delta families on CPU (measured 10-30% faster
    there: the C^2 UT work halves, the chunk loop stays cheap), 64 otherwise."""
    delta = FAMILY[family_or_delta].delta if isinstance(family_or_delta, str) else bool(family_or_delta)
    return 32 if (delta and torch.device(device).type == "cpu") else 64


def _gate_kind(g: torch.Tensor | None) -> str:
    if g is None:
        return "none"
    if g.dim() == 1:
        return "const"
    if g.dim() == 3:
        return "scalar"
    if g.dim() == 4:
        return "vector"
    raise ValueError(f"gate must be [H], [B,T,H] or [B,T,H,K], got {tuple(g.shape)}")


@dataclass
class _Chunked:
    """The inputs cut into N chunks of C tokens, heads flattened into Z = B * H (fp32, zero padded)."""

    N: int
    Z: int
    C: int
    K: int
    V: int
    kc: torch.Tensor  # [N, Z, C, K]
    vc: torch.Tensor  # [N, Z, C, V] (V = 0: zero values, only T is produced)
    qc: torch.Tensor | None  # [N, Z, C, K] with the scale folded in; None: no outputs
    bc: torch.Tensor | None  # [N, Z, C] beta


@dataclass
class _Decay:
    """The gate of every chunk, from b = cumulative log-decay since the chunk start (float64)."""

    vec: bool  # per-channel gate ([N, Z, C, K] decays) rather than one per head
    tril: torch.Tensor  # [C, C] bool, lower triangle incl. the diagonal
    b: torch.Tensor | None  # [N, Z, C(, K)] float64; None: no gate
    eb: torch.Tensor | None  # Gamma_t (<= 1), [N, Z, C, 1 | K]
    gam: torch.Tensor | None  # Gamma_C, the decay over a whole chunk, [N, Z(, K)]
    Dm: torch.Tensor | None  # [N, Z, C, C] exp(b_i - b_j), masked to j <= i (scalar gates / no gate)
    kd: torch.Tensor  # keys decayed to the chunk end, Gamma_C Gamma_t^-1 k_t
    T_span: torch.Tensor | None  # exp(sum g) over the whole span (plain families, when T is asked for)

    def scale_state(self, gam_c: torch.Tensor) -> torch.Tensor:
        """One chunk's Gamma_C shaped to multiply a [Z, K, V] state."""
        return gam_c.unsqueeze(-1) if self.vec else gam_c.view(-1, 1, 1)


def _chunk_inputs(q, k, v, beta, scale, N: int, C: int) -> _Chunked:
    B, _, H = k.shape[:3]
    K = k.shape[3]
    kc = _to_chunks(k, N, C)
    vc = _to_chunks(v, N, C) if v is not None else kc.new_zeros(N, B * H, C, 0)
    qc = _to_chunks(q, N, C, scale=scale) if q is not None else None
    bc = _to_chunks(beta, N, C) if beta is not None else None
    return _Chunked(N, B * H, C, K, vc.shape[-1], kc, vc, qc, bc)


def _chunk_decay(g, kind: str, ch: _Chunked, B: int, T: int, H: int, span_T: bool) -> _Decay:
    """Decay factors of every chunk; `span_T`: also the whole span's exp(sum g)."""
    N, C, kc = ch.N, ch.C, ch.kc
    vec = kind == "vector"
    tril = torch.ones(C, C, dtype=torch.bool, device=kc.device).tril()
    if kind == "none":
        return _Decay(vec, tril, None, None, None, tril.float(), kc, None)
    gb = g.view(1, 1, H).expand(B, T, H) if kind == "const" else g
    b = _to_chunks(gb, N, C, torch.float64).cumsum_(2)  # [N, Z, C(, K)]
    bl = b[:, :, -1:]
    T_span = exp_clamped(bl.squeeze(2).sum(0).float()) if span_T else None  # [Z(, K)]
    eb = exp_clamped(b.float())  # Gamma_t (<= 1)
    ebC = exp_clamped((bl - b).float())  # Gamma_C Gamma_t^-1 (<= 1)
    gam = exp_clamped(bl.squeeze(2).float())  # [N, Z(, K)]
    Dm = None
    if not vec:
        Dm = (b.unsqueeze(-1) - b.unsqueeze(-2)).float().clamp_(EXP_FLOOR, 0.0).exp_().masked_fill_(~tril, 0.0)
        eb, ebC = eb.unsqueeze(-1), ebC.unsqueeze(-1)
    return _Decay(vec, tril, b, eb, gam, Dm, kc * ebC, T_span)


def _intra_scores(ch: _Chunked, dec: _Decay, delta: bool):
    """(A, Lm, kb): q-k scores A (lower incl. diagonal; None without q), beta k-k scores Lm of the
    delta rule (only the strict lower triangle is read, by the solve; None for plain families) and,
    for per-channel delta, the beta-scaled keys kb (rows of the score matrix and of the W
    right-hand side). The scalar path folds beta into Lm and the W right-hand side instead (fewer
    elementwise passes)."""
    N, Z, C, K, kc, qc, bc = ch.N, ch.Z, ch.C, ch.K, ch.kc, ch.qc, ch.bc
    A = Lm = None
    kb = (kc * bc.unsqueeze(-1) if bc is not None else kc) if (delta and dec.vec) else None
    if dec.vec:
        rows = ([qc] if qc is not None else []) + ([kb] if delta else [])
        if rows:
            flat = lambda x: x.view(N * Z, C, K)
            sc = vec_scores([flat(x) for x in rows], flat(kc), dec.b.view(N * Z, C, K)).view(len(rows), N, Z, C, C)
            if qc is not None:
                A = sc[0].masked_fill_(~dec.tril, 0.0)
            if delta:
                Lm = sc[-1]
    else:
        if qc is not None:
            A = torch.matmul(qc, kc.transpose(-1, -2)).mul_(dec.Dm)
        if delta:
            Lm = torch.matmul(kc, kc.transpose(-1, -2))
            Lm.mul_(dec.Dm if bc is None else bc.unsqueeze(-1) * dec.Dm)
    return A, Lm, kb


def _plain_scan(ch: _Chunked, dec: _Decay, A, S0, want_T: bool):
    """Plain families: (chunk outputs [N, Z, C, V] or None, final state [Z, K, V], T or None,
    the state entering every chunk [N, Z, K, V])."""
    N, Z, C, K, V, kc, vc, qc, bc = ch.N, ch.Z, ch.C, ch.K, ch.V, ch.kc, ch.vc, ch.qc, ch.bc
    vb = vc * bc.unsqueeze(-1) if bc is not None else vc
    # chunk writes (one batched matmul), then one op per chunk for the scan of chunk states
    upd = torch.matmul(dec.kd.transpose(-1, -2), vb)  # [N, Z, K, V]
    Xs = kc.new_empty(N + 1, Z, K, V)  # Xs[c] = state entering chunk c
    if S0 is not None:
        Xs[0].copy_(S0)
    else:
        Xs[0].zero_()
    for c in range(N):
        if dec.gam is not None:
            torch.addcmul(upd[c], Xs[c], dec.scale_state(dec.gam[c]), out=Xs[c + 1])
        else:
            torch.add(Xs[c], upd[c], out=Xs[c + 1])
    S = Xs[N].clone()  # (no view into the chunk-state buffer)
    o_c = None
    if qc is not None:
        qg = qc * dec.eb if dec.b is not None else qc
        o_c = torch.baddbmm(
            torch.matmul(A, vb).view(N * Z, C, V), qg.view(N * Z, C, K), Xs[:N].view(N * Z, K, V)
        ).view(N, Z, C, V)
    T_out = None
    if want_T:  # no gate: identity transition
        T_out = dec.T_span if dec.T_span is not None else torch.ones(Z, device=kc.device)
    return o_c, S, T_out, Xs[:N]


def _delta_uw(ch: _Chunked, dec: _Decay, Lm, kb, want_T: bool):
    """The UT transform: U = (I+L)^-1 beta v and W = (I+L)^-1 beta Gamma k, one solve for both
    (U padded with K zero columns when T is asked for: the identity-started columns get zero values)."""
    V, kc, vc, bc, eb = ch.V, ch.kc, ch.vc, ch.bc, dec.eb
    Minv = unit_lower_inv(Lm)  # (I + L)^-1, reads only the strict lower triangle of Lm
    rhs = kc.new_empty(ch.N, ch.Z, ch.C, V + ch.K)
    if bc is not None:
        torch.mul(vc, bc.unsqueeze(-1), out=rhs[..., :V])
    else:
        rhs[..., :V].copy_(vc)
    if dec.vec:
        torch.mul(kb, eb, out=rhs[..., V:])
    elif dec.b is not None:
        torch.mul(kc, eb * bc.unsqueeze(-1) if bc is not None else eb, out=rhs[..., V:])
    elif bc is not None:
        torch.mul(kc, bc.unsqueeze(-1), out=rhs[..., V:])
    else:
        rhs[..., V:].copy_(kc)
    UW = torch.matmul(Minv, rhs)  # [N, Z, C, V + K]
    U, W = UW[..., :V], UW[..., V:]
    if want_T:
        U = F.pad(U, (0, ch.K))
    return U, W


def _delta_scan(ch: _Chunked, dec: _Decay, A, Lm, kb, S0, want_T: bool):
    """Delta families: (chunk outputs or None, final state [Z, K, V], T [Z, K, K] or None, the
    state entering every chunk [N, Z, K, V] or None when there are no outputs).

    The outputs need the state entering every chunk and every chunk's new values (V columns only).
    Without T the loop writes them in place into history buffers; with T (K augmented columns
    started at the identity) or without outputs it runs on two work buffers and keeps the V part."""
    N, Z, C, K, V, kc, qc = ch.N, ch.Z, ch.C, ch.K, ch.V, ch.kc, ch.qc
    U, W = _delta_uw(ch, dec, Lm, kb, want_T)
    Vx = V + (K if want_T else 0)
    kdT = dec.kd.transpose(-1, -2)
    keep = qc is not None
    in_place = keep and not want_T
    if in_place:
        Xs = kc.new_empty(N + 1, Z, K, V)  # Xs[c] = state entering chunk c
        dl = kc.new_empty(N, Z, C, V)
        X = Xs[0]
    else:
        X, Xn = kc.new_empty(Z, K, Vx), kc.new_empty(Z, K, Vx)
        dw = kc.new_empty(Z, C, Vx)
        if keep:
            starts, dl = kc.new_empty(N, Z, K, V), kc.new_empty(N, Z, C, V)
    X.zero_()
    if S0 is not None:
        X[..., :V].copy_(S0)
    if want_T:
        X[..., V:].copy_(torch.eye(K, device=kc.device))
    for c in range(N):
        if in_place:
            X, Xn, d = Xs[c], Xs[c + 1], dl[c]
        else:
            d = dw
            if keep:
                starts[c].copy_(X[..., :V])
        torch.baddbmm(U[c], W[c], X, alpha=-1.0, out=d)  # new values d = U - W S
        if dec.gam is not None:
            torch.mul(X, dec.scale_state(dec.gam[c]), out=Xn)
            Xn.baddbmm_(kdT[c], d)
        else:
            torch.baddbmm(X, kdT[c], d, out=Xn)
        if not in_place:
            if keep:
                dl[c].copy_(d[..., :V])
            X, Xn = Xn, X
    if in_place:
        X, starts = Xs[N], Xs[:N]
    S = X[..., :V].clone()
    T_out = X[..., V:].clone() if want_T else None
    o_c = None
    if qc is not None:
        qg = qc * dec.eb if dec.b is not None else qc
        o_c = torch.matmul(A, dl).add_(torch.matmul(qg, starts))
    return o_c, S, T_out, (starts if keep else None)


def _chunk_core(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor | None,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    scale: float | None,
    delta: bool,
    chunk_size: int,
    want_T: bool = False,
    out: torch.Tensor | None = None,
    starts: list | None = None,
):
    """Returns (o or None, final state [B,H,K,V] fp32, T or None); `starts` (a list, when given)
    receives the state entering every chunk, [N, B, H, K, V] fp32 (C = chunk_size once T >= it).

    q None: no outputs (summary only). v None: zero values (V = 0, only T is produced).
    T: [B,H] (scalar gates / no gate), [B,H,K] (per-channel gate) for the plain families,
    [B,H,K,K] for the delta families.
    """
    B, T, Hk, K = k.shape
    H = v.shape[2] if v is not None else Hk
    V = v.shape[3] if v is not None else 0
    if H != Hk:  # grouped value heads: each q/k head serves H // Hk value heads
        if H % Hk:
            raise ValueError(f"value heads {H} not a multiple of key heads {Hk}")
        rep = H // Hk
        k = k.repeat_interleave(rep, dim=2)
        q = q.repeat_interleave(rep, dim=2) if q is not None else None
    dev = k.device
    out_dtype = q.dtype if q is not None else torch.float32
    scale = K**-0.5 if scale is None else scale
    kind = _gate_kind(g)
    if kind == "const" and g.shape[0] != H:
        raise ValueError(f"const gate must have H={H} entries, got {tuple(g.shape)}")
    if kind in ("scalar", "vector") and g.shape[2] != H:
        raise ValueError("gate heads must match value heads")
    Z = B * H
    S0 = initial_state.float().reshape(Z, K, V) if initial_state is not None else None

    if T == 0:
        S = S0.clone() if S0 is not None else torch.zeros(Z, K, V, device=dev)
        o = torch.empty(B, 0, H, V, dtype=out_dtype, device=dev) if q is not None else None
        form = "matrix" if delta else "vector" if kind == "vector" else "scalar"
        return o, S.view(B, H, K, V), (identity_transition(form, B, H, K, dev) if want_T else None)

    C = _chunk_len(T, chunk_size)
    N = -(-T // C)
    ch = _chunk_inputs(q, k, v, beta, scale, N, C)
    dec = _chunk_decay(g, kind, ch, B, T, H, span_T=want_T and not delta)
    A, Lm, kb = _intra_scores(ch, dec, delta)
    if delta:
        o_c, S, T_out, entering = _delta_scan(ch, dec, A, Lm, kb, S0, want_T)
    else:
        o_c, S, T_out, entering = _plain_scan(ch, dec, A, S0, want_T)
    if starts is not None:
        starts.append(None if entering is None else entering.reshape(N, B, H, K, V))

    o = None
    if o_c is not None:
        o_full = _from_chunks(o_c, B, H, T)
        if out is not None:
            out.copy_(o_full)
            o = out
        else:
            o = o_full.to(out_dtype).contiguous()
    S = S.reshape(B, H, K, V)
    if want_T:
        T_out = T_out.reshape((B, H) + tuple(T_out.shape[1:]))
    return o, S, T_out


def identity_transition(form: str, B: int, H: int, K: int, device) -> torch.Tensor:
    """T of an empty span in structured `form` (fp32): ones, or the identity for "matrix"."""
    if form == "matrix":
        return torch.eye(K, device=device).expand(B, H, K, K).clone()
    if form == "vector":
        return torch.ones(B, H, K, device=device)
    return torch.ones(B, H, device=device)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    delta: bool = False,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of :func:`naive_recurrent`: returns (o [B,T,H,V] in q's dtype, S [B,H,K,V] fp32).

    ``out`` (optional, [B,T,H,V]) receives o. q/k may have fewer heads than v (grouped value
    heads, each q/k head serving H_v // H_k consecutive value heads).
    """
    o, S, _ = _chunk_core(q, k, v, g, beta, initial_state, scale, delta, chunk_size, out=out)
    return o, S


def chunk_with_transition(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    delta: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One pass producing (o or None when q is None, S [B,H,K,V], T).

    T is the segment's transition operator in structured form (fp32): [B,H] for scalar / no
    gates, [B,H,K] for per-channel gates, [B,H,K,K] for the delta families; with it
    S(C | S0) = T . S0 + S(C | 0). With ``initial_state`` S is the end state from that start.
    """
    return _chunk_core(q, k, v, g, beta, initial_state, scale, delta, chunk_size, want_T=True)


# Family wrappers: same signatures as the naive_* wrappers; the chunk size is the dispatcher's
# default for the device (:func:`default_chunk_size`: 32 for the delta families on CPU, else 64).


def chunk_retnet(q, k, v, g, initial_state=None, scale=None):
    """RetNet / Lightning attention: g [H], a fixed log-decay per head."""
    return chunk_linear_attn(q, k, v, g=g, initial_state=initial_state, scale=scale,
                             chunk_size=default_chunk_size(False, k.device))


def chunk_mamba2(q, k, v, g, initial_state=None, scale=1.0):
    """Mamba2 (SSD): q = C, k = B, v = dt*x, g = dt*A [B,T,H] (scalar per token)."""
    return chunk_linear_attn(q, k, v, g=g, initial_state=initial_state, scale=scale,
                             chunk_size=default_chunk_size(False, k.device))


def chunk_gla(q, k, v, g, initial_state=None, scale=None):
    """GLA: g [B,T,H,K], a per-channel log-decay."""
    return chunk_linear_attn(q, k, v, g=g, initial_state=initial_state, scale=scale,
                             chunk_size=default_chunk_size(False, k.device))


def chunk_deltanet(q, k, v, beta, initial_state=None, scale=None):
    """DeltaNet: beta [B,T,H], no decay."""
    return chunk_linear_attn(q, k, v, beta=beta, initial_state=initial_state, scale=scale, delta=True,
                             chunk_size=default_chunk_size(True, k.device))


def chunk_gated_deltanet(q, k, v, g, beta, initial_state=None, scale=None):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): g [B,T,H] scalar per token, beta [B,T,H]."""
    return chunk_linear_attn(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=True,
                             chunk_size=default_chunk_size(True, k.device))


def chunk_kda(q, k, v, g, beta, initial_state=None, scale=None):
    """KDA (Kimi-Linear): g [B,T,H,K] per channel, beta [B,T,H]."""
    return chunk_linear_attn(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=True,
                             chunk_size=default_chunk_size(True, k.device))


__all__ = [
    "SAFE_EXP",
    "default_chunk_size",
    "identity_transition",
    "chunk_linear_attn",
    "chunk_with_transition",
    "chunk_retnet",
    "chunk_mamba2",
    "chunk_gla",
    "chunk_deltanet",
    "chunk_gated_deltanet",
    "chunk_kda",
]
