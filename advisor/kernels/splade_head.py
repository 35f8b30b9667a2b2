"""The SPLADE head for training, forward and backward, without ever holding the B x L x V logits.

    out = SpladeHeadFunction.apply(hidden, weight, bias, mask)     # == splade_head_reference(...)

    logits[b, l, v] = hidden[b, l, :] . weight[v, :] + bias[v]                 hidden B x L x D, weight V x D
    out[b, v]       = max over l of log1p(relu(logits[b, l, v])) * mask[b, l]  mask B x L

Eager (and torch.compile) write the logits, B x L x V: 500 MB in bf16 at B=32, L=256, V=30522 (BERT's
vocabulary), 4 GB at V=250002, and eager keeps three such tensors for its backward. Here:

Forward (`_forward_kernel`, one program per (batch row b, block of BLOCK_V vocabulary columns), looping
over the sequence a BLOCK_L tile at a time): the tile's logits are accumulated in fp32 registers, the
chain is applied there, and each column keeps its running max, the sequence position that holds it
(`winner`, int32) and the derivative of out[b, v] with respect to the logit at that position
(`slope` = mask[b, s*] * (x* > 0) / (1 + x*), fp32). Those two B x V tensors are all the backward needs
besides the inputs. Bytes: hidden read once per vocabulary block (from L2: programs in flight share
b-blocks), weight read once per batch row (the grid's fast axis is b, so programs in flight share a
weight block in L2), B x V x (out + 4 + 4) written.

Backward, with c[b, v] = grad_out[b, v] * slope[b, v] (the gradient reaching the one winning logit):
  dbias[v]      = sum_b c[b, v]
  dweight[v, :] = sum_b c[b, v] * hidden[b, s*[b, v], :]         (`_dweight_kernel`: a gather per b,
                                                                   B x V x D multiply-adds, no matmul)
  dhidden[b, s] = sum_v [s*[b, v] == s] c[b, v] * weight[v, :]   (`_dhidden_kernel`: per b the one-hot
                  matrix P_b (L x V, column v holding c[b, v] at row s*[b, v]) times weight, built tile by
                  tile in registers and fed to tl.dot, never P in memory; each sequence tile walks only the
                  columns whose winner it holds (each batch row's columns sorted by winner first), so
                  B x V x BLOCK_L x D multiply-adds, the forward's FLOPs / (L / BLOCK_L))
Bytes of the backward: dweight reads grad, slope and winner (B x V each) and B x V gathered hidden rows
(B x V x D x 2 bytes in bf16, from L2: hidden is B x L x D), writes V x D; dhidden sorts winner (B x V),
reads B x V gathered weight rows (each column once per batch row, zero-slope columns never), writes B x L x D.

Ties: PyTorch's amax splits the gradient evenly among tied maxima; this kernel gives it all to the first
position holding the max. Where the max is 0 (every column whose logits are all <= 0 at unmasked
positions, and fully masked rows) every tied position has a zero derivative (relu's is 0 at x <= 0,
a masked position's is 0), so both conventions give 0. Positive ties need two logits whose chain values
are bit-identical: in fp32/fp64 on random data that does not happen (the tests draw such data); in bf16
eager's rounded logits do tie, and eager then averages the hidden rows of the tied positions where this
kernel, computing the chain in fp32, takes the true maximum's row. NaN: a column with a NaN logit gets
out NaN (as amax), and its gradient is undefined either way.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from advisor.interpreter import interpret_module_on_cpu, runs_interpreted


# ------------------------------------------------------------------------------------------ forward
@triton.jit
def _log1p(x):
    # log(1 + x) loses a tiny x; Kahan's log(u) * x / (u - 1), u = 1 + x, does not.
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * x / tl.where(d == 0.0, 1.0, d))


@triton.jit
def _forward_kernel(H, W, BIAS, MASK, OUT, WINNER, SLOPE,
                    L, V, D,
                    stride_hb, stride_hl, stride_hd, stride_wv, stride_wd, stride_mb, stride_ml,
                    HAS_BIAS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # the batch row (fast axis: programs in flight share a weight block)
    rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = rv < V
    h_row = H + b * stride_hb
    if HAS_BIAS:
        bias = tl.load(BIAS + rv, mask=v_ok, other=0.0).to(tl.float32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    winner = tl.zeros([BLOCK_V], tl.int32)
    slope = tl.zeros([BLOCK_V], tl.float32)
    nan_seen = tl.zeros([BLOCK_V], tl.int32)
    for l0 in range(0, L, BLOCK_L):
        rl = l0 + tl.arange(0, BLOCK_L)
        l_ok = rl < L
        # logits tile (BLOCK_L x BLOCK_V) = hidden[b, rl, :] @ weight[rv, :]^T, fp32 accumulation
        acc = tl.zeros([BLOCK_L, BLOCK_V], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            d_ok = rd < D
            h = tl.load(h_row + rl[:, None] * stride_hl + rd[None, :] * stride_hd,
                        mask=l_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(W + rv[None, :] * stride_wv + rd[:, None] * stride_wd,
                        mask=v_ok[None, :] & d_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter's bf16 tl.dot is wrong; bf16 -> fp32 is exact
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        x = acc
        if HAS_BIAS:
            x = x + bias[None, :]
        m = tl.load(MASK + b * stride_mb + rl * stride_ml, mask=l_ok, other=0.0).to(tl.float32)
        val = _log1p(tl.maximum(x, 0.0)) * m[:, None]
        nan_seen += tl.sum((val != val).to(tl.int32), axis=0)
        val = tl.where(l_ok[:, None], val, float("-inf"))  # rows past L never win
        tile_best = tl.max(val, axis=0)
        tile_at = tl.argmax(val, axis=0, tie_break_left=True)  # the first position among ties
        # d out / d logit at each position; the winner's picked out by a one-hot sum (no register gather)
        d = tl.where(x > 0.0, m[:, None] / (1.0 + x), 0.0)
        tile_slope = tl.sum(tl.where(tl.arange(0, BLOCK_L)[:, None] == tile_at[None, :], d, 0.0), axis=0)
        better = tile_best > best  # strict: an earlier tile keeps a tie
        best = tl.where(better, tile_best, best)
        winner = tl.where(better, l0 + tile_at, winner)
        slope = tl.where(better, tile_slope, slope)
    best = tl.where(nan_seen > 0, float("nan"), best)
    at = b * V + rv
    tl.store(OUT + at, best.to(OUT.dtype.element_ty), mask=v_ok)
    tl.store(WINNER + at, winner, mask=v_ok)
    tl.store(SLOPE + at, slope, mask=v_ok)


# ------------------------------------------------------------------------------------------ backward
@triton.jit
def _dweight_kernel(H, GRAD, WINNER, SLOPE, DW, DBIAS,
                    B, V, D,
                    stride_hb, stride_hl, stride_hd, stride_gb, stride_gv,
                    HAS_DBIAS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    # dweight[v, d] = sum_b c[b, v] * hidden[b, winner[b, v], d]: per batch row one gathered hidden row
    # per column, so B x BLOCK_V x BLOCK_D multiply-adds per program and no B x L x V anything.
    rv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    pid_d = tl.program_id(1)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    v_ok = rv < V
    d_ok = rd < D
    acc = tl.zeros([BLOCK_V, BLOCK_D], tl.float32)
    csum = tl.zeros([BLOCK_V], tl.float32)
    # Pointers advanced one batch row per step (64-bit pointer arithmetic: no int32 offset overflows).
    h_b, g_b = H, GRAD + rv * stride_gv
    winner_b, slope_b = WINNER + rv, SLOPE + rv
    for _ in range(0, B):
        c = tl.load(g_b, mask=v_ok, other=0.0).to(tl.float32) * tl.load(slope_b, mask=v_ok, other=0.0)
        s = tl.load(winner_b, mask=v_ok, other=0)
        h = tl.load(h_b + s[:, None] * stride_hl + rd[None, :] * stride_hd,
                    mask=v_ok[:, None] & d_ok[None, :] & (c != 0.0)[:, None], other=0.0)
        acc += c[:, None] * h.to(tl.float32)
        csum += c
        h_b += stride_hb
        g_b += stride_gb
        winner_b += V
        slope_b += V
    tl.store(DW + rv[:, None].to(tl.int64) * D + rd[None, :], acc.to(DW.dtype.element_ty),
             mask=v_ok[:, None] & d_ok[None, :])
    if HAS_DBIAS:
        if pid_d == 0:
            tl.store(DBIAS + rv, csum.to(DBIAS.dtype.element_ty), mask=v_ok)


@triton.jit
def _dhidden_kernel(W, GRAD, WINNER, SLOPE, DH, ORDER, BOUNDS,
                    L, V, D, n_l_blocks,
                    stride_wv, stride_wd, stride_gb, stride_gv,
                    BUCKETED: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # dhidden[b, l-tile, d-tile] = P_b[l-tile, :] @ weight[:, d-tile], with P_b[l, v] = c[b, v] where
    # winner[b, v] == l: each BLOCK_L x BLOCK_V block of P is built in registers from B x V rows.
    # BUCKETED: only the columns whose winner lies in this l-tile (ORDER: each batch row's columns sorted by
    # winner, BOUNDS: where each l-tile's run starts), the others' P blocks being all zero: L / BLOCK_L
    # times fewer FLOPs and weight rows read than walking every column.
    pid = tl.program_id(0)  # (b, l-tile) on the fast axis: programs in flight read the same weight columns
    pid_l = pid % n_l_blocks
    b = (pid // n_l_blocks).to(tl.int64)
    rl = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    l_ok = rl < L
    d_ok = rd < D
    if BUCKETED:
        start = tl.load(BOUNDS + b * (n_l_blocks + 1) + pid_l)
        end = tl.load(BOUNDS + b * (n_l_blocks + 1) + pid_l + 1)
    else:
        start = 0
        end = V
    acc = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)
    for i0 in range(start, end, BLOCK_V):
        ri = i0 + tl.arange(0, BLOCK_V)
        ok = ri < end
        if BUCKETED:
            rv = tl.load(ORDER + b * V + ri, mask=ok, other=0)
        else:
            rv = ri
        c = tl.load(GRAD + b * stride_gb + rv * stride_gv, mask=ok, other=0.0).to(tl.float32) \
            * tl.load(SLOPE + b * V + rv, mask=ok, other=0.0)
        s = tl.load(WINNER + b * V + rv, mask=ok, other=-1)
        p = tl.where(rl[:, None] == s[None, :], c[None, :], 0.0)
        w = tl.load(W + rv[:, None] * stride_wv + rd[None, :] * stride_wd, mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        else:  # P in the weight's dtype, as eager's logits gradient is
            p = p.to(w.dtype)
        acc = tl.dot(p, w, acc, input_precision=DOT_PRECISION)
    tl.store(DH + b * L * D + rl[:, None] * D + rd[None, :], acc.to(DH.dtype.element_ty),
             mask=l_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------ launch heuristics
def _small(n: int, least: int = 16, most: int = 32) -> int:
    """The interpreter's tile: a power of two >= 16 (tl.dot's minimum), small, so odd sizes leave a tail."""
    return max(least, min(most, triton.next_power_of_2(n)))


def forward_config(L: int, V: int, D: int, interpreted: bool = False) -> dict:
    """Tiles of the forward. The fp32 BLOCK_L x BLOCK_V accumulator and the chain's values on it live in
    registers: 64 x 128 with 8 warps keeps 32 fp32 of each per thread; BLOCK_D 64 bf16 keeps the two
    operand tiles at 8 + 16 KB per stage."""
    if interpreted:
        return dict(BLOCK_L=_small(L), BLOCK_V=_small(V), BLOCK_D=_small(D), num_warps=4, num_stages=1)
    return dict(BLOCK_L=64, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=3)


def dweight_config(V: int, D: int, interpreted: bool = False) -> dict:
    """A gather and multiply-add per batch row, no tensor cores: 64 columns x 128 features per program
    (fp32 accumulator: 32 per thread at 8 warps), each gathered hidden row slice 256 contiguous bytes."""
    if interpreted:
        return dict(BLOCK_V=_small(V), BLOCK_D=_small(D), num_warps=4, num_stages=1)
    return dict(BLOCK_V=64, BLOCK_D=128, num_warps=8, num_stages=2)


def dhidden_config(L: int, V: int, D: int, interpreted: bool = False) -> dict:
    """A matmul whose left operand is built in registers: a 64 x 128 output tile (fp32 accumulator), weight
    rows read 64 at a time. Bucketed (only the columns whose winner falls in the tile) wherever the sequence
    spans more than one tile: the sort costs one B x V int32 sort, the dense walk L / BLOCK_L times the work."""
    if interpreted:  # 16-row tiles: a sequence of 17 or more is bucketed there too
        cfg = dict(BLOCK_L=_small(L, most=16), BLOCK_V=_small(V), BLOCK_D=_small(D), num_warps=4, num_stages=1)
    else:
        cfg = dict(BLOCK_L=64, BLOCK_V=64, BLOCK_D=128, num_warps=4, num_stages=3)
    return dict(cfg, BUCKETED=L > cfg["BLOCK_L"])


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands: exact fp32 products unless torch allows TF32 for matmuls (eager then uses it too)."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _store_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): store fp32 there, round in torch."""
    return torch.float32 if interpreted and dtype == torch.bfloat16 else dtype


# ------------------------------------------------------------------------------------------ launchers
def _mask_2d(mask: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """The mask as B x L (the model multiplies by mask[..., None]: B x L x 1), strides kept (no copy)."""
    if mask.dim() == 3:
        mask = mask.squeeze(-1)
    return mask.expand(B, L)


def splade_head_forward(hidden, weight, bias, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out B x V in hidden's dtype, winner B x V int32, slope B x V fp32)."""
    B, L, D = hidden.shape
    V = weight.shape[0]
    if max(hidden.numel(), weight.numel(), B * V) >= 2**31:
        raise ValueError("the SPLADE head kernels index with 32-bit offsets: a tensor of 2**31 elements or more")
    mask = _mask_2d(mask, B, L)
    interp = runs_interpreted(hidden.device)  # the kernels launched on CPU tensors run in Triton's interpreter
    out = torch.empty(B, V, dtype=_store_dtype(hidden.dtype, interp), device=hidden.device)
    winner = torch.empty(B, V, dtype=torch.int32, device=hidden.device)
    slope = torch.empty(B, V, dtype=torch.float32, device=hidden.device)
    cfg = forward_config(L, V, D, interp)
    grid = (B, triton.cdiv(V, cfg["BLOCK_V"]))
    _forward_kernel[grid](hidden, weight, bias if bias is not None else out, mask, out, winner, slope,
                          L, V, D, *hidden.stride(), *weight.stride(), *mask.stride(),
                          HAS_BIAS=bias is not None, DOT_PRECISION=_dot_precision(hidden.dtype),
                          UPCAST=interp and hidden.dtype == torch.bfloat16, **cfg)
    return out.to(hidden.dtype), winner, slope


def splade_head_backward(grad_out, hidden, weight, winner, slope, needs: tuple) -> tuple:
    """(dhidden, dweight, dbias), each None where `needs` (hidden, weight, bias) says no gradient is wanted."""
    B, L, D = hidden.shape
    V = weight.shape[0]
    dh = dw = db = None
    interp = runs_interpreted(hidden.device)
    if needs[1] or needs[2]:
        dw = torch.empty(V, D, dtype=_store_dtype(weight.dtype, interp), device=weight.device)
        db = torch.empty(V, dtype=torch.float32, device=weight.device) if needs[2] else None
        cfg = dweight_config(V, D, interp)
        grid = (triton.cdiv(V, cfg["BLOCK_V"]), triton.cdiv(D, cfg["BLOCK_D"]))
        _dweight_kernel[grid](hidden, grad_out, winner, slope, dw, db if db is not None else dw, B, V, D,
                              *hidden.stride(), *grad_out.stride(), HAS_DBIAS=db is not None, **cfg)
        dw = dw.to(weight.dtype) if needs[1] else None
    if needs[0]:
        dh = torch.empty(B, L, D, dtype=_store_dtype(hidden.dtype, interp), device=hidden.device)
        cfg = dict(dhidden_config(L, V, D, interp))
        bucketed = cfg.pop("BUCKETED")
        n_l_blocks = triton.cdiv(L, cfg["BLOCK_L"])
        order = bounds = winner  # (unread unless bucketed)
        if bucketed:
            # each batch row's columns by winner, and where each l-tile's run of them starts (B x V int32 sort).
            # Columns with a zero slope (max 0: relu'd or masked everywhere, most of a trained SPLADE model's)
            # sort past the last tile: no program walks them (and tile 0, where they win, is not overloaded).
            past = n_l_blocks * cfg["BLOCK_L"]
            ranked, order = torch.sort(torch.where(slope != 0, winner, past), dim=1, stable=True)
            starts = torch.arange(0, n_l_blocks + 1, device=winner.device, dtype=torch.int32) * cfg["BLOCK_L"]
            bounds = torch.searchsorted(ranked, starts.expand(B, -1).contiguous()).to(torch.int32)
            order = order.to(torch.int32)
        grid = (B * n_l_blocks, triton.cdiv(D, cfg["BLOCK_D"]))
        _dhidden_kernel[grid](weight, grad_out, winner, slope, dh, order, bounds, L, V, D, n_l_blocks,
                              *weight.stride(), *grad_out.stride(), BUCKETED=bucketed,
                              DOT_PRECISION=_dot_precision(weight.dtype),
                              UPCAST=interp and weight.dtype == torch.bfloat16, **cfg)
        dh = dh.to(hidden.dtype)
    return dh, dw, db


# ------------------------------------------------------------------------------------------ autograd
class SpladeHeadFunction(torch.autograd.Function):
    """forward(hidden B x L x D, weight V x D, bias V or None, mask B x L (or B x L x 1)) -> B x V.
    Saved for the backward: the inputs (held by the caller anyway) and winner + slope, B x V x 8 bytes
    (eager keeps three B x L x V tensors). The mask gets no gradient (see `SpladeTrainable`: a mask
    that requires one runs eager's ops)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, mask):
        out, winner, slope = splade_head_forward(hidden, weight, bias, mask)
        ctx.save_for_backward(hidden, weight, winner, slope)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, winner, slope = ctx.saved_tensors
        dh, dw, db = splade_head_backward(grad_out, hidden, weight, winner, slope, ctx.needs_input_grad[:3])
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, db, None


def splade_head_reference(hidden, weight, bias, mask):
    """Eager PyTorch's SPLADE head (what the Function computes, and what its gradients are checked against)."""
    mask = _mask_2d(mask, hidden.shape[0], hidden.shape[1])
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return torch.amax(torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1), dim=1)


interpret_module_on_cpu(sys.modules[__name__])  # launched on CPU tensors: in Triton's interpreter
