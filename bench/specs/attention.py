"""Fused softmax attention: ``fused_block.attention`` vs SDPA's backends and eager math attention.

Providers (same bf16 q, k, v of shape (B, H, L, D), self-attention, no dropout):

- ``fused_block``: ``fused_block.attention`` (the Triton FlashAttention-style kernels) on
  contiguous (B, H, L, D) tensors.
- ``fused_block_auto``: ``fused_block.attention`` as users call it: the candidate timed fastest
  for the shape (our kernels, SDPA's cuDNN or flash: ``fused_block._attn_sdpa``); the two
  providers above force our kernels.
- ``fused_block_qkvpacked``: ``fused_block.attention_qkvpacked`` on the (B, L, 3 * H * D)
  output of a QKV projection, returning (B, L, H * D): the layers' path (no split, merge or
  gradient concatenation).
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``:
  ``torch.nn.functional.scaled_dot_product_attention`` restricted to one backend with
  ``torch.nn.attention.sdpa_kernel``; a backend the machine or shape lacks is reported
  unavailable with torch's reason.
- ``sdpa_default``: ``scaled_dot_product_attention`` as torch users call it (torch picks the
  backend: cuDNN on Hopper for these shapes, else flash).
- ``fa3``: FlashAttention-3 (``flash_attn_interface.flash_attn_func``, Hopper) on (B, L, H, D)
  tensors, its native layout; unavailable, with the reason, where it is not installed.
- ``eager``: ``softmax(q k^T * scale + causal mask) v`` written out in eager PyTorch (the
  L x L score matrix materialized).

Shapes (causal and not): the issue's B=4 H=16 L=4096 D=128 and B=8 H=32 L=2048 D=64, a long
sequence (L=8192; B=1 L=16384), grouped-query attention (B=4, 32 query heads over 8 key/value
heads, L=4096 D=128: the attention issue's table), and short ones (L=512, 1024 at 16k tokens),
where launch and tail effects matter. ``--quick``: B=4 H=16 L=4096 D=128 and B=8 H=32 L=2048
D=64. Modes: forward, backward (of a forward built once, gradients of q, k, v) and
forward+backward.

FLOPs: ``4 * B * H * L^2 * D`` for the forward (QK^T and PV, 2 FLOPs per multiply-add),
halved for causal; backward is 2.5x the forward (five products instead of two; our kernel
recomputes QK^T and dO V^T in its dQ programs, seven in all, and is still credited five), so
``fwd+bwd`` counts 3.5x. No ``bytes``: attention at these sizes is compute bound; the harness
reports % of the measured cuBLAS bf16 matmul rate.

Targets on an H200 in bf16 (issue 10; a benchmark, not a test): at D=128 and L >= 4096
forward >= 450 TFLOP/s causal and non-causal, backward >= 300, forward+backward at least SDPA
flash's and within 0.8x of SDPA's default (cuDNN); at D=64 forward+backward >= SDPA flash; no
regression against SDPA flash at L = 512, 1024.
"""
import math

import torch

from bench import harness
from bench.harness import Case

# (batch, heads, seq, head_dim), or (batch, heads, kv_heads, seq, head_dim) for GQA
SHAPES = ((4, 16, 4096, 128), (8, 32, 2048, 64), (2, 16, 8192, 128), (1, 16, 16384, 128), (4, 32, 8, 4096, 128),
          (16, 16, 1024, 128), (32, 16, 512, 128), (16, 32, 1024, 64), (32, 32, 512, 64))
QUICK_SHAPES = ((4, 16, 4096, 128), (8, 32, 2048, 64))
DTYPE = torch.bfloat16
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
PROVIDERS = (("fused_block", "fused_block_qkvpacked", "fused_block_auto") + tuple(SDPA_BACKENDS)
             + ("sdpa_default", "fa3", "eager"))
BWD_FACTOR = 2.5


def flops(batch, heads, seq, head_dim, causal, mode):
    fwd = 4 * batch * heads * seq * seq * head_dim
    if causal:
        fwd //= 2
    return {"fwd": fwd, "bwd": int(BWD_FACTOR * fwd), "fwd+bwd": int((1 + BWD_FACTOR) * fwd)}[mode]


def shape_of(entry, causal) -> dict:
    """The case's shape dict of a ``SHAPES`` entry (``kv_heads`` only for GQA)."""
    if len(entry) == 4:
        batch, heads, seq, head_dim = entry
        return dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=causal)
    batch, heads, kv_heads, seq, head_dim = entry
    return dict(batch=batch, heads=heads, kv_heads=kv_heads, seq=seq, head_dim=head_dim, causal=causal)


def eager_attention(q, k, v, causal):
    """Math attention in eager PyTorch: materializes the (B, H, Lq, Lk) scores (k and v of
    fewer heads repeated per group)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        lq, lk = s.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def _ours(fn, candidate):
    """``fn`` with fused_block's attention choice (``fused_block._attn_sdpa``) forced to
    ``candidate`` (our kernels) or left to the timed choice (None)."""
    from fused_block import _attn_sdpa

    def call(*inputs):
        before = _attn_sdpa.force(candidate)
        try:
            return fn(*inputs)
        finally:
            _attn_sdpa.force(before)
    return call


def _attention_fn(provider, causal, heads, gqa=False):
    """``fn(*inputs)`` for the provider; inputs are (q, k, v), or (qkv,) for the packed one
    ((B, L, H, D) tensors for FlashAttention-3)."""
    if provider in ("fused_block", "fused_block_auto"):
        import fused_block

        return _ours(lambda q, k, v: fused_block.attention(q, k, v, causal=causal),
                     "triton" if provider == "fused_block" else None)
    if provider == "fused_block_qkvpacked":
        import fused_block

        return _ours(lambda qkv: fused_block.attention_qkvpacked(qkv, heads, causal=causal), "triton")
    if provider == "eager":
        return lambda q, k, v: eager_attention(q, k, v, causal)
    if provider == "fa3":
        from flash_attn_interface import flash_attn_func  # FlashAttention-3's Hopper build

        def fa3(q, k, v):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
        return fa3
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if provider == "sdpa_default":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    backend = getattr(SDPBackend, SDPA_BACKENDS[provider])

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def _factory(provider, shape, mode):
    def factory():
        B, H, L, D = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
        Hkv = shape.get("kv_heads", H)
        packed = provider == "fused_block_qkvpacked"
        if packed and Hkv != H:
            raise ValueError("attention_qkvpacked packs as many key/value heads as query heads")
        fn = _attention_fn(provider, shape["causal"], H, gqa=Hkv != H)
        if packed:
            in_shapes, out_shape = [(B, L, 3 * H * D)], (B, L, H * D)
        elif provider == "fa3":  # its native (B, L, H, D) layout
            in_shapes, out_shape = [(B, L, H, D), (B, L, Hkv, D), (B, L, Hkv, D)], (B, L, H, D)
        else:
            in_shapes, out_shape = [(B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D)], (B, H, L, D)
        set_bytes = 2 * B * (H + Hkv) * L * D * 2

        def make(grad):
            ins = tuple(harness.randn(*s, dtype=DTYPE, device="cuda", requires_grad=grad) for s in in_shapes)
            return ins + ((harness.randn(*out_shape, dtype=DTYPE, device="cuda"),) if grad else ())

        if mode == "fwd":
            def run(inputs):
                with torch.no_grad():
                    return fn(*inputs)
            return harness.rotating(lambda: make(False), run, set_bytes)
        if mode == "bwd":
            *ins, dout = make(True)
            return harness.backward_fn((fn(*ins),), (dout,), ins)

        def step(inputs):
            *ins, dout = inputs
            return torch.autograd.grad(fn(*ins), ins, dout)
        return harness.rotating(lambda: make(True), step, set_bytes)
    return factory


# ---------------------------------------------------------------------------------------------
# issue 17's features: varlen, windows, decoding, score modifications
# ---------------------------------------------------------------------------------------------

# Packed sequences: lengths of one batch (22.6k tokens, max 8192), causal, H=16 D=128.
VARLEN_LENGTHS = (4096, 1000, 3000, 8192, 500, 2048, 3800)
# Sliding window: Mistral's 4096 keys over 16k tokens, causal, B=1 H=16 D=128.
WINDOW_SHAPE = dict(batch=1, heads=16, seq=16384, head_dim=128, left=4096)
# Decode steps: Lq = 1 (and 4: speculative) over a 16k cache, GQA 32:8, B=8, D=128.
DECODE_SHAPES = (dict(batch=8, heads=32, kv_heads=8, q_len=1, cache=16384, head_dim=128),
                 dict(batch=8, heads=32, kv_heads=8, q_len=4, cache=16384, head_dim=128))
# Score modifications at B=2 H=16 L=2048 D=128 (SDPA and eager take the (L, L) bias materialized).
SCORE_SHAPE = dict(batch=2, heads=16, seq=2048, head_dim=128)
SCORE_KINDS = ("softcap", "alibi", "t5_bias")


def visible_pairs(lq, lk, causal, window=(-1, -1)) -> int:
    """(query, key) pairs visible under bottom-right causality and ``window``: the FLOPs of the
    visible blocks only (4 * D per pair and head)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(lq, dtype=torch.int64) + (lk - lq)
    hi = torch.clamp(i + right, max=lk - 1) if right >= 0 else torch.full_like(i, lk - 1)
    lo = torch.clamp(i - left, min=0) if left >= 0 else torch.zeros_like(i)
    return int((hi - lo + 1).clamp(min=0).sum())


def _feature_flops(pairs, heads, head_dim, mode):
    fwd = 4 * pairs * heads * head_dim
    return {"fwd": fwd, "bwd": int(BWD_FACTOR * fwd), "fwd+bwd": int((1 + BWD_FACTOR) * fwd)}[mode]


def _train_case(op, shape, mode, names, build, flops_):
    """A Case whose providers ``names`` come from ``build()`` (called on the GPU, in each
    factory), ``{name: (make_inputs(grad) -> tuple, fn(*inputs) -> out)}``."""
    def factory_of(name):
        def factory():
            make, fn = build()[name]
            if mode == "fwd":
                def run(inputs):
                    with torch.no_grad():
                        return fn(*inputs)
                return harness.rotating(lambda: make(False), run, 1 << 30)
            ins = make(True)
            out = fn(*ins)
            dout = harness.randn(*out.shape, dtype=out.dtype, device="cuda")
            if mode == "bwd":
                return harness.backward_fn((out,), (dout,), [t for t in ins if t.requires_grad])

            def step():
                o = fn(*ins)
                return torch.autograd.grad(o, [t for t in ins if t.requires_grad], dout)
            return step
        return factory
    return Case(op=op, shape=shape, dtype=DTYPE, mode=mode,
                providers={name: factory_of(name) for name in names}, flops=flops_)


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def _varlen_providers(lengths, H, D):
    import fused_block

    T, L = sum(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    kpm = torch.arange(L, device="cuda")[None] >= torch.tensor(lengths, device="cuda")[:, None]

    def packed(grad):
        return tuple(harness.randn(T, H, D, dtype=DTYPE, device="cuda", requires_grad=grad) for _ in range(3))

    def padded(grad):
        return tuple(harness.randn(len(lengths), H, L, D, dtype=DTYPE, device="cuda", requires_grad=grad)
                     for _ in range(3))

    def sdpa_padded(q, k, v):
        import torch.nn.functional as F
        causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~kpm[:, None, None, :])

    return {
        "fused_block": (packed, lambda q, k, v: fused_block.attention_varlen(q, k, v, cu, cu, L, L, causal=True)),
        "fused_block_padded": (padded, lambda q, k, v: fused_block.attention(q, k, v, True, key_padding_mask=kpm)),
        "sdpa_padded": (padded, sdpa_padded),
    }


def _window_providers(B, H, L, D, left):
    import fused_block

    def make(grad):
        return tuple(harness.randn(B, H, L, D, dtype=DTYPE, device="cuda", requires_grad=grad) for _ in range(3))

    def flex(q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask
        if "mask" not in flex.__dict__:
            flex.mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= left), None, None, L, L)
            flex.fn = _flex()
        return flex.fn(q, k, v, block_mask=flex.mask)

    def sdpa_full(q, k, v):
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "fused_block": (make, lambda q, k, v: fused_block.attention(q, k, v, True, window=(left, -1))),
        "fused_block_full": (make, lambda q, k, v: fused_block.attention(q, k, v, True)),
        "sdpa_full_causal": (make, sdpa_full),
        "flex_attention": (make, flex),
    }


def _score_providers(kind, B, H, L, D):
    import torch.nn.functional as F

    import fused_block

    slopes = (2.0 ** -torch.arange(1, H + 1, dtype=torch.float32, device="cuda") * 8 / H)
    i = torch.arange(L, device="cuda")
    alibi = (-slopes[:, None, None] * (i[:, None] - i[None, :]).abs()).to(DTYPE)[None]  # (1, H, L, L)
    t5 = harness.randn(1, H, L, L, dtype=DTYPE, device="cuda")
    cap = 50.0

    def make(grad):
        ins = tuple(harness.randn(B, H, L, D, dtype=DTYPE, device="cuda", requires_grad=grad) for _ in range(3))
        if kind == "t5_bias":
            ins += (t5.detach().clone().requires_grad_(grad),)
        return ins

    if kind == "softcap":
        ours = lambda q, k, v: fused_block.attention(q, k, v, True, softcap=cap)  # noqa: E731

        def eager(q, k, v):
            s = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(D)
            s = cap * torch.tanh(s / cap)
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
            return torch.matmul(torch.softmax(s, -1).to(q.dtype), v)

        def flex(q, k, v):
            from torch.nn.attention.flex_attention import create_block_mask
            if "fn" not in flex.__dict__:
                flex.fn = _flex()
                flex.mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, L, L)
            return flex.fn(q, k, v, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap), block_mask=flex.mask)
        return {"fused_block": (make, ours), "eager": (make, eager), "flex_attention": (make, flex)}
    if kind == "alibi":
        ours = lambda q, k, v: fused_block.attention(q, k, v, alibi_slopes=slopes)  # noqa: E731
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)  # noqa: E731

        def flex(q, k, v):
            if "fn" not in flex.__dict__:
                flex.fn = _flex()
            return flex.fn(q, k, v, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())
        return {"fused_block": (make, ours), "sdpa_materialized_bias": (make, sdpa), "flex_attention": (make, flex)}
    ours = lambda q, k, v, b: fused_block.attention(q, k, v, bias=b)  # noqa: E731
    sdpa = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b)  # noqa: E731
    return {"fused_block": (make, ours), "sdpa_bias": (make, sdpa)}


def _decode_case(shape):
    import torch.nn.functional as F

    import fused_block
    from fused_block.kernels.attention import launchers

    B, Hq, Hkv, Lq, S, D = (shape[k] for k in ("batch", "heads", "kv_heads", "q_len", "cache", "head_dim"))

    def make():
        return (harness.randn(B, Hq, Lq, D, dtype=DTYPE, device="cuda"),
                harness.randn(B, Hkv, S, D, dtype=DTYPE, device="cuda"),
                harness.randn(B, Hkv, S, D, dtype=DTYPE, device="cuda"))

    def ours(q, k, v):
        return fused_block.attention(q, k, v, causal=True)

    def no_split(q, k, v):
        saved, launchers.DECODE_MIN_KEYS = launchers.DECODE_MIN_KEYS, 1 << 62
        try:
            return fused_block.attention(q, k, v, causal=True)
        finally:
            launchers.DECODE_MIN_KEYS = saved

    def sdpa(q, k, v):
        # Lq rows at the cache's end: bottom-right causal as an explicit (Lq, S) mask.
        keep = torch.ones(Lq, S, dtype=torch.bool, device="cuda").tril(S - Lq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    set_bytes = 2 * B * Hkv * S * D * 2

    def factory_of(fn):
        def factory():
            def run(inputs):
                with torch.no_grad():
                    return fn(*inputs)
            return harness.rotating(make, run, set_bytes)
        return factory
    return Case(op="attention_decode", shape=shape, dtype=DTYPE, mode="fwd",
                providers={"fused_block": factory_of(ours), "fused_block_no_split": factory_of(no_split),
                           "sdpa": factory_of(sdpa)},
                flops=_feature_flops(visible_pairs(Lq, S, True), Hq, D, "fwd") * B,
                bytes=set_bytes)


def feature_cases(quick: bool) -> list:
    """Issue 17's comparisons: varlen against the same tokens padded, a window against full
    causal attention, decode steps against SDPA, softcap / ALiBi / a T5 bias against SDPA and
    flex_attention (where torch has them). FLOPs count the visible (query, key) pairs only."""
    out = []
    modes = ("fwd+bwd",) if quick else harness.MODES
    H, D = 16, 128
    for mode in modes:
        pairs = sum(visible_pairs(n, n, True) for n in VARLEN_LENGTHS)
        out.append(_train_case("attention_varlen", dict(lengths=len(VARLEN_LENGTHS), tokens=sum(VARLEN_LENGTHS),
                                                        max_len=max(VARLEN_LENGTHS), heads=H, head_dim=D,
                                                        causal=True),
                               mode, ("fused_block", "fused_block_padded", "sdpa_padded"),
                               lambda: _varlen_providers(VARLEN_LENGTHS, H, D), _feature_flops(pairs, H, D, mode)))
        w = WINDOW_SHAPE
        pairs = w["batch"] * visible_pairs(w["seq"], w["seq"], True, (w["left"], -1))
        out.append(_train_case("attention_window", dict(w, causal=True), mode,
                               ("fused_block", "fused_block_full", "sdpa_full_causal", "flex_attention"),
                               lambda: _window_providers(w["batch"], w["heads"], w["seq"], w["head_dim"], w["left"]),
                               _feature_flops(pairs, w["heads"], w["head_dim"], mode)))
        s = SCORE_SHAPE
        for kind in SCORE_KINDS:
            causal = kind == "softcap"
            pairs = s["batch"] * visible_pairs(s["seq"], s["seq"], causal)
            names = {"softcap": ("fused_block", "eager", "flex_attention"),
                     "alibi": ("fused_block", "sdpa_materialized_bias", "flex_attention"),
                     "t5_bias": ("fused_block", "sdpa_bias")}[kind]
            out.append(_train_case(f"attention_{kind}", dict(s, causal=causal), mode, names,
                                   lambda kind=kind: _score_providers(kind, s["batch"], s["heads"], s["seq"],
                                                                      s["head_dim"]),
                                   _feature_flops(pairs, s["heads"], s["head_dim"], mode)))
    for shape in DECODE_SHAPES[:1] if quick else DECODE_SHAPES:
        out.append(_decode_case(shape))
    return out


def cases(quick: bool) -> list:
    out = feature_cases(quick)
    for entry in QUICK_SHAPES if quick else SHAPES:
        for causal in (False, True):
            shape = shape_of(entry, causal)
            size = {k: shape[k] for k in ("batch", "heads", "seq", "head_dim", "causal")}
            for mode in harness.MODES:
                out.append(Case(op="attention", shape=shape, dtype=DTYPE, mode=mode,
                                providers={p: _factory(p, shape, mode) for p in PROVIDERS},
                                flops=flops(mode=mode, **size)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: fused_block.attention and the same-dtype reference against the float64 reference
# ---------------------------------------------------------------------------------------------

# Small enough for the interpreter: self-attention over 64 tokens (whole blocks), and a causal
# cross-attention 17 x 100 with GQA 4:2 and padding (partial blocks, bottom-right diagonal).
NUMERICS_CASES = (
    dict(B=2, Hq=2, Hkv=2, Lq=64, Lk=64, D=64, causal=False, padding=False),
    dict(B=2, Hq=4, Hkv=2, Lq=17, Lk=100, D=64, causal=True, padding=True),
)
NUMERICS_DTYPES = (torch.float16, torch.bfloat16)


def numerics() -> list:
    try:
        from fused_block import reference
        from fused_block.attention import attention
    except Exception as exc:  # noqa: BLE001 - the op may not exist yet
        return [harness.unavailable_row("attention", harness.describe_error(exc))]
    dev = harness.DEVICE
    rows = []
    for c in NUMERICS_CASES:
        label = f"{c['B']}x{c['Hq']}:{c['Hkv']}x{c['Lq']}x{c['Lk']}x{c['D']}{' causal' if c['causal'] else ''}"
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            q = harness.randn(c["B"], c["Hq"], c["Lq"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            k = harness.randn(c["B"], c["Hkv"], c["Lk"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            v = harness.randn(c["B"], c["Hkv"], c["Lk"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            mask = None
            if c["padding"]:
                mask = torch.zeros(c["B"], c["Lk"], dtype=torch.bool, device=dev)
                mask[0, -30:] = True
            dout = harness.randn(c["B"], c["Hq"], c["Lq"], c["D"], dtype=dtype, device=dev)
            results = []
            for fn, dt in ((attention, dtype), (reference.attention, torch.float64), (reference.attention, dtype)):
                leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
                kw = {"compute_dtype": dtype} if fn is reference.attention and dt == dtype else {}
                out = fn(*leaves, c["causal"], None, mask, **kw)
                results.append((out,) + torch.autograd.grad(out, leaves, dout.to(dt)))
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                rows.append(harness.compare("attention", label, name, results[0][i], results[1][i], results[2][i]))
    return rows
