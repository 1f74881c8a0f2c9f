"""Walking a user's state: tensors out, plain values into a JSON skeleton, and back.

``flatten`` turns ``state`` (nested dicts/lists/tuples holding tensors, DTensors, modules,
optimizers, Stateful objects and plain Python values) into

* ``tensors``: ``{fqn: tensor}`` where ``fqn`` is the dotted key path, the same naming DCP's
  ``flatten_state_dict`` uses (dict keys and list indices joined with ``"."``);
* ``skeleton``: a JSON-serialisable copy of the structure in which every tensor is replaced by
  ``{"$tensor": fqn}`` and plain values are kept as data (tuples, non-string dict keys and
  non-finite floats are tagged so that they round-trip exactly). Nothing is ever pickled.

``plan_load`` walks the destination state against a saved skeleton and returns the tensors to
read (destination tensors, filled in place, or fresh ones allocated from the checkpoint's
metadata) plus the callbacks that put plain values and sub-states back once the tensors are in.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import StateMismatchError, UnsupportedStateError
from ..manifest import schema as fmt
from ..manifest.values import (TENSOR_TAG, check_exact, decode_value, encode_value, skel_items,
                               skel_seq)
from ..manifest.values import fqn as _fqn
from ..manifest.values import path_str as _path_str

log = logging.getLogger("fastckpt")


def is_dtensor(x: Any) -> bool:
    # a DTensor can only exist once its module was imported: no need to import it here (slow)
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def _is_module(x: Any) -> bool:
    return isinstance(x, torch.nn.Module)


def _is_optimizer(x: Any) -> bool:
    """A torch optimizer with torch's own ``state_dict``/``load_state_dict`` (which DCP's
    helpers understand). Subclasses that define their own (optimizer containers such as
    torchtitan's, wrappers) are Stateful objects: their own methods are called, as they are."""
    if not isinstance(x, torch.optim.Optimizer):
        return False
    t = type(x)
    return (t.state_dict is torch.optim.Optimizer.state_dict
            and t.load_state_dict is torch.optim.Optimizer.load_state_dict)


def _is_stateful(x: Any) -> bool:
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


# ------------------------------------------------------------------------------ adapters (objects)

def _find_modules(state: Any, out: list) -> list:
    if _is_module(state):
        out.append(state)
    elif isinstance(state, dict):
        for v in state.values():
            _find_modules(v, out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _find_modules(v, out)
    return out


def _model_for(optim: torch.optim.Optimizer, modules: list) -> torch.nn.Module | None:
    want = {id(p) for g in optim.param_groups for p in g["params"]}
    for m in modules:
        have = {id(p) for p in m.parameters()}
        if want <= have:
            return m
    return None


def _module_sd(m: torch.nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(m)


def _optim_sd(o: torch.optim.Optimizer, modules: list, *,
              saving: bool) -> tuple[dict, torch.nn.Module | None]:
    """The optimizer's state dict keyed by parameter FQN (DCP's layout: it reshards), and the
    model holding its parameters (None: torch's own layout, by parameter index).

    Saving never changes the optimizer: DCP's helper creates a missing state by running a
    zero-gradient ``step()`` (it bumps step counters and can move parameters), so a fresh
    optimizer (no state yet) is described without it: its param groups, no state."""
    model = _model_for(o, modules)
    if model is None:
        return o.state_dict(), None
    if saving and not o.state:
        return _fresh_optim_sd(o, model), model
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, o), model


def _param_fqns(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its FQN as DCP names it (wrapper prefixes such as FSDP's or
    torch.compile's removed)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        out.setdefault(id(p), next(iter(fqns)) if len(fqns) == 1 else name)
    return out


def _fresh_optim_sd(o: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """What DCP's helper returns for an optimizer that has no state, without creating any."""
    names = _param_fqns(model)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in o.param_groups]
    return {"state": {}, "param_groups": groups}


def _fresh_optimizer(o: torch.optim.Optimizer, modules: list, skel: Any) -> dict | None:
    """For a freshly built optimizer (no state yet) whose saved groups name exactly the model's
    parameters (DCP's FQNs): ``{id(param): fqn}``. Such an optimizer is loaded straight from the
    checkpoint; DCP's helper would first run a zero-gradient step to create the state
    (allocating and computing over every moment: over a second per GiB of moments on a CPU
    core) only to overwrite it. Plain and DTensor (FSDP2) parameters alike. Else None."""
    if o.state:
        return None
    model = _model_for(o, modules)
    if model is None:
        return None
    names = _param_fqns(model)
    groups = decode_value(_skel_items_dict(skel).get("param_groups", []), lambda f: None)
    saved = [list(g.get("params", [])) for g in groups] if isinstance(groups, list) else None
    mine = [[names.get(id(p)) for p in g["params"]] for g in o.param_groups]
    return names if saved == mine else None


def _fresh_moments(o: torch.optim.Optimizer, names: dict, skel: Any, meta: dict,
                   alloc: Callable) -> dict:
    """The destinations of a fresh optimizer's saved per-parameter state where a parameter is a
    DTensor (FSDP2): DTensors laid out like the parameter (``alloc(fqn, meta, like=param)``), so
    the load reads this rank's shard only and reshards like DCP; the rest (plain parameters,
    scalars such as Adam's ``step``) are allocated as saved. ``{"state": {param fqn: {key:
    tensor}}}``, for ``_checkpoint_driven`` to fill in place."""
    by_fqn = {names[id(p)]: p for g in o.param_groups for p in g["params"] if id(p) in names}
    out: dict[str, dict] = {}
    for pfqn, pskel in skel_items(_skel_items_dict(skel).get("state")) or []:
        p = by_fqn.get(pfqn)
        if p is None or not is_dtensor(p):
            continue
        for k, tskel in skel_items(pskel) or []:
            m = meta.get(tskel.get(TENSOR_TAG)) if isinstance(tskel, dict) else None
            if m is not None and tuple(m["shape"]) == tuple(p.shape) and m["dtype"] == p.dtype:
                out.setdefault(pfqn, {})[k] = alloc(tskel[TENSOR_TAG], m, like=p)
    return {"state": out}


def _skel_items_dict(skel: Any) -> dict:
    items = skel_items(skel)
    return dict(items) if items is not None else {}


def _by_param_index(o: torch.optim.Optimizer, tree: dict, names: dict) -> dict:
    """An FQN-keyed optimizer state dict (DCP's layout, as saved) in ``Optimizer.state_dict``'s
    own layout (parameters numbered in group order)."""
    index = {}
    for g in o.param_groups:
        for p in g["params"]:
            index[names[id(p)]] = len(index)
    state = {index[fqn]: v for fqn, v in tree.get("state", {}).items()}
    groups = [{**g, "params": [index[f] for f in g["params"]]} for g in tree["param_groups"]]
    return {"state": state, "param_groups": groups}


# ----------------------------------------------------------------------------------------- flatten

@dataclass
class Flat:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    skeleton: Any = None
    #: key path -> the key path of the tensor it is tied to (stored once, under the first)
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[tuple, str] = field(default_factory=dict)  # _view_key -> first key path


def flatten(state: Any) -> Flat:
    """Flatten a user's state. Raises UnsupportedStateError before anything is written."""
    if not isinstance(state, dict):
        raise UnsupportedStateError(
            f"state must be a dict (got {type(state).__qualname__}), e.g. "
            "{'model': model, 'optim': optimizer, 'step': step}")
    flat = Flat()
    try:
        modules = _find_modules(state, [])
        flat.skeleton = _flatten(state, (), flat, modules)
    except RecursionError:
        raise UnsupportedStateError(
            f"the state nests deeper than {fmt.MAX_NESTING} levels (too deep to walk); a "
            "checkpoint that deep could not be loaded: flatten it") from None
    deep = fmt.too_deep(flat.skeleton)
    if deep is not None:  # refused here: such a checkpoint could not be loaded back
        where = ".".join(str(k) for k in deep if not str(k).startswith("$"))
        raise UnsupportedStateError(
            f"the state nests deeper than {fmt.MAX_NESTING} levels (at key path "
            f"{where[:200]!r}); a checkpoint that deep could not be loaded (DCP's loader "
            "recurses per level): flatten it")
    clash = fmt.flat_clash(flat.skeleton, UnsupportedStateError)
    if clash is not None:  # refused here: every load of it would fail (DCP's flattening)
        raise UnsupportedStateError(
            f"two values of the state have the flattened name {clash!r} (as {{'a': {{'b': "
            "...}, 'a.b': ...} do): no load could tell them apart; rename one")
    return flat


def _flatten(x: Any, path: tuple, flat: Flat, modules: list) -> Any:
    if isinstance(x, torch.Tensor):
        return _tensor_ref(x, path, flat)
    if _is_module(x):
        return _flatten(_module_sd(x), path, flat, modules)
    if _is_optimizer(x):
        return _flatten(_optim_sd(x, modules, saving=True)[0], path, flat, modules)
    if isinstance(x, dict):
        if all(type(k) is str and not k.startswith("$") for k in x):
            return {k: _flatten(v, path + (k,), flat, modules) for k, v in x.items()}
        return {"$dict": [[encode_value(k, path), _flatten(v, path + (k,), flat, modules)]
                          for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        if isinstance(x, tuple):
            check_exact(x, path)  # (a namedtuple would load back as a tuple)
        seq = [_flatten(v, path + (i,), flat, modules) for i, v in enumerate(x)]
        return seq if isinstance(x, list) else {"$tuple": seq}
    if not isinstance(x, (str, bytes)) and _is_stateful(x):
        return _flatten(x.state_dict(), path, flat, modules)
    return encode_value(x, path)


def _tensor_ref(t: torch.Tensor, path: tuple, flat: Flat) -> dict:
    fqn = _fqn(path)
    if t.layout != torch.strided or t.is_quantized or (not is_dtensor(t) and t.is_meta):
        raise UnsupportedStateError(
            f"cannot store tensor with layout {t.layout}{' (quantized)' if t.is_quantized else ''}"
            f"{' on the meta device' if t.device.type == 'meta' else ''}; only dense strided "
            "tensors are supported", key=fqn)
    if fqn in flat.tensors:
        raise UnsupportedStateError(f"two tensors map to the same key path {fqn!r}; rename one",
                                    key=fqn)
    view = _view_key(t)
    first = flat.views.get(view) if view is not None else None
    if first is not None:  # tied: the same memory under a second key (GPT-2's lm_head/wte)
        flat.aliases[fqn] = first
        return {TENSOR_TAG: first}  # written once; the skeleton points both keys at it
    if view is not None:
        flat.views[view] = fqn
    flat.tensors[fqn] = t
    return {TENSOR_TAG: fqn}


def _view_key(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same memory seen the same way (a tie), for plain tensors and
    DTensors (their local shards) alike; None for a tensor with no elements here: every empty
    tensor's memory is at address 0, so two FSDP2 moments of a parameter whose rows do not
    reach this rank would look tied (before 2026-12-06 they were: this rank's skeleton said
    exp_avg_sq is exp_avg, and a load elsewhere gave it exp_avg's values)."""
    local = t.to_local() if is_dtensor(t) else t
    if local.numel() == 0:
        return None
    return (local.device.type, local.device.index, local.untyped_storage().data_ptr(),
            local.storage_offset(), tuple(local.shape), tuple(local.stride()), local.dtype,
            local.is_conj(), local.is_neg(), tuple(t.shape))


# ---------------------------------------------------------------------------------------- plan load

@dataclass
class LoadPlan:
    """What ``load`` must read (``targets``) and do afterwards (``finish``, in order)."""
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    finish: list[Callable[[], None]] = field(default_factory=list)


def plan_read(skeleton: Any, tensor_meta: dict[str, dict], *,
              alloc: Callable[[str, dict], torch.Tensor]) -> tuple[dict, LoadPlan]:
    """The whole saved state as a new dict (tensors allocated from the checkpoint's metadata,
    plain values as saved) and the plan that fills its tensors."""
    plan = LoadPlan()
    whole = _checkpoint_driven({}, skeleton, (), plan, tensor_meta, alloc)
    if not isinstance(whole, dict):
        raise StateMismatchError(f"the checkpoint holds {_kind(skeleton)}, not a dict")
    return whole, plan


def plan_load(state: dict, skeleton: Any, tensor_meta: dict[str, dict], *, strict: bool = True,
              alloc: Callable[[str, dict], torch.Tensor]) -> LoadPlan:
    """Match the destination ``state`` against the saved ``skeleton``.

    ``tensor_meta`` maps fqn -> {"dtype": torch.dtype, "shape": tuple}; ``alloc(fqn, meta)``
    allocates a tensor for a saved tensor the destination does not hold.
    """
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict (got {type(state).__qualname__})")
    plan = LoadPlan()
    modules = _find_modules(state, [])
    _plan_container(state, skeleton, (), plan, tensor_meta, strict, alloc, modules)
    _apart(plan)
    return plan


def _apart(plan: LoadPlan) -> None:
    """Destinations of two saved tensors that share memory (a tied model, an untied
    checkpoint; overlapping views): the readers fill targets at once, each checksummed from
    its destination, so they would mix the two (and fail the checksum of a sound chunk).
    Each such tensor is read into one of its own and copied in after the reads, in key
    order: the key that sorts last holds the data (a warning names them). Spans are compared
    by extent (conservative: interleaved views take the copies too)."""
    spans: dict = {}  # device -> [(first byte's address, past the last one, key)]
    for fqn, t in plan.targets.items():
        local = t.to_local() if is_dtensor(t) else t
        n = local.numel()
        if n == 0 or local.device.type == "meta":
            continue
        start = local.data_ptr()  # (one address space per device: storages never overlap)
        size = local.element_size()
        end = start + (n * size if local.is_contiguous() else
                       (sum((k - 1) * st for k, st in zip(local.shape, local.stride())) + 1) * size)
        spans.setdefault((local.device.type, local.device.index), []).append((start, end, fqn))
    shared: set = set()
    for lst in spans.values():
        lst.sort()
        reach, first = -1, None
        for start, end, fqn in lst:
            if start < reach:
                shared |= {first, fqn}
            if end > reach:
                reach, first = end, fqn
    if shared:
        log.warning("fastckpt: %s share memory in the state but are separate tensors in the "
                    "checkpoint: each is read on its own and copied in, %r last (it holds the "
                    "data)", sorted(shared), max(shared))
    copies = []
    for fqn in sorted(shared):
        dest = plan.targets[fqn]
        own = torch.empty_like(dest)
        plan.targets[fqn] = own
        copies.append(lambda d=dest, o=own: d.copy_(o))
    plan.finish[:0] = copies  # (before the rest: a tie's copy reads a destination)


def _plan_container(dest: Any, skel: Any, path: tuple, plan: LoadPlan, meta: dict, strict: bool,
                    alloc: Callable, modules: list, module: bool = False) -> None:
    """Load into a mutable container (dict or list) in place; its keys decide what is loaded.

    ``strict`` (the default): a key only the state has ("missing from the checkpoint") or only
    the checkpoint has ("not in the state") is an error naming it; not strict: such keys are
    left out. A key is never added to the caller's dict (``fastckpt.read`` returns a whole
    checkpoint). Sub-states of optimizers and Stateful objects are the checkpoint's (see
    ``_checkpoint_driven``).
    """
    if isinstance(dest, dict):
        items = skel_items(skel)
        if items is None:
            raise StateMismatchError(f"checkpoint holds {_kind(skel)} where the state holds a dict",
                                     key=_path_str(path))
        saved = dict(items)
        for k in dest:
            if k not in saved:
                if strict:
                    raise StateMismatchError(
                        "missing from the checkpoint (load with strict=False to leave it as "
                        "it is)", key=_fqn(path + (k,)))
                continue
        for k, child in items:
            if k not in dest:
                if strict:
                    where = "the module" if module else "the state"
                    raise StateMismatchError(
                        f"in the checkpoint but not in {where} (load with strict=False to "
                        "leave it out, or fastckpt.read() for the whole checkpoint)",
                        key=_fqn(path + (k,)))
                continue
            _plan_slot(dest, k, child, path + (k,), plan, meta, strict, alloc, modules)
        return
    if isinstance(dest, list):
        seq = skel_seq(skel)
        if seq is None or len(seq) != len(dest):
            raise StateMismatchError(
                f"checkpoint holds {_kind(skel)} where the state holds a list of {len(dest)}",
                key=_path_str(path))
        for i, child in enumerate(seq):
            _plan_slot(dest, i, child, path + (i,), plan, meta, strict, alloc, modules)
        return
    raise StateMismatchError(f"cannot load into a {type(dest).__qualname__}", key=_path_str(path))


def _kind(skel: Any) -> str:
    if isinstance(skel, dict) and TENSOR_TAG in skel:
        return "a tensor"
    if skel_seq(skel) is not None:
        return f"a sequence of {len(skel_seq(skel))}"
    if skel_items(skel) is not None:
        return "a dict"
    return f"the value {decode_value(skel)!r}"


def _plan_slot(container: Any, k: Any, skel: Any, path: tuple, plan: LoadPlan, meta: dict,
               strict: bool, alloc: Callable, modules: list) -> None:
    dest = container[k]
    if isinstance(dest, torch.Tensor):
        _plan_tensor(dest, skel, path, plan, meta)
        return
    if _is_module(dest):
        sd = _module_sd(dest)
        _plan_container(sd, skel, path, plan, meta, strict, alloc, modules, module=True)

        def load_module(m=dest, sd=sd):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(m, sd)
        _then(plan, path, load_module)
        return
    if _is_optimizer(dest):
        fast = _fresh_optimizer(dest, modules, skel)
        if fast is not None:  # nothing to initialise: the checkpoint says what there is
            tree = _checkpoint_driven(_fresh_moments(dest, fast, skel, meta, alloc), skel, path,
                                      plan, meta, alloc)
            _then(plan, path, lambda o=dest, tree=tree, names=fast:
                  o.load_state_dict(_by_param_index(o, tree, names)))
            return
        sd, model = _optim_sd(dest, modules, saving=False)
        tree = _checkpoint_driven(sd, skel, path, plan, meta, alloc)

        def load_optim(o=dest, model=model, tree=tree):
            if model is None:
                o.load_state_dict(tree)
            else:
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     set_optimizer_state_dict)
                set_optimizer_state_dict(model, o, tree, options=StateDictOptions(strict=strict))
        _then(plan, path, load_optim)
        return
    if isinstance(dest, (dict, list)):
        _plan_container(dest, skel, path, plan, meta, strict, alloc, modules)
        return
    if isinstance(dest, tuple):
        _assign_later(plan, container, k, skel, path, meta, alloc)
        return
    if not isinstance(dest, (str, bytes)) and _is_stateful(dest):
        tree = _checkpoint_driven(dest.state_dict(), skel, path, plan, meta, alloc)
        _then(plan, path, lambda o=dest, tree=tree: o.load_state_dict(tree))
        return
    # a plain value: replaced by the saved one
    _assign_later(plan, container, k, skel, path, meta, alloc)


def _then(plan: LoadPlan, path: tuple, fn: Callable) -> None:
    """``fn`` (a sub-state's ``load_state_dict``) after the reads, named by its key for the
    error of a failure (load.apply_loaded)."""
    fn.key = _fqn(path)  # type: ignore[attr-defined]
    plan.finish.append(fn)


def _plan_tensor(dest: torch.Tensor, skel: Any, path: tuple, plan: LoadPlan, meta: dict) -> None:
    fqn = _fqn(path)
    if not (isinstance(skel, dict) and TENSOR_TAG in skel):
        raise StateMismatchError(f"checkpoint holds {_kind(skel)} where the state holds a tensor",
                                 key=fqn)
    saved_fqn = skel[TENSOR_TAG]
    m = meta.get(saved_fqn)
    if m is None:
        raise StateMismatchError("tensor referenced by the manifest has no data entry", key=fqn)
    if tuple(dest.shape) != tuple(m["shape"]):
        raise StateMismatchError(
            f"shape mismatch: checkpoint has {list(m['shape'])}, state has {list(dest.shape)}",
            key=fqn)
    if dest.dtype != m["dtype"]:
        raise StateMismatchError(
            f"dtype mismatch: checkpoint has {m['dtype']}, state has {dest.dtype}", key=fqn)
    _target(plan, saved_fqn, dest)


def _target(plan: LoadPlan, saved_fqn: str, dest: torch.Tensor) -> None:
    """Read ``saved_fqn`` into ``dest``. A tensor saved once for two tied keys: a destination
    that is tied too (the same memory) is read once; an untied second one gets a copy of the
    first after the read. A destination on the meta device has no memory to load into
    (before 2026-12-06 such a load reported success and loaded nothing), nor does one that
    repeats its memory (stride 0: the reader's copy raised a RuntimeError); a DTensor whose local
    rows are not one box (``chunks.held_box``) would be read by torch's box of it, so it is
    refused as a save of it is."""
    if dest.device.type == "meta":
        raise StateMismatchError("the destination is on the meta device, with no memory to load "
                                 "into: materialise the model first (to_empty())", key=saved_fqn)
    local = dest.to_local() if is_dtensor(dest) else dest
    if local.numel() and any(st == 0 and n > 1 for n, st in zip(local.shape, local.stride())):
        raise StateMismatchError(
            "the destination repeats its memory along a dimension (an expand()ed tensor: "
            "several elements are one), so no load can fill it: load into a tensor of its own "
            "(clone() it)", key=saved_fqn)
    if is_dtensor(dest):
        from .chunks import held_box, strided
        if strided(dest) and held_box(dest) is None:
            raise UnsupportedStateError(
                f"DTensor placements {dest.placements} give this rank a local tensor that is "
                "not a single box of the global tensor; not supported yet", key=saved_fqn)
    first = plan.targets.get(saved_fqn)
    if first is None:
        plan.targets[saved_fqn] = dest
    elif _view_key(first) != _view_key(dest):
        plan.finish.append(lambda d=dest, f=first: d.copy_(f))


def _checkpoint_driven(dest_sd: Any, skel: Any, path: tuple, plan: LoadPlan, meta: dict,
                       alloc: Callable) -> Any:
    """Rebuild the saved sub-state, reusing destination tensors at the same key path in place.

    Used for optimizers and Stateful objects whose ``state_dict()`` may not have the entries yet
    (a freshly built Adam has no moments): the checkpoint decides what there is.
    """
    dest_tensors: dict[str, torch.Tensor] = {}
    _collect_tensors(dest_sd, path, dest_tensors)

    def tensor_for(fqn: str) -> torch.Tensor:
        m = meta.get(fqn)
        if m is None:
            raise StateMismatchError("tensor referenced by the manifest has no data entry", key=fqn)
        d = dest_tensors.get(fqn)
        if d is not None and tuple(d.shape) == tuple(m["shape"]) and d.dtype == m["dtype"]:
            _target(plan, fqn, d)
            return d
        if fqn in plan.targets:  # tied to a tensor this load already fills: share it
            return plan.targets[fqn]
        t = alloc(fqn, m)
        plan.targets[fqn] = t
        return t
    return decode_value(skel, tensor_for)


def _collect_tensors(x: Any, path: tuple, out: dict) -> None:
    if isinstance(x, torch.Tensor):
        out[_fqn(path)] = x
    elif isinstance(x, dict):
        for k, v in x.items():
            _collect_tensors(v, path + (k,), out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _collect_tensors(v, path + (i,), out)


def _assign_later(plan: LoadPlan, container: Any, k: Any, skel: Any, path: tuple, meta: dict,
                  alloc: Callable) -> None:
    value = _checkpoint_driven({}, skel, path, plan, meta, alloc)

    def assign(c=container, k=k, v=value):
        c[k] = v
    plan.finish.append(assign)
