"""Training calls replayed as a forward graph and a backward graph (`advisor.patching.train_graphs`).

CUDA graphs need a GPU; here a recorder with the same contract stands in for them: its "replays" run
the function again on the recording's static buffers and write the static outputs and gradients in
place, so a replay that would read overwritten memory on the GPU reads overwritten memory here too.
The GPU's own recordings run in bench/train.py (reports/train/host-bound-step.md)."""
import pytest
import torch
import torch.nn.functional as F

from advisor.patching.train_graphs import TrainGraphed, TrainRecording, mutates


class StaticRecorder:
    device_type = "cpu"

    def __init__(self):
        self.records = 0

    def record_training(self, fn, args, inputs):
        self.records += 1
        first = list(fn(*args))
        diff = [j for j, o in enumerate(first) if o.requires_grad]
        needs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        outs = [o.detach().clone() for o in first]
        grad_outputs = [torch.zeros_like(o) if j in diff else None for j, o in enumerate(outs)]
        grad_inputs = [torch.zeros_like(a) if i in needs else None for i, a in enumerate(args)]
        live: dict = {}

        def forward():
            with torch.enable_grad():
                live["outs"] = list(fn(*args))
            for o, new in zip(outs, live["outs"]):
                o.copy_(new.detach())

        def backward():
            gs = torch.autograd.grad([live["outs"][j] for j in diff], [args[i] for i in needs],
                                     [grad_outputs[j] for j in diff], allow_unused=True)
            for i, g in zip(needs, gs):
                grad_inputs[i].copy_(g) if g is not None else grad_inputs[i].zero_()

        return TrainRecording(forward, backward, inputs, outs, grad_outputs, grad_inputs, fused=0)


def layer(x, w, b):
    """A residual MLP block (what dynamo hands the backend: parameters as inputs)."""
    h = F.gelu(F.linear(x, w, b))
    return (x + h, h.sum(-1))


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4),
            torch.nn.Parameter(torch.randn(16, generator=g) / 4))


def grads_of(run, ps, x, steps=1):
    for p in sum(ps, ()):
        p.grad = None
    for step in range(steps):
        x1 = (x * (step + 1)).requires_grad_(True)  # another batch each step
        y = x1
        for w, b in ps:
            y = run(y, w, b)[0]
        y.pow(2).sum().backward()
    return [p.grad.clone() for p in sum(ps, ())] + [x1.grad.clone()]


def test_replayed_layers_give_eagers_gradients_and_accumulate():
    torch.manual_seed(0)
    ps = [params(1), params(2), params(3)]
    x = torch.randn(4, 8, 16)
    rec = StaticRecorder()
    graphed = TrainGraphed(layer, recorder=rec)
    for steps in (1, 2):  # two steps without zeroing: accumulated, not overwritten in a static buffer
        want = grads_of(layer, ps, x, steps)
        got = grads_of(graphed, ps, x, steps)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert rec.records == 3  # one recording per parameter set (layer), reused by every later step
    assert not graphed.not_replayed, graphed.not_replayed


def test_second_forward_before_the_backward_runs_op_by_op():
    # one module applied twice in a step (shared weights): a replay would overwrite the first call's
    # saved tensors, so the second call runs op by op and both gradients stay exact
    torch.manual_seed(0)
    w, b = params(1)
    x = torch.randn(4, 8, 16)

    def twice(run):
        w.grad = b.grad = None
        y = run(run(x.requires_grad_(False).clone().requires_grad_(True), w, b)[0], w, b)[0]
        y.pow(2).sum().backward()
        return w.grad.clone(), b.grad.clone()

    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    for a, b_ in zip(twice(graphed), twice(layer)):
        torch.testing.assert_close(a, b_)
    assert graphed.not_replayed == {"a second forward before the first one's backward": 1}


def test_unused_forward_lifts_the_block_once_dropped():
    torch.manual_seed(0)
    w, b = params(1)
    x = torch.randn(2, 16, requires_grad=True)
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    out = graphed(x, w, b)  # a forward under grad whose backward never comes (evaluation without no_grad)
    del out
    graphed(x, w, b)[0].sum().backward()
    assert not graphed.not_replayed


def test_backward_after_its_memory_was_replayed_over_raises():
    torch.manual_seed(0)
    w, b = params(1)
    x = torch.randn(2, 16, requires_grad=True)
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    first = graphed(x, w, b)[0].sum()
    first.backward(retain_graph=True)
    graphed(x * 2, w, b)[0].sum().backward()  # replays the forward over the first one's saved tensors
    with pytest.raises(RuntimeError, match="overwritten by a later replay"):
        first.backward()  # a backward reading overwritten memory must not return gradients


def test_refusals_run_op_by_op():
    w, b = params(1)
    x = torch.randn(2, 16, requires_grad=True)
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graphed(x, w, b)
    with torch.no_grad():
        graphed(x, w, b)
    assert set(graphed.not_replayed) == {"autocast", "no autograd"}


def test_graphs_that_write_in_place_are_not_recorded():
    bn = torch.nn.BatchNorm1d(4).train()
    traced = torch.fx.experimental.proxy_tensor.make_fx(lambda x: bn(x))(torch.randn(3, 4))
    assert mutates(traced.graph)  # running statistics updated in place: a replay would update a copy
    assert not mutates(torch.fx.experimental.proxy_tensor.make_fx(layer)(*(torch.randn(2, 16),) + params(1)).graph)


def test_replays_out_of_recording_order_never_use_overwritten_memory():
    # Recordings share one pool: a recording's scratch may lie over what a later-recorded one saved. In the
    # usual order (forwards as recorded, backwards reversed) nothing is overwritten; otherwise the forward
    # runs op by op, and a backward whose saved tensors may have been overwritten raises.
    torch.manual_seed(0)
    (wa, ba), (wb, bb) = params(1), params(2)
    x = torch.randn(2, 16, requires_grad=True)
    first = TrainGraphed(layer, recorder=StaticRecorder())
    later = TrainGraphed(layer, recorder=StaticRecorder())
    later(first(x, wa, ba)[0], wb, bb)[0].sum().backward()  # records `first`, then `later`
    later(first(x, wa, ba)[0], wb, bb)[0].sum().backward()  # the usual order: both replayed
    assert not first.not_replayed and not later.not_replayed
    b = later(x, wb, bb)[0]  # `later` awaits its backward ...
    a = first(x, wa, ba)[0]  # ... so `first` (recorded before it) runs op by op
    assert first.not_replayed == {"a module recorded after it awaits its backward": 1}
    (a.sum() + b.sum()).backward()  # both gradients exact: nothing was replayed over `later`'s tensors
    a = first(x, wa, ba)[0].sum()
    b = later(x, wb, bb)[0].sum()
    a.backward()  # `first`'s backward replays while `later` awaits its own: its scratch may overwrite later's
    with pytest.raises(RuntimeError, match="overwritten by a later replay"):
        b.backward()  # a backward over possibly overwritten tensors must not return gradients


def test_parameters_are_recorded_through_leaves_of_the_recordings_own():
    # read in place (same memory), but never the parameter object: its gradient accumulator, cached per
    # tensor, would be made on the recording's side stream and every later backward would sync streams
    w, b = params(1)
    seen = []

    class Seeing(StaticRecorder):
        def record_training(self, fn, args, inputs):
            seen.extend(args)
            return super().record_training(fn, args, inputs)

    graphed = TrainGraphed(layer, recorder=Seeing())
    graphed(torch.randn(2, 16, requires_grad=True), w, b)[0].sum().backward()
    assert seen[1] is not w and seen[1].data_ptr() == w.data_ptr() and seen[1].requires_grad
    assert w.grad is not None and b.grad is not None  # the parameters still get their gradients


def test_training_pool_is_handed_back_once_no_recording_is_left(monkeypatch):
    from advisor.patching import graph_pools, train_graphs

    monkeypatch.setattr(graph_pools, "_POOLS", {("cuda:0", "training"): ("pool", "anchor"),
                                                ("cuda:0", "inference"): ("other", "anchor")})
    w, b = params(1)
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    graphed(torch.randn(2, 16, requires_grad=True), w, b)[0].sum().backward()
    train_graphs.release_unused_pool()
    assert ("cuda:0", "training") in graph_pools._POOLS  # a recording still uses it
    graphed.recordings.clear()  # what a patched forward does when its training calls fall back
    train_graphs.release_unused_pool()
    assert list(graph_pools._POOLS) == [("cuda:0", "inference")]


def test_parameters_take_the_recordings_gradient_memory_without_a_copy():
    """The backward hands autograd the input gradients where the backward graph left them: a parameter's
    `.grad` is that memory (no clone per step); before the next backward writes there, a `.grad` still
    holding it (zero_grad(set_to_none=False), accumulation) is moved to memory of its own, and a reference
    taken to it before sees the values eager's would have."""
    torch.manual_seed(0)
    w, b = params(1)
    x = torch.randn(2, 16)
    rec = StaticRecorder()
    graphed = TrainGraphed(layer, recorder=rec)
    graphed(x, w, b)[0].sum().backward()
    recorded = next(iter(graphed.recordings.values()))
    assert w.grad.data_ptr() == recorded.grad_inputs[1].data_ptr()  # autograd took it as the .grad
    kept = w.grad
    first = kept.clone()
    graphed(x * 2, w, b)[0].sum().backward()  # accumulates: the first .grad was moved away before the replay
    w_eager, b_eager = (p.detach().clone().requires_grad_(True) for p in (w, b))
    layer(x, w_eager, b_eager)[0].sum().backward()
    layer(x * 2, w_eager, b_eager)[0].sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
    assert kept is w.grad and not torch.equal(kept, first)  # the same tensor object, accumulated in place
    w.grad.zero_(), b.grad.zero_()  # zero_grad(set_to_none=False)
    graphed(x, w, b)[0].sum().backward()
    torch.testing.assert_close(w.grad, _one_step_grad(x, w, b))  # zeros + one step, not the replay's twice


def _one_step_grad(x, w, b):
    w1 = w.detach().clone().requires_grad_(True)
    layer(x, w1, b.detach())[0].sum().backward()
    return w1.grad


def test_a_handed_out_gradient_held_elsewhere_raises_instead_of_being_overwritten():
    torch.manual_seed(0)
    w, b = params(1)
    x = torch.randn(2, 16, requires_grad=True)
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    h = torch.randn(2, 16)
    graphed(x + h, w, b)[0].sum().backward()
    recorded = next(iter(graphed.recordings.values()))
    assert x.grad.data_ptr() != recorded.grad_inputs[0].data_ptr()  # not a leaf of the call: a copy flowed on
    kept = [w.grad]
    w.grad = None  # the parameter let go of it; the caller's list did not
    with pytest.raises(RuntimeError, match="still held"):
        graphed(x + h, w, b)[0].sum().backward()
    del kept
    w.grad = b.grad = None
    graphed(x + h, w, b)[0].sum().backward()  # nothing held: replays again


def test_a_layer_at_new_shapes_replaces_its_recording_and_other_layers_keep_theirs():
    """Each training recording holds its saved activations for good: a layer never holds two shape variants
    (the user's loop at another length than the check's held both, above eager's peak), while two layers
    sharing one captured function keep one recording each."""
    rec = StaticRecorder()
    graphed = TrainGraphed(layer, recorder=rec)
    (w1, b1), (w2, b2) = params(1), params(2)
    for x in (torch.randn(2, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)):
        for w, b in ((w1, b1), (w2, b2)):
            graphed(x, w, b)[0].sum().backward()
    assert rec.records == 4 and len(graphed.recordings) == 2  # each layer: its 3-row recording only
    assert {r.reads for r in graphed.recordings.values()} == {frozenset({w1.data_ptr(), b1.data_ptr()}),
                                                               frozenset({w2.data_ptr(), b2.data_ptr()})}
    assert graphed(torch.randn(3, 16, requires_grad=True), w1, b1) and rec.records == 4  # replayed, not recorded


def test_the_training_checks_original_forwards_are_measured_without_training_recordings(monkeypatch):
    """The fused state's recordings (an earlier check's: the LM loss's) must not count against the original
    forwards' peak: the check then held a state 7 GB heavier in the user's loop to be lighter."""
    from advisor.measure.timing import Timing
    from advisor.patching import train_graphs
    from advisor.workflows import training

    for g in list(train_graphs._GRAPHED):  # earlier tests' layers, not yet collected
        g.recordings.clear()
    graphed = TrainGraphed(layer, recorder=StaticRecorder())
    w, b = params(1)
    graphed(torch.randn(2, 16, requires_grad=True), w, b)[0].sum().backward()
    assert graphed.recordings
    live = []
    monkeypatch.setattr(training, "peak_bytes", lambda step, device: (
        step(), live.append(sum(len(g.recordings) for g in list(train_graphs._GRAPHED)
                                if isinstance(g, TrainGraphed))), 100)[2])
    monkeypatch.setattr(training.timing, "time_configs", lambda call, configs, device, iters=20, rounds=5: {
        k: Timing(2.0, 5, "perf_counter", [2.0] * 5, 0.0, [2.0] * 5) for k in configs})
    monkeypatch.setattr(train_graphs, "release_pool", lambda kind: False)  # (no GPU pool here)

    class Handle:
        def train_fused(self, on):
            if on:  # the fused state records again, as a patched forward's training call would
                graphed(torch.randn(2, 16, requires_grad=True), w, b)[0].sum().backward()

    other = TrainGraphed(layer, recorder=StaticRecorder())  # another model's layer: its recording stays
    w2, b2 = params(2)
    other(torch.randn(2, 16, requires_grad=True), w2, b2)[0].sum().backward()
    training._compare(lambda: None, Handle(), "cpu", iters=2, addresses={w.data_ptr(), b.data_ptr()})
    assert live[0] == 1 and live[-1] == 2, live  # original forwards alone; the fused state with its recording
