"""Replay a rewritten training graph as two CUDA graphs: its forward, then its backward.

Why: under autograd a captured layer runs its aten ops, Triton launchers and autograd nodes one at a
time from Python, forward and backward. On the H100 the suite's Llama trained with its fused
backwards kept the GPU busy 31.7 ms per step against eager's 38.3 ms, yet stepped in 46.8 ms against
eager's 41.7: the host was the bottleneck (reports/train/host-bound-step.md). Recorded once per layer, a step's
forward and backward each cost one launch per layer.

The contract is `graphs.Graphed`'s (parameters read in place, every other input copied into a static
buffer, outputs copied out, one shared pool), plus what autograd needs:
- the recording keeps its autograd graph (the backward is recorded with `retain_graph`), so the tensors
  the backward reads stay allocated at the addresses the forward graph writes them to;
- the replayed forward is one `autograd.Function`: its backward copies the output gradients in, replays
  the backward graph and hands autograd the leaves' (parameters') gradients where the graph left them (no
  copy: autograd takes each as the `.grad`, as it takes eager's fresh ones), copies of the others'
  (they flow on through ops that may keep them). Before the next backward replay
  writes there again, a `.grad` still holding that memory (gradients accumulated over micro-batches,
  `zero_grad(set_to_none=False)`) is moved to memory of its own (`_evacuate`: the tensor object keeps its
  identity); one held elsewhere makes the replay raise rather than overwrite it;
- one forward, then its backward: a second forward of the same recording before the first one's
  backward (one module called twice in a step: two views through one encoder, weights shared) runs op
  by op, because a replay would overwrite what the first call's backward reads; the block lifts at that
  backward, or when its autograd graph is dropped unused. A backward whose forward memory was replayed
  over anyway (`retain_graph` and a second backward after a new forward) raises instead of returning
  wrong gradients.
Memory: the recordings share one pool of their own (not the inference graphs'), so each one's scratch
(forward temporaries, the backward's) may lie where a recording made after it keeps its saved tensors.
That is safe in a step's usual order, forwards in the order they were recorded and backwards in reverse
(what `torch.cuda.make_graphed_callables` assumes too); here it is checked, not assumed: a forward
replay while a later-recorded one awaits its backward runs op by op instead, and a replay that may have
written over a later-recorded one's saved tensors marks it, so that its backward raises rather than
return wrong gradients (`_ALIVE`, `TrainRecording.seq`). Output gradients are copied into buffers
shared by every recording of that shape (read only during the backward replay). The backward graph
copies the input gradients into buffers of its own, outside the pool (the pool's memory it computed them
in may be an earlier recording's scratch, which that one's backward replay writes later in the step):
the parameters' are their `.grad` between a backward and `zero_grad`, as eager's would be; the forward
then holds them too (0.8 GB on the H100's Llama). They were copied into buffers shared by the layers and
cloned out instead: one more copy of every parameter's gradient per step.

Not recorded (op by op, said in `not_replayed`): graphs that mutate a tensor (BatchNorm's running
statistics in train mode, a cache updated in place: a replay would update the static copy, and the
recording's warm-up would update them twice more), autocast (its casts are decided per call), calls made
inside a backward pass (activation checkpointing re-runs forwards there), and no output needing a grad.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from advisor.patching import graph_pools, rewrite
from advisor.patching.graphs import (_LIVE as _GRAPHED, Graphed, _copy_in, _copy_out, capture, drop_recordings_reading,
                                     in_place_addresses, release_pool)

WARMUP = 2  # forward + backward runs before recording: Triton compiles, autotuning, workspaces
_SEQ = itertools.count()
# Recordings whose last replayed forward may still be backpropagated (its autograd node is alive).
_ALIVE: "weakref.WeakSet[TrainRecording]" = weakref.WeakSet()
_SHARED: dict = {}  # (device, role, index, shape, strides, dtype) -> a gradient buffer every recording shares


@dataclass(eq=False)
class TrainRecording:
    forward: Callable[[], None]  # replays the forward graph (static inputs -> static outputs, saved tensors)
    backward: Callable[[], None]  # replays the backward graph (static output grads -> static input grads)
    inputs: list  # per argument: its static buffer, or None (read in place / not a tensor)
    outputs: list  # the forward's static outputs
    grad_outputs: list  # per output: its gradient's static buffer, None where it takes none
    grad_inputs: list  # per argument: its gradient's static buffer, None where it has none
    fused: int  # fused sites (with a generated backward) one forward runs
    keep: tuple = ()  # what must outlive the replays (the graphs, the autograd graph's outputs)
    generation: int = 0  # forwards replayed so far
    pending: bool = False  # a replayed forward's backward has not run yet
    seq: int = field(default_factory=lambda: next(_SEQ))  # order of recording (scratch may overlap later ones')
    clobbered: bool = False  # an earlier recording replayed over its saved tensors since its forward
    # per argument: how many tensors hold its gradient's memory while none is handed out (the recording's own)
    own_uses: list = field(init=False)
    holders: list = field(default_factory=list)  # per argument: the leaf the last backward handed its gradient to
    reads: frozenset = frozenset()  # addresses of the tensors it reads in place (its layer's parameters)

    def __post_init__(self):
        self.own_uses = [_uses(g) for g in self.grad_inputs]


def _uses(t: torch.Tensor | None) -> int:
    """How many tensors hold `t`'s memory (its storage's use count)."""
    return 0 if t is None else torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def release_unused_pool() -> None:
    """Once no training recording is left (every patched forward's training calls fell back to eager's ops),
    hand the training pool's memory back: what its recordings kept stays reserved in it otherwise (BERT:
    14 GB reserved for eager's 6). A later recording starts a new pool."""
    if any(g.pool_kind == "training" and g.recordings for g in list(_GRAPHED)):
        return
    _SHARED.clear()  # the gradient buffers: a recording still alive in an old autograd graph holds its own
    release_pool("training")


def drop_training_recordings(addresses: set | None = None) -> None:
    """Forget the training recordings (those reading a tensor at `addresses` in place: one model's, where
    given; else every one) and hand back their pool once none is left (training runs the original forwards
    now: `workflows.training`); a later training call through a fused capture records again."""
    graphs = [g for g in list(_GRAPHED) if isinstance(g, TrainGraphed)]
    if addresses is None:
        for g in graphs:
            g.recordings.clear()
    else:
        drop_recordings_reading(graphs, addresses)
    release_unused_pool()


def mutates(graph: torch.fx.Graph) -> bool:
    """Whether any op of the graph writes a tensor in place (its schema says so)."""
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            return True
    return False


class TrainGraphed(Graphed):
    """`fn(*args)` (a rewritten training graph's forward) replayed with its backward where it can be."""

    pool_kind = "training"

    def __init__(self, fn: Callable, recorder=None, ops: int | None = None, out_bytes: int = 0):
        # Forward and backward both run from Python when not replayed: twice the launches a replay saves.
        super().__init__(fn, recorder or CudaTrainRecorder(), None if ops is None else 2 * ops, out_bytes)

    def _refusal(self, args) -> str | None:
        if not torch.is_grad_enabled():
            return "no autograd"
        if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
            return "autocast"
        if _in_backward():
            return "called inside a backward pass (activation checkpointing)"
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return "no input needs a gradient"
        return None

    def _copied_bytes(self, args, inputs_bytes: int) -> int:
        # inputs and outputs copied, their gradients too, and every gradient handed to autograd
        grads = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
        return 2 * super()._copied_bytes(args, inputs_bytes) + grads

    def _make_room(self, args) -> None:
        """One recording per set of parameters (a layer): each holds its saved activations for good, so a
        layer called at new shapes replaces its recording instead of adding one (two shape variants held
        Llama's training above eager's peak). Its memory goes back to the pool for the new one."""
        reads = in_place_addresses(args, self.recorder.device_type)
        for key in [k for k, rec in self.recordings.items() if getattr(rec, "reads", None) == reads]:
            del self.recordings[key]
        super()._make_room(args)

    def _record(self, args) -> TrainRecording:
        inputs = self._static_inputs(args)
        static_args = []
        for s, a in zip(inputs, args):
            if s is not None:
                static_args.append(s.requires_grad_(True) if a.requires_grad else s)  # a leaf of the recording
            elif isinstance(a, torch.Tensor) and a.requires_grad:
                # A parameter, read in place through a leaf of the recording's own. Recorded with the parameter
                # itself, its gradient accumulator (an autograd node, cached per tensor) was made on the side
                # stream the recording runs on, and every later backward of the model, graphed or not, then
                # synchronised the streams once per parameter (BERT: 396 event waits in two steps, 10 ms a step).
                static_args.append(a.detach().requires_grad_(True))
            else:
                static_args.append(a)
        rec = self.recorder.record_training(self.fn, static_args, inputs)
        rec.reads = in_place_addresses(args, self.recorder.device_type)
        return rec

    def _run(self, rec: TrainRecording, args) -> list:
        why = None
        if rec.pending:  # the last forward's backward has not run: a replay would overwrite what it reads
            why = "a second forward before the first one's backward"
        elif any(j.pending and j.seq > rec.seq for j in list(_ALIVE)):
            why = "a module recorded after it awaits its backward"  # this one's scratch may hold its saved tensors
        if why is not None:
            self.not_replayed[why] = self.not_replayed.get(why, 0) + 1
            return self.fn(*args)
        return list(_Replayed.apply(rec, *args))


class _Token:
    """Lives as long as a replayed forward's autograd node: its end lifts the recording's block."""


def _release(rec_ref, generation: int) -> None:
    rec = rec_ref()
    if rec is not None and rec.generation == generation:
        rec.pending = False
        _ALIVE.discard(rec)


def _clobber(rec: TrainRecording) -> None:
    """`rec` is about to replay: its scratch may lie over what recordings made after it keep for a backward."""
    for j in list(_ALIVE):
        if j.seq > rec.seq:
            j.clobbered = True


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rec: TrainRecording, *args):
        _copy_in(rec.inputs, args)
        _clobber(rec)
        rec.forward()
        rec.generation += 1
        rec.pending, rec.clobbered = True, False
        _ALIVE.add(rec)
        ctx.rec, ctx.generation = rec, rec.generation
        # leaves (parameters): their `.grad` may be the recording's own gradient memory after this backward
        ctx.leaves = [weakref.ref(a) if isinstance(a, torch.Tensor) and a.is_leaf and g is not None else None
                      for a, g in zip(args, rec.grad_inputs)]
        ctx.token = token = _Token()
        weakref.finalize(token, _release, weakref.ref(rec), rec.generation)
        if rec.fused:  # the sites ran inside the graph: counted as if they ran from Python
            rewrite.count_fused_runs(rec.fused)
        outs = _copy_out(rec.outputs)
        plain = [o for o, s in zip(outs, rec.grad_outputs) if isinstance(o, torch.Tensor) and s is None]
        if plain:
            ctx.mark_non_differentiable(*plain)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gouts):
        rec = ctx.rec
        if rec.generation != ctx.generation or rec.clobbered:
            raise RuntimeError("fusion-advisor: the tensors this CUDA-graph-replayed layer saved for its backward "
                               "were overwritten by a later replay (a backward through an old graph, or backwards "
                               "out of the forwards' order); set FUSION_ADVISOR_CUDA_GRAPHS=0 to run such a "
                               "training loop op by op.")
        for s, g in zip(rec.grad_outputs, gouts):
            if s is not None:
                s.copy_(g) if g is not None else s.zero_()
        _clobber(rec)
        _evacuate(rec)
        rec.backward()
        rec.pending = False
        rec.holders = ctx.leaves
        # A leaf's (a parameter's): an alias, which autograd takes as its `.grad` (no copy; `_evacuate` moves it
        # before the next replay). Others' flow on to ops whose own gradients may hold them: copies.
        return (None, *[None if g is None else g.detach() if leaf is not None else g.clone()
                        for g, leaf in zip(rec.grad_inputs, ctx.leaves)])


def _evacuate(rec: TrainRecording) -> None:
    """Before the backward graph writes the input gradients again: a leaf's `.grad` still holding the memory
    the last backward handed it gets memory of its own, in place (`set_`: every reference to that tensor
    follows). Memory still held elsewhere (a gradient kept by user code) raises instead of being overwritten."""
    with torch.no_grad():
        for g, own, ref in itertools.zip_longest(rec.grad_inputs, rec.own_uses, rec.holders):
            if g is None or _uses(g) == own:
                continue
            held = ref() if ref is not None else None
            grad = held.grad if held is not None else None
            if grad is not None and grad.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
                grad.set_(grad.clone())
            if _uses(g) != own:
                raise RuntimeError(
                    "fusion-advisor: a gradient a CUDA-graph-replayed layer handed out is still held (not as a "
                    "parameter's .grad) and its next backward would overwrite it; clone gradients you keep "
                    "across steps, or set FUSION_ADVISOR_CUDA_GRAPHS=0 to run training op by op.")


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _differentiable(outs) -> list[int]:
    return [j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]


def _needing_grads(args) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]


def _grads(outs, args, grad_outputs, retain: bool):
    return torch.autograd.grad([outs[j] for j in _differentiable(outs)], [args[i] for i in _needing_grads(args)],
                               [grad_outputs[j] for j in _differentiable(outs)], retain_graph=retain,
                               allow_unused=True)


def _shared(device, role: str, index: int, like: torch.Tensor) -> torch.Tensor:
    """The buffer every recording uses for its `index`-th `role` gradient of this layout (outside any pool)."""
    key = (device, role, index, tuple(like.shape), tuple(like.stride()), like.dtype)
    buf = _SHARED.get(key)
    if buf is None:
        buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
        buf = _SHARED[key] = buf.zero_()
    return buf


class CudaTrainRecorder:
    """Records the forward graph and the backward graph of one training call (as
    `torch.cuda.make_graphed_callables` does), in the training recordings' pool, keeping the autograd
    graph so that its saved tensors stay allocated: no later recording gets them as scratch."""

    device_type = "cuda"

    def record_training(self, fn: Callable, args: list, inputs: list) -> TrainRecording:
        device = next(a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == self.device_type)
        pool = graph_pools.pool(device, "training")
        warm = graph_pools.side_stream(device)
        current = torch.cuda.current_stream(device)
        warm.wait_stream(current)
        with torch.cuda.stream(warm), rewrite.recording_replayed_graph():  # (sites time GPU work alone)
            for _ in range(WARMUP):
                outs = list(fn(*args))
                if not _differentiable(outs):
                    raise ValueError("no output needs a gradient")
                _grads(outs, args, [torch.ones_like(o) if isinstance(o, torch.Tensor) else None for o in outs], False)
            del outs
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        outs: list = []
        before = rewrite.fused_runs()
        capture(fwd, pool, device, lambda: outs.extend(fn(*args)), after=(warm, current))
        fused = rewrite.fused_runs() - before
        grad_outputs = [_shared(device, "output", j, o) if j in _differentiable(outs) else None
                        for j, o in enumerate(outs)]
        needs = _needing_grads(args)
        # Outside the pool: memory of the pool that this recording's gradients were computed in may be an
        # earlier recording's scratch, written by its backward replay later in the same step.
        buffers = {i: torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype,
                                          device=args[i].device) for i in needs}
        grad_inputs: list = [None] * len(args)

        def backward():
            for i, g in zip(needs, _grads(outs, args, grad_outputs, True)):
                if g is not None:
                    buffers[i].copy_(g)
                    grad_inputs[i] = buffers[i]

        capture(bwd, pool, device, backward, after=(current,))
        return TrainRecording(fwd.replay, bwd.replay, inputs, outs, grad_outputs, grad_inputs, fused,
                              keep=(fwd, bwd))
