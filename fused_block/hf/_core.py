"""The shared patching core: a converted layer's state, its fused ``forward``, the conversion
loop and the call-time guard's spec of every family (:class:`Family`).

A family module (``llama.py``, ``gpt2.py``, ...) supplies a :class:`Family`; the table in
``fused_block/hf/__init__.py`` maps layer class names to families. Everything a family shares
with the others lives here (patching, the guard, argument handling, cached weight packing) or
in :mod:`fused_block.hf._attention` (mask plans, the KV cache, the attention dispatch).
"""
import contextlib
import copy
import functools
import inspect
import pickle
import sys
import types
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from fused_block import _backend, _guard, lora
from fused_block.blocks import _TP
from fused_block.linear import linear

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Hugging Face activation names (ACT2FN keys) and the GEMM epilogue's equivalent.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_CAPTURE_MODULE = "transformers.utils.output_capturing"
# In a family's tree: the submodule's class as found at conversion (checked by the family).
SAME = "same"


def warn_once(key, message):
    _backend.warn_once(key, f"fused_block: {message}", stacklevel=3)


def is_transformers_model(model) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


class Family:
    """A layer class's conversion: ``check(layer)`` at conversion and ``check_call(layer, call)``
    per call return a reason to keep the original forward (or None); ``prepare(layer)`` records
    what the layer's conversion decided; ``run(layer, call, x)`` computes the output;
    ``tree(layer)`` maps the path of every submodule the original forward calls and ``run``
    does not to its allowed classes (a tuple, or ``SAME``: its class at conversion); ``called``
    lists the paths of the submodules ``run`` calls itself (their subtrees are not checked);
    ``rotaries``: the class names of the model-level rotary module the family's RoPE reads;
    ``cross_attention``: ``run`` takes ``encoder_hidden_states`` (decoder layers of
    encoder-decoders); ``lora_paths(layer)``: the linears whose PEFT LoRA wrappers ``run``
    fuses into its GEMMs (:mod:`fused_block.lora`); ``returns_tensor``: the layer's return form
    where its forward's annotation does not say (False: a tuple whose first item is the hidden
    states, BLOOM's); ``own_output``: ``run`` returns the layer's whole output as its forward
    does (T5's tuple), not only the hidden states. The tree is the call-time guard's spec
    (:mod:`fused_block._guard`): a submodule outside it, of another class, wrapped (PEFT but
    at ``lora_paths``, quantization), hooked or with its own ``forward`` makes the layer run
    its original forward."""

    def __init__(self, check, check_call, run, tree, called=lambda layer: (), prepare=lambda layer: None,
                 rotaries=(), cross_attention=False, lora_paths=lambda layer: (), returns_tensor=None,
                 own_output=False):
        self.check, self.check_call, self.run, self.called = check, check_call, run, called
        self.tree, self.prepare, self.rotaries, self.cross_attention = tree, prepare, rotaries, cross_attention
        self.lora_paths, self.returns_tensor, self.own_output = lora_paths, returns_tensor, own_output

    def __reduce__(self):
        """Pickled by reference (its functions are lambdas; a loaded model must share the table's
        object): the name of a layer class it converts in :data:`fused_block.hf.FAMILIES`."""
        from fused_block.hf import FAMILIES

        for name, family in FAMILIES.items():
            if family is self:
                return family_of, (name,)
        raise pickle.PicklingError("fused_block: a converted layer's Family that is not in fused_block.hf.FAMILIES "
                                   "cannot be pickled (it is pickled by its name there)")


def family_of(layer_class_name):
    """The family of a layer class name (:data:`fused_block.hf.FAMILIES`): an unpickled
    :class:`Family`."""
    from fused_block.hf import FAMILIES

    return FAMILIES[layer_class_name]


# ---------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------

def convert_modules(model, families, causal_lms, patch_lm, lm_check):
    """Patch every layer of ``model`` whose class name is in ``families`` in place, then the
    causal LMs (``causal_lms``) through ``lm_check``/``patch_lm``; returns the converted modules."""
    rotary = {}
    for family in set(families.values()):
        found = [(path, m) for path, m in model.named_modules() if type(m).__name__ in family.rotaries
                 and hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
        rotary[family] = _Rotary(model, *found[0]) if len(found) == 1 and found[0][0] else None
    converted = []
    for m in model.modules():
        family = families.get(type(m).__name__)
        if family is None or not type(m).__module__.startswith("transformers.models.") or "_fused_block" in m.__dict__:
            continue
        reason = family.check(m)
        if reason is None and ("forward" in m.__dict__ or any(hasattr(s, "_hf_hook") for s in m.modules())):
            reason = "its forward is already wrapped (accelerate's device hooks or another patch)"
        if reason is None and not family.own_output and _returns_tensor(type(m).forward, family) is None:
            reason = f"the return type of {type(m).__name__}.forward is not recognised (transformers version?)"
        if reason is not None:
            warn_once(("convert", type(m).__name__, reason), f"{type(m).__name__} is left unconverted: {reason}")
            continue
        _patch(m, family, rotary[family])
        family.prepare(m)
        reason = _tree_reason(m, family)  # the MLP may have joined the tree
        if reason is not None:
            _unpatch(m)
            warn_once(("convert", type(m).__name__, reason), f"{type(m).__name__} is left unconverted: {reason}")
            continue
        m._fused_block.spec = _spec(m, family)
        converted.append(m)
    for m in model.modules():
        if type(m).__name__ in causal_lms and type(m).__module__.startswith("transformers.models.") \
                and "_fused_block" not in m.__dict__:
            reason = lm_check(m)
            if reason is not None:
                warn_once(("convert", type(m).__name__, reason),
                          f"{type(m).__name__}'s loss runs Hugging Face's code (the logits are built): {reason}")
                continue
            patch_lm(m)
            converted.append(m)
    return converted


def _tree_reason(layer, family):
    """At conversion: a submodule the family does not know, or of a class it does not fuse (a
    PEFT LoRA wrapper at one of the family's ``lora_paths`` is judged by its base layer; the
    guard checks its parts at every call)."""
    tree = family.tree(layer)
    wrapped = tuple(p for p in family.lora_paths(layer) if p in tree and lora.is_lora(layer.get_submodule(p)))
    called = tuple(family.called(layer))
    prefixes = tuple(p + "." for p in called + wrapped)  # a wrapper's parts: the guard's, per call
    found = {}
    for path, m in layer.named_modules():
        if not path or path in called or path.startswith(prefixes):
            continue
        allowed = tree.get(path)
        if allowed is None:
            return f"{path} ({type(m).__name__}) is a submodule the fused path does not know"
        base = type(lora.base(m)) if path in wrapped else type(m)
        if allowed is not SAME and base not in allowed:
            return f"{path} is a {base.__module__}.{base.__qualname__}, not one of {[c.__name__ for c in allowed]}"
        found[path] = allowed
    missing = [p for p in tree if p not in found]
    return f"{missing[0]} is missing" if missing else None


def _spec(layer, family):
    """The guard's spec: the tree with ``SAME`` resolved to the classes found now (at conversion;
    a LoRA wrapper's base layer's class)."""
    return {path: (type(lora.base(layer.get_submodule(path))),) if allowed is SAME else allowed
            for path, allowed in family.tree(layer).items()}


def _lora_spec(layer, spec, family):
    """``spec`` with each LoRA-wrapped linear at the family's ``lora_paths`` expanded into the
    wrapper's parts (:func:`fused_block.lora.spec`, its base layer of the linear's classes);
    returns (spec, paths to skip, wrapped paths)."""
    out, skip, wrapped = spec, [], []
    for path in family.lora_paths(layer):
        m = layer.get_submodule(path) if path in spec else None
        if m is not None and lora.is_lora(m):
            if out is spec:
                out = dict(spec)
            entries, called = lora.spec(path, m, spec[path])
            out.update(entries)
            skip.extend(called)
            wrapped.append(path)
    return out, tuple(skip), tuple(wrapped)


def _is_capture_hook(fn):
    """transformers' output-capturing hooks: installed once, inert unless a collector asks."""
    return getattr(fn, "__module__", None) == _CAPTURE_MODULE


def _capture_key(fn):
    """The output a capture hook records (the ``key`` its closure holds), or None if unreadable."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = getattr(code, "co_freevars", ())
    if "key" in names and len(cells) == len(names):
        key = cells[names.index("key")].cell_contents
        return key if isinstance(key, str) else None
    return None


def _capture_reason(keys):
    """Why the outputs the active collector asks for cannot be recorded: one of ``keys`` (those
    the capture hooks of the submodules the fused path does not call record; None in it: a hook
    of unknown key) other than the hidden states. Outputs of called submodules (gpt-oss's router
    logits) are recorded by their own hooks."""
    collector = sys.modules[_CAPTURE_MODULE]._active_collector.get()
    for k in collector or ():
        if k != "hidden_states" and not k.startswith("_") and (k in keys or None in keys):
            return f"output capturing of {k} (output_{k}=True) from a submodule the fused path does not call"
    return None


def _describe(layer):
    """For :func:`fused_block._guard.reason`: the layer's spec (with its LoRA wrappers' parts)
    checked against its submodules; per call, transformers' output capturing and the wrappers'
    PEFT state."""
    state = layer._fused_block
    spec, skip, wrapped = _lora_spec(layer, state.spec, state.family)
    tp = layer.__dict__.get(_TP)
    why, watched = _guard.scan(layer, spec, tuple(state.family.called(layer)) + skip, _is_capture_hook,
                               None if tp is None else tp.accepts)
    hooks = [getattr(h, "func", h) for m in watched for h in m._forward_hooks.values()]
    keys = frozenset(_capture_key(fn) for fn in hooks if _is_capture_hook(fn))
    checks = ([lambda: _capture_reason(keys)] if keys else []) + ([lora.live(layer, wrapped)] if wrapped else [])
    if len(checks) < 2:
        return why, watched, checks[0] if checks else None
    return why, watched, lambda: checks[0]() or checks[1]()


class _Rotary:
    """The model-level rotary module whose ``inv_freq`` a family's RoPE reads (LLaMA's
    ``model.rotary_emb``) and where it sits: its owner (held weakly: no cycle through the
    model, and a copy of a layer alone does not copy the model) and its name there."""

    def __init__(self, model, path, module):
        parent, _, self.name = path.rpartition(".")
        self.module, self.cls = module, type(module)
        self.owner = weakref.ref(model.get_submodule(parent))

    def current(self):
        """The module while it is what the model calls for the layers' ``position_embeddings``:
        still at its place (not replaced: another ``rope_parameters``), of its class, without
        an instance ``forward`` or forward hooks (which change the tables); else None (the
        layers then read the ``position_embeddings`` they are given)."""
        m, owner = self.module, self.owner()
        if (owner is None or owner._modules.get(self.name) is not m or type(m) is not self.cls or "forward" in m.__dict__
                or m._forward_hooks or m._forward_pre_hooks):
            return None
        return m

    def __deepcopy__(self, memo):
        """In a copy of the model: the copy's module at the copy's owner (copied before its layers)."""
        new = copy.copy(self)  # (through __getstate__: without the owner)
        new.module, new.owner = copy.deepcopy(self.module, memo), self.owner
        owner = self.owner()
        if owner is not None and id(owner) in memo:
            new.owner = weakref.ref(memo[id(owner)])
        return new

    def __getstate__(self):
        """Pickled without its owner (a weak reference; a layer pickled alone would otherwise
        carry the whole model): the owner's :class:`_Rotaries` points it at the unpickled owner
        when the owner is in the same pickle, else it has none (:meth:`current`: None)."""
        return {k: v for k, v in self.__dict__.items() if k != "owner"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.owner = _no_owner


def _no_owner():
    return None


class _Rotaries:
    """In the ``__dict__`` of a :class:`_Rotary`'s owner (``_ROTARIES``): the records that read its
    rotary module. Their weak references to the owner do not survive pickling; this does, with
    the owner, and gives them the unpickled owner (``_relink``)."""

    def __init__(self, owner):
        self.owner, self.rotaries = weakref.ref(owner), []

    def __reduce__(self):
        return _relink, (self.owner(), self.rotaries)


def _relink(owner, rotaries):
    """An unpickled (or copied) :class:`_Rotaries` of ``owner``."""
    if owner is None:  # pickled from a shallow copy's dict after its owner was freed
        return None
    link = _Rotaries(owner)
    for r in rotaries:
        r.owner = link.owner
        link.rotaries.append(r)
    return link


_ROTARIES = "_fused_block_rotaries"


def _register_rotary(rotary):
    """Record ``rotary`` in its owner's :class:`_Rotaries` (a layer now reads it)."""
    owner = rotary.owner()
    link = owner.__dict__.get(_ROTARIES)
    if type(link) is not _Rotaries or link.owner() is not owner:
        link = owner.__dict__[_ROTARIES] = _Rotaries(owner)  # a plain attribute: no state-dict entry
    if not any(r is rotary for r in link.rotaries):
        link.rotaries.append(rotary)


class _State:
    """What a converted layer keeps beside its modules: how its forward was called and returns."""

    def __init__(self, family, original, positional, returns_tensor, rotary):
        self.family, self.original, self.positional = family, original, positional
        self.returns_tensor = returns_tensor
        self.rotary = rotary  # the model's rotary module (LLaMA family; a _Rotary), not a submodule
        self.packed = _Packed()  # name -> (key, value, weak references) cache of cached()
        self.fused_mlp = False  # LLaMA family: the MLP runs as swiglu
        self.spec = {}  # the call-time guard's spec (_spec), set once the family prepared the layer


def _patch(module, family, rotary):
    forward = type(module).forward
    params = list(inspect.signature(forward).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    state = _State(family, forward, positional, _returns_tensor(forward, family), rotary)
    module.__dict__["_fused_block"] = state  # a plain attribute: no submodule, no state-dict entry
    if rotary is not None:
        _register_rotary(rotary)
    bind_forward(module, _fused_forward)


def _unpatch(module):
    del module.__dict__["_fused_block"], module.__dict__["forward"], module.__dict__["_replicate_for_data_parallel"]


def bind_forward(module, forward):
    """``module.forward = forward`` bound to ``module``, an instance attribute; also in the
    replicas ``torch.nn.parallel.replicate`` makes (``nn.DataParallel``: the Trainer's wrapper
    with several GPUs in one process), whose ``__dict__`` is a shallow copy of the module's and
    whose forward would otherwise stay bound to the original module (its weights on the first
    GPU, gradients bypassing the replica's copies): there it is bound to the replica.

    Bound as :func:`bound` binds (a ``functools.partial``, not a ``types.MethodType``: a
    converted model pickles, ``torch.save(model)``)."""
    module.forward = bound(forward, module)
    module._replicate_for_data_parallel = bound(_replicate_for_data_parallel, module)


def bound(function, module):
    """``function`` bound to ``module``: ``functools.partial(function, module)``, called in C as
    a bound method is (no Python frame more), which pickles and copies (with the module: the
    function by its qualified name) where a ``types.MethodType`` in a module's ``__dict__``
    pickles as ``getattr(module, function.__name__)`` and fails. ``__func__`` and ``__self__``
    as a bound method's, for code that rebinds a module's forward through them (accelerate's
    mixed precision wrapper)."""
    method = functools.partial(function, module)
    method.__func__, method.__self__ = function, module
    return method


def _replicate_for_data_parallel(self):
    replica = type(self)._replicate_for_data_parallel(self)
    for name in ("forward", "_replicate_for_data_parallel"):  # forward: or a wrapper set over ours since (accelerate's autocast)
        method = replica.__dict__.get(name)
        if isinstance(method, types.MethodType) and method.__self__ is self:
            replica.__dict__[name] = types.MethodType(method.__func__, replica)
        elif isinstance(method, functools.partial) and method.__dict__.get("__self__") is self:
            replica.__dict__[name] = bound(method.func, replica)
    return replica


def _returns_tensor(forward, family):
    """True if the layer returns a tensor, False for a tuple (older transformers; BLOOM), None if
    unknown (no annotation and the family does not say)."""
    ann = inspect.signature(forward).return_annotation
    if ann is inspect.Signature.empty:
        return family.returns_tensor
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    if ann is torch.Tensor or text in ("torch.Tensor", "Tensor", "torch.FloatTensor"):
        return True
    if "tuple" in str(ann).lower():
        return False
    return None


def _fused_forward(self, *args, **kwargs):
    state = self._fused_block
    call = dict(zip(state.positional, args))
    call.update(kwargs)
    hidden = call.get("hidden_states")
    reason = (_common_reason(call, hidden, state.family.cross_attention) or _guard.reason(self, _describe)
              or state.family.check_call(self, call))
    if reason is not None:
        if _TP in self.__dict__:
            raise RuntimeError(f"fused_block: {type(self).__name__} is tensor parallel (fused_block.distributed."
                               f"LayerParallel): it runs on its shards fused only, not its original forward: {reason}")
        warn_once((type(self).__name__, reason), f"{type(self).__name__} runs its original forward: {reason}")
        return state.original(self, *args, **kwargs)
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled() \
            and hasattr(self, "_gradient_checkpointing_func"):
        out = _checkpointed(self, call)
    else:
        out = _run(self, call, hidden)
    if state.returns_tensor or state.family.own_output:
        return out
    # Older transformers: a tuple, whose models read the updated cache after the hidden states
    # (when use_cache) or ignore what follows them.
    return (out, kv_cache(call)) if call.get("use_cache") and kv_cache(call) is not None else (out,)


def _run(layer, call, hidden):
    """The family's fused layer; a tensor-parallel one (``fused_block.distributed``) on this
    rank's shards, also when gradient checkpointing recomputes it."""
    tp = layer.__dict__.get(_TP)
    if tp is None:
        return layer._fused_block.family.run(layer, call, hidden)
    return tp.call(layer, layer._fused_block.family.run, layer, call, hidden)


def _checkpointed(layer, call):
    """``run`` under the layer's activation checkpointing, as transformers' own layers run: no
    cache (the recomputation would update it twice) unless the layer may keep it, and every
    tensor argument passed positionally (a reentrant checkpoint gives gradients to those only,
    e.g. the encoder's output of a cross-attention)."""
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        call = {k: None if k in _CACHE_NAMES else False if k == "use_cache" else v for k, v in call.items()}
    names = [k for k, v in call.items() if isinstance(v, torch.Tensor)]

    def run(*tensors):
        args = dict(call, **dict(zip(names, tensors)))
        return _run(layer, args, args["hidden_states"])

    return layer._gradient_checkpointing_func(run, *(call[k] for k in names))


def _common_reason(call, hidden, cross_attention):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return "hidden_states is not a (batch, length, hidden) tensor"
    mask = call.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)):
        return f"an attention mask of type {type(mask).__name__} (e.g. flex attention's BlockMask)"
    if hidden.dtype not in KERNEL_DTYPES:
        return f"dtype {hidden.dtype} (the kernels take fp32, fp16 and bf16)"
    if call.get("output_attentions"):
        return "output_attentions=True (the fused attention never forms the attention weights)"
    if call.get("head_mask") is not None:
        return "a head_mask"
    if call.get("encoder_hidden_states") is not None and not cross_attention:
        return "cross-attention (encoder_hidden_states)"
    for name in _CACHE_NAMES:
        cache = call.get(name)
        if cache is not None and not hasattr(cache, "update"):
            return f"a legacy (tuple) {name}"
        if cache is not None and _update_needs_call(cache):
            return f"a {type(cache).__name__} (its update reads the attention's keyword arguments)"
    return None


_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
_NEEDS_CALL = {}  # cache class -> whether its update takes a required argument past (k, v, layer_idx)


def _update_needs_call(cache):
    """Whether ``cache.update`` requires more than ``(key_states, value_states, layer_idx)``:
    continuous batching's ``PagedAttentionCache`` (``generate_batch``, ``init_continuous_batching``)
    takes the attention's kwargs, from which it reads the batch's read and write indices and
    where it leaves ``cu_seq_lens_k`` for the attention. The fused layers call ``update(k, v,
    layer_idx)``: such a call raised (every request of a ``generate_batch`` failed, empty)."""
    cls = type(cache)
    found = _NEEDS_CALL.get(cls)
    if found is None:
        try:
            params = list(inspect.signature(cache.update).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        found = _NEEDS_CALL[cls] = sum(p.default is p.empty and p.kind in positional for p in params) > 3 or any(
            p.default is p.empty and p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    return found


def kv_cache(call):
    """The call's KV cache (whichever name this transformers version passes it under), or None."""
    for name in _CACHE_NAMES:
        if call.get(name) is not None:
            return call[name]
    return None


# ---------------------------------------------------------------------------------------------
# weight packing
# ---------------------------------------------------------------------------------------------

_STEPS = [0]  # optimizer steps taken, by any torch.optim optimizer (_stepped)


def _stepped(_optimizer, _args, _kwargs):
    # Not while torch.compile traces a step: a count it read would be a guard, recompiling
    # each step (a compiled fused step is not seen).
    if not torch.compiler.is_compiling():
        _STEPS[0] += 1


# torch's global hook after every torch.optim optimizer's step: the fused ones (fused=True,
# Trainer's default adamw_torch_fused) write the parameters in place without bumping their
# version counters, as may optimizers with kernels of their own.
register_optimizer_step_post_hook(_stepped)


class _Packed(dict):
    """:func:`cached`'s entries; a copy of the module (``copy.deepcopy``) starts without them
    (its tensors are others: the entries could never hit, and their weak storage references
    must not be freed twice)."""

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()


try:  # where torch's composable distributed APIs (FSDP2's fully_shard among them) keep their states
    from torch.distributed._composable_state import _module_state_mapping as _COMPOSABLE
except ImportError:  # a torch built without torch.distributed
    _COMPOSABLE = {}
_FSDP2 = [0, False]  # (len(_COMPOSABLE) when last looked, whether an FSDP2 state was among them)


def _fsdp2_in_use():
    """Whether ``fully_shard`` (FSDP2) manages a module in this process: it refills each
    unsharded parameter in place at every forward (the same tensor and storage, its version
    counter preserved, and on a GPU often the same address from the caching allocator), so a
    change made to the sharded parameters between forwards (``load_state_dict``, an EMA swap, a
    write under no_grad) shows in no key. Looked up again when the count of states changes."""
    n = len(_COMPOSABLE)
    if n != _FSDP2[0]:
        _FSDP2[:] = [n, any(type(ref()).__name__ == "FSDPState" for ref in list(_COMPOSABLE.values()))]
    return _FSDP2[1]


def cached(state, name, tensors, make, stamp=(), held=()):
    """``make(tensors)``; cached across calls while the tensors are unchanged and no gradient
    flows through them (generation; buffers), recomputed otherwise (training, compile).
    "Unchanged": the same storage (the storage object itself, held weakly, not its address: a
    tensor freed and a new one made at its address, as a parametrized weight recomputed per
    call, ``param.data = ...`` or ``.half().float()``, is another storage), the same view of it
    (first element, shape and strides: ``param.data = param.data.t()``) and version counter,
    the same ``stamp`` (what else the caller knows changes them: PEFT's merges,
    :func:`fused_block.lora.merged_state`, whose storage addresses stay unique while the entry
    holds the storages of the tensors ``held`` weakly), no optimizer step since (fused
    optimizers write without a version bump) and no module or parameter registered or assigned under a guarded
    layer since (the guard's epoch, :mod:`fused_block._guard`: PEFT wrapping or unwrapping the
    linears, as ``get_peft_model`` and ``merge_and_unload`` do around merges that are written
    through ``.data``). Any other write through ``.data`` bumps no version counter, so it is not
    seen otherwise. Inference tensors (a model built under ``torch.inference_mode``) have no
    version counter: recomputed every call; so are parameters while FSDP2 manages a module in
    the process (:func:`_fsdp2_in_use`: its unsharded parameters change in place unseen).
    A copy made under ``torch.inference_mode`` is an inference tensor, which autograd refuses
    to save: outside that mode it is made again (a frozen model evaluated under inference mode
    and then trained, its adapters, embeddings or input taking gradients, saves the copy)."""
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or any(t.is_inference() for t in tensors)
            or (_fsdp2_in_use() and any(isinstance(t, torch.nn.Parameter) for t in tensors))):
        return make(tensors)
    # A storage's address (_cdata) is not reused while the entry holds a weak reference to it.
    key = (_guard._EPOCH, _STEPS[0], stamp,
           *((t.untyped_storage()._cdata, t.data_ptr(), t.shape, t.stride(), t._version, t.dtype, t.device)
             for t in tensors))
    hit = state.packed.get(name)
    if hit is None or hit[0] != key or (hit[1].is_inference() and not torch.is_inference_mode_enabled()):
        hit = state.packed[name] = (key, make(tensors),
                                    tuple(StorageWeakRef(t.untyped_storage()) for t in (*tensors, *held)))
    return hit[1]


def packed(state, name, tensors, stamp=(), held=()):
    """``torch.cat(tensors)`` (None for absent biases), cached as :func:`cached`."""
    return None if tensors[0] is None else cached(state, name, tensors, torch.cat, stamp, held)


class _Parts:
    """A saved view of a packed weight, kept as the parts it was concatenated from."""

    def __init__(self, parts, versions, size, stride, offset):
        self.parts, self.versions, self.size, self.stride, self.offset = parts, versions, size, stride, offset


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


@contextlib.contextmanager
def saved_as_parts(weight, parts):
    """Inside, autograd saves ``weight``, the concatenation of ``parts`` (dim 0) that
    :func:`packed` made for this call, and any view of it as ``parts`` themselves, concatenated
    again when the backward reads them: a training step keeps the copy for its GEMM, not until
    the backward (the parts are the parameters, alive anyway; LLaMA-3-8B's q/k/v weights are
    50 MB a layer, 1.6 GB over 32 layers, which a saved copy would hold through the step, and
    past FSDP's resharding). The backward pays one more concatenation per packed weight.
    Autograd's check stays: a part changed in place between the forward and the backward
    raises at the backward, as a saved tensor would. Not where nothing is saved (no gradient,
    a cached copy), while ``torch.compile`` traces (its graph decides what it saves), or under
    other saved-tensor hooks (activation checkpointing, offloading: theirs apply)."""
    if (weight is None or not weight.requires_grad or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or _TOP_HOOKS is None or _TOP_HOOKS(False) is not None):
        yield
        return
    storage = weight.untyped_storage()._cdata  # the storage itself (data pointers repeat: meta, empty)
    versions = tuple(p._version for p in parts)

    def pack(t):
        # the copy, or a tensor on its storage (F.linear's transpose, an op's detached alias)
        if t.layout is not torch.strided or t.untyped_storage()._cdata != storage:
            return t
        return _Parts(parts, versions, t.size(), t.stride(), t.storage_offset())

    def unpack(t):
        if type(t) is not _Parts:
            return t
        if tuple(p._version for p in t.parts) != t.versions:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               "inplace operation: a weight of a packed projection (fused_block.hf) changed "
                               "between the forward and the backward")
        return torch.cat(t.parts).as_strided(t.size, t.stride, t.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def packed_linear(state, name, x, linears, bias, **kw):
    """``linear(x, packed(state, name, their weights), bias, **kw)`` for the linear modules
    ``linears`` (PEFT LoRA wrappers included: their base layer's weight, the packed copy made
    again when PEFT merges or unmerges their adapters, which it writes through ``.data``), the
    packed weight saved for the backward as its parts (:func:`saved_as_parts`)."""
    weights = tuple(m.weight for m in linears)
    w = packed(state, name, weights, *lora.merged_state(linears))
    with saved_as_parts(w, weights):
        return linear(x, w, bias, **kw)


def packed_bias(state, name, linears):
    """The concatenated biases of ``linears`` (zeros for one without, e.g. Whisper's k_proj),
    None when none has one; cached as :func:`cached`, with the linears' PEFT merge state (a
    merged ``lora_bias`` is written into the base bias through ``.data``)."""
    biases = [m.bias for m in linears]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    stamp, held = lora.merged_state(linears)
    if len(present) == len(biases):
        return packed(state, name, tuple(biases), stamp, held)

    def make(ts):
        it = iter(ts)
        return torch.cat([next(it) if b is not None else ts[0].new_zeros(m.out_features)
                          for b, m in zip(biases, linears)])

    return cached(state, name, tuple(present), make, stamp, held)
