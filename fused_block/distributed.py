"""Distributed training with the fused layers: FSDP2, tensor and sequence parallelism.

**FSDP2** (``torch.distributed.fsdp.fully_shard``, per layer and/or on the whole model) needs
nothing from this module: inside a forward FSDP2 hands a layer its unsharded parameters as
plain tensors, which the fused path reads like any others; the layers' outputs are tensors of
their own (not views), so FSDP2's output hooks hold. A submodule sharded on its own (say
``fully_shard(layer.linear1)``) carries FSDP's hooks, so its layer runs torch's forward, which
calls it (the call-time guard, ``fused_block._guard``).

**Tensor parallelism** (``torch.distributed.tensor.parallel.parallelize_module``):
:class:`LayerParallel` is the ``ParallelStyle`` of one layer, ``fused_block``'s
``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` or a converted Hugging Face LLaMA,
Mistral or Qwen2 decoder layer; :func:`tp_plan` gives a whole model's plan. The style places
the parameters as the standard plan does (:data:`PLACEMENTS`)::

    fused layer                                  converted LLaMA-family layer
    self_attn.in_proj_weight  colwise, by heads  self_attn.{q,k,v}_proj   colwise (Shard(0))
      (each of q, k, v: _StridedShard(0, 3))     self_attn.o_proj         rowwise (Shard(1))
    self_attn.out_proj        rowwise (Shard(1)) mlp.{gate,up}_proj       colwise
    linear1                   colwise; SwiGLU's  mlp.down_proj            rowwise
      [gate; up] each by columns (_S(0, 2))      *_layernorm              replicated
    linear2                   rowwise
    norm1.., packed biases    replicated

and the layer's forward runs the same kernels on the rank's shards: its heads (the attention
kernel on local heads), its FFN columns. In a layer's call the inputs stay plain tensors:

- *TP* (``sequence_parallel=False``): the layer takes and returns the whole sequence on every
  rank. A norm's output enters the attention / FFN as it is (its gradient is all-reduced), the
  out-projection's and the FFN's partial sums are all-reduced (one all-reduce each, as
  Megatron-LM), then the residual is added.
- *SP* (``sequence_parallel=True``): the layer takes and returns the rank's part of the
  sequence (dim 1, dim 0 with ``batch_first=False``); the norms run on it, their outputs are
  all-gathered into the attention and the FFN, whose partial sums are reduce-scattered back.

Rowwise biases join the partial sums on rank 0 only; replicated parameters read on a rank's
part of the data get ``Partial`` gradients, which DTensor (or FSDP2) reduces. The collectives
are DTensor redistributions, so the same code runs over gloo and NCCL.

Dropout under tensor parallelism: every rank of the group must draw the same seeds, i.e. seed
their generators alike (``torch.manual_seed(s)`` on every rank, as torch's own TP needs for
``nn.Dropout`` on replicated activations). A dropout on a rank's shard (attention
probabilities of its heads, the FFN's hidden columns, under SP the residual stream's tokens)
uses ``seed + rank`` (``_backend.seed_shift``); one on a tensor all ranks hold alike (the
residual stream under TP, the FFN output's partial sums) uses the shared seed.

Not expressible, and refused with a ``ValueError`` naming it: head counts or FFN widths that
the TP degree does not divide, grouped-query attention in a fused layer (its packed
[q (H D); k (Hkv D); v (Hkv D)] weight has blocks of different sizes, which no DTensor
placement shards by heads; converted LLaMA layers keep separate q/k/v projections and take
GQA), ``kdim``/``vdim``/``add_bias_kv``/``add_zero_attn`` attention, unbatched inputs, and
under SP a sequence length the degree does not divide.

**FSDP2 x TP** (2-D mesh): shard each TP-placed layer with
``fully_shard(layer, mesh=dp_mesh, shard_placement_fn=fsdp_shard_placement)``: FSDP2 must
shard the packed weights (``_StridedShard`` on dim 0) on dim 1, because a dim-0 FSDP shard of
[q_r; k_r; v_r] has no DTensor description (FSDP2 would build one that ``full_tensor()`` and
state dicts read wrongly); a layer sharded otherwise raises a ``ValueError`` at its first call
and on ``state_dict()``.
"""
import contextlib
import copy
import pickle

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from fused_block import _backend, blocks, lora

# How a layer's parameter is placed on the tensor-parallel mesh and read by its forward.
COLWISE = "colwise"            # Shard(0): output rows by heads / FFN columns
PACKED = "packed"              # _StridedShard(0, k): each of k equal row blocks by heads / columns
ROWWISE = "rowwise"            # Shard(1): input columns; the product is a partial sum
ROWWISE_BIAS = "rowwise_bias"  # Replicate; added to rank 0's partial sum
PACKED_BIAS = "packed_bias"    # Replicate; each rank reads its slice of each of k blocks
REPLICATED = "replicated"      # Replicate: norms

#: Each role's placement on the tensor-parallel mesh.
PLACEMENTS = {COLWISE: lambda k: (Shard(0),), PACKED: lambda k: (_StridedShard(0, split_factor=k),),
              ROWWISE: lambda k: (Shard(1),), ROWWISE_BIAS: lambda k: (Replicate(),),
              PACKED_BIAS: lambda k: (Replicate(),), REPLICATED: lambda k: (Replicate(),)}

_FUSED_LAYERS = (blocks.TransformerEncoderLayer, blocks.TransformerDecoderLayer)
# Converted Hugging Face layers (fused_block.hf.llama's family) with a tensor-parallel plan.
_LLAMA_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


def _divides(name, n, size):
    if n % size:
        raise ValueError(f"{name} ({n}) is not divisible by the tensor-parallel degree ({size})")


def _fused_params(layer, size):
    """[(submodule path, parameter name, role, blocks)] of a fused encoder/decoder layer, and
    its attention modules (whose head counts a call divides by the degree)."""
    params = []
    for name in layer._ATTENTIONS:
        mha = getattr(layer, name)
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"{name}: kdim/vdim, add_bias_kv and add_zero_attn are not supported under tensor "
                             "parallelism")
        if mha.num_kv_heads != mha.num_heads:
            raise ValueError(f"{name}: num_kv_heads ({mha.num_kv_heads}) != nhead ({mha.num_heads}): the packed "
                             "[q; k; v] in_proj_weight of grouped-query attention has blocks of different sizes, "
                             "which no DTensor placement shards by heads")
        _divides(f"{name}: nhead", mha.num_heads, size)
        params += [(name, "in_proj_weight", PACKED, 3), (name, "in_proj_bias", PACKED_BIAS, 3),
                   (f"{name}.out_proj", "weight", ROWWISE, 1), (f"{name}.out_proj", "bias", ROWWISE_BIAS, 1)]
    _divides("dim_feedforward", layer.linear2.in_features, size)
    swiglu = layer._activation() == "swiglu"
    params += [("linear1", "weight", PACKED if swiglu else COLWISE, 2),
               ("linear1", "bias", PACKED_BIAS if swiglu else COLWISE, 2),
               ("linear2", "weight", ROWWISE, 1), ("linear2", "bias", ROWWISE_BIAS, 1)]
    params += [(n, p, REPLICATED, 1) for n in layer._NORMS for p in ("weight", "bias")]
    return params, [getattr(layer, name) for name in layer._ATTENTIONS]


def _llama_params(layer, size):
    attn, mlp = layer.self_attn, layer.mlp
    D = attn.head_dim
    _divides("num_attention_heads", attn.q_proj.out_features // D, size)
    _divides("num_key_value_heads", attn.k_proj.out_features // D, size)
    _divides("intermediate_size", mlp.down_proj.in_features, size)
    params = [(f"self_attn.{p}_proj", n, COLWISE, 1) for p in "qkv" for n in ("weight", "bias")]
    params += [("self_attn.o_proj", "weight", ROWWISE, 1), ("self_attn.o_proj", "bias", ROWWISE_BIAS, 1)]
    params += [(f"mlp.{p}_proj", n, COLWISE, 1) for p in ("gate", "up") for n in ("weight", "bias")]
    params += [("mlp.down_proj", "weight", ROWWISE, 1), ("mlp.down_proj", "bias", ROWWISE_BIAS, 1)]
    params += [(n, "weight", REPLICATED, 1) for n in ("input_layernorm", "post_attention_layernorm")]
    return params, []


def _describe(layer, size):
    wrapped = [path for path, m in layer.named_modules() if lora.is_lora(m)]
    if wrapped:
        raise ValueError(f"{wrapped[0]}: PEFT LoRA on a tensor-parallel layer is not supported (its adapters would "
                         "need the base weight's sharding)")
    if isinstance(layer, _FUSED_LAYERS):
        params, heads = _fused_params(layer, size)
        seq_dim = 1 if layer.self_attn.batch_first else 0
    elif "_fused_block" in layer.__dict__ and type(layer).__name__ in _LLAMA_LAYERS:
        params, heads = _llama_params(layer, size)
        seq_dim = 1
    else:
        raise TypeError(f"LayerParallel: {type(layer).__name__} is not one of fused_block's Transformer layers or a "
                        "converted (fused_block.convert) LLaMA, Mistral or Qwen2 decoder layer")
    found = [(path, name, role, k) for path, name, role, k in params
             if layer.get_submodule(path)._parameters.get(name) is not None]
    return found, heads, seq_dim


class LayerParallel(ParallelStyle):
    """Tensor (and sequence) parallelism for one fused layer: ``parallelize_module(layer,
    tp_mesh, LayerParallel())`` places its parameters (module docstring) and its forward then
    runs the kernels on the rank's shards.

    ``sequence_parallel``: the layer's input and output hold the rank's part of the sequence
    (else every rank holds all of it). ``input_layouts`` / ``output_layouts``: the layout
    (``Replicate()`` or ``Shard(seq_dim)``) the caller passes / wants, as plain local tensors,
    when it is not the layer's own (a stack's first and last layers under SP: :func:`tp_plan`);
    DTensor inputs are redistributed. ``memory_layouts``: the decoder's memory as passed
    (default: as ``input_layouts``); memory is used as it comes.
    """

    def __init__(self, *, sequence_parallel=False, input_layouts=None, output_layouts=None, memory_layouts=None):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        self.input_layouts, self.output_layouts = input_layouts, output_layouts
        self.memory_layouts = memory_layouts

    def _apply(self, module, device_mesh):
        if device_mesh.ndim != 1:
            raise ValueError(f"LayerParallel needs a 1-D tensor-parallel mesh, got {device_mesh.ndim} dims")
        if blocks._TP in module.__dict__:
            raise ValueError(f"{type(module).__name__} is already tensor parallel")
        size = device_mesh.size()
        params, heads, seq_dim = _describe(module, size)
        for path, name, role, k in params:
            owner = module.get_submodule(path)
            p = owner._parameters[name]
            dt = distribute_tensor(p.detach(), device_mesh, PLACEMENTS[role](k))
            owner.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        internal = Shard(seq_dim) if self.sequence_parallel else Replicate()
        inputs = self.input_layouts or internal
        plan = _Plan(module, device_mesh, params, heads, self.sequence_parallel, seq_dim, internal, inputs,
                     self.output_layouts or internal, self.memory_layouts or inputs)
        module.__dict__[blocks._TP] = plan
        module.register_forward_pre_hook(plan.prepare_inputs, with_kwargs=True)
        module.register_forward_hook(plan.prepare_output)
        module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: plan.check_fsdp(m))
        return module


def tp_plan(model, *, sequence_parallel=False):
    """The tensor-parallel plan of ``model`` for ``parallelize_module(model, tp_mesh, plan)``:
    ``{fqn: LayerParallel(...)}`` for each of its fused (or converted LLaMA-family) layers.

    Everything else (embeddings, final norm, LM head) stays replicated: each rank computes it
    whole, from the same input, so its parameters get the same gradients everywhere. With
    ``sequence_parallel`` each stack of consecutive layers (the layers of one container, e.g.
    ``blocks``) takes the whole sequence into its first layer, splits it there, and gathers it
    after its last. For a single layer the plan is a :class:`LayerParallel` itself.
    """
    def supported(m):
        return isinstance(m, _FUSED_LAYERS) or ("_fused_block" in m.__dict__
                                                and type(m).__name__ in _LLAMA_LAYERS)

    if supported(model):
        return LayerParallel(sequence_parallel=sequence_parallel)
    stacks = {}
    for name, m in model.named_modules():
        if name and supported(m):
            stacks.setdefault(name.rpartition(".")[0], []).append(name)
    if not stacks:
        other = sorted({type(m).__name__ for m in model.modules()
                        if hasattr(m.__dict__.get("_fused_block"), "family")})  # converted layers
        if other:
            raise ValueError(f"{type(model).__name__}: its converted layers ({', '.join(other)}) have no tensor-parallel "
                             f"plan; converted layers that do: {', '.join(_LLAMA_LAYERS)}")
        raise ValueError(f"{type(model).__name__} has no fused_block Transformer layer or converted LLaMA-family "
                         "layer (run fused_block.convert first)")
    plan = {}
    whole = Replicate()
    for names in stacks.values():
        for i, name in enumerate(names):
            first, last = i == 0, i == len(names) - 1
            plan[name] = LayerParallel(sequence_parallel=sequence_parallel,
                                       input_layouts=whole if sequence_parallel and first else None,
                                       output_layouts=whole if sequence_parallel and last else None,
                                       memory_layouts=whole)
    return plan


def fsdp_shard_placement(param):
    """``shard_placement_fn`` for ``fully_shard`` over tensor-parallel layers: ``Shard(1)`` for
    the packed weights (``_StridedShard`` on dim 0), the default (dim 0) for the others."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def get_state_dict(model, optimizers, **kwargs):
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` with the packed tensor-parallel
    weights (and their optimizer states) as ``Shard(0)`` DTensors of the same values.

    torch.distributed.checkpoint saves each rank's part of a tensor as one block of it, and a
    rank's [q_r; k_r; v_r] rows are three blocks (it refuses them: "overlapping chunks"). The
    copy costs a redistribution of those weights (a gather of each, one at a time).
    """
    from torch.distributed.checkpoint import state_dict as sd
    msd, osd = sd.get_state_dict(model, optimizers, **kwargs)
    return _map(_unstrided, msd), _map(_unstrided, osd)


def set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, **kwargs):
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for what :func:`get_state_dict`
    returned (and ``torch.distributed.checkpoint.load`` filled): each DTensor goes back to the
    placements of the model's own."""
    from torch.distributed.checkpoint import state_dict as sd
    own_m, own_o = sd.get_state_dict(model, optimizers, **kwargs)
    sd.set_state_dict(model, optimizers, model_state_dict=_map(_placed_like, model_state_dict, own_m),
                      optim_state_dict=_map(_placed_like, optim_state_dict, own_o), **kwargs)


def _map(fn, tree, like=None):
    if isinstance(tree, dict):
        return {k: _map(fn, v, None if like is None else like.get(k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(fn, v, None if like is None else like[i]) for i, v in enumerate(tree)]
    return fn(tree, like)


def _unstrided(t, _like):
    if isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements):
        return t.redistribute(t.device_mesh, tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p
                                                   for p in t.placements))
    return t


def _placed_like(t, like):
    if isinstance(t, DTensor) and isinstance(like, DTensor) and t.placements != like.placements:
        return t.redistribute(like.device_mesh, like.placements)
    return t


def add_norm(fn, x, residual, params, eps, dropout_p, residual_in_fp32, out_is_residual, **options):
    """``fn`` (``add_layer_norm`` / ``add_rms_norm``) on a DTensor ``x``: each rank normalizes
    its own rows with the kernel, and the outputs are DTensors placed like x (what a
    ``SequenceParallel`` style on a fused norm module hands it and expects back).

    x may be replicated or sharded on any dim but the normalized last one (not ``Partial``:
    reduce it first); ``residual`` a DTensor placed alike or None; weight and bias replicated
    DTensors on x's mesh, whose gradients are ``Partial`` over the mesh dims that shard x (a
    plain parameter there would get a partial gradient nobody reduces, so it is refused). A
    dropout draws its mask from the shared seed plus the rank's index among x's shards.
    """
    mesh, placements = x.device_mesh, tuple(x.placements)
    last = x.dim() - 1
    for p in placements:
        if p.is_partial() or (isinstance(p, (Shard, _StridedShard)) and p.dim in (-1, last)):
            raise ValueError(f"x: the norms take DTensors replicated or sharded along rows (not on the normalized "
                             f"last dim, not partial), got placements {placements}")
    if residual is not None and (not isinstance(residual, DTensor) or residual.device_mesh != mesh
                                 or tuple(residual.placements) != placements):
        raise ValueError(f"residual: must be a DTensor placed like x ({placements})")
    sharded = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    grad = tuple(Partial() if i in sharded else Replicate() for i in range(mesh.ndim))
    local = []
    for name, w in zip(("weight", "bias"), params):
        if isinstance(w, DTensor):
            if w.device_mesh != mesh or not all(isinstance(p, Replicate) for p in w.placements):
                raise ValueError(f"{name}: must be a DTensor replicated on x's mesh, got {tuple(w.placements)}")
            w = w.to_local(grad_placements=grad)
        elif w is not None and sharded and w.requires_grad:
            raise ValueError(f"{name}: a plain tensor beside a sharded x would get each rank's partial gradient, "
                             "which nothing reduces: make it a replicated DTensor (as torch's SequenceParallel does)")
        local.append(w)
    coordinate = mesh.get_coordinate()
    shard = 0
    for i in sharded:
        shard = shard * mesh.size(i) + coordinate[i]
    x_local = x.to_local()
    with _backend.seed_shift([shard]) if dropout_p > 0 else _NO_SHIFT:
        out, rout = fn(x_local, None if residual is None else residual.to_local(), *local, eps, dropout_p,
                       residual_in_fp32, out_is_residual, **options)

    def wrap(t):
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())

    return wrap(out), x if rout is x_local else wrap(rout)


class _Plan:
    """What :class:`LayerParallel` set up on a layer; ``call`` runs one forward on the shards."""

    def __init__(self, layer, mesh, params, heads, sequence_parallel, seq_dim, internal, inputs, output, memory):
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.internal, self.inputs, self.output, self.memory = internal, inputs, output, memory
        self.params = [(layer.get_submodule(path), name, role, k) for path, name, role, k in params]
        self.heads = heads
        self.expected = {(path, name): PLACEMENTS[role](k) for path, name, role, k in params}
        self.packed = {(layer.get_submodule(path), name) for path, name, role, k in params if role == PACKED}
        self.fsdp_checked = False

    def __reduce_ex__(self, protocol):
        raise pickle.PicklingError(
            "fused_block: a tensor-parallel layer (fused_block.distributed.LayerParallel) cannot be pickled: its "
            "plan holds the device mesh (process groups) and its parameters are DTensors; save a distributed state "
            "dict (torch.distributed.checkpoint) instead")

    def __copy__(self):  # copies as before (copy's default goes through __reduce_ex__)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = memo[id(self)] = object.__new__(type(self))
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    # -- the call-time guard ------------------------------------------------------------------
    def accepts(self, path, name, t):
        """The guard's ``accept``: ``t`` is the DTensor this plan placed at ``path.name``."""
        expected = self.expected.get((path, name))
        return (expected is not None and isinstance(t, DTensor) and t.device_mesh == self.mesh
                and tuple(t.placements) == expected)

    def whole_length(self, n):
        """The whole sequence's length where the layer's input (its internal layout) holds ``n``
        of its tokens: this rank's part under sequence parallelism."""
        return n * self.size if isinstance(self.internal, Shard) else n

    # -- the layer's input and output ---------------------------------------------------------
    def _convert(self, t, src, dst):
        """A plain local tensor from layout ``src`` to ``dst`` (a DTensor from its own)."""
        if isinstance(t, DTensor):
            return t.redistribute(self.mesh, (dst,)).to_local()
        if src == dst:
            return t
        return DTensor.from_local(t, self.mesh, (src,), run_check=False).redistribute(self.mesh, (dst,)).to_local()

    def _input(self, name, t, src, dst, split):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: tensor parallelism needs batched (3-D) inputs, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if isinstance(t, DTensor) and t.device_mesh != self.mesh:
            raise ValueError(f"{name}: a DTensor on {t.device_mesh}, but the layer is tensor parallel on {self.mesh}")
        if split and (isinstance(t, DTensor) or isinstance(src, Replicate)):  # (a DTensor's shape is the global one)
            _divides(f"{name}: the sequence length (dim {self.seq_dim}, split by sequence parallelism)",
                     t.shape[self.seq_dim], self.size)
        return self._convert(t, src, dst)

    def prepare_inputs(self, module, args, kwargs):
        """The forward pre-hook: the input (and a decoder's memory) in the layer's layout."""
        names = ("tgt", "memory") if isinstance(module, blocks.TransformerDecoderLayer) else \
            ("src",) if isinstance(module, blocks.TransformerEncoderLayer) else ("hidden_states",)
        layouts = ((self.inputs, self.internal, self.sequence_parallel), (self.memory, self.memory, False))
        args = list(args)
        for i, (name, (src, dst, split)) in enumerate(zip(names, layouts)):
            if i < len(args):
                args[i] = self._input(name, args[i], src, dst, split)
            elif name in kwargs:
                kwargs[name] = self._input(name, kwargs[name], src, dst, split)
        return tuple(args), kwargs

    def prepare_output(self, module, args, out):
        """The forward hook: the output in the layout the caller wants."""
        def convert(y):
            y = self._convert(y, self.internal, self.output)
            return _Own.apply(y) if y._base is not None else y

        if isinstance(out, tuple):  # older transformers: (hidden_states, ...)
            return (convert(out[0]), *out[1:])
        return convert(out)

    # -- one call -----------------------------------------------------------------------------
    def check_fsdp(self, layer):
        """FSDP2 over this layer must shard the packed weights on dim 1 (module docstring)."""
        for owner, name, role, k in self.params:
            p = owner._parameters[name]
            if role == PACKED and isinstance(p, DTensor) and p.device_mesh.ndim > 1:
                fsdp = p.placements[0]
                if not (isinstance(fsdp, Shard) and not isinstance(fsdp, _StridedShard) and fsdp.dim == 1):
                    raise ValueError(f"{type(layer).__name__}: FSDP2 shards the packed tensor-parallel weight {name} "
                                     f"as {fsdp} (only Shard(1) keeps it describable): pass shard_placement_fn="
                                     "fused_block.distributed.fsdp_shard_placement to fully_shard")
        if not self.fsdp_checked:
            state = layer._get_fsdp_state() if hasattr(layer, "_get_fsdp_state") else None
            group = None if state is None else state._fsdp_param_group
            for fp in () if group is None else group.fsdp_params:
                info = fp._module_info
                if (info.module, info.param_name) in self.packed and fp.fsdp_placement.dim != 1:
                    raise ValueError(f"{type(layer).__name__}: FSDP2 shards the packed tensor-parallel weight "
                                     f"{info.param_name} on dim {fp.fsdp_placement.dim} (only dim 1 keeps it "
                                     "describable): pass shard_placement_fn=fused_block.distributed."
                                     "fsdp_shard_placement to fully_shard")
            self.fsdp_checked = True

    @torch.compiler.disable  # swaps module state: runs eagerly under torch.compile (a graph break)
    def call(self, layer, fn, *args):
        """``fn(*args)`` (the layer's fused forward) with the layer's parameters replaced by
        this rank's local tensors and its attention modules holding their share of the heads."""
        self.check_fsdp(layer)
        run = _Run(self)
        saved = []
        try:
            for owner, name, role, k in self.params:
                p = owner._parameters[name]
                saved.append((owner, name, p))
                owner._parameters[name] = run.local(p, role, k)
            for mha in self.heads:
                saved.append((mha, None, (mha.num_heads, mha.num_kv_heads)))
                mha.num_heads, mha.num_kv_heads = mha.num_heads // self.size, mha.num_kv_heads // self.size
                mha.__dict__[blocks._TP_RUN] = run
            layer.__dict__[blocks._TP_RUN] = run
            return fn(*args)
        finally:
            layer.__dict__.pop(blocks._TP_RUN, None)
            for owner, name, value in reversed(saved):
                if name is None:
                    owner.num_heads, owner.num_kv_heads = value
                    owner.__dict__.pop(blocks._TP_RUN, None)
                else:
                    owner._parameters[name] = value


class _Run:
    """One call of a tensor-parallel layer: its rank's view of the layer's tensors and the
    collectives between its parts (each a DTensor redistribution with the gradient it needs)."""

    def __init__(self, plan):
        self.plan, self.mesh, self.rank, self.size = plan, plan.mesh, plan.rank, plan.size
        self.sequence_parallel = plan.sequence_parallel

    def local(self, p, role, k):
        if role in (COLWISE, PACKED, ROWWISE):
            return p.to_local()
        # A replicated parameter read on this rank's part of the data: its gradient is partial.
        if role == REPLICATED:
            return p.to_local(grad_placements=(Partial(),) if self.sequence_parallel else None)
        full = p.to_local(grad_placements=(Partial(),))
        if role == ROWWISE_BIAS:  # once in the sum of the partial products; every rank gets a gradient
            return full if self.rank == 0 else full * 0
        return full.view(k, self.size, -1)[:, self.rank].reshape(-1)  # PACKED_BIAS: [b0_r; b1_r; ...]

    def enter(self, t, memory=False):
        """A tensor in the layer's layout as the rank's heads / columns read it: whole (all-
        gathered from sequence parts); its gradient, partial on each rank, is reduced back."""
        layout = self.plan.memory if memory else self.plan.internal
        d = DTensor.from_local(t, self.mesh, (layout,), run_check=False)
        if not isinstance(layout, Replicate):
            d = d.redistribute(self.mesh, (Replicate(),))
        return d.to_local(grad_placements=(Partial(),))

    def leave(self, t):
        """Partial sums (a rowwise product) reduced into the layer's layout."""
        d = DTensor.from_local(t, self.mesh, (Partial(),), run_check=False)
        return d.redistribute(self.mesh, (self.plan.internal,)).to_local()

    def length(self, n, memory=False):
        layout = self.plan.memory if memory else self.plan.internal
        return n * self.size if isinstance(layout, Shard) else n

    def seeds(self, offsets):
        return _backend.seed_shift(offsets) if offsets else _NO_SHIFT


class _Own(torch.autograd.Function):
    """A redistributed output (``to_local()`` returns a view) as a tensor of its own: FSDP2
    warns when a module returns a view. The gradient passes through."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


_NO_SHIFT = contextlib.nullcontext()
