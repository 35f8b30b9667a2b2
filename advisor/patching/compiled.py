"""Functions of ours that dynamo compiles, and what they need around them: each with a code object of its own whose
compiled state goes with its holder (`compile_fresh`), dynamo's recompile-limit warnings taken as our notes
(`dynamo_limits_noted`), and inference tensors handed to them as normal tensors (`_as_normal_inputs`). Shared by the
patched forward's captures (`forward`) and its any-shape compile (`any_shape`)."""
from __future__ import annotations

import contextlib
import logging
import threading
import types
import weakref
from typing import Callable

import torch


def compile_fresh(fn: Callable, backend: Callable | str, holder: object, graphs: int | None = None,
                  dynamic: bool = False) -> Callable:
    """`torch.compile` of a copy of `fn` with a code object of its own (`_fresh`), whose compiled state
    goes when `holder` does (the capture's users: a model deleted, or unpatched and dropped). Dynamo keeps
    its graphs alive through the code object's cache (and the globals its bytecode installs), and every
    backend ever compiled with in a module-level table (for `torch._dynamo.reset`): both would otherwise
    keep a dead model's captured graphs, and their CUDA-graph recordings' memory, for the process's life."""
    fresh = _fresh(fn)
    compiled = torch.compile(fresh, backend=backend, dynamic=dynamic)
    compiled._fusion_advisor_fresh = fresh  # whose code object holds dynamo's cache (`_guards_accept` reads it)
    compiled._fusion_advisor_graphs = graphs  # the graphs it may hold (`forward._full`)
    release = weakref.finalize(holder, _release_compiled, getattr(fresh, "__code__", None), backend)
    release.atexit = False  # the process is ending: nothing to hand back, and dynamo may be half torn down
    return compiled


def cached_graphs(compiled: Callable) -> int | None:
    """How many graphs dynamo holds for a `compile_fresh` function (its code object's cache entries); None where
    dynamo's internals moved (or it is not one of ours)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(compiled._fusion_advisor_fresh.__code__))
    except Exception:  # noqa: BLE001
        return None


def _release_compiled(code, backend: Callable | str) -> None:
    try:
        from torch._dynamo import eval_frame, reset_code

        if code is not None:
            reset_code(code)  # its cache entries, hence the compiled graphs their bytecode calls
        for k, wrapper in list(eval_frame.cached_backends.items()):
            if getattr(wrapper, "compiler_fn", wrapper) is backend:
                eval_frame.cached_backends.pop(k, None)
    except Exception:  # dynamo's internals moved: the memory stays, as it would have without this
        pass


def _fresh(fn: Callable) -> Callable:
    """The same function with its own code object. Dynamo keeps its compiled-code cache on the code
    object and stops compiling after `recompile_limit` (8) entries; every plan (set of pattern keys)
    is a new backend, hence a new entry, so plans would otherwise share, and exhaust, one cache.
    A function of torch's own files (`nn.Linear.forward`: a patched LM head) dynamo compiles only from a
    wrapper frame, and it wraps them all in one `inner` whose code, and cache, they then share: the
    ninth such capture in a process ran uncaptured. Those get a wrapper of ours, with its own code.
    The functions a decorator's wrapper holds in its closure (the forward it wraps) get their own too: where
    dynamo breaks the graph inside, it compiles them as frames of their own, and a decorator's code is shared
    by every function it wraps (HF's `deprecate_kwarg` wrapper around every decoder layer's forward: ten
    models optimized with `output_hidden_states` in one process exhausted its cache at the third)."""
    return _fresh_function(fn, depth=3)


def _fresh_function(fn: Callable, depth: int) -> Callable:
    if not isinstance(fn, types.FunctionType):
        return fn
    if _wrapped_by_dynamo(fn):
        def call(*args, **kwargs):
            return fn(*args, **kwargs)

        call.__code__ = call.__code__.replace(co_name=fn.__name__)  # a code object of its own
        call.__name__, call.__qualname__ = fn.__name__, fn.__qualname__
        return call
    closure = fn.__closure__
    if closure and depth > 1 and any(isinstance(_cell_value(c), types.FunctionType) for c in closure):
        closure = tuple(types.CellType(_fresh_function(v, depth - 1)) if isinstance(v := _cell_value(c), types.FunctionType)
                        else c for c in closure)
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, closure)
    g.__kwdefaults__ = fn.__kwdefaults__
    g.__dict__.update(fn.__dict__)
    g.__qualname__ = fn.__qualname__
    return g


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name the closure binds later)
        return None


def _wrapped_by_dynamo(fn: Callable) -> bool:
    """Whether `torch.compile(fn)` would run `fn` through dynamo's shared wrapper (its skip rules)."""
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(fn))
    except Exception:  # internals moved: a wrapper of ours is right either way
        return True


_NOTED = threading.local()
_NOTES_INSTALLED = False
_LIMIT_MESSAGE = "torch._dynamo hit config."


class _DynamoLimitNotes(logging.Filter):
    """Takes dynamo's recompile-limit warning (a frame compiled `recompile_limit` times: dynamo runs it eagerly
    from then on) when it comes from a frame of one of our captures, where it is ours to account for: noted as
    a fallback reason of the patched forward (`dynamo_limits_noted`), not printed on the user's terminal.
    Outside our captures (the user's own `torch.compile`) the warning passes as dynamo logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        notes = getattr(_NOTED, "notes", None)
        if notes is None or not str(record.msg).startswith(_LIMIT_MESSAGE):
            return True
        try:
            limit, value, where = record.args[0], record.args[1], record.args[2]
            notes.append(f"dynamo's {limit} ({value}) reached by {where} inside the capture: dynamo runs that "
                         "frame without compiling it from then on (its ops unfused)")
        except Exception:  # noqa: BLE001  (the message's arguments moved)
            notes.append("dynamo's recompile limit reached inside the capture: a frame runs without compiling")
        return False


@contextlib.contextmanager
def dynamo_limits_noted():
    """Yields a list: the recompile-limit warnings dynamo gave inside the block, in words (see `_DynamoLimitNotes`)."""
    global _NOTES_INSTALLED
    if not _NOTES_INSTALLED:
        logging.getLogger("torch._dynamo.convert_frame").addFilter(_DynamoLimitNotes())
        _NOTES_INSTALLED = True
    outer, notes = getattr(_NOTED, "notes", None), []
    _NOTED.notes = notes
    try:
        yield notes
    finally:
        _NOTED.notes = outer  # (a capture inside another's call, an outer capture's layer, notes its own)


def _as_normal_inputs(x):
    """`x` with each inference tensor in it, through plain tuples, lists and dicts, as `_as_normal_tensor`
    (walked by hand: pytree's walk cost 25 µs of a decoder layer's call here, this one 3). Tensors inside
    other objects (a KV cache) stay as they are: dynamo's guards see them and capture afresh where they differ."""
    if isinstance(x, torch.Tensor):
        return _as_normal_tensor(x)
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(_as_normal_inputs(v) for v in x)
    if kind is dict:
        return {k: _as_normal_inputs(v) for k, v in x.items()}
    return x


def _as_normal_tensor(t: torch.Tensor) -> torch.Tensor:
    """An inference tensor's memory as a normal tensor (outside inference mode): same storage, offset, sizes
    and strides. Left as they are: normal tensors, subclasses and layouts or bits a bare storage view
    would lose (sparse, conjugate, negative); dynamo's guards then decide whether the capture serves them."""
    if (not t.is_inference() or type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_conj()
            or t.is_neg()):
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                               t.stride())
