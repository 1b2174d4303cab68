"""Fused rotary position embeddings (RoPE) on q and k: validation, ops, autograd, public API.

- ``rope(q, k, positions, inv_freq)`` rotates q (B, L, Hq, D) and k (B, L, Hk, D) (the layout
  of a QKV projection's output viewed per head; any strides) in one kernel launch and returns
  new contiguous (B, L, H, D) tensors; ``.transpose(1, 2)`` gives SDPA's (B, H, L, D) layout
  without a copy.
- ``rope_qkvpacked(qkv, num_heads, num_kv_heads, ...)`` takes the packed QKV projection output
  (B, L, (H + 2 Hkv) * D) (or (L, B, ...)) and returns one packed tensor of the same layout,
  q and k rotated and v copied in the same launch: the input of
  :func:`fused_block.attention_qkvpacked`, whose one packed gradient comes back through one
  launch too (no split, copy or cat on either side).

The backward is the same kernel with the inverse rotation; nothing is saved but the angle
inputs. See :mod:`fused_block.kernels.rope` for the layouts and the fp32 angle computation.
"""
from typing import Optional

import torch
from torch import Tensor

from fused_block import _backend, _library, _validate, reference
from fused_block.kernels import common
from fused_block.kernels import rope as _k

_INT_DTYPES = (torch.int32, torch.int64)
# cos/sin tables: any float dtype, read in fp32 (a float64 table, e.g. one Hugging Face code
# precomputed in float64, is rounded to fp32 before the kernel: :func:`_kernel_table`).
_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _kernel_table(t):
    """A cos/sin table as the kernels read it: fp32, fp16 or bf16 with a unit last stride; a
    float64 table rounded to fp32 first (the kernels read every table in fp32)."""
    return common.unit(t.float() if t.dtype is torch.float64 else t)


def _fake(q, k, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, conj):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@_library.op("rope", fake=_fake)
def _rope_op(q: Tensor, k: Tensor, positions: Optional[Tensor], inv_freq: Optional[Tensor],
             cos: Optional[Tensor], sin: Optional[Tensor], scale: float, rot_dim: int, interleaved: bool,
             conj: bool) -> tuple[Tensor, Tensor]:
    """q (B, L, Hq, D), k (B, L, Hk, D), unit last stride -> rotated contiguous copies."""
    with _backend.device_guard(q):
        return _k.rope(q, k, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, conj)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, cos, sin, scale, rot_dim, interleaved):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(positions, inv_freq, cos, sin)
        ctx.scale, ctx.rot_dim, ctx.interleaved = scale, rot_dim, interleaved
        ctx.q_shape, ctx.k_shape = q.shape, k.shape
        return _rope_op(q, k, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, False)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dq, dk):
        positions, inv_freq, cos, sin = ctx.saved_tensors
        # An unused output has no gradient: give the kernel zero heads of it instead of zeros.
        B, L, _, D = ctx.q_shape
        gq = common.unit(dq) if dq is not None else dk.new_empty((B, L, 0, D))
        gk = common.unit(dk) if dk is not None else dq.new_empty((B, L, 0, D))
        rq, rk = _rope_op(gq, gk, positions, inv_freq, cos, sin, ctx.scale, ctx.rot_dim, ctx.interleaved, True)
        return (rq if dq is not None else None, rk if dk is not None else None,
                None, None, None, None, None, None, None)


_RoPE_apply = _library.fast_apply(_RoPE)


def _check(q, k, positions, inv_freq, cos, sin, scale, interleaved):
    _validate.tensor("q", q, ndim=4)
    _validate.tensor("k", k, ndim=4)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    B, L, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != L or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, L={L}, Hk, D={D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    _validate.same_device("q", q, k=k)
    return _check_angles("q", q, B, L, D, positions, inv_freq, cos, sin, scale, interleaved, False)


def _check_angles(ref_name, ref, B, L, D, positions, inv_freq, cos, sin, scale, interleaved, default_positions):
    """The angle arguments for B sequences of L tokens with head dim D; returns the rotary dim
    and ``scale`` as a Python number (numpy's converted).
    ``default_positions``: positions may be None with inv_freq (0..L-1)."""
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {_validate.type_name(interleaved)}")
    scale = _validate.positive("scale", scale)
    if not _validate.finite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    from_positions = positions is not None or inv_freq is not None
    from_table = cos is not None or sin is not None
    if from_positions == from_table:
        raise ValueError("pass either positions and inv_freq, or cos and sin (exactly one pair)"
                         if not default_positions else
                         "pass either inv_freq (with positions, or none for 0..L-1), or cos and sin")
    if from_positions:
        _validate.tensor("positions", positions, dtypes=_INT_DTYPES, ndim=2, optional=default_positions)
        _validate.tensor("inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1)
        if positions is not None and (positions.shape[0] not in (1, B) or positions.shape[1] != L):
            raise ValueError(f"positions must have shape ({B} or 1, {L}), got {tuple(positions.shape)}")
        rot_dim = 2 * inv_freq.shape[0]
        if not 2 <= rot_dim <= D:
            raise ValueError(f"inv_freq must have between 1 and D/2 = {D // 2} entries, got {inv_freq.shape[0]}")
        _validate.same_device(ref_name, ref, positions=positions, inv_freq=inv_freq)
        if inv_freq.requires_grad and torch.is_grad_enabled():
            raise ValueError("inv_freq: no gradient flows to the frequencies; pass inv_freq.detach()")
        return rot_dim, scale
    if scale != 1.0:  # the tables are read as given: a scale of its own would be ignored
        raise ValueError(f"scale applies to angles from positions and inv_freq; cos and sin are used as given "
                         f"(scale them instead: Hugging Face's tables hold attention_scaling already), got "
                         f"scale={scale}")
    _validate.tensor("cos", cos, dtypes=_TABLE_DTYPES, ndim=3)
    _validate.tensor("sin", sin, dtypes=_TABLE_DTYPES, ndim=3)
    if cos.shape[0] not in (1, B) or cos.shape[1] != L:
        raise ValueError(f"cos must have shape ({B} or 1, {L}, rotary dim), got {tuple(cos.shape)}")
    _validate.shape("sin", sin, cos.shape)
    rot_dim = cos.shape[2]
    if rot_dim % 2 or not 2 <= rot_dim <= D:
        raise ValueError(f"cos: the rotary dim (last dim) must be even and in [2, D={D}], got {rot_dim}")
    _validate.same_device(ref_name, ref, cos=cos, sin=sin)
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("cos/sin: no gradient flows to the tables; pass cos.detach() and sin.detach()")
    return rot_dim, scale


def rope(q: Tensor, k: Tensor, positions: Optional[Tensor] = None, inv_freq: Optional[Tensor] = None, *,
         cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, scale: float = 1.0,
         interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embeddings applied to q and k in one kernel.

    Args:
        q: (B, L, Hq, D); k: (B, L, Hk, D), q's dtype (fp32, fp16, bf16). Any strides (views of
            a fused QKV projection need no copy).
        positions: (B or 1, L) int32/int64 absolute positions (offset by the cache length when
            decoding), with ``inv_freq``: (D_rot / 2,) fp32, e.g. ``base ** (-arange(0, D_rot, 2) / D_rot)``.
            Angles ``pos * inv_freq`` are rounded to fp32 and their cos/sin computed in fp32 in the
            kernel, then multiplied by ``scale`` (Hugging Face's ``attention_scaling``).
        cos, sin: instead of positions, (B or 1, L, D_rot) tables in Hugging Face's layout (any
            float dtype, float64 included, read in fp32): ``cat((f, f))`` for half-split,
            ``repeat_interleave(f, 2)`` for interleaved; used as given (``scale`` must be 1: a
            table's scaling is in it).
        interleaved: False: half-split pairs (i, i + D_rot/2), GPT-NeoX/Hugging Face LLaMA
            ``rotate_half``; True: adjacent pairs (2i, 2i + 1), GPT-J / Meta's LLaMA.
    Dimensions past D_rot are copied unchanged (partial rotary). Returns ``(q_out, k_out)``,
    contiguous (B, L, H, D) in q's dtype. Gradients flow to q and k (not to the angle inputs).
    """
    rot_dim, scale = _check(q, k, positions, inv_freq, cos, sin, scale, interleaved)
    _backend.no_dtensor("rope", q, k)
    if not _backend.use_triton(q):
        return reference.rope(q, k, positions, inv_freq, cos=cos, sin=sin, scale=scale, interleaved=interleaved)
    if cos is not None:
        cos, sin = _kernel_table(cos), _kernel_table(sin)
    q, k = common.unit(q), common.unit(k)
    if not _backend.needs_autograd(q, k):
        return _rope_op(q, k, positions, inv_freq, cos, sin, float(scale), rot_dim, interleaved, False)
    return _RoPE_apply(q, k, positions, inv_freq, cos, sin, float(scale), rot_dim, interleaved)


# ---------------------------------------------------------------------------------------------
# packed QKV
# ---------------------------------------------------------------------------------------------

def _packed_fake(qkv, positions, inv_freq, cos, sin, n_rot, n_heads, batch_first, scale, rot_dim, interleaved,
                 conj):
    return qkv.new_empty(qkv.shape)


@_library.op("rope_qkvpacked", fake=_packed_fake)
def _rope_packed_op(qkv: Tensor, positions: Optional[Tensor], inv_freq: Optional[Tensor], cos: Optional[Tensor],
                    sin: Optional[Tensor], n_rot: int, n_heads: int, batch_first: bool, scale: float, rot_dim: int,
                    interleaved: bool, conj: bool) -> Tensor:
    """qkv (B, L, n_heads * D) (or (L, B, ...)), unit last stride -> a contiguous copy with its
    first ``n_rot`` heads rotated."""
    with _backend.device_guard(qkv):
        return _k.rope_packed(qkv, (0, 1) if batch_first else (1, 0), n_rot, n_heads, positions, inv_freq, cos, sin,
                              scale, rot_dim, interleaved, conj)


class _RoPEPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, positions, inv_freq, cos, sin, n_rot, n_heads, batch_first, scale, rot_dim, interleaved):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(positions, inv_freq, cos, sin)
        ctx.args = (n_rot, n_heads, batch_first, scale, rot_dim, interleaved)
        return _rope_packed_op(qkv, positions, inv_freq, cos, sin, *ctx.args, False)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 11
        positions, inv_freq, cos, sin = ctx.saved_tensors
        dqkv = _rope_packed_op(common.unit(grad), positions, inv_freq, cos, sin, *ctx.args, True)
        return (dqkv,) + (None,) * 10


_RoPEPacked_apply = _library.fast_apply(_RoPEPacked)


def _qknorm_fake(qkv, q_weight, k_weight, positions, inv_freq, cos, sin, n_q, n_rot, n_heads, batch_first, scale,
                 rot_dim, interleaved, eps, unit_offset=False):
    return qkv.new_empty(qkv.shape)


@_library.op("rope_qkvpacked_qknorm", fake=_qknorm_fake)
def _rope_qknorm_op(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                    inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor], n_q: int, n_rot: int,
                    n_heads: int, batch_first: bool, scale: float, rot_dim: int, interleaved: bool,
                    eps: float, unit_offset: bool = False) -> Tensor:
    """:func:`_rope_packed_op` with q's and k's heads RMS-normalized (weights (D,), applied as 1 +
    w with ``unit_offset``) first."""
    with _backend.device_guard(qkv):
        return _k.rope_packed_qknorm(qkv, qkv, q_weight, k_weight, (0, 1) if batch_first else (1, 0), n_q, n_rot,
                                     n_heads, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, eps, False,
                                     unit_offset)


def _qknorm_bwd_fake(grad, qkv, q_weight, k_weight, positions, inv_freq, cos, sin, n_q, n_rot, n_heads, batch_first,
                     scale, rot_dim, interleaved, eps, unit_offset=False):
    D = q_weight.shape[0]
    return qkv.new_empty(qkv.shape), qkv.new_empty((D,), dtype=torch.float32), qkv.new_empty((D,), dtype=torch.float32)


@_library.op("rope_qkvpacked_qknorm_bwd", fake=_qknorm_bwd_fake)
def _rope_qknorm_bwd_op(grad: Tensor, qkv: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                        inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor], n_q: int, n_rot: int,
                        n_heads: int, batch_first: bool, scale: float, rot_dim: int, interleaved: bool,
                        eps: float, unit_offset: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(dqkv, dq_weight, dk_weight)``, the weights' gradients in fp32 (per-program rows summed)."""
    with _backend.device_guard(qkv):
        dqkv, dwq, dwk = _k.rope_packed_qknorm(grad, qkv, q_weight, k_weight, (0, 1) if batch_first else (1, 0),
                                               n_q, n_rot, n_heads, positions, inv_freq, cos, sin, scale, rot_dim,
                                               interleaved, eps, True, unit_offset)
        return dqkv, dwq.sum(0), dwk.sum(0)


class _RoPEPackedQKNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, positions, inv_freq, cos, sin, n_q, n_rot, n_heads, batch_first, scale,
                rot_dim, interleaved, eps, unit_offset):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, q_weight, k_weight, positions, inv_freq, cos, sin)
        ctx.args = (n_q, n_rot, n_heads, batch_first, scale, rot_dim, interleaved, eps, unit_offset)
        return _rope_qknorm_op(qkv, q_weight, k_weight, positions, inv_freq, cos, sin, *ctx.args)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 16
        qkv, q_weight, k_weight, positions, inv_freq, cos, sin = ctx.saved_tensors
        dqkv, dwq, dwk = _rope_qknorm_bwd_op(common.unit(grad), qkv, q_weight, k_weight, positions, inv_freq, cos, sin,
                                             *ctx.args)
        return (dqkv if ctx.needs_input_grad[0] else None, dwq.to(q_weight.dtype) if ctx.needs_input_grad[1] else None,
                dwk.to(k_weight.dtype) if ctx.needs_input_grad[2] else None) + (None,) * 13


_RoPEPackedQKNorm_apply = _library.fast_apply(_RoPEPackedQKNorm)


def _check_qk_norm(qkv, D, q_weight, k_weight, eps):
    """``(norms, eps)``: whether the per-head norms are asked for (both weights), after checking
    them, and then eps as a Python number (numpy's converted). eps must be > 0, where torch's
    ``rms_norm`` takes 0: the kernel's padding heads (zeros) would get rstd = inf, and their
    NaN would reach the weights' gradients."""
    if q_weight is None and k_weight is None:
        return False, eps
    if q_weight is None or k_weight is None:
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_weight), ("k_norm_weight", k_weight)):
        _validate.tensor(name, w, ndim=1)
        _validate.shape(name, w, (D,))
    _validate.same_device("qkv", qkv, q_norm_weight=q_weight, k_norm_weight=k_weight)
    eps = _validate.positive("norm_eps", eps)
    if not _validate.finite(eps):
        raise ValueError(f"norm_eps must be finite, got {eps}")
    return True, eps


def _count(name, n):
    """``n`` as a Python int (numpy's converted), after checking it is positive."""
    if type(n) is not int:
        n = _validate.integer(name, n)
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {n}")
    return n


def rope_qkvpacked(qkv: Tensor, num_heads: int, num_kv_heads: Optional[int] = None, positions: Optional[Tensor] = None,
                   inv_freq: Optional[Tensor] = None, *, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
                   scale: float = 1.0, interleaved: bool = False, batch_first: bool = True,
                   q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                   norm_eps: float = 1e-6, norm_unit_offset: bool = False) -> Tensor:
    """Rotary position embeddings on a packed QKV projection, q, k and v in one kernel.

    Args:
        qkv: (B, L, (H + 2 Hkv) * D) with ``batch_first`` (else (L, B, ...)), the output of one
            matmul with rows [q; k; v] (heads contiguous within each), as
            :func:`fused_block.attention_qkvpacked` takes it; fp32, fp16 or bf16; any batch and
            sequence strides with a contiguous last dim.
        num_heads: H; num_kv_heads: Hkv (default H).
        positions: (B or 1, L) int32/int64 absolute positions, or None for 0..L-1; with
            ``inv_freq`` (D_rot / 2,) fp32. cos, sin: instead, (B or 1, L, D_rot) tables (any
            float dtype, float64 included, read in fp32).
            ``scale`` and ``interleaved`` as :func:`rope`.
        q_norm_weight, k_norm_weight: (D,) each, or both None: every q head (k head) is first
            RMS-normalized over its D elements, ``x / sqrt(mean(x^2) + norm_eps)`` with fp32
            statistics (``norm_eps`` > 0: unlike torch's ``rms_norm``, not 0), and multiplied by
            the weight (Qwen3's ``q_norm`` / ``k_norm``; any float
            dtype, read in fp32), in the same launch; the weights then get gradients too.
            ``norm_unit_offset``: the heads are scaled by ``1 + weight`` instead (Gemma 3's
            ``q_norm`` / ``k_norm``, whose weights are offsets from 1), in fp32.
    Returns a new contiguous tensor of qkv's shape and dtype: q's and k's heads rotated (dims
    past D_rot copied), v's copied, for :func:`fused_block.attention_qkvpacked` with the same
    ``batch_first``. Its gradient is one packed tensor (dq and dk rotated back, dv passed on)
    written by one launch. Gradients flow to qkv (and the norm weights), not to the angle
    inputs. Saved for backward: the angle inputs; with the norms also qkv and the weights (the
    statistics are recomputed).
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    num_heads, num_kv_heads = _count("num_heads", num_heads), _count("num_kv_heads", num_kv_heads)
    if not isinstance(batch_first, bool):
        raise TypeError(f"batch_first must be a bool, got {_validate.type_name(batch_first)}")
    _validate.tensor("qkv", qkv, ndim=3)
    _backend.no_dtensor("rope_qkvpacked", qkv)
    heads = num_heads + 2 * num_kv_heads
    if qkv.shape[2] % heads != 0 or qkv.shape[2] == 0:
        raise ValueError(f"qkv's last dim ({qkv.shape[2]}) must be (num_heads + 2 * num_kv_heads) = {heads} "
                         "times the head dim")
    B, L = (qkv.shape[0], qkv.shape[1]) if batch_first else (qkv.shape[1], qkv.shape[0])
    D = qkv.shape[2] // heads
    rot_dim, scale = _check_angles("qkv", qkv, B, L, D, positions, inv_freq, cos, sin, scale, interleaved, True)
    norm, norm_eps = _check_qk_norm(qkv, D, q_norm_weight, k_norm_weight, norm_eps)
    if not isinstance(norm_unit_offset, bool):
        raise TypeError(f"norm_unit_offset must be a bool, got {_validate.type_name(norm_unit_offset)}")
    if not _backend.use_triton(qkv):
        return reference.rope_qkvpacked(qkv, num_heads, num_kv_heads, positions, inv_freq, cos=cos, sin=sin,
                                        scale=scale, interleaved=interleaved, batch_first=batch_first,
                                        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
                                        norm_unit_offset=norm_unit_offset)
    if cos is not None:
        cos, sin = _kernel_table(cos), _kernel_table(sin)
    if norm:
        args = (q_norm_weight, k_norm_weight, positions, inv_freq, cos, sin, num_heads, num_heads + num_kv_heads,
                heads, batch_first, float(scale), rot_dim, interleaved, float(norm_eps), norm_unit_offset)
        if _backend.needs_autograd(qkv, q_norm_weight, k_norm_weight):
            return _RoPEPackedQKNorm_apply(common.unit(qkv), *args)
        return _rope_qknorm_op(common.unit(qkv), *args)
    args = (positions, inv_freq, cos, sin, num_heads + num_kv_heads, heads, batch_first, float(scale), rot_dim,
            interleaved)
    if _backend.needs_autograd(qkv):
        return _RoPEPacked_apply(common.unit(qkv), *args)
    return _rope_packed_op(common.unit(qkv), *args, False)
