"""Replay a rewritten inference graph as CUDA graphs: one launch per layer call instead of one per op.

Why: a captured layer runs its aten ops and Triton launchers one at a time from Python. On the H100's
host that cost 1.3 ms per GPT-2 layer call, more than the 0.9 ms the GPU needs for the layer, so the
GPU idled and the kernels' savings never reached the wall clock (docs/EXPERIMENTS.md, host_overhead:
GELU fused, device busy 19.0 -> 14.6 ms, call 25.8 -> 25.3 ms). A CUDA graph replays them all at once.

The contract of a CUDA graph is fixed addresses, so:
- parameters, and the buffers and tensor attributes of modules (dynamo marks them static addresses), are
  read in place: a graph is recorded per set of their addresses (twelve layers that share one captured
  function get twelve graphs);
- a 0-dim CPU tensor (HF layers pass some) is part of the recording's key by its value, and is copied
  into a pinned buffer (a graph may copy it to the GPU: see `_host_scalar`);
- every other tensor input is copied into a static buffer with the input's storage size, offset and
  strides (the graph may read through `as_strided` views relative to the storage), before each replay;
- every output is copied out after the replay: nothing handed to the caller is overwritten later;
- which patterns run their launchers (`only`) is decided at recording, so it is part of the key;
- tensors derived from weights (`derived`: a BatchNorm folded into a conv) are read where they live and
  recomputed in place before a replay when the weights they come from changed.
All graphs share one memory pool: they run one at a time on one stream and their static outputs stay
alive, so the scratch one frees at the end of its recording is safe for the next to reuse. Every buffer a
graph reads is ours for as long as it lives, whoever else records graphs or empties caches in the process
(`graph_pools`: cuBLAS's workspace is the one PyTorch would otherwise lend us from a shared table).
Not replayed (the plain function runs): when copying the inputs in and the outputs out would cost the
GPU more than the graph saves the host (a few large memory-bound kernels: the seed's one fused kernel
on 1 GB ran 2.35x faster than eager op by op and no faster replayed), inputs off the GPU, autograd, a
storage far larger than the view the graph reads, `FUSION_ADVISOR_CUDA_GRAPHS=0` or `replay_off()`,
and a function whose recording failed (said once).
"""
from __future__ import annotations

import threading
import traceback
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from advisor import config
from advisor.kernels import derived
from advisor.patching import graph_pools, rewrite, timing, triton_setup

MAX_GRAPHS = 64  # per captured function: layers x `only` states seen while timing patterns
MAX_STORAGE_RATIO = 4  # copy a view's whole storage only when it is at most this much larger
HOST_S_PER_OP = 5e-6  # host time an op costs when run from Python (dispatch + launch), a low estimate
COPY_BYTES_PER_S = 2.5e12  # device-to-device copy: read + write, about an H100's measured copy rate
_STATE = threading.local()
_LIVE: "weakref.WeakSet[Graphed]" = weakref.WeakSet()


def replay_enabled() -> bool:
    on = getattr(_STATE, "on", None)
    return config.current().cuda_graphs if on is None else on


def replay_off():
    """Inside this block captured functions run op by op (the comparison for the graphs' benefit)."""
    return rewrite.thread_flag(_STATE, "on", False)


@dataclass
class Recording:
    """One recorded graph: the static inputs it reads and the outputs it writes."""

    replay: Callable[[], None]
    inputs: list  # per argument: a static buffer to copy into, or None (read in place / not a tensor)
    outputs: list
    derived: list = field(default_factory=list)  # `derived.Derived` entries it reads: refreshed before a replay
    reads: frozenset = frozenset()  # addresses of the tensors it reads in place (parameters, buffers)
    sites: tuple = ()  # the fused sites whose kernels it launches (credited on each replay: `rewrite.credit`)


def clear_recordings() -> None:
    """Drop every recorded graph (and its buffers); the next call of each function records again.
    After timing patterns one by one, and on unpatch: recordings of states no longer used hold memory."""
    for g in list(_LIVE):
        g.recordings.clear()


def drop_recordings_reading(graphs, addresses: set) -> bool:
    """Drop the recordings among `graphs` that read any tensor at `addresses` in place (one model's parameters:
    another model sharing the capture keeps its own); returns whether any was dropped."""
    dropped = False
    for g in graphs:
        for key in [k for k, rec in g.recordings.items() if rec.reads & addresses]:
            del g.recordings[key]
            dropped = True
    return dropped


def release_pool(kind: str) -> bool:
    """Once no recording of `kind` ("inference" or "training") is left, hand its pool's memory back to the
    caching allocator (what the recordings kept stays reserved in the pool otherwise); the next recording
    starts a new pool. Returns whether a pool was handed back."""
    if any(g.pool_kind == kind and g.recordings for g in list(_LIVE)):
        return False
    return graph_pools.release(kind)


class CudaRecorder:
    """Records a `torch.cuda.CUDAGraph`: a warm-up on the side stream (as the CUDA graph docs ask), then the
    capture on its pool's own stream (`graph_pools`: every buffer the graph reads stays ours)."""

    device_type = "cuda"

    def record(self, fn: Callable, args: list) -> tuple[Callable[[], None], list]:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        pool = graph_pools.pool(device)
        warm = graph_pools.side_stream(device)
        current = torch.cuda.current_stream(device)
        warm.wait_stream(current)
        triton_setup.wait()  # the first launches need it: not hashed a second time beside the thread computing it
        with torch.cuda.stream(warm):
            fn(*args)  # first launches compile / autotune / allocate workspaces, none of which may be recorded
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end, not `torch.cuda.graph`: that context also synchronises and empties the caching
        # allocator (whose blocks the next eager ops then cudaMalloc again), and some versions gc.collect():
        # with it, the first patched call of an 8-layer Llama took 10.5 s instead of 2.1 s on the H100.
        # Thread-local: other threads' CUDA calls (a data loader's) are no error during the recording.
        outs = capture(graph, pool, device, lambda: fn(*args), after=(warm, current))
        return graph.replay, list(outs)


def capture(graph, pool: graph_pools.GraphPool, device: torch.device, body: Callable, after=()):
    """Record `body()` into `graph`, in `pool`, on the pool's capture stream (which first waits for the
    streams `after`); returns what `body` returned. A capture the GPU invalidated abandons its pool."""
    stream = pool.stream(device)
    for s in after:
        stream.wait_stream(s)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
        try:
            result = body()
        finally:
            try:
                graph.capture_end()
            except Exception:
                graph_pools.abandon(device, pool.handle)
                raise
    torch.cuda.current_stream(device).wait_stream(stream)
    return result


class Graphed:
    """`fn(*args)` (a rewritten graph's forward) replayed from CUDA graphs where it can be."""

    pool_kind = "inference"  # the shared pool its recordings live in (`CudaRecorder.pool`, `release_pool`)

    def __init__(self, fn: Callable, recorder=None, ops: int | None = None, out_bytes: int = 0):
        self.fn = fn
        self.recorder = recorder or CudaRecorder()
        self.ops = ops  # ops the function runs one by one (None: unknown, always worth replaying)
        self.out_bytes = out_bytes
        self.recordings: OrderedDict = OrderedDict()
        self.failed: str | None = None
        self.failed_trace: str | None = None
        self.not_replayed: dict[str, int] = {}  # why calls ran op by op -> how many (diagnostics)
        # One call at a time records or replays: a replay copies its inputs into the recording's static buffers,
        # runs, and copies the outputs out, and two threads of a serving pool calling one patched model would
        # otherwise each replay the other's inputs
        self._lock = threading.RLock()
        _LIVE.add(self)

    def __call__(self, *args):
        if self.failed or not replay_enabled():
            return self.fn(*args)
        key = self._key(args)
        if isinstance(key, str):
            self.not_replayed[key] = self.not_replayed.get(key, 0) + 1
            return self.fn(*args)
        with self._lock:
            return self._call_graphed(key, args)

    def _call_graphed(self, key, args):
        rec = self.recordings.get(key)
        if rec is None:
            self._make_room(args)
            try:
                with timing.timed("record"):
                    rec = self._record(args)
            except Exception as e:  # an op that cannot be recorded: this function runs op by op from now on
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{_where(e)}"
                self.failed_trace = traceback.format_exc()  # the whole of it, for a bug report
                warnings.warn(f"fusion-advisor: CUDA graph of a patched forward not used ({self.failed})",
                              RuntimeWarning, stacklevel=3)
                return self.fn(*args)
            self.recordings[key] = rec
        return self._run(rec, args)

    def _make_room(self, args) -> None:
        """Before a new recording: the oldest goes once there are `MAX_GRAPHS`."""
        while len(self.recordings) >= MAX_GRAPHS:
            self.recordings.popitem(last=False)

    def _refusal(self, args) -> str | None:
        """Why this call cannot replay at all (before looking at each input)."""
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return "autograd"
        return None

    def _key(self, args) -> tuple | str:
        """What a recording depends on beyond the capture's guards, or why it cannot be replayed."""
        why = self._refusal(args)
        if why is not None:
            return why
        parts = [rewrite.enabled_keys()]
        copied = 0  # bytes of the inputs a replay copies in
        dev = self.recorder.device_type
        # One pass, each argument classified once: a whole model's capture takes hundreds of parameters, and
        # this runs before every replay (two passes cost 0.8 ms per call for 300 on this project's CPU).
        for a in args:
            kind = input_kind(a, dev)
            if kind == "value":
                parts.append(("v", a))
            elif kind == "host scalar":
                parts.append(("host scalar", a.dtype, a.item()))  # read by value at launch: part of the graph
            elif kind == "off device":
                return f"an input off the GPU ({a.device.type}, shape {list(a.shape)})"
            elif kind == "in place":
                parts.append((a.data_ptr(), a.requires_grad))
            else:
                nbytes = a.untyped_storage().nbytes()
                if nbytes > MAX_STORAGE_RATIO * max(1, a.numel() * a.element_size()) and nbytes > 1 << 20:
                    return f"an input's storage ({nbytes >> 20} MiB) far larger than its view"
                copied += nbytes
                parts.append((nbytes, a.storage_offset(), a.requires_grad))
        if self.ops is not None and 2 * self._copied_bytes(args, copied) / COPY_BYTES_PER_S > self.ops * HOST_S_PER_OP:
            return "copies in and out would cost more than the launches"
        return tuple(parts)

    def _copied_bytes(self, args, inputs_bytes: int) -> int:
        """Bytes a replay copies (inputs in, outputs out): weighed against the launches it saves."""
        return self.out_bytes + inputs_bytes

    def _static_inputs(self, args) -> list:
        """Per argument: a static buffer holding a copy of it, or None (read in place, or not a tensor)."""
        kinds = [input_kind(a, self.recorder.device_type) for a in args]
        inputs = [_static_like(a, pinned=k == "host scalar") if k in ("host scalar", "copied") else None
                  for a, k in zip(args, kinds)]
        _copy_in(inputs, args)
        return inputs

    def _record(self, args) -> Recording:
        inputs = self._static_inputs(args)
        static_args = [a if s is None else s for a, s in zip(args, inputs)]
        with derived.reading() as used, rewrite.recording_sites() as sites:
            replay, outs = self.recorder.record(self.fn, static_args)
        reads = in_place_addresses(args, self.recorder.device_type)
        return Recording(replay, inputs, outs, list({id(d): d for d in used}.values()), reads, tuple(sites))

    @staticmethod
    def _run(rec: Recording, args) -> list:
        for d in rec.derived:  # weights changed since (new state dict, fine-tuning): their folds, in place
            d.refresh()
        _copy_in(rec.inputs, args)
        rec.replay()
        rewrite.credit(rec.sites)
        return _copy_out(rec.outputs)


def _where(e: BaseException) -> str:
    """` (at file:line, ...)`: the innermost frames a recording failed in (which op could not be recorded)."""
    frames = traceback.extract_tb(e.__traceback__)[-3:]
    return " (at " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line or ''}".strip() for f in reversed(frames)) + ")" \
        if frames else ""


def read_in_place(a: torch.Tensor) -> bool:
    """A parameter, or a tensor dynamo marked as a static address: a module's buffer or tensor attribute
    (what Inductor's CUDA graphs read in place too). Recordings are keyed by its address; copying it in
    before every replay cost ResNet-50's whole-model graph 106 copies (BatchNorm statistics) per call."""
    return isinstance(a, torch.nn.Parameter) or getattr(a, "_dynamo_static_input_type", None) is not None


def in_place_addresses(args, device_type: str) -> frozenset:
    """Addresses of the arguments a recording reads in place (parameters, buffers): which layer it is."""
    return frozenset(a.data_ptr() for a in args if input_kind(a, device_type) == "in place")


def input_kind(a, device_type: str) -> str:
    """How a replay treats one argument: `value` (not a tensor: part of the recording's key), `host
    scalar`, `off device` (never replayed), `in place` (`read_in_place`: keyed by its address) or
    `copied` (into the recording's static buffer before each replay)."""
    if not isinstance(a, torch.Tensor):
        return "value"
    if not (a.is_cuda if device_type == "cuda" else a.device.type == device_type):
        return "host scalar" if _host_scalar(a, device_type) else "off device"
    return "in place" if read_in_place(a) else "copied"


def _host_scalar(a: torch.Tensor, device_type: str) -> bool:
    """A 0-dim CPU tensor beside device tensors (HF layers pass some). A kernel may take it by value at
    launch (baked into the graph: the recording is keyed by its value, one graph per value seen) or
    copy it to the GPU (legal while recording only from pinned memory: its static buffer is pinned)."""
    return a.dim() == 0 and a.device.type == "cpu" and device_type != "cpu"


def _static_like(a: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """A tensor laid out like `a` (size, strides, storage offset) on a storage of its own, as large."""
    pin = pinned and torch.cuda.is_available()
    with torch.inference_mode(False):  # a normal tensor: copied into inside or outside inference mode
        storage = torch.empty(a.untyped_storage().nbytes(), dtype=torch.uint8, device=a.device,
                              pin_memory=pin).untyped_storage()
        return torch.empty(0, dtype=a.dtype, device=a.device).set_(storage, a.storage_offset(), a.size(), a.stride())


def _copy_in(statics: list, args) -> None:
    """Each static buffer gets its input's whole storage (reads may reach outside the view)."""
    pairs = [(_bytes(s), _bytes(a)) for s, a in zip(statics, args) if s is not None]
    _copy_all([d for d, _ in pairs], [a for _, a in pairs])


def _copy_out(outs: list) -> list:
    """Fresh copies of the static outputs that keep their layout and their aliasing: outputs sharing a
    storage share one copy of it (AOTAutograd rebuilds an output's views from it by offset and strides)."""
    copies: dict = {}
    sources, targets = [], []
    fresh = []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            fresh.append(o)
            continue
        storage = o.untyped_storage()
        copy = copies.get(storage.data_ptr())
        if copy is None:
            src = _bytes(o)
            dst = torch.empty_like(src)
            sources.append(src)
            targets.append(dst)
            copy = copies[storage.data_ptr()] = dst.untyped_storage()
        fresh.append(torch.empty(0, dtype=o.dtype, device=o.device).set_(copy, o.storage_offset(), o.size(), o.stride()))
    _copy_all(targets, sources)
    return fresh


def _copy_all(targets: list, sources: list) -> None:
    """targets[i] <- sources[i] (byte views of whole storages), in one `torch._foreach_copy_` per device and word
    size where `copy_` would launch a memcpy each: an HF decoder stack's replay copies its hidden states and every
    layer's keys and values out (27 copies per call of an 8-layer Mistral on the H200, 2-3 us of GPU time each)."""
    groups: dict = {}
    for t, s in zip(targets, sources):
        t, s = _words(t), _words(s)
        if t.dtype != s.dtype:
            t, s = t.view(torch.uint8), s.view(torch.uint8)
        ts, ss = groups.setdefault((t.device, s.device, t.dtype), ([], []))
        ts.append(t)
        ss.append(s)
    for ts, ss in groups.values():
        if len(ts) == 1:
            ts[0].copy_(ss[0])
        else:
            torch._foreach_copy_(ts, ss)


def _words(b: torch.Tensor) -> torch.Tensor:
    """A byte view as 8-byte words where its size and address allow: the copy kernel then moves 8 bytes an
    element, not one."""
    return b.view(torch.int64) if b.numel() % 8 == 0 and b.data_ptr() % 8 == 0 else b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
