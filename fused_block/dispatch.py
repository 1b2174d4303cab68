"""Per-shape choice between our fused GEMM and cuBLAS for every matrix product of the layers.

Every product of :mod:`fused_block.linear` (forward and backward of ``linear``, the FFNs, the
gated first layer, LoRA) goes through :func:`gemm`, which takes
:func:`fused_block.kernels.matmul.gemm`'s arguments plus an op name. Two candidates:

- ``"triton"``: our kernel, the product and the whole epilogue in one launch;
- ``"cublas"``: the product on cuBLAS (``torch.mm`` / ``torch.addmm``, the bias through
  cuBLASLt's bias epilogue; ``torch._addmm_activation`` for bias + tanh GELU (CUDA) or ReLU
  when nothing else follows and no pre-activation is kept), then one Triton elementwise pass for
  what remains: ``matmul.epilogue`` (activation, SwiGLU/GeGLU, dropout, residual) forward,
  ``matmul.act_grad`` (dropout mask, act'(pre), the bias gradient's partial sums, and the
  hidden activation recomputed for the next weight gradient) backward. The
  intermediate product is rounded to the input dtype, as eager PyTorch rounds ``F.linear``.

The choice is made once per key (op, device class, dtypes, fp32 precision, M rounded up to a
power of two, N, K, the epilogue's flags), like the kernels' configs
(``kernels.common.ConfigCache``): on CUDA both candidates are timed on the real arguments and
the faster is kept; with ``FUSED_BLOCK_TUNE=0``, during CUDA graph capture, and in the
interpreter the static rule's first candidate runs:

- interpreter (CPU tests): ``"triton"`` always (the tests prove our kernels run);
- CUDA: ``"triton"`` for forward products with an epilogue to fuse (activation, residual,
  dropout, a kept pre-activation, LoRA in the reduction), ``"cublas"`` for everything else:
  bias-only and plain projections, and every backward product (dX, dW, dW with the bias
  gradient, dPre = (dY W) * act'). From the first H200 probe (bf16, 8192x1600->6400): our
  GEMM + bias + GELU forward ran at 636 TFLOP/s against eager's cuBLAS GEMM + GELU at 553 (bare
  cuBLAS 740), so a fused forward epilogue pays; the GELU MLP's forward + backward ran at 531
  against eager's 585, so our backward loses to cuBLAS + an elementwise pass, and a product
  with nothing to fuse loses the 14% between our GEMM and cuBLAS.

Under ``torch.use_deterministic_algorithms(True)`` the per-key choice runs our kernel (fixed-order
sums, no atomics). ``FUSED_BLOCK_GEMM=cublas`` / ``=triton`` (or :func:`force`) overrides the
choice everywhere a candidate expresses the call (tests: the cuBLAS candidate's numerics under
the interpreter).
:func:`table` lists which candidate ran for each key (``fused_block.dispatch_table()``).
"""
import contextlib
import os

import torch

from fused_block import _timing
from fused_block.kernels import common
from fused_block.kernels import matmul as _k

TRITON, CUBLAS = "triton", "cublas"
CANDIDATES = (TRITON, CUBLAS)


def _env_force():
    return _timing.forced_by_env("FUSED_BLOCK_GEMM", CANDIDATES)


_FORCE = _env_force()
_CACHE = common.ConfigCache("gemm_dispatch")
# key -> the candidate that last ran for it (chosen, static or forced): what table() lists.
_RAN = {}
_ORDERS = {(True, True): (TRITON, CUBLAS), (True, False): (TRITON, CUBLAS),
           (False, True): (TRITON, CUBLAS), (False, False): (CUBLAS, TRITON)}


@contextlib.contextmanager
def force(candidate):
    """Run every product on ``candidate`` ("triton", "cublas", or None for the per-key choice)
    inside the block (where the candidate expresses the call)."""
    global _FORCE
    _timing.check_candidate(candidate, CANDIDATES)
    previous, _FORCE = _FORCE, candidate
    try:
        yield
    finally:
        _FORCE = previous


# The epilogue flags of a key, in its order from position 9 (table() names the ones set).
_FLAGS = ("act_grad", "bias", "residual", "store_pre", "hout", "part", "rowsum", "dropout", "lora", "b2",
          "a2", "transpose_a", "transpose_b")
_FP32 = torch.float32
_deterministic = torch._C._get_deterministic_algorithms
_compiling = torch.compiler.is_compiling
_tracing = torch._C._get_tracing_state


# The call's signature (op, shapes, dtypes, device, the keywords' names, each keyword's value
# when it is a plain scalar, else None or the tensor's dtype; not the dropout seed, new each step)
# -> its key: the key's 22 fields are
# derived once per signature (about half of the dispatch's host time per product).
_KEYS = {}
_SCALARS = (bool, int, float)


def gemm(op, a, b, c, **kw):
    """``matmul.gemm(a, b, c, **kw)`` on the candidate chosen for this call's key; ``op`` names
    the product in :func:`table` (e.g. "linear.fwd", "ffn.dx"). Returns None, except with
    ``rowsum=True`` (a weight gradient ``dY^T X`` with its bias gradient: ``a`` is dY, ``part``
    not given): colsum(dY), as our kernel's fp32 partial sums ``(cdiv(rows, PARTIAL_ROWS), N)``
    (reduce them with ``matmul.reduce_partials``, another bias's partials in the same launch)
    or as the cuBLAS candidate's finished ``(N,)`` sums in dY's dtype (``torch.sum``: one
    reduction kernel, as eager's ``addmm`` backward computes a bias gradient, in place of an
    elementwise pass and a reduction launch)."""
    dtype = a.dtype
    sig = (op, a.shape, b.shape, dtype, c.dtype, a.device, common.fp32_precision() if dtype is _FP32 else "", *kw,
           *[v if v is None or v.__class__ in _SCALARS else v.dtype for k, v in kw.items() if k != "seed"])
    key = _KEYS.get(sig)
    if key is None:
        if a.numel() == 0 or b.numel() == 0:
            if kw.get("rowsum"):  # no product, yet dY's column sums (zeros without rows)
                _k.gemm(a, b, c, **{k: v for k, v in kw.items() if k != "rowsum"})
                return torch.sum(_mat(a), 0)
            return _triton(a, b, c, kw)
        if kw.get("a2") is not None:  # its K joins a2's columns: not in the signature
            key = _key(op, a, b, c, kw)
        else:
            if len(_KEYS) > 4096:
                _KEYS.clear()
            key = _KEYS[sig] = _key(op, a, b, c, kw)
    path = _FORCE
    if path is None:
        if _deterministic():
            # torch.use_deterministic_algorithms(True): our kernels are deterministic (no atomics,
            # fixed-order sums); cuBLAS raises there unless CUBLAS_WORKSPACE_CONFIG is set. Nothing
            # is timed or remembered.
            path = TRITON
        else:
            path = _CACHE.chosen.get(key)
            if path is None:
                path = _choose(key, a, b, c, kw)
    _RAN[key] = path
    if path == CUBLAS:
        return _cublas(a, b, c, **kw)
    return _triton(a, b, c, kw)


# A plain projection's signature (shapes, dtype, device, fp32 precision, bias or not) -> the keys
# of its three products (forward with the bias alone; dX; dW with or without dB), derived once.
_PLAIN_KEYS = {}
TORCH = "torch"  # in table(): a plain projection run as torch's own F.linear (see below)


def _plain_keys(x, weight, bias):
    """The keys ``linear``'s forward and backward give their products for this projection."""
    n = weight.shape[0]
    dy = x.new_empty(1).expand(*x.shape[:-1], n)  # dY's shape, dtype and device (the keys read no more)
    return (_key("linear.fwd", x, weight, x, {"bias": bias, "transpose_b": True}),
            _key("linear.dx", dy, weight, x, {}),
            _key("linear.dw", dy, x, weight, {"rowsum": True, "transpose_a": True} if bias is not None
                 else {"transpose_a": True}))


def linear_on_torch(x, weight, bias) -> bool:
    """Whether the plain projection ``x @ weight.T + bias`` (no activation, residual, dropout or
    LoRA) runs as torch's own ``F.linear``, forward and backward (torch's autograd: ``addmm``;
    ``mm`` for dX, ``mm`` for dW and ``sum`` for dB: eager's ops), instead of ``linear``'s
    Function with its products dispatched one by one.

    It does where its forward product and the gradient products this call will need (dX if x
    needs a gradient, dW if the weight does) are chosen, or statically ruled, for cuBLAS: their
    cuBLAS candidates are then exactly the ops torch runs (the bias gradient included,
    ``torch.sum`` of dY's columns), so the only difference is the host cost, which torch's C++
    autograd pays at eager's price (``python -m bench --only host``). Not with a forced
    candidate (``force``, ``FUSED_BLOCK_GEMM``: the tests of each candidate), under
    deterministic algorithms (our kernels run), in the interpreter (the static rule's first
    candidate is ours), while ``torch.compile`` or ``torch.jit.trace`` records (the graph keeps
    ``linear``'s op), or on a GPU before a product's choice is timed (the call runs ``linear``'s
    own path, which times it). Listed in :func:`table` as the forward key with candidate
    ``"torch"``."""
    grad = torch.is_grad_enabled()
    return projection_on_torch(x, weight, bias, grad and x.requires_grad, grad and weight.requires_grad)


def projection_on_torch(x, weight, bias, need_x: bool, need_w: bool) -> bool:
    """:func:`linear_on_torch` for a projection of tensors with ``x``'s shape, dtype and device,
    whose backward computes dX where ``need_x`` and dW where ``need_w`` (a layer's step asks
    it of a projection whose input it has not computed yet, ``fused_block._step``)."""
    if _compiling() or _FORCE is not None or _deterministic() or _tracing() is not None:
        return False  # compiled graphs and traces keep linear's op
    dtype = x.dtype
    sig = (x.shape, weight.shape, dtype, x.device, common.fp32_precision() if dtype is _FP32 else "", bias is None)
    keys = _PLAIN_KEYS.get(sig)
    if keys is None:
        if x.numel() == 0 or weight.numel() == 0:
            return False
        if len(_PLAIN_KEYS) > 4096:
            _PLAIN_KEYS.clear()
        keys = _PLAIN_KEYS[sig] = _plain_keys(x, weight, bias)
    chosen = _CACHE.chosen
    for key, needed in zip(keys, (True, need_x, need_w)):
        if needed and (chosen.get(key) or _untimed(key)) != CUBLAS:
            return False
    _RAN[keys[0]] = TORCH
    return True


def _untimed(key):
    """What :func:`_choose` runs for a new key of a product with nothing to fuse where it times
    nothing (``ConfigCache.get``: the interpreter, ``FUSED_BLOCK_TUNE=0``, stubbed launches):
    the static rule's first candidate; None where it would time the candidates (then
    ``linear``'s own path runs the call and times them)."""
    interpreter = key[1] == 0
    if not interpreter and common.TUNE and not common.STUB_LAUNCHES:
        return None
    return _ORDERS[(interpreter, False)][0]


def _triton(a, b, c, kw):
    """Our kernel's candidate: ``matmul.gemm``, with ``rowsum`` into partials it allocates and returns."""
    if kw.get("rowsum"):
        rows = common.n_rows(a)
        part = common.empty((common.cdiv(rows, _k.PARTIAL_ROWS), a.shape[-1]), _FP32, a.device)
        _k.gemm(a, b, c, part=part, **kw)
        return part
    _k.gemm(a, b, c, **kw)
    return None


def _dtype_or_false(t):
    return False if t is None else t.dtype


def _key(op, a, b, c, kw) -> tuple:
    """The choice's key for a call: a flat tuple of what the choice depends on (the device as
    its config-table architecture, M rounded up to a power of two; the residual as its dtype,
    False without one: the cuBLAS candidate's route, hence whether the choice may offer it,
    depends on it, ``_route``)."""
    numel = a.numel()
    get = kw.get
    ta, tb = get("transpose_a", False), get("transpose_b", False)
    if ta:
        M = a.shape[-1]
        K = numel // M
    else:
        K = a.shape[-1]
        M = numel // K
    a2 = get("a2")
    if a2 is not None:
        K += a2.shape[1]
    dtype = a.dtype
    return (op, common.arch(a.device), dtype, c.dtype, common.fp32_precision() if dtype is _FP32 else "",
            min(common.next_pow2(M), 65536), b.shape[0] if tb else b.shape[-1], K, get("activation", 0),
            get("act_grad", False), get("bias") is not None, _dtype_or_false(get("residual")), get("store_pre", False),
            get("hout") is not None, get("part") is not None, get("rowsum", False), bool(get("dropout_p", 0.0)),
            get("lora_a") is not None, get("b2") is not None, a2 is not None, ta, tb)


# The cuBLAS candidate's elementwise passes that no GPU run has verified yet: the forward's
# ``matmul.epilogue`` kernel and ``act_grad``'s ``STORE_H`` (the hidden activation recomputed in
# the FFN backward's pass). Until a committed GPU run verifies them, the per-key choice offers
# cuBLAS only where its call runs neither (cuBLAS alone, its bias / GELU / ReLU epilogues, and
# ``act_grad``'s modes that ran on the H200 before); FUSED_BLOCK_GEMM_NEW_EPILOGUES=1 offers
# it everywhere, and a forced candidate (:func:`force`, FUSED_BLOCK_GEMM) runs them regardless.
NEW_EPILOGUES = os.environ.get("FUSED_BLOCK_GEMM_NEW_EPILOGUES", "0") == "1"


def _route(a, c, act_grad, a2, b2, activation, residual, dropout_p, store_pre, bias, lora_a) -> str:
    """What the cuBLAS candidate runs for a call (:func:`_cublas`): "act_grad" (the product, then
    ``matmul.act_grad``), "dual" (the dual-K product alone), "plain" (the product alone, + the
    bias gradient's sums), "addmm_activation" (cuBLASLt's GELU (tanh) / ReLU epilogue with
    nothing after it; torch's CPU version of use_gelu is the erf GELU, so the tanh GELU takes
    the epilogue kernel there), "addmm_residual" (a residual and at most a bias after the
    product: the residual as cuBLAS's C input, ``addmm(residual, a, b)``, then the bias added by
    torch: no Triton pass) or "epilogue" (the product, then ``matmul.epilogue``)."""
    if act_grad:
        return "act_grad"
    if b2 is not None and a2 is not None:
        return "dual"
    gated = b2 is not None
    if not gated and not activation and residual is None and not dropout_p and not store_pre:
        return "plain"
    if (not gated and bias is not None and (activation == 3 or activation == 2 and a.is_cuda) and residual is None
            and not dropout_p and not store_pre and lora_a is None and c.dtype == a.dtype):
        return "addmm_activation"
    if (not gated and not activation and residual is not None and not dropout_p and not store_pre and lora_a is None
            and residual.dtype == a.dtype and c.dtype == a.dtype):
        return "addmm_residual"
    return "epilogue"


def unverified_epilogue(a, c, kw) -> bool:
    """Whether the cuBLAS candidate of this call (``matmul.gemm``'s keywords ``kw``) runs one of
    the elementwise passes no GPU run has verified yet (see ``NEW_EPILOGUES``)."""
    get = kw.get
    route = _route(a, c, get("act_grad", False), get("a2"), get("b2"), get("activation", 0), get("residual"),
                   get("dropout_p", 0.0), get("store_pre", False), get("bias"), get("lora_a"))
    return route == "epilogue" or (route == "act_grad" and get("hout") is not None)


def _choose(key, a, b, c, kw):
    """The cache's choice for a new key: timed on CUDA, else the static rule's first candidate
    (only ours where the cuBLAS candidate would run an unverified pass: ``NEW_EPILOGUES``)."""
    arch = key[1]
    (activation, act_grad, _, residual, store_pre, _, _, _, dropout, lora) = key[8:18]
    fused_forward = not act_grad and bool(activation or residual or dropout or store_pre or lora)
    order = _ORDERS[(arch == 0, fused_forward)]
    if arch != 0 and not NEW_EPILOGUES and unverified_epilogue(a, c, kw):
        order = (TRITON,)
    return _CACHE.get(key, order, lambda cand: _run(cand, a, b, c, kw))


def _run(path, a, b, c, kw):
    """One timed run of a candidate, with what its caller must still do for a finished result:
    for ``rowsum`` our kernel's partial sums are reduced (one launch, as ``linear``'s backward
    does; the FFN's reduces two biases' partials in that one launch, so there this charges ours
    a little more than it pays), where cuBLAS's ``torch.sum`` returns the finished sums."""
    if path == CUBLAS:
        _cublas(a, b, c, **kw)
    else:
        part = _triton(a, b, c, kw)
        if part is not None:
            _k.reduce_partials(part, a.dtype)


def _mat(t):
    """``t`` as a 2-D matrix: itself, or the (rows, last dim) view of a contiguous tensor (its
    rows counted, not inferred: ``view(-1, 0)`` is ambiguous for an empty last dim)."""
    if t.dim() == 2:
        return t
    n = t.shape[-1]
    return t.view(-1, n) if n else t.view(common.n_rows(t), 0)


def _joined(x, y, dim):
    """``torch.cat((x, y), dim)`` as a view when ``y`` follows ``x`` in memory along ``dim`` (the
    halves of one buffer: an FFN's [gate | up] gradient, mlp's stacked gate and up weights),
    else None. Both must be views of one storage: tensors of two storages can also lie back to
    back (two blocks of one CUDA caching-allocator segment: swiglu's separate gate and up
    weights), and a view of the first reaching into the second is out of its storage's bounds."""
    if x.stride() != y.stride() or x.dtype != y.dtype:
        return None
    step = x.shape[dim] * x.stride(dim)
    if y.data_ptr() != x.data_ptr() + step * x.element_size():
        return None
    sx, sy = x.untyped_storage(), y.untyped_storage()
    if sx.data_ptr() != sy.data_ptr() or sx.nbytes() != sy.nbytes():
        return None
    shape = list(x.shape)
    shape[dim] += y.shape[dim]
    return x.as_strided(shape, x.stride())


def _product(out, a, b, bias=None):
    """``out = a @ b (+ bias)`` on cuBLAS (addmm: cuBLASLt's bias epilogue)."""
    if bias is not None:
        torch.addmm(bias, a, b, out=out)
    else:
        torch.mm(a, b, out=out)


def _cublas(a, b, c, *, a2=None, b2=None, c2=None, bias=None, bias2=None, residual=None, aux=None, aux2=None,
            hout=None, part=None, seed=None, dropout_p=0.0, activation=0, act_grad=False, store_pre=False,
            round_pre=False, rowsum=False, lora_a=None, lora_b=None, lora_b2=None, transpose_a=False,
            transpose_b=False):
    """The cuBLAS candidate of ``matmul.gemm``: same arguments, same outputs (``round_pre`` is
    implied: the product is rounded to a's dtype before any epilogue)."""
    A = _mat(a).t() if transpose_a else _mat(a)
    B = _mat(b).t() if transpose_b else _mat(b)
    M, N = A.shape[0], B.shape[1]
    route = _route(a, c, act_grad, a2, b2, activation, residual, dropout_p, store_pre, bias, lora_a)
    if route == "act_grad":
        # dPre = (A @ B) * keep / (1 - p) * act'(pre) (gated: dGate into c, dUp into c2, the halves
        # of one buffer), the bias gradient's partials into part, the hidden activation into hout.
        dh = common.empty((M, N), a.dtype, a.device)
        torch.mm(A, B, out=dh)
        out = _mat(c)
        _k.act_grad(dh, aux, activation, dbias=part is not None, seed=seed, dropout_p=dropout_p,
                    pre2=aux2, out=out if c2 is None else out[:, :2 * N], part=part, hout=hout)
        return
    if route == "dual":  # the dual-K product a @ b + a2 @ b2, no epilogue
        A2 = _mat(a2)
        B2 = _mat(b2).t() if transpose_b else _mat(b2)
        joined_a = _joined(A, A2, 1)
        joined_b = None
        if joined_a is not None:
            joined_b = _joined(_mat(b), _mat(b2), 1 if transpose_b else 0)
        C = _mat(c)
        if joined_b is not None:  # one product over the joined K
            torch.mm(joined_a, joined_b.t() if transpose_b else joined_b, out=C)
        else:
            torch.mm(A, B, out=C)
            C.addmm_(A2, B2)
        return
    if route == "plain":
        C = _mat(c)
        _product(C, A, B, bias)
        if lora_a is not None:
            C.addmm_(lora_a, lora_b)
        if rowsum:  # colsum(dY), dY = a read as rows (A is its transpose): eager's bias gradient
            return torch.sum(_mat(a), 0)
        return None
    if route == "addmm_activation":  # cuBLASLt's GELU (tanh) / ReLU epilogue, nothing after it
        torch._addmm_activation(bias, A, B, use_gelu=activation == 2, out=_mat(c))
        return
    if route == "addmm_residual":  # residual + a @ b in one rounding (cuBLAS's C, beta = 1), + bias
        C = _mat(c)
        torch.addmm(_mat(residual), A, B, out=C)
        if bias is not None:
            C.add_(bias)
        return
    if b2 is not None:  # gated
        pre = _mat(aux) if store_pre else common.empty((M, 2 * N), a.dtype, a.device)
        p1, p2 = pre[:, :N], pre[:, N:2 * N]
        B2 = _mat(b2).t() if transpose_b else _mat(b2)
        _product(p1, A, B, bias)
        _product(p2, A, B2, bias2)
        if lora_a is not None:
            p1.addmm_(lora_a, lora_b)
            p2.addmm_(lora_a, lora_b2)
    else:
        p1 = _mat(aux) if store_pre else common.empty((M, N), a.dtype, a.device)
        p2 = None
        _product(p1, A, B, bias)
        if lora_a is not None:
            p1.addmm_(lora_a, lora_b)
    _k.epilogue(p1, c, activation, pre2=p2, residual=residual, seed=seed, dropout_p=dropout_p)


def table():
    """Which candidate ran for each product key since the start (or :func:`clear`): a list of
    dicts with op, device ("interpreter", "sm_80" or "sm_90": the config-table class), dtype,
    out_dtype, precision (fp32 only), M (bucket: rows rounded up to a power of two), N, K,
    activation code, the epilogue flags set (b2 alone: the gated two-projection forward; a2
    with b2: a product continuing over a second pair), and candidate: "triton", "cublas", or
    "torch" (a plain projection run as torch's own ``F.linear``, its backward products by
    torch's autograd on cuBLAS: :func:`linear_on_torch`; its dX and dW keys are then not
    listed unless they ran otherwise)."""
    rows = []
    for key, cand in _RAN.items():
        op, arch, dtype, out_dtype, precision, m, n, k, activation = key[:9]
        rows.append(dict(op=op, device="interpreter" if arch == 0 else f"sm_{arch}",
                         dtype=str(dtype).split(".")[-1], out_dtype=str(out_dtype).split(".")[-1],
                         precision=precision, M=m, N=n, K=k, activation=activation,
                         epilogue=[f for f, v in zip(_FLAGS, key[9:]) if v], candidate=cand))
    return rows


def format_table(rows=None) -> str:
    """:func:`table` as aligned text, one product key a line."""
    rows = table() if rows is None else rows
    lines = [f"{'op':<14} {'device':<11} {'dtype':<9} {'M':>6} {'N':>6} {'K':>6} {'act':>3} {'candidate':<9} "
             "epilogue"]
    for r in rows:
        lines.append(f"{r['op']:<14} {r['device']:<11} {r['dtype']:<9} {r['M']:>6} {r['N']:>6} {r['K']:>6} "
                     f"{r['activation']:>3} {r['candidate']:<9} {','.join(r['epilogue'])}")
    return "\n".join(lines)


def clear():
    """Forget every choice (the next call of each key chooses again) and the table."""
    _CACHE.chosen.clear()
    _RAN.clear()
