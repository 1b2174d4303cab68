"""The LM head's loss without the logits: ``linear_cross_entropy`` and ``LinearCrossEntropy``.

``loss = F.cross_entropy(softcap(hidden @ weight.T + bias), target)`` (+ ``z_loss * lse^2``
per token), computed chunk by chunk (``fused_block.kernels.loss``): the (N, V) logits never
exist, only one chunk of them at a time, in a buffer of at most 1/8 of their fp32 size (and
at most ``kernels.loss.CHUNK_BUDGET_BYTES``). The products run on cuBLAS (``torch.mm`` /
``addmm`` into the chunk buffer and the gradients), the softmax, loss and dlogits in one
Triton pass over each chunk's logits.

Where the gradients are computed (measured in FLOPs, N tokens, vocabulary V, hidden H; memory
in ``tests/test_loss.py``'s allocation records):

- ``reduction="mean"`` / ``"sum"`` on the token-chunk loop: **in the forward**, as
  Liger-Kernel does. Each chunk's logits feed the loss and, at once, dlogits, dhidden and the
  dW accumulation: 6 N V H FLOPs for the training step (three GEMMs), where recomputing them in
  the backward costs 8 N V H (the logits GEMM twice). The backward multiplies them by the
  incoming gradient (one launch, new tensors: a second backward through a retained graph gets
  the same answer).
- ``reduction="mean"`` / ``"sum"`` on the vocabulary-outer schedule (below): **in the
  backward**. That schedule computes the logits twice anyway (pass 1 for the log-sum-exps,
  pass 2 for the gradients), so the forward runs pass 1 alone (2 N V H) and the backward pass 2
  from the saved log-sum-exps with the incoming gradient folded into each row of dlogits (6 N V
  H): the same 8 N V H, and no scaled copies of the gradients (dW alone is 2 V H bytes: 1 GiB
  at LLaMA-3's head), dW written once per vocabulary chunk straight into the result.
- ``reduction="none"``: **recomputed in the backward**, where the per-token incoming gradient
  weights each row of dlogits before the sums over tokens (dW, db) that no later scaling can
  undo. The forward computes the loss only (2 N V H) and saves its inputs and the per-token
  log-sum-exps (N fp32), so the backward runs the gradient pass alone: the logits GEMM, dlogits
  from the saved LSE (no second softmax pass over the logits), dhidden and dW (6 N V H; 8 in
  all, as the vocabulary-outer schedule's backward, which skips its pass 1).
- Without gradients (eval, ``torch.no_grad()``): the loss only, 2 N V H.

Schedules (``fused_block.kernels.loss.schedule``). The token-chunk loop keeps, for 16-bit
weights and more than one chunk, an fp32 (V, H) dW accumulator (4 V H bytes), above 1/8 of the
fp32 logits whenever N < 8 H. There (when also H <= V / 8 and dW is needed) the vocabulary is
the outer loop instead: pass 1 over vocabulary chunks merges each row's online log-sum-exp,
pass 2 recomputes each chunk's logits, forms dlogits, writes dW[chunk] and db[chunk] once and
adds dlogits @ W[chunk] into an fp32 (N, H) dhidden accumulator (within the rule since H <= V /
8; for 16-bit inputs held in dW's last 2 N rows, whose dW is written last from their dlogits
recomputed, where 2 N <= V / 4): 8 N V H FLOPs with gradients instead of 6 (and 2 N / 4 V more
for those rows), no allocation beyond the results above 1/8 of the fp32 logits. fp32 weights
accumulate dW in dW itself and keep the token loop.

Precision: fp32 log-sum-exp and loss; the logits and dlogits of a chunk are rounded to the
hidden dtype (as eager ``F.linear`` and a bf16 model's gradient are); the products and the
dW/db sums accumulate in fp32 (cuBLAS's own; across chunks an fp32 accumulator); fp32 inputs
follow torch's matmul precision because the products are torch's.
Deterministic: a fixed chunk order, no atomics. The loss is fp32 whatever the input dtype.
"""
import weakref
from typing import Optional

import torch
from torch import Tensor

from fused_block import _backend, _library, _validate, reference
from fused_block.kernels import common
from fused_block.kernels import loss as _k
from fused_block.linear import _autocast, _torch_dtype

REDUCTIONS = tuple(_k.REDUCTIONS)


# ---------------------------------------------------------------------------------------------
# torch.library ops on 2-D hidden states
# ---------------------------------------------------------------------------------------------

def _grads_fake(hidden, weight, bias, need_dh, need_dw, need_db):
    N, H = hidden.shape
    V = weight.shape[0]
    return (hidden.new_empty((N, H) if need_dh else (0,)), weight.new_empty((V, H) if need_dw else (0,)),
            (bias if bias is not None else weight).new_empty((V,) if need_db else (0,)))


def _fwd_fake(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction, need_dh,
              need_dw, need_db):
    N = hidden.shape[0]
    f32 = torch.float32
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=f32)
    return (loss, hidden.new_empty((N,), dtype=f32), *_grads_fake(hidden, weight, bias, need_dh, need_dw, need_db))


def _options(ignore_index, label_smoothing, z_loss, softcap):
    return dict(ignore_index=ignore_index, smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap if softcap > 0 else None)


def _empty_unless(t, like):
    return t if t is not None else like.new_empty(0)


@_library.op("lce_fwd", fake=_fwd_fake)
def _lce_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
             label_smoothing: float, z_loss: float, softcap: float, reduction: str, need_dh: bool, need_dw: bool,
             need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden (N, H), weight (V, H), bias (V,) or None, target (N,) int64 -> (loss, lse (N,)
    fp32, dh (N, H), dw (V, H), db (V,)). ``softcap`` 0 means none. loss: fp32, (N,) for
    reduction "none", else 0-d. The gradients (each empty unless asked for; only for "mean" and
    "sum") are those of the loss itself: the backward multiplies them by the incoming gradient."""
    N = hidden.shape[0]
    dev = hidden.device
    loss_rows = common.empty((N,), torch.float32, dev)
    lse = common.empty((N,), torch.float32, dev)
    mean = reduction == "mean"
    with _backend.device_guard(hidden):
        count = None
        if mean:
            count = common.empty((1,), torch.float32, dev)
            _k.count_valid(target, ignore_index, count)
        dh, dw, db = _k.chunked(hidden, weight, bias, target, loss_rows, lse,
                                **_options(ignore_index, label_smoothing, z_loss, softcap), need_dh=need_dh,
                                need_dw=need_dw, need_db=need_db,
                                scale_mode=_k.SCALE_MEAN if mean else _k.SCALE_CONST, scale_t=count)
        if reduction == "none":
            loss = loss_rows
        else:
            loss = common.empty((), torch.float32, dev)
            _k.reduce_loss(loss_rows, count, mean, loss)
    return loss, lse, _empty_unless(dh, hidden), _empty_unless(dw, weight), _empty_unless(db, weight)


def _bwd_fake(dloss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap, reduction,
              need_dh, need_dw, need_db):
    return _grads_fake(hidden, weight, bias, need_dh, need_dw, need_db)


@_library.op("lce_bwd", fake=_bwd_fake)
def _lce_bwd(dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
             ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, reduction: str, need_dh: bool,
             need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients from the forward's lse (N,) fp32 and the incoming gradient dloss, fp32:
    (N,) per token for reduction "none", 0-d for "mean" and "sum" (the gradients deferred to
    the backward: the vocabulary-outer schedule). The chunk loop's gradient pass, each row of
    dlogits weighted by its token's share of dloss (dh, dw, db as in ``lce_fwd``)."""
    N = hidden.shape[0]
    with _backend.device_guard(hidden):
        if reduction != "none":  # one weight per row: dloss, over the valid tokens for "mean"
            rows = dloss.reshape(1)
            if reduction == "mean":
                count = common.empty((1,), torch.float32, hidden.device)
                _k.count_valid(target, ignore_index, count)
                rows = rows / count.clamp(min=1.0)
            dloss = rows.expand(N).contiguous()
        dh, dw, db = _k.chunked(hidden, weight, bias, target, None, lse,
                                **_options(ignore_index, label_smoothing, z_loss, softcap), need_dh=need_dh,
                                need_dw=need_dw, need_db=need_db, scale_mode=_k.SCALE_ROW, scale_t=dloss,
                                lse_known=True)
    return _empty_unless(dh, hidden), _empty_unless(dw, weight), _empty_unless(db, weight)


def _scale_fake(g, dh, dw, db):
    return dh.new_empty(dh.shape), dw.new_empty(dw.shape), db.new_empty(db.shape)  # contiguous, as the kernel's


@_library.op("lce_scale", fake=_scale_fake)
def _lce_scale(g: Tensor, dh: Tensor, dw: Tensor, db: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(g * dh, g * dw, g * db) for the forward's gradients and the incoming 0-d gradient g:
    one launch, new contiguous tensors in the inputs' dtypes (empty ones stay empty). The
    kernel reads its inputs as contiguous: the forward's gradients are (a strided one, from a
    direct call of the op, is copied first)."""
    with _backend.device_guard(g):
        return tuple(_k.scale(g.reshape(1), dh.contiguous(), dw.contiguous(), db.contiguous()))


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------

class _LCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        ctx.set_materialize_grads(False)
        ctx.reduction = reduction
        ctx.need = (need_dh, need_dw, need_db)
        # The gradients in the backward: always for "none"; for "mean"/"sum" where the schedule
        # is the vocabulary-outer one (its pass 2 recomputes the logits either way).
        N, H = hidden.shape
        ctx.deferred = reduction == "none" or (need_dh or need_dw or need_db) and (
            _k.FORCE_SCHEDULE or _k.schedule(N, weight.shape[0], H, hidden.element_size(),
                                             weight.dtype == torch.float32, need_dh, need_dw,
                                             weight.stride(1) == 1)) == "vocab"
        if ctx.deferred:
            loss, lse = _lce_fwd(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap,
                                 reduction, False, False, False)[:2]
            ctx.save_for_backward(hidden, weight, bias, target, lse)
            ctx.options = (ignore_index, label_smoothing, z_loss, softcap)
        else:
            loss, lse, dh, dw, db = _lce_fwd(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss,
                                             softcap, reduction, need_dh, need_dw, need_db)
            ctx.save_for_backward(dh, dw, db)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dloss, _dlse):
        need_dh, need_dw, need_db = ctx.need
        if dloss is None:
            return (None,) * 9
        if ctx.deferred:
            hidden, weight, bias, target, lse = ctx.saved_tensors
            dh, dw, db = _lce_bwd(dloss.float().contiguous(), hidden, weight, bias, target, lse, *ctx.options,
                                  ctx.reduction, need_dh, need_dw, need_db)
        else:
            _check_versions(ctx)
            dh, dw, db = _lce_scale(dloss.float(), *ctx.saved_tensors)
        return (dh if need_dh else None, dw if need_dw else None, db if need_db else None) + (None,) * 6


_LCEFn_apply = _library.fast_apply(_LCEFn)


def _watch_versions(loss, tensors):
    """Where the forward computed the gradients (not deferred), they are scaled in the
    backward without reading the inputs, so autograd's saved-tensor version check never sees
    an in-place change of hidden, weight, bias or target between forward and backward (an
    ``optimizer.step()``), where torch's ``F.linear`` + ``F.cross_entropy`` raise: the
    inputs' versions now, checked by :func:`_check_versions`: those torch's composition saves
    (hidden for dW, the weight for dhidden, the target; never the bias). Weak references:
    nothing is kept alive (an input freed before the backward cannot have changed through
    itself)."""
    ctx = loss.grad_fn
    if ctx is not None and not ctx.deferred:
        need_dh, need_dw, _ = ctx.need
        hidden, weight, target = tensors
        read = (hidden if need_dw else None, weight if need_dh else None, target)
        ctx.versions = [(weakref.ref(t), t._version) for t in read if t is not None]


def _check_versions(ctx):
    for ref, version in getattr(ctx, "versions", ()):
        t = ref()
        if t is not None and t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                f"{version} instead (an input of fused_block.linear_cross_entropy changed between its forward "
                f"and backward, as torch's F.linear and F.cross_entropy report)")


# ---------------------------------------------------------------------------------------------
# validation and the public function
# ---------------------------------------------------------------------------------------------

def _number(name, value, *, low, high=None):
    value = _validate.number(name, value, "a float")
    if not value >= low or not (value <= high if high is not None else _validate.finite(value)):
        bounds = f"in [{low}, {high}]" if high is not None else f"finite and >= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def _check_options(ignore_index, label_smoothing, z_loss, softcap, reduction):
    """The loss options (of :func:`linear_cross_entropy` and :class:`LinearCrossEntropy`), returned
    with numpy scalars made Python ints and floats (as torch's ``cross_entropy`` takes them: numpy
    integers for ``ignore_index``, numpy numbers for the floats), except ``reduction``."""
    ignore_index = _validate.integer("ignore_index", ignore_index)
    if not -2 ** 63 <= ignore_index < 2 ** 63:
        raise ValueError(f"ignore_index must fit in int64 (a class index), got {ignore_index}")
    label_smoothing = _number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    z_loss = _number("z_loss", z_loss, low=0.0)
    if softcap is not None:
        softcap = _validate.positive("softcap", softcap)
        if not _validate.finite(softcap):
            raise ValueError(f"softcap must be finite (None for no softcapping), got {softcap}")
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, got {type(reduction).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return ignore_index, label_smoothing, z_loss, softcap


def _check(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, return_lse):
    """``_check_options``' options, after checking every argument."""
    _validate.tensor("hidden", hidden, min_ndim=1)
    _validate.tensor("weight", weight, ndim=2)
    _validate.tensor("bias", bias, ndim=1, optional=True)
    _backend.no_dtensor("linear_cross_entropy", hidden, weight)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of class indices, got dtype "
                        f"{str(target.dtype).replace('torch.', '')}")
    _validate.same_device("hidden", hidden, weight=weight, bias=bias, target=target)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but hidden has dtype {hidden.dtype}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has in_features {weight.shape[1]} (shape {tuple(weight.shape)}) but "
                         f"hidden.shape[-1] is {hidden.shape[-1]}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight must have a nonzero vocabulary and hidden size, got shape {tuple(weight.shape)}")
    _validate.shape("bias", bias, (weight.shape[0],))
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    ignore_index, label_smoothing, z_loss, softcap = _check_options(ignore_index, label_smoothing, z_loss, softcap,
                                                                    reduction)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {_validate.type_name(return_lse)}")
    # Values are checked only where that costs no synchronization: CPU tensors, outside a trace.
    if target.device.type == "cpu" and not torch.compiler.is_compiling() and target.numel():
        # in int64, as the kernels read the target: compared in a narrower dtype, ignore_index
        # would wrap (uint8's 255 is -1, int32's -100 is 2^32 - 100) and pass the class it names
        t = target if target.dtype == torch.int64 else target.long()
        bad = (t != ignore_index) & ((t < 0) | (t >= weight.shape[0]))
        if bad.any():
            value = t[bad].flatten()[0].item()
            raise ValueError(f"target holds class index {value} outside [0, {weight.shape[0]}) "
                             f"(and not ignore_index={ignore_index})")
    return ignore_index, label_smoothing, z_loss, softcap


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: Optional[float] = None, reduction: str = "mean", return_lse: bool = False):
    """``F.cross_entropy(softcap(hidden @ weight.T + bias), target, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus ``z_loss * lse^2`` per non-ignored token,
    without the (N, V) logits.

    hidden (..., H) fp32/fp16/bf16; weight (V, H) (``nn.Linear`` layout: an LM head's weight);
    bias (V,) or None; target (...) integer class indices in [0, V) or ``ignore_index``.
    ``softcap``: Gemma's final logit softcapping ``c * tanh(logits / c)`` (None: none).
    ``z_loss``: PaLM's auxiliary ``z_loss * logsumexp(logits)^2``, averaged like the loss.
    ``reduction``: "mean" (over the non-ignored tokens; 0 when every token is ignored, where
    ``F.cross_entropy`` gives NaN), "sum", or "none" (per token, 0 where ignored, target's
    shape). Returns the fp32 loss, and with ``return_lse`` also the per-token log-sum-exp of
    the (softcapped) logits, fp32, target's shape, without gradient.

    As ``F.cross_entropy`` takes them, ``ignore_index`` may be a numpy integer and the float
    options numpy numbers (converted to Python's here); bools are refused.

    A target outside [0, V) that is not ``ignore_index`` raises ValueError for CPU tensors;
    on CUDA (where checking would synchronize) that token's loss and gradients are NaN.
    Under autocast hidden, weight and bias are cast like ``F.linear``'s inputs.
    """
    if isinstance(hidden, torch.Tensor) and not hidden.is_meta:  # meta tensors have no autocast state
        hidden, weight, bias = _autocast(hidden, weight, bias)
    x = hidden
    ignore_index, label_smoothing, z_loss, softcap = _check(x, weight, target, bias, ignore_index, label_smoothing,
                                                            z_loss, softcap, reduction, return_lse)
    if not _backend.use_triton(x):
        return reference.linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                              reduction=reduction, return_lse=return_lse)
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()  # the dW kernel reads rows with unit stride
    t = target.reshape(-1).contiguous()
    t = t if t.dtype == torch.int64 else t.long()
    bias = bias.contiguous() if bias is not None else None
    args = (x2, weight, bias, t, int(ignore_index), float(label_smoothing), float(z_loss),
            float(softcap) if softcap is not None else 0.0, reduction)
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in (x2, weight, bias)):
        loss, lse = _LCEFn_apply(*args)
        if not torch.compiler.is_compiling():
            _watch_versions(loss, (x, weight, target))
    else:
        loss, lse = _lce_fwd(*args, False, False, False)[:2]
    if reduction == "none":
        loss = loss.view(target.shape)
    return (loss, lse.view(target.shape)) if return_lse else loss


class LinearCrossEntropy(torch.nn.Linear):
    """An LM head with its loss: ``torch.nn.Linear`` (same constructor, parameters and state
    dict) whose ``forward(input, target)`` returns :func:`linear_cross_entropy`'s loss, and
    ``forward(input)`` the (softcapped) logits, as ``nn.Linear`` does.

    The loss options are attributes (``ignore_index``, ``label_smoothing``, ``z_loss``,
    ``softcap``, ``reduction``). :meth:`from_linear` wraps an existing head's parameters.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, reduction: str = "mean"):
        ignore_index, label_smoothing, z_loss, softcap = _check_options(ignore_index, label_smoothing, z_loss, softcap,
                                                                        reduction)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap, self.reduction = softcap, reduction

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **options) -> "LinearCrossEntropy":
        """A LinearCrossEntropy sharing ``linear``'s weight and bias (the same Parameters)."""
        w = linear.weight
        head = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", **options)
        head.weight = w
        head.bias = linear.bias
        return head

    def forward(self, input: Tensor, target: Optional[Tensor] = None, *, return_lse: bool = False):
        if target is None:  # the options as set now (attributes), checked as the loss checks them
            softcap = _check_options(self.ignore_index, self.label_smoothing, self.z_loss, self.softcap,
                                     self.reduction)[3]
            logits = torch.nn.functional.linear(input, self.weight, self.bias)
            return logits if softcap is None else softcap * torch.tanh(logits / softcap)
        # float64 (a head after .double()) runs the plain PyTorch reference, as the other modules do
        fn = reference.linear_cross_entropy if _torch_dtype(input) else linear_cross_entropy
        return fn(input, self.weight, target, self.bias, ignore_index=self.ignore_index,
                  label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                  reduction=self.reduction, return_lse=return_lse)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"z_loss={self.z_loss}, softcap={self.softcap}, reduction={self.reduction!r}")
