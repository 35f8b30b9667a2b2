"""Who owns the memory a recorded CUDA graph reads, checked on the CPU against a model of PyTorch's CUDA layer.

A graph bakes in the address of every buffer its kernels touch. `FakeCuda` models the parts of PyTorch that
decide those buffers' owners: streams, private pools, captures, and cuBLAS's process-wide table of
workspaces (one per stream, allocated at the first matmul on the stream: inside a capture from the capture's
pool, else eagerly; emptied by whoever calls `torch._C._cuda_clearCublasWorkspaces`, as torch.compile's
cudagraph trees do around each of their recordings). On the GPU, a graph whose workspace had been allocated
eagerly wrote into freed memory once a reduce-overhead model beside it emptied the table and the cache
(`bench/coexist.py`; reports/coexist/).
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
import torch

from advisor.patching import graph_pools
from advisor.patching.graphs import CudaRecorder, release_pool
from advisor.patching.train_graphs import CudaTrainRecorder


class FakeStream:
    ids = itertools.count(1)

    def __init__(self, *args, **kwargs):
        self.cuda_stream = next(self.ids)

    def wait_stream(self, other):
        pass


class FakeCuda:
    def __init__(self):
        self.default = FakeStream()
        self.current = self.default
        self.capturing: dict = {}  # stream -> pool handle of the capture running on it
        self.workspaces: dict = {}  # stream -> (owner: "eager" or a pool handle, serial)
        self.serial = itertools.count()
        self.eager_streams: set = set()  # streams that ran work outside any capture
        self.baked: list = []  # per captured matmul: (graph's pool, the workspace's owner)
        self.handles = itertools.count(1)
        fake = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                assert fake.current not in fake.capturing, "one capture per stream"
                self.pool = pool
                fake.capturing[fake.current] = pool

            def capture_end(self):
                fake.capturing.pop(fake.current)

            def replay(self):
                pass

        self.Graph = Graph

    def matmul(self, a, b):
        """A cuBLAS matmul: reads (or allocates) its stream's workspace."""
        s = self.current
        pool = self.capturing.get(s)
        if s not in self.workspaces:
            self.workspaces[s] = ("eager" if pool is None else pool, next(self.serial))
        if pool is None:
            self.eager_streams.add(s)
        else:
            self.baked.append((pool, self.workspaces[s][0]))
        return a @ b

    @contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", self.Graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(self.handles)))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.workspaces.clear, raising=False)
        monkeypatch.setattr(graph_pools, "_driver_stream", lambda device: FakeStream())
        monkeypatch.setattr(graph_pools, "_POOLS", {})
        monkeypatch.setattr(graph_pools, "_SIDE_STREAMS", {})
        monkeypatch.setattr(graph_pools, "_SPARE", {})


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_a_recordings_cublas_workspace_is_allocated_inside_its_capture_in_its_pool(cuda):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    CudaRecorder().record(lambda x, y: [cuda.matmul(x, y)], [a, b])
    (pool, owner), = cuda.baked
    assert owner == pool  # not "eager": a workspace allocated outside the pool is freed by others' clears
    assert not cuda.eager_streams & set(cuda.capturing) and all(
        s not in cuda.eager_streams for p in graph_pools._POOLS.values() for s in p.streams.values())


def test_once_the_workspace_table_is_emptied_later_captures_still_bake_workspaces_of_their_pool(cuda):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    fn = lambda x, y: [cuda.matmul(x, y)]  # noqa: E731
    CudaRecorder().record(fn, [a, b])
    cuda.workspaces.clear()  # a reduce-overhead model's recording beside ours
    cuda.matmul(a, b)  # eager work of the user's on the default stream meanwhile
    CudaRecorder().record(fn, [a, b])
    assert [owner for _, owner in cuda.baked] == [pool for pool, _ in cuda.baked]


def test_warm_ups_never_run_on_a_capture_stream(cuda, monkeypatch):
    made = set()  # the streams the driver made for us: never one of PyTorch's shared set

    def driver_stream(device):
        s = FakeStream()
        made.add(s.cuda_stream)
        return s
    monkeypatch.setattr(graph_pools, "_driver_stream", driver_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a stream of PyTorch's shared set"))
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for _ in range(3):
        CudaRecorder().record(lambda x, y: [cuda.matmul(x, y)], [a, b])
    capture_streams = {s for p in graph_pools._POOLS.values() for s in p.streams.values()}
    assert capture_streams and not capture_streams & cuda.eager_streams
    side = graph_pools.side_stream(torch.device("cpu"))
    assert side in cuda.eager_streams and side.cuda_stream in made  # the warm-ups ran there, a stream of our own


def test_training_captures_take_their_workspace_from_the_training_pool(cuda):
    w = torch.randn(8, 3, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    CudaTrainRecorder.device_type = "cpu"
    try:
        rec = CudaTrainRecorder()
        rec.record_training(lambda a, b: [cuda.matmul(a, b)], [x, w], [None, None])
    finally:
        CudaTrainRecorder.device_type = "cuda"
    training = graph_pools._POOLS[(torch.device("cpu"), "training")].handle
    assert cuda.baked and all(pool == owner == training for pool, owner in cuda.baked)


def test_a_released_pool_lets_go_of_its_workspaces_before_its_streams_serve_again(cuda):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    CudaRecorder().record(lambda x, y: [cuda.matmul(x, y)], [a, b])
    first = graph_pools._POOLS[(torch.device("cpu"), "inference")]
    assert release_pool("inference")  # no Graphed holds a recording: the pool goes
    assert not cuda.workspaces  # else the table kept a block of the released pool (and its segment) alive
    CudaRecorder().record(lambda x, y: [cuda.matmul(x, y)], [a, b])
    second = graph_pools._POOLS[(torch.device("cpu"), "inference")]
    assert second.handle != first.handle
    assert set(second.streams.values()) == set(first.streams.values())  # recycled: no stream made per round
    assert cuda.baked[-1] == (second.handle, second.handle)  # the recycled stream's workspace is the new pool's


def test_without_a_stream_of_our_own_nothing_is_recorded_and_the_reason_is_kept(cuda, monkeypatch):
    """A stream from PyTorch's shared set could carry another library's eagerly allocated workspace into the
    graph: where the driver makes no stream of our own, the function runs op by op and says why."""
    from advisor.patching.graphs import Graphed

    monkeypatch.setattr(graph_pools, "_driver_stream", lambda device: None)

    class OnTheGpu(CudaRecorder):
        device_type = "cpu"  # (its arguments are CPU tensors here)

    g = Graphed(lambda x, y: [cuda.matmul(x, y)], OnTheGpu())
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.warns(RuntimeWarning, match="no CUDA stream of our own"):
        (out,) = g(a, b)
    assert torch.allclose(out, a @ b) and "NoPrivateStream" in g.failed and not cuda.baked


def test_a_capture_without_its_cuda_graph_is_said_in_the_report(tmp_path):
    """Where a recording fails or is refused (no stream of our own), the capture runs op by op: `print(report)`
    and the handle say which module and why, as apply.json does at optimize's end."""
    import warnings

    import advisor
    from advisor.patching.graphs import Graphed
    from test_graphs import ReplayOnCpu, affine

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, (torch.randn(4, 8),), out=tmp_path, reuse=False, interpret=True)
    assert not report.handle.graphs_not_used()
    forward = next(f for f in report.handle.forwards.values() if f._backend is not None)
    g = Graphed(affine, ReplayOnCpu(fail=True))
    forward._backend.inference_graphs.append(g)
    with pytest.warns(RuntimeWarning):
        g(torch.nn.Parameter(torch.ones(2), requires_grad=False), torch.ones(2))
    (module, why), = report.handle.graphs_not_used().items()
    assert "operation not permitted when stream is capturing" in why
    assert f"{module} runs its capture op by op, without a CUDA graph: {why}" in str(report)
