"""Tensors derived from a model's weights, computed once and again only when those weights change.

Why: an eval BatchNorm folded into the conv before it (`codegen/conv.py`) is a few small kernels on the weights.
Run on every call they cost more than the fused conv saves: ResNet-50 handed back 6.76 ms against 6.11 ms
without the conv epilogue on the H100 (758 kernels per call against 120, docs/EXPERIMENTS.md: conv_bn_paths). Cached without
a check, they would go stale when the user loads new weights, fine-tunes or updates BatchNorm statistics.

So `derived(fn, *sources)` keeps `fn(*sources)` per set of source tensors (by identity) with what says whether a
source changed, checked on every read: a change recomputes the values *into the same tensors*. What it checks:
- the sources' version counters, which in-place writes through autograd's view bump (`load_state_dict`, a
  non-fused optimizer step, `with torch.no_grad(): w.mul_(2)`);
- their data pointers (`.data = ...`, `model.to(...)`, `.half()`, `load_state_dict(..., assign=True)` hands new
  tensors, hence new entries);
- reads of a source's `.data` (`w.data.mul_(1.5)`): the tensor `.data` hands out has a version counter of its own,
  so a write through it bumps none of the source's. `torch.Tensor.data` is wrapped (`_WatchedData`, installed with
  the first entry: a few hundred nanoseconds more per `.data` read of any tensor), so that such a read of a source
  makes every value stale (a read counts as a write: recomputed once), and one still held is watched by its own
  version for later writes;
- optimizer steps: a fused optimizer (`fused=True`) writes its parameters without bumping their versions, so every
  step (`register_optimizer_step_post_hook`) makes every value stale (`stale_all`);
- a BatchNorm's running statistics updated by its train-mode forward (the native kernel writes them directly):
  every train-mode call of a patched module makes every value stale (`patching/forward.py`).
Writes none of these see: an optimizer's update run outside `Optimizer.step`, a kernel of one's own writing
in place outside autograd. A CUDA graph that read them stays valid:
`Graphed` notes the derived tensors a recording read (`reading`) and refreshes them before each replay (a replay
runs no Python, so the graph alone would never see a change).
A source without a version counter (an inference tensor) cannot be watched: then nothing is cached and `fn`
runs on every call, as without this module (correct, slower).
"""
from __future__ import annotations

import inspect
import threading
import weakref
from typing import Callable

import torch

_STATE = threading.local()
_CACHE: dict[tuple, "Derived"] = {}
# Threads calling one model read one entry: its values are refreshed in place, so a read while another thread
# writes them would see half of the new weights
_LOCK = threading.RLock()
MAX_ENTRIES = 4096  # a model's worth of convs many times over; beyond it the oldest go (recomputed if used)


_EPOCH = [0]  # bumped by `stale_all`: entries computed in an earlier epoch are recomputed when next read


def stale_all() -> None:
    """Every derived value is recomputed when next read: a call that may update sources without bumping their
    versions ran (a train-mode forward: BatchNorm's running statistics)."""
    _EPOCH[0] += 1


def _versions(sources) -> tuple | None:
    """The sources' version counters and data pointers, or None when one has no version (an inference tensor)."""
    try:
        return tuple((s._version, s.data_ptr()) if isinstance(s, torch.Tensor) else None for s in sources)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


_WATCHED: set[int] = set()  # ids of the live source tensors: reads of their `.data` make every value stale
_HELD: dict[int, list] = {}  # id -> [weak reference, version seen] of each `.data` of a source still held


def _watch(source: torch.Tensor) -> None:
    """Reads of `source.data` make every value stale from now on, for as long as `source` lives (`_WatchedData`)."""
    if id(source) not in _WATCHED:
        _WATCHED.add(id(source))
        weakref.finalize(source, _WATCHED.discard, id(source)).atexit = False
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOKED.append(True)
        torch.Tensor.data = _WatchedData(inspect.getattr_static(torch.Tensor, "data"))
        _HOOKED.append(register_optimizer_step_post_hook(lambda *_: stale_all()))


_HOOKED: list = []  # set once the `.data` and optimizer-step watches are installed


class _WatchedData:
    """`torch.Tensor.data` as it was, except that a read of a source's makes every value stale: the tensor handed
    out shares the source's memory, not its version counter, so `w.data.mul_(1.5)` bumps no version `derived`
    reads. One still held is watched for later writes by its own version (`_check_held`)."""

    def __init__(self, base):
        self.base = base
        self.__doc__ = getattr(base, "__doc__", None)

    def __get__(self, obj, cls=None):
        out = self.base.__get__(obj, cls)
        if obj is not None and id(obj) in _WATCHED:
            stale_all()
            key = id(out)
            _HELD[key] = [weakref.ref(out, lambda _ref: _HELD.pop(key, None)), out._version]
        return out

    def __set__(self, obj, value) -> None:
        self.base.__set__(obj, value)


def _check_held() -> None:
    """A `.data` of a source still held and written since it was last looked at makes every value stale."""
    for held in list(_HELD.values()):
        t = held[0]()
        if t is not None and t._version != held[1]:
            held[1] = t._version
            stale_all()


class Derived:
    """`fn(*sources)` and the source versions it was computed at."""

    def __init__(self, key: tuple, fn: Callable, sources: tuple):
        self.key, self.fn = key, fn
        me = weakref.ref(self)

        def gone(_ref) -> None:  # a source freed (validation's inputs, replaced weights): its values go too
            entry = me()
            if entry is not None and _CACHE.get(entry.key) is entry:
                del _CACHE[entry.key]

        self.refs = tuple(weakref.ref(s, gone) if isinstance(s, torch.Tensor) else None for s in sources)
        for s in sources:
            if isinstance(s, torch.Tensor):
                _watch(s)
        self.versions, self.epoch = _versions(sources), _EPOCH[0]
        self.values = self._compute(sources)

    def _compute(self, sources) -> tuple:
        # Plain tensors outside autograd and inference mode: refreshed in place from any mode later.
        with torch.inference_mode(False), torch.no_grad():
            return tuple(v.detach() for v in self.fn(*sources))

    def sources(self) -> tuple | None:
        """The source tensors, or None once one was freed."""
        out = tuple(r() if r is not None else None for r in self.refs)
        return None if any(r is not None and s is None for r, s in zip(self.refs, out)) else out

    def refresh(self, sources: tuple | None = None, now: tuple | None = None) -> None:
        """Recompute into the same tensors if a source changed since (what a replay must do before it runs).
        `sources`, `now`: the sources and their versions, when the caller has just read them (`derived`)."""
        if sources is None:
            sources = self.sources()
            if _HELD:  # (`derived` has looked already)
                _check_held()
        if sources is None:
            return
        if self.epoch == _EPOCH[0] and (_versions(sources) if now is None else now) == self.versions:
            return
        with _LOCK, torch.inference_mode(False), torch.no_grad():
            for old, new in zip(self.values, self.fn(*sources)):
                old.copy_(new)
            self.versions, self.epoch = _versions(sources), _EPOCH[0]  # the copies above do not touch the sources


def derived(fn: Callable, *sources) -> tuple:
    """`fn(*sources)` (a tuple of tensors), cached per source tensors while none of them changed."""
    versions = _versions(sources)
    if versions is None:
        return tuple(fn(*sources))
    if _HELD:
        _check_held()
    key = (fn, tuple(id(s) if isinstance(s, torch.Tensor) else s for s in sources))
    with _LOCK:
        entry = _entry(key, fn, sources, versions)
    readers = getattr(_STATE, "readers", None)
    if readers:
        readers[-1].append(entry)
    return entry.values


def _entry(key: tuple, fn: Callable, sources: tuple, versions: tuple) -> "Derived":
    entry = _CACHE.get(key)
    held = entry.sources() if entry is not None else None
    if held is None or any(a is not b for a, b in zip(held, sources) if isinstance(b, torch.Tensor)):
        # new, or its id reused by another tensor since
        entry = _CACHE[key] = Derived(key, fn, sources)
        if len(_CACHE) > MAX_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
    elif not _frozen():
        entry.refresh(held, versions)
    return entry


def _frozen() -> bool:
    """Inside a CUDA-graph recording (or its CPU stand-in in tests) no kernel may run to refresh: `Graphed`
    refreshes before the recording's replays instead."""
    return getattr(_STATE, "frozen", False) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class reading:
    """`with reading() as used:` collects the derived entries read inside the block (a recording's)."""

    def __enter__(self) -> list:
        stack = getattr(_STATE, "readers", None)
        if stack is None:
            stack = _STATE.readers = []
        stack.append([])
        return stack[-1]

    def __exit__(self, *exc) -> None:
        _STATE.readers.pop()


class frozen:
    """Reads inside the block return the cached values without checking them (a graph replay's view)."""

    def __enter__(self):
        self.before = getattr(_STATE, "frozen", False)
        _STATE.frozen = True

    def __exit__(self, *exc) -> None:
        _STATE.frozen = self.before
