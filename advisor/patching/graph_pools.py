"""Where our CUDA graphs' memory lives, and who may free it: safe beside every other CUDA-graph user.

A recorded graph bakes in the address of every buffer its kernels touch. Each must stay ours, and
allocated, for as long as the graph may replay:
- intermediates and static outputs live in a private pool of ours (`GraphPool.handle`); only captures
  into that pool allocate from it, and it is never handed back while a recording made in it lives (the
  anchor recording, then `release`);
- cuBLAS's workspace. PyTorch keeps one per (cuBLAS handle, stream) in a process-wide table, allocated at
  the first matmul on that stream, and a graph captured on the stream reads it from there. Other users
  empty that table: torch.compile's cudagraph trees around each warm-up and recording (HF's static-cache
  `generate` too), and graph destructors for their capture stream. Our recordings used to warm up on the
  stream they were captured on, so their workspace had been allocated eagerly, outside any pool: emptied by
  a reduce-overhead model beside ours and handed back to the driver by an `empty_cache`, the next replay's
  split-K matmuls wrote into freed memory (`unspecified launch failure`, `illegal memory access`).
  So every capture runs on a stream of its pool's own (`GraphPool.stream`), on which nothing runs
  eagerly: its workspace is allocated inside the first capture, in our pool. Emptied by anyone, it goes
  back to that pool, still ours and still mapped, and a later capture of ours may reuse it as scratch (our
  graphs replay one at a time, like every other scratch the pool shares between them).
- The stream is one nobody else is handed: PyTorch's `torch.cuda.Stream()` cycles through a shared set
  of streams, so another library's eager matmuls could run on the same stream and leave a workspace
  outside our pool in the table. A stream of the driver's own (`cuStreamCreate`) is ours alone; where the
  driver makes none, nothing is recorded (`private_stream`).
Warm-ups (first launches compile, autotune and allocate workspaces) run on `side_stream`, never on a
capture stream.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

_CU_STREAM_NON_BLOCKING = 1


@dataclass
class GraphPool:
    """A private memory pool, the anchor recording that keeps it alive, and the streams captures into it
    run on (one per thread: two threads may record at once, and one stream holds one capture). The streams
    are this pool's alone while it lives: a workspace allocated in one pool must not be read by graphs of
    another, which could outlive it. A released pool's streams serve later pools once cuBLAS's table has let
    go of their workspaces (`release`)."""

    handle: tuple
    anchor: object
    streams: dict  # thread ident -> capture stream

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        key = threading.get_ident()
        s = self.streams.get(key)
        if s is None:
            spare = _SPARE.get(device)
            s = self.streams[key] = spare.pop() if spare else private_stream(device)
        return s


_POOLS: dict = {}  # (device, kind) -> GraphPool
_SIDE_STREAMS: dict = {}  # (device, thread) -> the stream warm-ups run on
_SPARE: dict = {}  # device -> capture streams of released pools, no workspace left in cuBLAS's table


def pool(device: torch.device, kind: str = "inference") -> GraphPool:
    """The shared pool of `device` for `kind` ("inference", "training"). A pool lives while a recording
    made in it lives: once every recording had been dropped, recording into the same handle again failed
    inside PyTorch (`use_count > 0` INTERNAL ASSERT in CUDACachingAllocator). The anchor, a recording never
    dropped while the pool is in use, keeps it alive."""
    entry = _POOLS.get((device, kind))
    if entry is None:
        entry = GraphPool(torch.cuda.graph_pool_handle(), None, {})
        anchor = torch.cuda.CUDAGraph()
        stream = entry.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            anchor.capture_begin(pool=entry.handle, capture_error_mode="thread_local")
            try:
                torch.zeros(1, device=device).add_(1)  # one kernel: CUDA refuses to instantiate an empty graph
            finally:
                anchor.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        entry.anchor = anchor
        _POOLS[(device, kind)] = entry
    return entry


def release(kind: str) -> bool:
    """Hand the pools of `kind` back (the caller knows no recording of theirs is left): the anchors go,
    cuBLAS's table lets go of the workspaces our capture streams allocated in them (else each would keep
    its pool's segment), and the caching allocator frees what the pools held. The next recording starts a
    new pool, with streams of its own."""
    dropped = [key for key in _POOLS if key[1] == kind]
    pools = [_POOLS.pop(key) for key in dropped]
    if dropped and torch.cuda.is_available():
        _forget_workspaces()
        torch.cuda.empty_cache()
        for (device, _), p in zip(dropped, pools):  # (a training loop with evaluations releases once per round)
            _SPARE.setdefault(device, []).extend(p.streams.values())
    return bool(dropped)


def abandon(device: torch.device, handle) -> None:
    """After a recording the GPU invalidated (a synchronising op inside it), `capture_end` raises before
    telling the allocator the recording is over, so every later recording into the pool failed
    ('beginAllocateToPool: already recording'): end it here, and record the next ones in a new pool
    (graphs already recorded keep theirs)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), handle)
        except Exception:  # already ended (the failure came later): nothing to undo
            pass
    for key in [k for k, p in _POOLS.items() if p.handle == handle]:
        _POOLS.pop(key)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream warm-ups run on (per thread). One for all recordings: the caching allocator keeps a
    stream's freed blocks for that stream, so a new stream per recording kept each warm-up's scratch
    reserved apart (the H100's Llama training: 20 GB reserved for 9.5 GB allocated). Ours alone too: our
    eager matmuls on a stream of PyTorch's shared set would leave a workspace outside any pool in cuBLAS's
    table for whoever captures on that stream next (a user's `torch.cuda.graph`)."""
    key = (device, threading.get_ident())
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = private_stream(device)
    return stream


def private_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream no other code in the process is handed (see the module's docstring). Never destroyed:
    cuBLAS's table is keyed by the stream's address, which a destroyed stream's successor could reuse.
    Where the driver makes none, no graph is recorded (the caller runs op by op and says why): a stream of
    PyTorch's shared set could carry another library's workspace into our graphs."""
    made = _driver_stream(device)
    if made is None:
        raise NoPrivateStream("no CUDA stream of our own for the capture (the driver's cuStreamCreate failed): "
                              "a shared stream could hand the graph a workspace another library frees")
    return made


class NoPrivateStream(RuntimeError):
    pass


def _driver_stream(device: torch.device) -> torch.cuda.Stream | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    with torch.cuda.device(device):
        torch.cuda.current_stream().synchronize()  # the device's primary context is current on this thread
        handle = ctypes.c_void_p()
        if lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING)) != 0 or not handle.value:
            return None
        return torch.cuda.ExternalStream(handle.value, device=device)


def _forget_workspaces() -> None:
    """Empty PyTorch's table of cuBLAS workspaces (as torch.compile's cudagraph trees do around each of
    their recordings): the next matmul on each stream allocates a new one, where it then runs."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
