"""Distributed training on the fused layers: FSDP2, tensor and sequence parallelism,
activation checkpointing, FSDP2 x TP and torch.compile, against single-process training.

Every case spawns its ranks (tests/dist_testing.py: CPU processes on gloo, the kernels in the
Triton interpreter, a file rendezvous, collective timeouts and a deadline) and one more
process for the single-process run, and compares the loss, every gradient and the parameters
after a few SGD steps (momentum: optimizer state) in fp32 (IEEE in the interpreter: what differs is the order of the
ranks' sums), the ranks' kernel launches, and that nothing warned (no FSDP2 view warning, no
fused_block fallback). Data parallel ranks take their rows of one global batch and seed their
generator with (step, data-parallel rank) before each forward; the single-process run takes
the same rows as micro-batches under the same seeds and averages their gradients, so the
dropout masks are the ranks' own (and, with checkpointing, the recomputed forward's).

CI runs 2 processes (one FSDP2 case with two models, one FSDP2 evaluation of a converted HF
model, one TP/SP case); 4 processes, the other models and layer kinds, FSDP2 x TP, torch.compile and the torchrun example are ``heavy``.

Sizes: d_model 32 with 2 heads (head dim 16, the attention kernel's smallest; 2 heads split
over 2 ranks), FFN 64 (48 for SwiGLU's 2 x 48 rows); tests/hf_testing.py's LLaMA (hidden 64,
4 heads, 2 KV heads, 2 layers); 2 sequences of 8 tokens per data-parallel rank (8: a sequence
that 2 and 4 ranks split evenly under sequence parallelism); 2 layers where a layer boundary
matters (FSDP2 groups, sequence-parallel stacks), 1 elsewhere.
"""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fused_block
from fused_block import models
import dist_testing
import interpreter_numpy

FP32 = dict(atol=2e-5, rtol=1e-5)
GPT = models.DecoderOnlyConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)
LLAMA_LIKE = models.LlamaLikeConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, num_kv_heads=2, d_model=64,
                                    dim_feedforward=48)
ROWS, T = 2, 8  # per data-parallel rank


# ---------------------------------------------------------------------------------------------
# models, data and the training step, shared by the ranks and the single-process run
# ---------------------------------------------------------------------------------------------

def _build(name):
    """A model by name (the ranks and the single-process run build the same one from seed 0)."""
    torch.manual_seed(0)
    if name == "gpt":
        return models.DecoderOnly(GPT)
    if name == "gpt_1_layer":
        return models.DecoderOnly(models.DecoderOnlyConfig(**{**GPT.__dict__, "n_layer": 1}))
    if name == "gpt_no_dropout":
        return models.DecoderOnly(models.DecoderOnlyConfig(**{**GPT.__dict__, "dropout": 0.0}))
    if name == "llama_like":
        return models.LlamaLike(LLAMA_LIKE)
    if name == "llama_like_mha":  # tensor parallel: the fused layers take MHA only
        return models.LlamaLike(models.LlamaLikeConfig(**{**LLAMA_LIKE.__dict__, "num_kv_heads": None}))
    import hf_testing
    overrides = {"num_key_value_heads": 4} if name == "hf_llama_4kv" else {}
    return fused_block.convert(hf_testing.model("llama", "cpu", **overrides))


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.blocks


def _tokens(step, rows, vocab=64):
    """The global batch of ``step``: rows counting up by a per-row stride (learnable)."""
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 3, (rows, 1), generator=g)
    return (start + stride * torch.arange(T + 1)) % vocab


def _loss(model, tokens):
    if hasattr(model, "model"):  # Hugging Face: labels are shifted inside
        ids = tokens[:, :-1]
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # the first row left-padded: the layers read a padding mask (the whole sequence's)
        return model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    return model(tokens[:, :-1], targets=tokens[:, 1:])[1]


def _plain(name):
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model):
    return {_plain(n): _full(p.grad).detach().clone() for n, p in model.named_parameters()}


def _params(model):
    return {_plain(n): _full(p).detach().clone() for n, p in model.named_parameters()}


def _optimizer(model):
    # SGD with momentum, not Adam: Adam scales each gradient by its own running magnitude, so
    # parameters whose exact gradient is 0 (attention's key bias) would turn the ranks' and the
    # single process's different rounding noise (~1e-9) into updates of up to lr.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _seed(step, dp_rank):
    return 1000 * step + dp_rank


def _reference(name, dp_size, steps, bf16=False):
    """Single-process training: per step, each data-parallel rank's rows as a micro-batch under
    its seed, the gradients averaged (FSDP2's reduce-scatter mean). ``bf16``: FSDP2's
    MixedPrecisionPolicy(bf16 parameters, fp32 reduction): each micro-batch runs on a bf16
    copy of the fp32 parameters and its gradient is summed in fp32."""
    model = _build(name)
    opt = _optimizer(model)
    out = {"loss": [], "grads": []}
    for step in range(steps):
        tokens = _tokens(step, ROWS * dp_size)
        low = model
        if bf16:  # the parameters only, as FSDP2 casts them (buffers such as RoPE frequencies stay fp32)
            low = copy.deepcopy(model)
            for p in low.parameters():
                p.data = p.data.to(torch.bfloat16)
        losses, total = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in range(dp_size):
            low.zero_grad(set_to_none=True)
            torch.manual_seed(_seed(step, r))
            loss = _loss(low, tokens[r * ROWS:(r + 1) * ROWS])
            loss.backward()
            losses.append(loss.item())
            for (n, p), q in zip(model.named_parameters(), low.parameters()):
                total[n] += q.grad.float() / dp_size
        for n, p in model.named_parameters():
            p.grad = total[n]
        out["loss"].append(losses)
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = _params(model)
    return out


def _sharded_step(model, opt, out, step, dp_rank, dp_size):
    """One data-parallel training step on rank ``dp_rank``'s rows, recorded in ``out``; returns the rows."""
    tokens = _tokens(step, ROWS * dp_size)[dp_rank * ROWS:(dp_rank + 1) * ROWS]
    torch.manual_seed(_seed(step, dp_rank))
    loss = _loss(model, tokens)
    loss.backward()
    out["loss"].append(loss.item())
    out["grads"].append(_grads(model))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return tokens


def _finish(out, model, watch):
    out["params"] = _params(model)
    out["warnings"], out["launches"] = watch.warnings, watch.launches


class _Watch:
    """In a rank: every warning (FSDP2's view warning, fused_block's fallbacks) and the kernels'
    launch count over a block."""

    def __enter__(self):
        from fused_block.kernels import common
        self._launches = sum(common.LAUNCHES.values())
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # numpy's and torch's deprecations
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations of its own APIs
        interpreter_numpy.strict()  # but not numpy's array-to-scalar conversion, an error on numpy >= 2.4
        return self

    def __exit__(self, *exc):
        from fused_block.kernels import common
        self._catch.__exit__(*exc)
        self.launches = sum(common.LAUNCHES.values()) - self._launches
        self.warnings = [f"{w.category.__name__}: {w.message}" for w in self.caught]


def _check_ranks(ranks, ref, steps, dp_rank=lambda r: r, **tol):
    tol = tol or FP32
    for r, out in enumerate(ranks):
        assert out["warnings"] == [], out["warnings"]
        assert out["launches"] > 0, "the kernels did not run"
        for step in range(steps):
            torch.testing.assert_close(out["loss"][step], ref["loss"][step][dp_rank(r)], **tol)
            for n, g in ref["grads"][step].items():
                torch.testing.assert_close(out["grads"][step][n], g, **tol, msg=lambda m: f"step {step} {n}: {m}")
        for n, p in ref["params"].items():
            torch.testing.assert_close(out["params"][n], p, **tol, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------

def _fsdp_model(name, per_layer, bf16, reshard, checkpointed, mesh=None):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build(name)
    if checkpointed:  # the first layer recomputes its forward (and its dropout masks) in backward
        first = _layers(model)[0]
        apply_activation_checkpointing(model, check_fn=lambda m: m is first)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    kw = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if per_layer:
        for layer in _layers(model):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp_train(rank, world, case, checkpoint_dir):
    """Train ``case["name"]`` under FSDP2 for ``case["steps"]`` steps. With ``dcp_step``: after
    that many steps, save model and optimizer with torch.distributed.checkpoint, load them into
    a freshly built (differently initialized) model and optimizer, and continue there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    build = dict(name=case["name"], per_layer=case["per_layer"], bf16=case["bf16"], reshard=case["reshard"],
                 checkpointed=case["checkpointed"])
    model = _fsdp_model(**build)
    opt = _optimizer(model)
    out = {"loss": [], "grads": []}
    with _Watch() as watch:
        for step in range(case["steps"]):
            if step == case.get("dcp_step"):
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
                model = _fsdp_model(**build)  # initial parameters, not the saved ones
                opt = _optimizer(model)
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            _sharded_step(model, opt, out, step, rank, world)
    _finish(out, model, watch)
    return out


FSDP_CASES = {
    # per layer + root, fp32, resharded after forward, dropout 0.1 with the first layer
    # checkpointed, a DCP save and load after step 1
    "per_layer": dict(name="gpt", per_layer=True, bf16=False, reshard=True, checkpointed=True, dcp_step=1, steps=2),
    # the whole model (1 layer) as one group, bf16 parameters with fp32 reduction, kept unsharded
    "whole_bf16": dict(name="gpt_1_layer", per_layer=False, bf16=True, reshard=False, checkpointed=False, steps=2),
    # fused_block.models.LlamaLike (RoPE, GQA, SwiGLU, RMSNorm) and a converted HF LLaMA
    "llama_like": dict(name="llama_like", per_layer=True, bf16=False, reshard=True, checkpointed=False, steps=2),
    "hf_llama": dict(name="hf_llama", per_layer=True, bf16=True, reshard=False, checkpointed=True, steps=2),
}


def _fsdp_cases(rank, world, names, checkpoint_dir):
    return {name: _fsdp_train(rank, world, FSDP_CASES[name], os.path.join(checkpoint_dir, name)) for name in names}


def _fsdp_references(names, world):
    return {n: _reference(FSDP_CASES[n]["name"], world, FSDP_CASES[n]["steps"], FSDP_CASES[n]["bf16"])
            for n in names}


def _run_fsdp(names, world, tmp_path):
    ranks, ref = dist_testing.spawn(_fsdp_cases, world, names, str(tmp_path),
                                    reference=(_fsdp_references, (names, world)))
    for name in names:
        _check_ranks([r[name] for r in ranks], ref[name], FSDP_CASES[name]["steps"])


def test_fsdp2_two_processes(tmp_path):
    """A 2-layer GPT (fused_block.models.DecoderOnly, tied embeddings, dropout 0.1): sharded
    per layer and on the root, fp32, resharding after forward, the first layer under
    checkpoint_wrapper, a distributed checkpoint saved and loaded after the first step; and a
    1-layer one sharded as one group with bf16 parameters, fp32 reduction, no resharding."""
    _run_fsdp(["per_layer", "whole_bf16"], 2, tmp_path)


@pytest.mark.heavy
def test_fsdp2_four_processes(tmp_path):
    pytest.importorskip("transformers")
    _run_fsdp(list(FSDP_CASES), 4, tmp_path)


@pytest.mark.heavy
def test_fsdp2_llama_like_and_converted_hf_llama(tmp_path):
    pytest.importorskip("transformers")
    _run_fsdp(["llama_like", "hf_llama"], 2, tmp_path)


def _fsdp_eval_after_a_weight_change(rank, world):
    """A converted HF LLaMA sharded per layer and on the root, evaluated under no_grad, its
    sharded parameters then halved in place (as load_state_dict, an EMA swap or a write under
    no_grad change them: no optimizer step) and evaluated again. FSDP2's storage freeing is made
    a no-op, so each unsharded parameter comes back at its address, as a GPU's caching
    allocator often hands it back; FSDP2 refills it without a version bump."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    import hf_testing

    _fsdp_param.free_storage = lambda t: None
    torch.manual_seed(0)
    model = fused_block.convert(hf_testing.model("llama", "cpu")).eval()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        model.reshard()
        for p in model.parameters():
            p.mul_(0.5)
        after = model(input_ids=ids, use_cache=False).logits
    model.reshard()
    return dict(ids=ids, before=before, after=after, weights={n: p.full_tensor() for n, p in model.named_parameters()})


def test_fsdp2_evaluation_after_the_sharded_weights_change():
    """The converted layers' packed q/k/v weights are not reused across FSDP2's in-place
    refills of its unsharded parameters (before: the first evaluation's packed weights, logits
    off by 0.74 from a model holding the new weights)."""
    pytest.importorskip("transformers")
    import hf_testing

    ranks = dist_testing.spawn(_fsdp_eval_after_a_weight_change, 2)
    torch.manual_seed(0)
    model = hf_testing.model("llama", "cpu").eval()  # unconverted: the reference
    model.load_state_dict(ranks[0]["weights"])
    with torch.no_grad():
        want = model(input_ids=ranks[0]["ids"], use_cache=False).logits
    for r in ranks:
        assert not torch.allclose(r["before"], r["after"])
        torch.testing.assert_close(r["after"], want, **FP32)


# ---------------------------------------------------------------------------------------------
# tensor and sequence parallelism
# ---------------------------------------------------------------------------------------------

def _layer(kind, heads, dropout=0.0):
    """A fused layer of ``heads`` heads of dim 16 (d_model 16 * heads)."""
    torch.manual_seed(0)
    d = 16 * heads
    common = dict(dropout=dropout, batch_first=True, norm_first=True)
    if kind == "llama":  # SwiGLU ([gate; up] in linear1), RMSNorm, RoPE, no biases
        return fused_block.TransformerEncoderLayer(d, heads, 48, activation="swiglu", bias=False, norm="rms", rope=True,
                                                   **common)
    if kind == "post_ln":  # biases everywhere: packed QKV bias, colwise linear1 bias, rowwise biases
        return fused_block.TransformerEncoderLayer(d, heads, 64, activation="gelu", **{**common, "norm_first": False})
    if kind == "decoder":
        return fused_block.TransformerDecoderLayer(d, heads, 64, **common)
    if kind == "decoder_post_ln":
        return fused_block.TransformerDecoderLayer(d, heads, 64, activation="relu", **{**common, "norm_first": False})
    raise ValueError(kind)


def _layer_inputs(kind, heads, length=T):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, length, 16 * heads, generator=g)
    mem = torch.randn(ROWS, length - 2, 16 * heads, generator=g) if kind.startswith("decoder") else None
    w = torch.randn(ROWS, length, 16 * heads, generator=g)  # the loss's weights: sum(y * w)
    return x, mem, w


def _layer_step(layer, kind, heads, checkpointed=False, length=T):
    """Forward (causal) and backward of sum(y * w); y, the input gradients and the layer's."""
    from torch.utils.checkpoint import checkpoint
    x, mem, w = _layer_inputs(kind, heads, length)
    x.requires_grad_(True)
    args = (x,) if mem is None else (x, mem.requires_grad_(True))
    kw = {"is_causal": True} if mem is None else {"tgt_is_causal": True}
    y = checkpoint(layer, *args, use_reentrant=False, **kw) if checkpointed else layer(*args, **kw)
    (y * w).sum().backward()
    out = {"y": y.detach().clone(), "dx": x.grad, "grads": _grads(layer)}
    if mem is not None:
        out["dmem"] = mem.grad
    layer.zero_grad(set_to_none=True)
    return out


def _model_step(model):
    tokens = _tokens(0, ROWS)
    loss = _loss(model, tokens)
    loss.backward()
    out = {"loss": loss.detach(), "grads": _grads(model)}
    model.zero_grad(set_to_none=True)
    return out


def _style(sp):
    """Sequence parallel: the layer splits the whole sequence it gets and gathers its output."""
    from torch.distributed.tensor import Replicate
    from fused_block.distributed import LayerParallel
    return LayerParallel(sequence_parallel=sp, input_layouts=Replicate() if sp else None,
                         output_layouts=Replicate() if sp else None)


# Each raises a ValueError naming what the tensor-parallel degree does not divide or the plan
# cannot shard (expected text beside it).
def _odd_heads(mesh, world):
    layer = fused_block.TransformerEncoderLayer(16 * (world + 1), world + 1, 64, dropout=0.0, batch_first=True)
    _parallelize(layer, mesh, _style(False))


def _odd_ffn(mesh, world):
    _parallelize(fused_block.TransformerEncoderLayer(32, 2, 2 * world + 1, batch_first=True), mesh, _style(False))


def _gqa(mesh, world):
    layer = fused_block.TransformerEncoderLayer(64, 4, 64, batch_first=True, num_kv_heads=2)
    _parallelize(layer, mesh, _style(False))


def _odd_sequence(mesh, world):
    layer = _parallelize(_layer("llama", world), mesh, _style(True))
    _layer_step(layer, "llama", world, length=T + 1)


def _per_head_mask(mesh, world):
    layer = _parallelize(_layer("post_ln", world), mesh, _style(False))
    x = _layer_inputs("post_ln", world)[0]
    layer(x, src_mask=torch.zeros(ROWS * world, T, T))


def _odd_sequence_dtensor(mesh, world):  # the DTensor's (global) length is checked too
    from torch.distributed.tensor import DTensor, Replicate
    layer = _parallelize(_layer("llama", world), mesh, _style(True))
    layer(DTensor.from_local(_layer_inputs("llama", world, length=T + 1)[0], mesh, (Replicate(),)))


def _other_mesh(mesh, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    other = init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b"))["b"]
    layer = _parallelize(_layer("post_ln", world), mesh, _style(False))
    layer(DTensor.from_local(_layer_inputs("post_ln", world)[0], other, (Replicate(),)))


def _two_batch_first(mesh, world):  # the layer's own check: one layout is sharded
    layer = _layer("decoder", world)
    layer.multihead_attn.batch_first = False
    layer = _parallelize(layer, mesh, _style(False))
    x, mem, _ = _layer_inputs("decoder", world)
    layer(x, mem.transpose(0, 1))


def _parallelize(module, mesh, plan):
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(module, mesh, plan)


ERRORS = {"_odd_heads": "nhead ({h}) is not divisible by the tensor-parallel degree ({w})",
          "_odd_ffn": "dim_feedforward ({f}) is not divisible by the tensor-parallel degree ({w})",
          "_gqa": "num_kv_heads (2) != nhead (4)",
          "_per_head_mask": "src_mask: per-head (3-D) masks are not supported under tensor parallelism",
          "_odd_sequence": "the sequence length (dim 1, split by sequence parallelism) ({t}) is not divisible by "
                           "the tensor-parallel degree ({w})",
          "_odd_sequence_dtensor": "the sequence length (dim 1, split by sequence parallelism) ({t}) is not "
                                   "divisible by the tensor-parallel degree ({w})",
          "_other_mesh": "src: a DTensor on",
          "_two_batch_first": "self_attn.batch_first and multihead_attn.batch_first differ: not supported under "
                              "tensor parallelism"}


def _tp_run(rank, world, layer_cases, model_cases, dropout_cases, errors, norms):
    """Each case on a 1-D tensor-parallel mesh over all ranks, from the same seeds on every
    rank. Layers take and return the whole sequence (sequence parallel: split and gathered at
    the layer's boundary by its input/output layouts); models run tp_plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from fused_block.distributed import tp_plan

    mesh = init_device_mesh("cpu", (world,))
    out = {"layers": {}, "models": {}, "dropout": {}, "errors": {}}
    with _Watch() as watch:
        for kind, sp, *compiled in layer_cases:
            layer = _parallelize(_layer(kind, world), mesh, _style(sp))
            if compiled:  # inside a compiled graph the TP layer's call runs eagerly
                layer = torch.compile(layer)
            out["layers"][(kind, sp, *compiled)] = _layer_step(layer, kind, world)
        for name, sp in model_cases:
            model = _build(name)
            _parallelize(model, mesh, tp_plan(model, sequence_parallel=sp))
            out["models"][name, sp] = _model_step(model)
        for kind, sp, which in dropout_cases:
            layer = _parallelize(_dropout_layer(kind, world, which), mesh, _style(sp))
            runs = []
            for checkpointed in (False, True):  # the same seed: the same masks, also when recomputed
                torch.manual_seed(7)
                runs.append(_layer_step(layer, kind, world, checkpointed))
            out["dropout"][kind, sp, which] = runs
        for name in errors:
            try:
                globals()[name](mesh, world)
            except ValueError as e:
                out["errors"][name] = str(e)
        if norms:
            out["norms"] = _sequence_parallel_norms(mesh, rank, world)
    out["warnings"], out["launches"] = watch.warnings, watch.launches
    return out


def _dropout_layer(kind, heads, which):
    """Dropout 0.25 in training; ``which="replicated"`` keeps only the dropouts of tensors every
    rank holds whole under TP (the residual stream's, the FFN output's): their masks are the
    single-process layer's. ``"all"``: also attention's and the FFN hidden activation's, drawn
    per rank on its heads and columns. ``"hidden_one"``: as ``"replicated"`` with the FFN hidden
    activation's dropout at 1 (torch's dropout, which draws no seed)."""
    layer = _layer(kind, heads, dropout=0.25).train()
    if which in ("replicated", "hidden_one"):
        layer.dropout.p = 1.0 if which == "hidden_one" else 0.0
        for name in layer._ATTENTIONS:
            getattr(layer, name).dropout = 0.0
    return layer


def _single_dropout_step(kind, heads, which):
    layer = _dropout_layer(kind, heads, which)
    torch.manual_seed(7)
    return _layer_step(layer, kind, heads)


def _norm_modules():
    torch.manual_seed(0)
    norms = {"layer": fused_block.LayerNorm(32), "rms": fused_block.RMSNorm(32)}
    with torch.no_grad():
        for n in norms.values():
            for p in n.parameters():
                p.normal_()
    return norms


def _norm_step(norm, x, w):
    from torch.distributed.tensor import DTensor
    y = norm(x)
    ((y.to_local() if isinstance(y, DTensor) else y) * w).sum().backward()
    return {"y": y, "dx": x.grad, "grads": {n: _full(p.grad) for n, p in norm.named_parameters()}}


def _sequence_parallel_norms(mesh, rank, world):
    """fused_block's norm modules under torch's SequenceParallel style (a final norm in a
    user's plan): each rank's part of the sequence in, DTensors out; the kernels run on the
    local rows, the weights' gradients are reduced. And the other ops refuse DTensors."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    out = {}
    x, _, w = _layer_inputs("norm", 2)
    part = slice(rank * T // world, (rank + 1) * T // world)
    for name, norm in _norm_modules().items():
        _parallelize(norm, mesh, SequenceParallel())
        got = _norm_step(norm, x[:, part].clone().requires_grad_(True), w[:, part])
        out[name] = {"y": got["y"].full_tensor(), "dx": got["dx"], "grads": got["grads"]}
    try:
        fused_block.linear(DTensor.from_local(x[:, part], mesh, (Shard(1),)), torch.ones(4, 32))
    except TypeError as e:
        out["linear"] = str(e)
    return out


def _tp_reference(layer_cases, model_cases, dropout_cases, world):
    return {"layers": {case: _layer_step(_layer(case[0], world), case[0], world) for case in layer_cases},
            "models": {(name, sp): _model_step(_build(name)) for name, sp in model_cases},
            "dropout": {(kind, sp, which): _single_dropout_step(kind, world, which)
                        for kind, sp, which in dropout_cases if which != "all" and not sp},
            "norms": {name: _norm_step(norm, x.clone().requires_grad_(True), w)
                      for name, norm in _norm_modules().items() for x, _, w in [_layer_inputs("norm", 2)]}}


def _run_tp(world, layer_cases, model_cases, dropout_cases=(), errors=tuple(ERRORS), norms=False):
    ranks, ref = dist_testing.spawn(_tp_run, world, layer_cases, model_cases, dropout_cases, errors, norms,
                                    reference=(_tp_reference, (layer_cases, model_cases, dropout_cases, world)))
    for rank, out in enumerate(ranks):
        assert out["warnings"] == [], out["warnings"]
        assert out["launches"] > 0, "the kernels did not run"
        for case, r in ref["layers"].items():
            torch.testing.assert_close(out["layers"][case], r, **FP32, msg=lambda m: f"{case}: {m}")
        for case, r in ref["models"].items():
            torch.testing.assert_close(out["models"][case], r, **FP32, msg=lambda m: f"{case}: {m}")
        for case, (plain, recomputed) in out["dropout"].items():
            # Seeded: a run under checkpointing (its forward, and its recomputation in backward)
            # draws the plain run's masks.
            torch.testing.assert_close(recomputed, plain, atol=0, rtol=0)
            # One mask per tensor the ranks hold alike: every rank's whole output is the same,
            # and where only such tensors drop (TP), the single-process layer's masks.
            torch.testing.assert_close(plain["y"], ranks[0]["dropout"][case][0]["y"], atol=0, rtol=0)
            if case in ref["dropout"]:
                torch.testing.assert_close(plain, ref["dropout"][case], **FP32, msg=lambda m: f"{case}: {m}")
        expected = {name: ERRORS[name].format(h=world + 1, f=2 * world + 1, t=T + 1, w=world) for name in errors}
        assert set(out["errors"]) == set(errors), out["errors"]
        for name, message in out["errors"].items():
            assert expected[name] in message, (expected[name], message)
        if norms:
            part = slice(rank * T // world, (rank + 1) * T // world)
            for name in ("layer", "rms"):
                r = ref["norms"][name]
                mine = {"y": r["y"], "dx": r["dx"][:, part], "grads": r["grads"]}  # this rank's part of dx
                torch.testing.assert_close(out["norms"][name], mine, **FP32, msg=lambda m: f"{name} norm: {m}")
            assert "fused_block.linear: got a DTensor" in out["norms"]["linear"]


def test_tensor_and_sequence_parallel_two_processes():
    """TP and SP on 2 ranks: a LLaMA-style fused layer (packed [q; k; v] and [gate; up] split by
    heads and columns, RoPE on local heads) under both, a Post-LN layer with every bias under
    TP, a converted HF LLaMA (GQA, 2 layers) under SP through tp_plan; dropout masks seeded,
    recomputed by checkpointing, shared by the ranks where they drop a replicated tensor (the
    single-process layer's masks; also beside a hidden dropout at 1, which draws none), under TP
    and SP; the ValueErrors; fused_block's norm modules
    under torch's SequenceParallel style (DTensors in and out, the kernels on local rows)."""
    pytest.importorskip("transformers")
    _run_tp(2, [("llama", False), ("llama", True), ("post_ln", False)], [("hf_llama", True)],
            dropout_cases=[("llama", False, "replicated"), ("decoder", False, "hidden_one"), ("post_ln", True, "all")],
            norms=True)


@pytest.mark.heavy
def test_tensor_and_sequence_parallel_more_layers():
    """Decoder layers (cross-attention: the memory enters each rank's heads), Post-LN under SP,
    a LLaMA-style layer under SP inside torch.compile, the fused LLaMA-like model under SP and
    the converted HF LLaMA under TP."""
    pytest.importorskip("transformers")
    _run_tp(2, [("decoder", True), ("decoder_post_ln", False), ("post_ln", True), ("llama", True, "compiled")],
            [("llama_like_mha", True), ("hf_llama", False)],
            dropout_cases=[("post_ln", False, "replicated"), ("decoder", False, "all")], errors=())


@pytest.mark.heavy
def test_tensor_and_sequence_parallel_four_processes():
    pytest.importorskip("transformers")
    _run_tp(4, [("llama", True), ("post_ln", False)], [("hf_llama_4kv", True)], errors=("_odd_heads", "_odd_sequence"))


def test_seed_shift_offsets_the_seeds_in_draw_order():
    """What a tensor-parallel layer's dropouts draw (fused_block._backend.seed_shift): the i-th
    seed drawn inside the block plus the i-th offset (a rank's own Philox stream where it drops
    its shard), the drawn values otherwise; a dropout with p = 0 draws nothing."""
    from fused_block import _backend
    torch.manual_seed(3)
    plain = [_backend.dropout_seed(0.5, "cpu") for _ in range(3)]
    torch.manual_seed(3)
    with _backend.seed_shift([5, 0]):
        assert _backend.dropout_seed(0.0, "cpu").numel() == 0
        shifted = [_backend.dropout_seed(0.5, "cpu") for _ in range(3)]
    assert [s.item() for s in shifted] == [plain[0].item() + 5, plain[1].item(), plain[2].item()]


def test_tp_plan_names_converted_layers_it_has_no_plan_for():
    pytest.importorskip("transformers")
    import hf_testing
    from fused_block.distributed import tp_plan
    model = fused_block.convert(hf_testing.model("qwen3", "cpu"))
    with pytest.raises(ValueError, match=r"converted layers \(Qwen3DecoderLayer\) have no tensor-parallel plan"):
        tp_plan(model)
    with pytest.raises(ValueError, match="run fused_block.convert first"):
        tp_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_custom_activation_hidden_dropout_takes_the_rank_shift(device):
    """A custom activation callable runs between the FFN's GEMMs, and so does its dropout: it
    draws its seed as the kernels' dropouts do (``_backend.dropout_seed``), so under tensor
    parallelism a rank's shift gives its FFN columns a mask of its own (torch's generator gave
    every rank the same one); the same seed and shift give the same mask."""
    from fused_block import _backend
    torch.manual_seed(0)
    layer = fused_block.TransformerEncoderLayer(32, 2, 64, dropout=0.5, activation=torch.tanh, batch_first=True,
                                                norm_first=True, device=device).train()
    layer.dropout1.p = layer.dropout2.p = 0.0  # the hidden dropout alone draws
    layer.self_attn.dropout = 0.0
    x = torch.randn(2, 8, 32, device=device)

    def run(offset):
        torch.manual_seed(7)
        with _backend.seed_shift([offset]):
            return layer(x)

    first, shifted, again = run(0), run(1), run(0)
    assert torch.equal(first, again)
    assert not torch.equal(first, shifted)


# ---------------------------------------------------------------------------------------------
# FSDP2 x TP on a 2-D mesh; torch.compile of an FSDP2 stack
# ---------------------------------------------------------------------------------------------

def _two_d_train(rank, world, sequence_parallel, steps, checkpoint_dir):
    """A 2-layer GPT (no dropout: TP's per-rank masks are not the single process's) on a
    (dp 2, tp 2) mesh: tp_plan on the tp dim, then FSDP2 per layer and on the root over dp. The
    tp ranks of a dp rank take the same rows under the same seed. Then a distributed
    checkpoint of the trained model (fused_block.distributed.get_state_dict: the packed
    weights as DCP can save them), loaded back into a fresh 2-D model. Also: FSDP2 without
    fsdp_shard_placement over a TP layer raises at its first call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fused_block.distributed import fsdp_shard_placement, get_state_dict, set_state_dict, tp_plan

    def build():
        model = _build("gpt_no_dropout")
        _parallelize(model, mesh["tp"], tp_plan(model, sequence_parallel=sequence_parallel))
        for layer in model.blocks:
            fully_shard(layer, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
        fully_shard(model, mesh=mesh["dp"])
        return model, _optimizer(model)

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model, opt = build()
    out = {"loss": [], "grads": []}
    with _Watch() as watch:
        for step in range(steps):
            tokens = _sharded_step(model, opt, out, step, dp_rank, 2)
    _finish(out, model, watch)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    out["loaded"] = _params(model)
    wrong = _build("gpt_no_dropout")
    _parallelize(wrong, mesh["tp"], tp_plan(wrong))
    fully_shard(wrong.blocks[0], mesh=mesh["dp"])
    try:
        _loss(wrong, tokens)
    except ValueError as e:
        out["misplaced"] = str(e)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_fsdp2_x_tensor_parallel_on_a_2d_mesh(sequence_parallel, tmp_path):
    """Loss, gradients and parameters as one process's; the checkpoint holds the trained
    weights (loaded back on 4 ranks, and into a plain model in this process)."""
    import torch.distributed.checkpoint as dcp
    ranks, ref = dist_testing.spawn(_two_d_train, 4, sequence_parallel, 2, str(tmp_path),
                                    reference=(_reference, ("gpt_no_dropout", 2, 2)))
    _check_ranks(ranks, ref, 2, dp_rank=lambda r: r // 2)
    for out in ranks:
        assert "shard_placement_fn=fused_block.distributed.fsdp_shard_placement" in out["misplaced"]
        torch.testing.assert_close(out["loaded"], out["params"], atol=0, rtol=0)
    plain = _build("gpt_no_dropout").state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: as intended
        dcp.load({"model": plain}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.testing.assert_close({n: plain[n] for n in ref["params"]}, ref["params"], **FP32)


def _compiled_train(rank, world, steps):
    """The 2-layer GPT sharded per layer and on the root by FSDP2, then torch.compile'd."""
    model = torch.compile(_fsdp_model("gpt_no_dropout", per_layer=True, bf16=False, reshard=True,
                                      checkpointed=False))
    opt = _optimizer(model)
    out = {"loss": [], "grads": []}
    with _Watch() as watch:
        for step in range(steps):
            _sharded_step(model, opt, out, step, rank, world)
    _finish(out, model, watch)
    from torch._dynamo.utils import counters
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.heavy
def test_torch_compile_of_an_fsdp2_stack():
    ranks, ref = dist_testing.spawn(_compiled_train, 2, 2, reference=(_reference, ("gpt_no_dropout", 2, 2)))
    _check_ranks(ranks, ref, 2)
    assert all(out["graphs"] > 0 for out in ranks)  # dynamo compiled graphs (the fused ops inside them)


# ---------------------------------------------------------------------------------------------
# the torchrun example
# ---------------------------------------------------------------------------------------------

@pytest.mark.heavy
def test_torchrun_example_trains_and_resumes(tmp_path):
    """examples/train_gpt.py under torchrun (--standalone: a free port) on 4 CPU processes over
    gloo, FSDP2 x TP with sequence parallelism, the kernels in the interpreter: it trains,
    saves a distributed checkpoint, and a second run resumes from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(root, "examples", "train_gpt.py"), "--tp", "2", "--sp", "--tiny", "--batch", "2",
           "--checkpoint", str(tmp_path / "ckpt")]
    first = subprocess.run(cmd + ["--steps", "3"], env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in first.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), first.stdout
    second = subprocess.run(cmd + ["--steps", "1"], env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 3:" in second.stdout, second.stdout
