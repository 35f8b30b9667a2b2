"""The HBM-bytes and time model of a fusion group.

Unfused bytes: what the group's kernels move today, each op reading its inputs and writing its
outputs (a broadcast input at its true size). Fused bytes: each outside input read once plus each
output that escapes the group (read by an op outside it, or read by nobody: a final output) written
once. Time: the kernels' measured time minus a roofline guess at the fused kernel,
max(HBM bytes / bandwidth, flops / peak, rows x a row program's time) + one launch, where an input that was written so recently that it is
still in L2 (`l2_resident_bytes`) is not HBM traffic: the residual add + LayerNorm after a GEMM reads the GEMM's
output from L2, and measured 1.24-1.60x the saving a roofline of every byte from HBM predicts
(reports/zoo/l2-resident-epilogues). A padded GEMM (`padded_cost`) is predicted at the padded product's roofline plus
its pad copies: it saves time, not bytes. A GEMM epilogue moves the product from
cuBLAS to our Triton GEMM, which is slower (`TRITON_GEMM_SLOWDOWN`): that cost is taken off the bytes it saves.
"""
from __future__ import annotations

import math
from typing import Iterator
from dataclasses import dataclass

from advisor.analysis.alignment import PaddedGemm, unaligned_gemm
from advisor.analysis.fusion import Group
from advisor.graph.nodes import Graph, per_template
from advisor.ops.registry import CONV_EPILOGUE, GEMM_EPILOGUE_ACTIVATIONS, OpClass, cublaslt_epilogue, lookup

# When meta.json has no measured figures: sustained copy bandwidth (read + write) and launch cost.
# `unaligned_matmul_flops`: what cuBLAS's unaligned (align1) GEMM kernels reach, for CPU traces' padded-matmul
# estimates: GPT-2's bf16 LM head on the H100, 843 GFLOP in 8.7 ms (docs/EXPERIMENTS.md: kernel_diff).
DEFAULT_DEVICE = {
    "cuda": {"bandwidth_Bps": 3.0e12, "launch_us": 2.5, "flops": 50e12, "matmul_flops": 700e12,
             "unaligned_matmul_flops": 97e12},
    "cpu": {"bandwidth_Bps": 10e9, "launch_us": 5.0, "flops": 100e9, "matmul_flops": 500e9},
}


# Our Triton GEMM (codegen/matmul.py, its tiles tuned at the shape) against cuBLAS on the same bf16 product, by K:
# the time cuBLAS + one fused epilogue kernel would take, less the epilogue's bytes, over cuBLAS's time
# (reports/matmul-fusion/: the zoo's and suite's fc1 + GELU and SwiGLU gates on the H100). Under
# K = 1024 our tiles run the product 1.6-2x slower, more than the output's round trip saves: BERT-base fc1 + GELU
# measured 2 µs a site slower fused, DeiT-S's 5, ConvNeXt-T's first stage 16 faster (a small K, a wide output).
TRITON_GEMM_SLOWDOWN = ((96, 1.72), (192, 1.82), (384, 2.0), (768, 1.64), (1024, 1.5), (2048, 1.38), (4096, 1.18),
                        (16384, 1.07))

# A linear's ReLU or GELU applied in cuBLASLt's own epilogue (`patching.gemm_epilogues`): the share of the
# activation kernel's time the epilogue still adds to the GEMM. H200, bf16 (docs/experiments/gemm_epilogues): ReLU
# 4-12% (BERT's fc1 0.123 ms against the GEMM's 0.119 and the ReLU kernel's 0.048), GELU 4-33% (0.133 against
# 0.119 and 0.068; ViT-B/16's 0.219 against 0.187 and 0.102).
CUBLASLT_EPILOGUE_SHARE = {"relu": 0.1, "gelu": 0.3}  # (by `registry.GEMM_EPILOGUE_ACTIVATIONS`)


# A row kernel (codegen/printer.py) is bound by its programs as well as its bytes. One program per row ran 0.62-0.69
# ns a row whatever the width (H100 softmax on rows of 49-256: 301056 rows of 49 in 186 µs, 4x eager's kernel,
# reports/kernels/); rows shorter than ROW_PACK_ELEMENTS are now packed that many elements to a
# one-warp program (codegen/module.py's `_row_config`), 2.2 ns a program at rows of 49 (41 µs, eager's 45).
ROW_PROGRAM_S = 0.62e-9  # a program of one row
PACKED_PROGRAM_S = 2.0e-9  # a program of several short rows, ROW_PACK_ELEMENTS in one warp
ROW_PACK_ELEMENTS = 1024
# Short rows whose width is no multiple of 16 bytes (Swin's windows of 49) are loaded and stored one element at a
# time, so there a packed program's time grows with the tensors it reads and writes row by row (`row_streams`).
# H100, bf16 rows of 49, 16 to a program: softmax (one tensor in, one out) 2.2 ns a program; the shifted-window
# softmax (scores, bias and mask in, one out) 3.4 ns (docs/EXPERIMENTS.md: row_index_math).
UNALIGNED_PROGRAM_S = 0.9e-9
UNALIGNED_STREAM_S = 0.64e-9


def rows_per_program(width: int, rows: int) -> int:
    """How many rows the persistent row kernel packs into one program (`_row_config`'s rule: a test holds them
    equal): rows of under ROW_PACK_ELEMENTS columns (their power-of-two block) share one."""
    return min(max(1, ROW_PACK_ELEMENTS // _pow2(width)), _pow2(rows))


def _pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as `triton.next_power_of_2`, without importing Triton."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def row_programs_s(rows: int, width: int, streams: int = 0) -> float:
    """The time a row kernel's programs take, however few bytes they move. `streams`: for rows that are not
    16-byte aligned, the tensors each row loads or stores (0: aligned rows)."""
    per = rows_per_program(width, rows)
    if per == 1:
        program = ROW_PROGRAM_S
    else:
        program = UNALIGNED_PROGRAM_S + streams * UNALIGNED_STREAM_S if streams else PACKED_PROGRAM_S
    return -(-rows // per) * program


def row_streams(graph: Graph, reads: dict[int, int], escapes: dict[int, int], width: int) -> int:
    """For a row group whose rows are not 16 bytes aligned, the tensors its kernel loads or stores row by row:
    outside reads and escaping outputs larger than one row (a per-column weight is loaded once a program);
    0 for aligned rows (or no output to tell the rows' dtype by)."""
    if not escapes:
        return 0
    out = graph.values[next(iter(escapes))]
    itemsize = out.bytes // max(math.prod(out.shape), 1)
    if not itemsize or (width * itemsize) % 16 == 0:
        return 0
    return sum(1 for nbytes in (*reads.values(), *escapes.values()) if nbytes > width * itemsize)


def triton_gemm_slowdown(k: int) -> float:
    """`TRITON_GEMM_SLOWDOWN` at reduction length `k`, linear in log2(k) between its points, flat beyond them."""
    pts = TRITON_GEMM_SLOWDOWN
    if k <= pts[0][0]:
        return pts[0][1]
    for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
        if k <= k1:
            return r0 + (r1 - r0) * math.log2(k / k0) / math.log2(k1 / k0)
    return pts[-1][1]


@dataclass(frozen=True)
class DeviceModel:
    type: str
    name: str
    bandwidth_Bps: float
    launch_us: float
    flops: float  # non-matmul arithmetic rate
    matmul_flops: float
    source: str  # "measured" or "table"
    l2_bytes: int = 0  # the GPU's L2 (meta.json's device.l2_bytes); 0: unknown, every read counted from HBM

    @classmethod
    def from_meta(cls, meta: dict, device_type: str) -> "DeviceModel":
        table = DEFAULT_DEVICE[device_type]
        dev = meta.get("device") or {}
        bw, launch = meta.get("bandwidth_Bps"), meta.get("launch_us")
        measured = bool(bw) and bool(launch) and (dev.get("type", device_type) == device_type)
        return cls(device_type, str(dev.get("name") or device_type), float(bw) if measured else table["bandwidth_Bps"],
                   float(launch) if measured else table["launch_us"], table["flops"], table["matmul_flops"],
                   "measured" if measured else "table",
                   int(dev.get("l2_bytes") or 0) if device_type == "cuda" and dev.get("type", device_type) == device_type else 0)


@dataclass
class GroupCost:
    bytes_unfused: int
    bytes_fused: int
    kernels: int
    measured_us: float
    predicted_fused_us: float
    intermediate_bytes: int = 0  # made and consumed inside the group: memory the fused kernel never allocates
    padded: PaddedGemm | None = None  # padded_matmul groups: the GEMM and its padding
    # A conv epilogue (`CONV_EPILOGUE`) runs inside cuDNN's conv kernel: the measured time of every kernel after
    # the conv is what it saves (not an increment on a fused base group, as a Triton GEMM epilogue's is).
    in_anchor_kernel_us: float | None = None
    # A Triton GEMM epilogue: what taking the product over from cuBLAS costs on the GPU (`gemm_takeover_us`).
    gemm_takeover_us: float = 0.0
    # The unfused kernels' share of the GPU's timeline (`timeline_us`): what removing them saves. None: `measured_us`.
    timeline_us: float | None = None

    @property
    def bytes_saved(self) -> int:
        return self.bytes_unfused - self.bytes_fused


def external_io(graph: Graph, members: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Values read from outside the group (value id -> bytes, widest view) and values that escape it."""
    inside = set(members)
    values = graph.values
    reads: dict[int, int] = {}
    escapes: dict[int, int] = {}
    for m in members:
        node = graph.nodes[m]
        for u in node.reads:
            if values[u.value].producer not in inside:
                reads[u.value] = max(reads.get(u.value, 0), u.bytes)
        for u in node.writes:
            consumers = values[u.value].consumers
            if not consumers or any(c not in inside for c in consumers):
                escapes[u.value] = max(escapes.get(u.value, 0), u.bytes)
    return reads, escapes


# An input still sits in L2 when it and everything the kernels between its writer and its reader moved fit in this
# share of the L2: half, because the H100's L2 is two partitions and a line written by one SM's partition is not
# in the other's, and the kernels between also keep their own working sets there.
L2_SHARE = 0.5


class TrafficSince:
    """Bytes moved by the graph's nodes from one to another (in execution order), from prefix sums made when first
    asked: the reuse distance that says whether a value is still in L2 when a later node reads it."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._prefix: list[int] | None = None

    def between(self, first: int, last: int) -> int:
        """Bytes moved by nodes first+1 .. last-1."""
        if self._prefix is None:
            acc, prefix = 0, [0]
            for n in self.graph.nodes:
                acc += n.bytes
                prefix.append(acc)
            self._prefix = prefix
        return self._prefix[last] - self._prefix[first + 1] if last > first + 1 else 0


def l2_resident_bytes(graph: Graph, members: list[int], reads: dict[int, int], device: DeviceModel,
                      traffic: TrafficSince) -> float:
    """Of the group's outside reads, the bytes still in L2 when the fused kernel runs (where the group's last member
    ran: every input is written by then). The L2 is taken as least-recently-used over `L2_SHARE` of its size: of a
    value, the part written last stays until the traffic since (the nodes between its writer and the fused kernel,
    less the group's own, which no longer run) has filled the rest, so a value read a little late is partly there
    (SwiGLU's gate behind the up projection: its fused kernel measured 8.5 µs a site on Mistral, between the 6.1
    of both inputs in L2 and the 9.75 of one, docs/EXPERIMENTS.md: estimate_check). Parameters and graph inputs (no
    writer) and anything on a GPU whose L2 is unknown count as HBM reads."""
    if device.l2_bytes <= 0:
        return 0.0
    budget = device.l2_bytes * L2_SHARE
    at = max(members)
    resident = 0.0
    for v, nbytes in reads.items():
        value = graph.values[v]
        p = value.producer
        if p < 0 or p >= at:
            continue
        since = traffic.between(p, at) - sum(graph.nodes[m].bytes for m in members if p < m < at)
        whole = max(value.bytes, nbytes)
        resident += nbytes * min(max(budget - since, 0) / whole, 1.0)
    return resident


def group_cost(graph: Graph, group: Group, device: DeviceModel) -> GroupCost:
    return next(group_costs(graph, [group], device))


def group_costs(graph: Graph, groups: list[Group], device: DeviceModel) -> Iterator[GroupCost]:
    """The cost of each group, one at a time. Each group's outside reads and escapes are worked out once (an epilogue's
    base group's too, when it comes first in `groups`), each node template's flops once."""
    flops_of = per_template(_flops)
    bases = {id(g.extends) for g in groups if g.kind == "epilogue" and g.extends is not None}
    traffic = TrafficSince(graph)
    io: dict[int, tuple] = {}  # id(group) -> external_io, kept for epilogue bases only
    for group in groups:
        if group.kind == "padded_matmul":
            yield padded_cost(graph, group, device)
            continue
        reads, escapes = external_io(graph, group.members)
        if id(group) in bases:
            io[id(group)] = reads, escapes
        fused = sum(reads.values()) + sum(escapes.values())
        # One pass over the members, each sum in member order (so the floats add up as they always did).
        unfused, kernels, measured, timeline, flops, between, matmul = 0, 0, 0, 0, 0, 0, False
        for m in group.members:
            n = graph.nodes[m]
            unfused += n.bytes
            kernels += max(len(n.kernels), 1)
            measured += n.time_us
            timeline += timeline_us(n, device)
            flops += flops_of(n)
            matmul = matmul or n.cls is OpClass.MATMUL
            for u in n.writes:
                if u.value not in escapes:
                    between += u.bytes
        in_anchor, takeover = None, 0.0
        if group.kind == "epilogue" and CONV_EPILOGUE.get(graph.nodes[group.anchor].op) == "conv":
            in_anchor = measured - graph.nodes[group.anchor].time_us
        elif group.kind == "epilogue" and device.type == "cuda" and \
                cublaslt_epilogue(ops := [graph.nodes[m].op for m in group.members]):
            in_anchor = (measured - graph.nodes[group.anchor].time_us) * (1.0 - CUBLASLT_EPILOGUE_SHARE[GEMM_EPILOGUE_ACTIVATIONS[ops[1]]])
        elif group.kind == "epilogue" and graph.nodes[group.anchor].cls is OpClass.MATMUL:
            takeover = gemm_takeover_us(graph.nodes[group.anchor], flops_of(graph.nodes[group.anchor]), device)
        if group.kind == "epilogue":
            # An epilogue is counted on top of its pointwise group already being fused.
            base = group.extends
            b_reads, b_escapes = io[id(base)] if id(base) in io else \
                external_io(graph, base.members if base else [m for m in group.members if m != group.anchor])
            unfused = graph.nodes[group.anchor].bytes + sum(b_reads.values()) + sum(b_escapes.values())
            kernels = 2
        rate = device.matmul_flops if matmul else device.flops
        # An epilogue's saving is counted by bytes (est_time_saved_us); its prediction stays the plain roofline.
        hbm = fused if group.kind == "epilogue" else fused - l2_resident_bytes(graph, group.members, reads, device,
                                                                                traffic)
        programs = row_programs_s(*group.rows, row_streams(graph, reads, escapes, group.rows[1])) \
            if group.rows and group.kind == "fusion" and device.type == "cuda" else 0.0
        predicted = max(hbm / device.bandwidth_Bps * 1e6, flops / rate * 1e6, programs * 1e6) + device.launch_us
        yield GroupCost(int(unfused), int(fused), kernels, measured, predicted, between, in_anchor_kernel_us=in_anchor,
                        gemm_takeover_us=takeover, timeline_us=timeline)


def timeline_us(node, device: DeviceModel) -> float:
    """What the node's kernels take of the GPU's timeline: each at least one launch (`launch_us` is measured as
    the cost of one tiny kernel in a CUDA graph of them: a 1 µs kernel still holds the stream that long). Their
    durations alone had put chains of tiny kernels at about half of what fusing them measured (T5's position
    buckets 23 vs 39 µs, RoBERTa's position ids 7 vs 18, reports/zoo/tiny-kernel-chains-without-floor); with the floor they still
    measured 1.3-2.3x the estimate in reports/zoo/tiny-kernel-chains-with-floor, within those rounds' spread."""
    if device.type != "cuda" or not node.kernel_spans:
        return node.time_us
    return sum(max(span[2], device.launch_us) for span in node.kernel_spans)


def gemm_takeover_us(gemm, flops: float, device: DeviceModel) -> float:
    """What running the product `gemm` as our Triton GEMM instead of cuBLAS adds, on the GPU: its measured time on a
    GPU trace (cuBLAS's), else the GPU table's roofline of it, times (`triton_gemm_slowdown`(K) - 1)."""
    if device.type == "cuda":
        cublas_us = gemm.time_us
    else:
        t = DEFAULT_DEVICE["cuda"]
        cublas_us = max(flops / t["matmul_flops"], gemm.bytes / t["bandwidth_Bps"]) * 1e6
    return (triton_gemm_slowdown(_reduction_length(gemm)) - 1.0) * cublas_us


def padded_cost(graph: Graph, group: Group, device: DeviceModel) -> GroupCost:
    """A padded GEMM: it moves what the GEMM moved plus the pad copies (so `bytes_saved` is negative: padding
    costs traffic, it saves time), and is predicted at the padded product's FLOP roofline plus the copies."""
    n = graph.nodes[group.members[0]]
    pad = unaligned_gemm(n)
    return GroupCost(n.bytes, n.bytes + pad.copy_bytes, max(len(n.kernels), 1), n.time_us, padded_us(pad, device),
                     0, pad)


def padded_us(pad: PaddedGemm, device: DeviceModel) -> float:
    """The padded GEMM at its FLOP roofline plus each pad copy at the copy bandwidth, each one launch."""
    return (pad.padded_flops / device.matmul_flops * 1e6 + pad.copy_bytes / device.bandwidth_Bps * 1e6
            + (1 + pad.copies) * device.launch_us)


SLOW_UNALIGNED = 2.0  # a GPU trace's unaligned GEMM is worth padding when it measured this far above its roofline


def padding_pays(cost: GroupCost, device: DeviceModel) -> bool:
    """Whether a padded_matmul group is a candidate. On a GPU trace, by its measured time: far above the
    unpadded GEMM's roofline (cuBLAS did drop to an unaligned kernel: some shapes it runs well regardless)
    and above the padded prediction. A CPU trace measured CPU kernels: the unaligned GEMM is a GPU trap,
    reported at every size with the GPU model's estimate (`bytes_model_saved_us`), zero where padding
    would not pay."""
    if device.type != "cuda":
        return True
    pad = cost.padded
    roofline = pad.flops / device.matmul_flops * 1e6 + device.launch_us
    return cost.measured_us > SLOW_UNALIGNED * roofline and cost.measured_us > cost.predicted_fused_us


def est_time_saved_us(cost: GroupCost, group: Group, device: DeviceModel) -> float:
    if cost.in_anchor_kernel_us is not None:
        return max(cost.in_anchor_kernel_us, 0.0)
    if group.kind == "epilogue":
        # Incremental: the matmul output's round trip and one launch disappear; our GEMM is slower than cuBLAS's.
        # (A CPU trace's takeover is the GPU's: `bytes_model_saved_us` takes it off.)
        takeover = cost.gemm_takeover_us if device.type == "cuda" else 0.0
        return max(cost.bytes_saved / device.bandwidth_Bps * 1e6 + device.launch_us - takeover, 0.0)
    unfused = cost.measured_us if cost.timeline_us is None else cost.timeline_us
    return max(unfused - cost.predicted_fused_us, 0.0)


def gpu_model() -> DeviceModel:
    """The GPU a CPU trace's savings are stated for: the default table's bandwidth and launch cost."""
    t = DEFAULT_DEVICE["cuda"]
    return DeviceModel("cuda", "GPU (bytes model)", t["bandwidth_Bps"], t["launch_us"], t["flops"], t["matmul_flops"],
                       "table")


def bytes_model_saved_us(cost: GroupCost, device: DeviceModel) -> float:
    """What fusing saves by the bytes model alone: the bytes no longer moved at `device`'s bandwidth plus the
    launches no longer made. What a CPU trace's candidates would save on a GPU: the fused kernels are Triton
    kernels, which on the CPU run in the interpreter, so a share of the CPU time is no promise at all.
    A padded GEMM saves no bytes: the unaligned kernel's modelled time less the padded one's."""
    if cost.padded is not None:
        pad = cost.padded
        unaligned = pad.flops / DEFAULT_DEVICE["cuda"]["unaligned_matmul_flops"] * 1e6
        return max(unaligned + device.launch_us - padded_us(pad, device), 0.0)
    saved = max(cost.bytes_saved, 0) / device.bandwidth_Bps * 1e6 + max(cost.kernels - 1, 0) * device.launch_us
    return max(saved - cost.gemm_takeover_us, 0.0)


def _flops(node) -> float:
    """Arithmetic of one op, by its registry entry's flops rule."""
    info = lookup(node.op)
    if info is not None and info.flops == "matmul" and len(node.reads) >= 2 and node.writes:
        return 2.0 * math.prod(node.writes[0].shape or (1,)) * _reduction_length(node)
    return float(math.prod(node.writes[0].shape)) if node.writes and node.writes[0].shape else 0.0


def _reduction_length(matmul) -> int:
    """K of a product: the last dim of its first operand of two or more dims (linear's x, addmm's mat1, mm's a)."""
    shapes = [u.shape for u in matmul.reads if len(u.shape) >= 2]
    return shapes[0][-1] if shapes else 1
