"""NVTX ranges, for the advisor's own phases and for making a workload's NVTX ranges visible in a profile.

`nvtx_range(name)` opens an NVTX range with whatever is available: the `nvtx` package if importable,
else `torch.cuda.nvtx` when CUDA is available, else nothing (the GPU machine has no `nvtx` package,
a CPU build of torch has no NVTX at all).

`ranges_as_regions()` is used by the collector while a workload is profiled: it wraps
`torch.cuda.nvtx.range_push/range_pop/range/range_start/range_end` and the `nvtx` package's
`annotate/push_range/pop_range/start_range/end_range` so that each NVTX range also opens a
record_function named `advisor.region::NAME`. The Kineto trace then shows NVTX ranges as
`user_annotation` events, which `--region NAME` can select. The original functions are always called
(so Nsight still sees the ranges, and errors they raise still propagate); `nvtx_range` and
`advisor.region` use the originals, never the wrappers, so nothing is recorded twice.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, List, Optional

REGION_PREFIX = "advisor.region::"

try:  # the `nvtx` package (absent on the GPU machine)
    import nvtx as _nvtx_pkg  # type: ignore
except Exception:  # pragma: no cover - depends on the environment
    _nvtx_pkg = None

# The unwrapped functions, captured at import (before any wrapping can happen).
_ORIG: Dict[str, Any] = {}
if _nvtx_pkg is not None:
    for _n in ("annotate", "push_range", "pop_range", "start_range", "end_range"):
        if hasattr(_nvtx_pkg, _n):
            _ORIG["nvtx." + _n] = getattr(_nvtx_pkg, _n)
try:
    import torch.cuda.nvtx as _torch_nvtx

    for _n in ("range_push", "range_pop", "range", "range_start", "range_end"):
        if hasattr(_torch_nvtx, _n):
            _ORIG["torch." + _n] = getattr(_torch_nvtx, _n)
except Exception:  # pragma: no cover
    _torch_nvtx = None


def _torch_cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def backend() -> str:
    """Which NVTX implementation `nvtx_range` uses: 'nvtx', 'torch' or 'none'."""
    if "nvtx.annotate" in _ORIG:
        return "nvtx"
    if "torch.range_push" in _ORIG and _torch_cuda_available():
        return "torch"
    return "none"


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range around a block; a no-op when no NVTX implementation is usable."""
    kind = backend()
    if kind == "nvtx":
        with _ORIG["nvtx.annotate"](name, domain="fusion-advisor"):
            yield
        return
    if kind == "torch":
        pushed = False
        try:
            _ORIG["torch.range_push"](name)
            pushed = True
        except Exception:  # NVTX unusable after all: run the block without a range
            pass
        try:
            yield
        finally:
            if pushed:
                try:
                    _ORIG["torch.range_pop"]()
                except Exception:  # pragma: no cover
                    pass
        return
    yield


# --------------------------------------------------------------------------------------------
# NVTX ranges -> record_function while profiling
# --------------------------------------------------------------------------------------------
_active = False
_tls = threading.local()


def _stack() -> List[Any]:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def _rf_enter(message: Any) -> Optional[Any]:
    if not _active or message is None:
        return None
    name = str(message)
    if not name:
        return None
    import torch

    return torch.ops.profiler._record_function_enter_new(REGION_PREFIX + name, None)


def _rf_exit(handle: Optional[Any]) -> None:
    if handle is None:
        return
    import torch

    try:
        with torch._C.DisableTorchFunctionSubclass():
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
    except Exception:  # pragma: no cover - never let bookkeeping break the workload
        pass


def _message_of(args, kwargs, key="message") -> Any:
    if args:
        return args[0]
    return kwargs.get(key)


def _wrap_push(orig: Callable, key: str) -> Callable:
    @functools.wraps(orig)
    def push(*args, **kwargs):
        result = orig(*args, **kwargs)  # raises exactly as the original would
        _stack().append(_rf_enter(_message_of(args, kwargs, key)))
        return result

    return push


def _wrap_pop(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def pop(*args, **kwargs):
        result = orig(*args, **kwargs)
        s = _stack()
        if s:
            _rf_exit(s.pop())
        return result

    return pop


_process_ranges: Dict[Any, Any] = {}


def _wrap_start(orig: Callable, key: str) -> Callable:
    @functools.wraps(orig)
    def start(*args, **kwargs):
        rid = orig(*args, **kwargs)
        handle = _rf_enter(_message_of(args, kwargs, key))
        if handle is not None:
            try:
                _process_ranges[rid] = handle
            except TypeError:  # unhashable id: cannot pair it with its end
                _rf_exit(handle)
        return rid

    return start


def _wrap_end(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def end(rid, *args, **kwargs):
        result = orig(rid, *args, **kwargs)
        try:
            _rf_exit(_process_ranges.pop(rid, None))
        except TypeError:
            pass
        return result

    return end


def _torch_range(msg, *args, **kwargs):
    """Replacement for torch.cuda.nvtx.range that goes through the (wrapped) push/pop."""
    import torch.cuda.nvtx as tn

    @contextlib.contextmanager
    def cm():
        tn.range_push(msg.format(*args, **kwargs))
        try:
            yield
        finally:
            tn.range_pop()

    return cm()


def _make_annotate(orig_cls):
    class annotate(orig_cls):  # type: ignore[misc, valid-type]
        __doc__ = orig_cls.__doc__

        def __init__(self, message=None, *args, **kwargs):
            super().__init__(message, *args, **kwargs)
            self._advisor_message = message
            self._advisor_handles: List[Any] = []

        def __enter__(self):
            result = super().__enter__()
            self._advisor_handles.append(_rf_enter(self._advisor_message))
            return result

        def __exit__(self, *exc):
            if self._advisor_handles:
                _rf_exit(self._advisor_handles.pop())
            return super().__exit__(*exc)

        def __call__(self, func):
            inner = super().__call__(func)
            message = self._advisor_message if self._advisor_message is not None else getattr(func, "__name__", None)

            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                handle = _rf_enter(message)
                try:
                    return inner(*args, **kwargs)
                finally:
                    _rf_exit(handle)

            return wrapper

    annotate.__name__ = annotate.__qualname__ = "annotate"
    annotate.__module__ = getattr(orig_cls, "__module__", "nvtx")
    return annotate


@contextlib.contextmanager
def ranges_as_regions():
    """While active, every NVTX range opened by the workload is also a record_function `advisor.region::NAME`."""
    global _active
    patched: List[tuple] = []  # (module, attribute, original)

    def patch(module, attr, new):
        patched.append((module, attr, getattr(module, attr)))
        setattr(module, attr, new)

    try:
        if _torch_nvtx is not None:
            if "torch.range_push" in _ORIG:
                patch(_torch_nvtx, "range_push", _wrap_push(_ORIG["torch.range_push"], "msg"))
            if "torch.range_pop" in _ORIG:
                patch(_torch_nvtx, "range_pop", _wrap_pop(_ORIG["torch.range_pop"]))
            if "torch.range" in _ORIG:
                patch(_torch_nvtx, "range", _torch_range)
            if "torch.range_start" in _ORIG:
                patch(_torch_nvtx, "range_start", _wrap_start(_ORIG["torch.range_start"], "msg"))
            if "torch.range_end" in _ORIG:
                patch(_torch_nvtx, "range_end", _wrap_end(_ORIG["torch.range_end"]))
        if _nvtx_pkg is not None:
            import sys

            mods = [_nvtx_pkg]
            inner = sys.modules.get("nvtx.nvtx")
            if inner is not None and inner is not _nvtx_pkg:
                mods.append(inner)
            for m in mods:
                if "nvtx.annotate" in _ORIG and isinstance(_ORIG["nvtx.annotate"], type):
                    patch(m, "annotate", _make_annotate(_ORIG["nvtx.annotate"]))
                if "nvtx.push_range" in _ORIG:
                    patch(m, "push_range", _wrap_push(_ORIG["nvtx.push_range"], "message"))
                if "nvtx.pop_range" in _ORIG:
                    patch(m, "pop_range", _wrap_pop(_ORIG["nvtx.pop_range"]))
                if "nvtx.start_range" in _ORIG:
                    patch(m, "start_range", _wrap_start(_ORIG["nvtx.start_range"], "message"))
                if "nvtx.end_range" in _ORIG:
                    patch(m, "end_range", _wrap_end(_ORIG["nvtx.end_range"]))
        _active = True
        yield
    finally:
        _active = False
        # Close whatever the workload left open so the profile's events stay balanced.
        s = _stack()
        while s:
            _rf_exit(s.pop())
        while _process_ranges:
            _rf_exit(_process_ranges.popitem()[1])
        for module, attr, orig in reversed(patched):
            setattr(module, attr, orig)
