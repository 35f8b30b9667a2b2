"""`advisor.patching.graphs.Graphed`: what a CUDA graph replay reads and writes, checked on the CPU.

`ReplayOnCpu` stands in for `torch.cuda.graph` with the same contract: recording runs the function on
the static arguments once and keeps its outputs; a replay reads only those static arguments (whatever
the caller passes later) and writes into the same output tensors. So every test here fails if the
wrapper forgets to copy an input in, hands out a buffer a later replay overwrites, or replays a
graph recorded for other parameters or another set of enabled patterns.
"""
from __future__ import annotations

import pytest
import torch

from advisor.patching import only
from advisor.patching.graphs import Graphed, replay_off


class ReplayOnCpu:
    device_type = "cpu"

    def __init__(self, fail: bool = False):
        self.records = 0
        self.fail = fail

    def record(self, fn, args):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.records += 1
        outs = list(fn(*args))

        def replay():
            with torch.inference_mode():  # a graph writes memory, whatever mode recorded the outputs
                for o, new in zip(outs, fn(*args)):
                    o.copy_(new)
        return replay, outs


def affine(w, x):
    return [x * w + 1]


def test_replays_read_the_new_inputs_and_return_fresh_outputs():
    w = torch.nn.Parameter(torch.tensor([2.0, 3.0]), requires_grad=False)
    g = Graphed(affine, ReplayOnCpu())
    x1, x2 = torch.tensor([1.0, 1.0]), torch.tensor([5.0, -1.0])
    (y1,) = g(w, x1)
    (y2,) = g(w, x2)
    assert g.recorder.records == 1
    assert torch.equal(y2, x2 * w + 1)
    assert torch.equal(y1, x1 * w + 1)  # not overwritten by the second replay
    x2.add_(100)  # the caller's tensor is not the graph's: later changes do not leak into old outputs
    assert torch.equal(y2, torch.tensor([11.0, -2.0]))


def test_one_recording_per_parameter_set_and_per_enabled_patterns():
    g = Graphed(affine, ReplayOnCpu())
    x = torch.arange(4.0)
    w1, w2 = (torch.nn.Parameter(torch.full((4,), v), requires_grad=False) for v in (2.0, 3.0))
    for _ in range(2):
        assert torch.equal(g(w1, x)[0], x * 2 + 1)
        assert torch.equal(g(w2, x)[0], x * 3 + 1)
    assert g.recorder.records == 2
    with only({"some-pattern"}):
        assert torch.equal(g(w1, x)[0], x * 2 + 1)
    assert g.recorder.records == 3


def test_views_keep_their_storage_offset_and_what_lies_outside_them():
    """The rewritten graph may read an input through as_strided relative to its storage (below its own
    offset): the static buffer carries the whole storage at the same offset."""
    def reads_before(x):
        return [x.as_strided((3,), (1,), x.storage_offset() - 1) * 10]

    g = Graphed(reads_before, ReplayOnCpu())
    for start in (0.0, 100.0):
        base = torch.arange(start, start + 6)
        x = base[2:5]
        assert torch.equal(g(x)[0], base[1:4] * 10)
    assert g.recorder.records == 1


def test_not_replayed_when_it_cannot_be():
    g = Graphed(affine, ReplayOnCpu())
    w = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    big = torch.zeros(1 << 20)
    assert torch.equal(g(w, big[:4] + 0)[0], torch.ones(4))  # a dense input is recorded
    assert torch.equal(g(w, big[:4])[0], torch.ones(4))  # a tiny view of a 4 MB storage is not copied
    with replay_off():
        g(w, torch.zeros(4))
    with torch.enable_grad():
        g(w, torch.zeros(4, requires_grad=True))
    assert g.recorder.records == 1 and len(g.recordings) == 1


def test_a_host_scalar_input_is_read_by_value_one_recording_per_value():
    """HF layers pass 0-dim CPU tensors beside GPU ones: a kernel reads such a tensor by value at launch,
    so it is part of the recording's key (a new value records anew); a larger CPU tensor is refused."""
    class OnTheGpu(ReplayOnCpu):
        device_type = "cuda"

    g = Graphed(lambda s: [torch.arange(3.0) * s], OnTheGpu())
    for v in (2.0, 3.0, 2.0, 3.0):
        assert torch.equal(g(torch.tensor(v))[0], torch.arange(3.0) * v)
    assert g.recorder.records == 2 and not g.not_replayed
    g(torch.ones(3))
    assert list(g.not_replayed) == ["an input off the GPU (cpu, shape [3])"]


def test_a_failed_recording_runs_op_by_op_from_then_on():
    g = Graphed(affine, ReplayOnCpu(fail=True))
    w = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.warns(RuntimeWarning, match="CUDA graph of a patched forward not used"):
        assert torch.equal(g(w, torch.ones(2))[0], torch.full((2,), 2.0))
    assert g.failed and "capturing" in g.failed
    assert torch.equal(g(w, torch.zeros(2))[0], torch.ones(2))


def test_inference_tensors_inside_and_outside_inference_mode():
    g = Graphed(affine, ReplayOnCpu())
    w = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with torch.inference_mode():
        x = torch.ones(2)
        assert torch.equal(g(w, x)[0], torch.full((2,), 2.0))
    with torch.no_grad():
        assert torch.equal(g(w, torch.zeros(2))[0], torch.ones(2))
    assert g.recorder.records == 1


def test_outputs_sharing_a_storage_still_share_one_after_the_copy():
    def split(x):
        base = x * 2
        return [base, base[1:3]]

    g = Graphed(split, ReplayOnCpu())
    x = torch.arange(4.0)
    g(x)
    base, view = g(x + 1)
    assert torch.equal(base, (x + 1) * 2) and torch.equal(view, base[1:3])
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and view.storage_offset() == 1


def test_not_replayed_when_the_copies_cost_more_than_the_launches():
    """One op on 64 MB: copying it in and out costs the GPU more than one launch costs the host."""
    from advisor.patching.graphs import COPY_BYTES_PER_S, HOST_S_PER_OP

    w = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    x = torch.ones(1 << 24)
    few = Graphed(affine, ReplayOnCpu(), ops=2, out_bytes=x.nbytes)
    assert 2 * 2 * x.nbytes / COPY_BYTES_PER_S > 2 * HOST_S_PER_OP
    few(w, x)
    assert few.recorder.records == 0
    many = Graphed(affine, ReplayOnCpu(), ops=100_000, out_bytes=x.nbytes)
    many(w, x)
    assert many.recorder.records == 1


def test_a_captured_graph_says_how_many_ops_it_runs_and_what_it_returns():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from advisor.patching.capture import _ops, _output_bytes

    with FakeTensorMode():
        x = torch.empty(8, 4)
        gm = make_fx(lambda x: ((x + 1).relu(), x.sum(0)), tracing_mode="real")(x)
    assert _ops(gm.graph) == 3 and _output_bytes(gm.graph) == (32 + 4) * 4


def test_clear_recordings_frees_them_and_the_next_call_records_again():
    from advisor.patching.graphs import clear_recordings

    g = Graphed(affine, ReplayOnCpu())
    w = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    g(w, torch.ones(2))
    clear_recordings()
    assert not g.recordings
    assert torch.equal(g(w, torch.zeros(2))[0], torch.ones(2)) and g.recorder.records == 2


def test_host_to_gpu_copies_of_safe_sources_become_recordable():
    """A CUDA graph records a host-to-GPU copy only from pinned memory, asynchronously (Mistral's captures
    copy a 0-dim step counter and its mask code's tensor constants, and never replayed). A 0-dim CPU input
    (pinned and keyed by value by `Graphed`) and a graph constant (pinned once) become non_blocking
    copies; other host tensors and copies that stay on the host are left alone."""
    from advisor.patching.host_copies import make_host_copies_recordable

    aten = torch.ops.aten
    g = torch.fx.Graph()
    step, big, x = g.placeholder("step"), g.placeholder("big"), g.placeholder("x")
    step.meta["val"], big.meta["val"], x.meta["val"] = torch.tensor(3), torch.ones(4), torch.ones(4)
    lifted = g.call_function(aten.lift_fresh_copy.default, (g.get_attr("_tensor_constant0"),))
    cuda = torch.device("cuda", 0)
    copies = [g.call_function(aten._to_copy.default, (step,), {"dtype": torch.int64, "device": cuda}),
              g.call_function(aten._to_copy.default, (lifted,), {"device": cuda}),
              g.call_function(aten._to_copy.default, (big,), {"device": cuda}),
              g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float16})]
    g.output(tuple(copies))
    root = torch.nn.Module()
    root._tensor_constant0 = torch.tensor([1, 2])
    gm = torch.fx.GraphModule(root, g)
    pinned = []
    assert make_host_copies_recordable(gm, pin=lambda t: pinned.append(t) or t.clone()) == 2
    by_input = {n.args[0].name: n for n in gm.graph.nodes if n.target is aten._to_copy.default}
    assert by_input["step"].kwargs["non_blocking"] and by_input["_tensor_constant0"].kwargs["non_blocking"]
    assert "non_blocking" not in by_input["big"].kwargs and "non_blocking" not in by_input["x"].kwargs
    assert not any(n.target is aten.lift_fresh_copy.default for n in gm.graph.nodes)  # the GPU copy is fresh
    assert len(pinned) == 1 and torch.equal(gm._tensor_constant0, torch.tensor([1, 2]))
    assert make_host_copies_recordable(gm, pin=lambda t: pinned.append(t) or t) == 0  # done once


def test_a_constant_is_pinned_outside_aotautograds_fake_mode(monkeypatch):
    """AOTAutograd calls the inference compiler with its fake mode on; pinning a real constant there raised
    ("Please convert all Tensors to FakeTensors", the H100 zoo's Mistral whole-stack capture failed on its
    mask constant). The default pin runs on the real tensor (a stand-in pin here: no GPU to pin for)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.patching import host_copies

    seen = []

    def pin_memory(t):
        seen.append(t.is_pinned())  # a real tensor's query: raises under the fake mode
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    const = torch.tensor(4096)
    with FakeTensorMode():
        out = host_copies._pinned(const)
    assert seen == [False] and torch.equal(out, const) and type(out) is torch.Tensor


def test_module_buffers_are_read_in_place():
    # dynamo marks a module's buffers as static addresses: the graph reads them where they live (no copy
    # per replay), so an in-place update of one is seen by the next replay without a new recording
    stats = torch.ones(4)
    seen = []

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("stats", stats)

        def forward(self, x):
            return x * self.stats

    def backend(gm, example_inputs):
        seen.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Scale(), backend=backend)(torch.ones(4))
    assert any(a is stats for a in seen) and getattr(stats, "_dynamo_static_input_type", None) is not None
    rec = ReplayOnCpu()
    g = Graphed(lambda s, x: [x * s], recorder=rec)
    x = torch.ones(4)
    assert torch.equal(g(stats, x)[0], torch.ones(4))
    stats.mul_(3)  # e.g. statistics loaded into the buffer in place
    assert torch.equal(g(stats, x)[0], torch.full((4,), 3.0)) and rec.records == 1
    [recording] = g.recordings.values()
    assert recording.inputs[0] is None and recording.inputs[1] is not None  # the buffer not copied, x copied
    plain = torch.ones(4)  # an activation: copied in, so the replay sees each call's values
    g2 = Graphed(lambda s, x: [x * s], recorder=ReplayOnCpu())
    g2(plain, x)
    assert torch.equal(g2(torch.full((4,), 2.0), x)[0], torch.full((4,), 2.0))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(x + torch.relu(self.fc(x)))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _recordings_reading(model) -> int:
    from advisor.patching.graphs import _LIVE

    ptrs = {p.data_ptr() for p in model.parameters()}
    return sum(1 for g in list(_LIVE) if g.pool_kind == "inference" for r in g.recordings.values() if r.reads & ptrs)


def test_a_training_call_drops_its_models_inference_recordings(monkeypatch, tmp_path):
    """Training through a patched model (its calls needing gradients run the original forward) held the
    inference recordings' static inputs and outputs: BERT peaked 0.8 GB above eager on the H100. A call needing
    gradients drops the recordings that read that model's weights (and hands the pool back once none is left);
    a second patched model of the same class (an EMA teacher, inference only) keeps its own; the next inference
    call records again and answers as eager does. CUDA graphs stand in as `ReplayOnCpu`."""
    import copy

    import advisor
    from advisor.patching import capture

    monkeypatch.setattr(capture, "replayed", lambda g, device, compiled=None: Graphed(compiled or g.forward, ReplayOnCpu()))
    torch.manual_seed(0)
    student = _Stack().eval()
    teacher, untouched = copy.deepcopy(student), copy.deepcopy(student)
    x = torch.randn(4, 8, 32)
    for k, model in enumerate((student, teacher)):
        advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path / str(k))
    with torch.no_grad():
        student(x)
        teacher(x)
    assert _recordings_reading(student) > 0 and _recordings_reading(teacher) > 0
    kept = _recordings_reading(teacher)

    loss = student(x).square().mean()  # a training step's forward: parameters need gradients
    loss.backward()
    assert _recordings_reading(student) == 0
    assert _recordings_reading(teacher) == kept  # another model's recordings are not this step's to drop
    want = untouched(x).square().mean()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(student.blocks[0].fc.weight.grad, untouched.blocks[0].fc.weight.grad)

    with torch.no_grad():
        torch.testing.assert_close(student(x), untouched(x), rtol=1e-5, atol=1e-5)
        student(x)
    assert _recordings_reading(student) > 0  # recorded again for inference


def test_a_replay_counts_the_fused_launches_it_replays():
    """A replay runs no Python, so the sites its recording captured are credited on each replay: a reused plan's
    model (recorded at its check call, replayed at the counted one) was reported with no kernel launched."""
    from advisor.patching import rewrite

    site = rewrite.Site(key="k:kernel", label="c1 test", launcher=lambda x: (x * 2,), fallback=lambda x: (x * 2,),
                        inputs=[rewrite.InputSpec(False, torch.float32, (4,), (1,))], outputs=[((4,), (1,), torch.float32)],
                        device_type=None)

    class GraphOnly(ReplayOnCpu):  # as a CUDA graph: the replay writes the outputs without calling the function
        def record(self, fn, args):
            replay, outs = super().record(fn, args)
            return (lambda: None), outs

    g = Graphed(lambda x: list(site(x)), recorder=GraphOnly())
    old = rewrite.set_caller("layer")
    try:
        g(torch.ones(4))  # records (its warm-up and capture run the site)
        before = dict(site.callers)
        for _ in range(3):
            g(torch.ones(4))
    finally:
        rewrite.set_caller(old)
    assert site.callers["layer"] - before["layer"] == 3


def test_threads_replaying_one_graph_each_get_their_own_outputs():
    """A serving pool's threads calling one patched model replay one recording: its static input buffers are
    shared, so replays run one at a time (each thread's output from its own input)."""
    import threading
    import time

    class Interleaving(ReplayOnCpu):  # a replay that lets other threads run between reading and writing
        def record(self, fn, args):
            replay, outs = super().record(fn, args)

            def slow_replay():
                time.sleep(0)
                replay()
            return slow_replay, outs

    g = Graphed(lambda x: [x * 2 + 1], recorder=Interleaving())
    g(torch.zeros(64))  # recorded
    wrong = []

    def worker(k: int):
        for i in range(50):
            x = torch.full((64,), float(k * 1000 + i))
            if not torch.equal(g(x)[0], x * 2 + 1):
                wrong.append((k, i))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} of 400 calls got another thread's output"
