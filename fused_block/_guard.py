"""The call-time guard: a fused forward runs only while what it bypasses is what it fuses.

A fused layer reads its submodules' weights instead of calling them. That gives the original's
answer only while every submodule the original forward would call is a plain module of a class
the fused path reproduces: not a PEFT ``LoraLayer``, not a quantized ``nn.Linear`` subclass
(bitsandbytes' ``Linear4bit``/``Linear8bitLt``) or a tensor-subclass weight (torchao, DTensor:
but a tensor-parallel layer reads the DTensors its own plan placed, ``accept`` below),
no instance-level ``forward`` (accelerate's hooks), no forward, forward-pre or backward hooks,
no parametrization the fused path cannot read through. A layer describes what it bypasses as a
*spec*, ``{path: allowed classes}`` for every descendant its original forward would call;
:func:`reason` returns why the fused path would give another answer, or None.

Cost: the verdict is cached per layer and recomputed only after something that could change it:

- a module, parameter or buffer registered or assigned on a guarded layer or on any module
  under it (torch's global registration hooks; PEFT, quantization libraries, ``parametrize``
  and plain ``layer.linear1 = ...`` all go through them) bumps a global epoch. A positive
  verdict marks the layer's whole module tree (an instance attribute); registrations on other
  modules cannot change a verdict and leave it alone: Hugging Face's ``self.layers[:n]``
  builds a new ``ModuleList`` on every forward, which registers the layers on that new list,
  not under them (and, under torch.compile, a graph that bumped the epoch would guard on it);
- registering or removing a hook on a bypassed submodule bumps it too: a positive verdict
  gives those submodules hook dicts that bump it on change (:class:`_HookDict`); a dict that
  already holds tolerated hooks (and so may have handles) is kept and its length checked;
- what torch announces nowhere, a submodule's class or instance-level ``forward`` changing,
  or another module put in its place without torch's registration (``parent._modules[name] =
  ...``: ``torch.ao.quantization``'s swaps, transformers' AWQ and HIGGS replacements), is
  checked on every call (three lookups per submodule), as are torch's global module hooks.

About 2 us per layer call on the fast path (a fused ``TransformerEncoderLayer``, 8 watched
submodules, on this project's 2-core CI machine, 2026-12-06; 1.4 us before the place check
was added that day), well under 1% of a training step's host time; a negative
verdict is never cached (the original path is the slow one anyway, and a hook removed through
a handle made before the dicts were replaced must be seen). Under ``torch.compile`` the full
check runs while tracing (dynamo guards on what it reads) and nothing is cached.
"""
import collections
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.utils import parametrize

_EPOCH = 0
# The instance attribute that marks every module in the tree of a layer with a cached positive
# verdict (and perhaps some that have left it since, or copies: they only cost a spurious bump).
# An attribute, not a global set of modules: a registration traced by torch.compile then reads
# the registering module only, so no graph guards on the set of guarded modules.
_MARK = "_fused_block_guarded"


def _bump(*_args):
    global _EPOCH
    _EPOCH += 1


def _registered(module, _name, _value):
    """torch's global registration hook: bump the epoch if ``module`` is in a guarded tree.

    Traced by torch.compile too (HF's ``self.layers[:n]`` registers inside the traced
    forward): a new module is not marked, so the graph neither bumps nor guards on the epoch;
    a traced registration on a marked module bumps it when the graph runs."""
    if _MARK in module.__dict__:
        _bump()


# torch calls these on every register_module/register_parameter/register_buffer and module,
# parameter or buffer assignment; returning None keeps the value.
_module.register_module_module_registration_hook(_registered)
_module.register_module_parameter_registration_hook(_registered)
_module.register_module_buffer_registration_hook(_registered)

_HOOK_DICTS = {"_forward_hooks": "forward hook", "_forward_pre_hooks": "forward pre-hook",
               "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook"}


class _HookDict(collections.OrderedDict):
    """A module's hook dict that bumps the epoch when a hook is added or removed."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _bump()

    def __delitem__(self, key):
        super().__delitem__(key)
        _bump()

    def pop(self, *args):
        _bump()
        return super().pop(*args)

    def popitem(self, last=True):
        _bump()
        return super().popitem(last)

    def clear(self):
        _bump()
        super().clear()

    def setdefault(self, key, default=None):
        _bump()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        _bump()
        super().update(*args, **kwargs)


_transforms_active = torch._C._are_functorch_transforms_active


def _global_hook_reason():
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks
            or _module._global_backward_hooks or _module._global_backward_pre_hooks):
        return ("a global module hook (torch.nn.modules.module.register_module_forward_hook and the like) "
                "would see the submodules the fused path does not call")
    return None


def _qualname(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_tensor(t):
    if t is None or type(t) in (nn.Parameter, torch.Tensor):
        return True
    # While torch.compile / torch.export trace, parameters are fake stand-ins of plain tensors.
    return torch.compiler.is_compiling() and type(t) in _tracing_types()


def _tracing_types():
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FakeTensor, FunctionalTensor


def tensors_reason(path, owner, names, accept=None):
    """Why a tensor the fused path reads (``owner.<name>``) is not a plain tensor, or None.

    ``accept(path, name, t)``: True for a tensor subclass the fused path reads all the same
    (a tensor-parallel layer's DTensor parameters, placed as its plan placed them)."""
    for name in names:
        if parametrize.is_parametrized(owner, name):
            # its originals, not an evaluation (which may update state: spectral_norm's power
            # iteration in training; the fused path evaluates it once per call, as torch does)
            for pname, p in owner.parametrizations[name]._parameters.items():
                if not _plain_tensor(p) and not (accept is not None and accept(path, f"{name}.{pname}", p)):
                    where = f"{path}.{name}" if path else name
                    return f"{where} is parametrized over a {type(p).__name__}, which the kernels do not read"
            continue
        t = getattr(owner, name, None)
        if not _plain_tensor(t) and not (accept is not None and accept(path, name, t)):
            where = f"{path}.{name}" if path else name
            return (f"{where} is a {type(t).__name__} (a quantized, distributed or other tensor subclass), "
                    "which the kernels do not read")
    return None


def module_reason(path, m, allowed, tolerate_hook=None, accept=None):
    """Why submodule ``m`` (at ``path``) is not what a fused path reproduces, or None.

    ``allowed``: a tuple of classes ``m`` must be exactly (after undoing ``parametrize``'s
    class swap), or None for any class. ``tolerate_hook(fn)``: True for hooks known to change
    nothing (checked per call by the caller's ``live`` function instead). ``accept``: as for
    :func:`tensors_reason`.
    """
    cls = parametrize.type_before_parametrizations(m)
    if allowed is not None and cls not in allowed:
        names = " or ".join(_qualname(c) for c in allowed)
        return f"{path} is a {_qualname(type(m))}, not {names}"
    if "forward" in m.__dict__:
        return f"{path} has an instance-level forward (a patch or accelerate's hooks)"
    for attr, kind in _HOOK_DICTS.items():
        for hook in getattr(m, attr).values():
            if tolerate_hook is None or not tolerate_hook(getattr(hook, "func", hook)):
                return f"{path} has a {kind}"
    params = m._parameters
    if parametrize.is_parametrized(m):
        params = dict(params)
        for name, plist in m.parametrizations.items():
            # one original, or several (original0, original1, ...: weight_norm's g and v)
            for pname, p in plist._parameters.items():
                params[name if pname == "original" else f"{name}.{pname}"] = p
    for name, p in params.items():
        if not _plain_tensor(p) and not (accept is not None and accept(path, name, p)):
            return tensors_reason(path, m, (name,)) if name in m._parameters else \
                f"{path}.{name} is parametrized over a {type(p).__name__}"
    return None


def scan(layer, spec, skip=(), tolerate_hook=None, accept=None):
    """``(reason, watched)``: why ``layer``'s fused path would differ from its forward, and the
    submodules to watch. ``spec``: {path: allowed classes or None} for every descendant the
    original forward calls; paths under ``skip`` (called by the fused path, or only read) are
    not checked, and neither are the parametrization containers of a parametrized submodule.
    ``accept``: the DTensor parameters a tensor-parallel layer reads (:func:`tensors_reason`).
    """
    watched = []
    prune = tuple(p + "." for p in skip)
    # Every path: a module in two slots (a decoder's tied self- and cross-attention) is in both.
    modules = dict(layer.named_modules(remove_duplicate=False))
    for path, m in modules.items():
        if not path or path in skip or path.startswith(prune):
            continue
        if path.endswith(".parametrizations") or ".parametrizations." in path:
            owner = path[:path.index(".parametrizations")] if ".parametrizations" in path else path
            if owner in spec and parametrize.is_parametrized(layer.get_submodule(owner)):
                continue
        if path not in spec:
            return f"{path} ({_qualname(type(m))}) is a submodule the fused path does not know", ()
        reason = module_reason(path, m, spec[path], tolerate_hook, accept)
        if reason is not None:
            return reason, ()
        watched.append(m)
    missing = [p for p in spec if p not in modules]
    if missing:
        return f"{missing[0]} is missing", ()
    return None, watched


class _Verdict:
    __slots__ = ("layer", "epoch", "watch", "counted", "live")

    def __init__(self, layer, epoch, watch, counted, live):
        self.layer, self.epoch, self.watch, self.counted, self.live = layer, epoch, watch, counted, live


_VERDICTS = {}  # id(layer) -> _Verdict (positive verdicts only)


def reason(layer, describe):
    """Why ``layer``'s fused forward must not run now (None: it may).

    ``describe(layer) -> (reason, watched, live)``: a full check (usually through :func:`scan`),
    the submodules whose class and instance ``forward`` to check per call, and ``live()`` (or
    None), a cheap per-call check of state no registration announces.
    """
    why = _global_hook_reason()
    if why is not None:
        return why
    if torch.compiler.is_compiling():
        return describe(layer)[0]
    if _transforms_active():
        return ("a torch.func transform (grad, vmap, jacrev, ...) is active, which the kernels' autograd "
                "Functions do not take")
    v = _VERDICTS.get(id(layer))
    if v is not None and v.epoch == _EPOCH and v.layer() is layer:
        for m, cls, parent, name in v.watch:
            if type(m) is not cls or "forward" in m.__dict__ or parent._modules.get(name) is not m:
                break
        else:
            for hooks, n in v.counted:
                if len(hooks) != n:
                    break
            else:
                return None if v.live is None else v.live()
    why, watched, live = describe(layer)
    if why is not None:
        _VERDICTS.pop(id(layer), None)
        return why
    watched = list({id(m): m for m in watched}.values())  # a module in several slots: once
    counted = []
    for m in watched:  # hooks added later announce themselves
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr)
            if type(hooks) is _HookDict:
                continue
            if hooks:  # tolerated hooks, perhaps with handles to this very dict: keep it, count it
                counted.append((hooks, len(hooks)))
            else:
                m.__dict__[attr] = _HookDict()
    key = id(layer)

    def forget(_ref, key=key, verdicts=_VERDICTS):  # bound now: at interpreter exit the global is gone
        if verdicts.get(key) is verdict:
            del verdicts[key]

    # where each watched submodule sits: its parents' _modules, which code may write directly;
    # every slot of a module held in several (a decoder's tied self- and cross-attention)
    places = {}
    for parent in layer.modules():
        for name, child in parent._modules.items():
            places.setdefault(id(child), []).append((parent, name))
    verdict = _Verdict(weakref.ref(layer, forget), _EPOCH,
                       tuple((m, type(m), *place) for m in watched for place in places[id(m)]), tuple(counted), live)
    for m in layer.modules():  # registrations here may change the verdict from now on
        m.__dict__[_MARK] = True
    _VERDICTS[key] = verdict
    return None if live is None else live()
