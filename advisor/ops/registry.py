"""The op registry: the one place that knows what an aten op is.

Every stage asks here: the graph builder (is this op a view to see through, or a node?), the analyzer
(which class, which fusion rules apply, how it is costed), the generator (how it lowers to Triton, or
why it is not generated). An op missing from the registry is a fusion barrier, listed by name in the
analysis, never a crash.

One entry per op holds all of that. The lowerings themselves (Triton emit functions, which need torch)
are written in `advisor.ops.lowering`, which attaches each to its entry through `LOWERINGS`; attaching
one to an op the registry does not know fails at import, so the generator cannot hold a lowering the
graph never reaches. An op the analyzer may fuse carries a lowering or a `not_generated` reason
(tests/test_registry.py holds that). Arguments are read by schema name through `advisor.ops.args`.

No other module spells an op's name (tests/test_registry.py holds that too): a family a stage asks about
is a tag on the entries (`tagged(name, "identity_copy")`), and the few facts that are a mapping or a
sequence rather than a family (other spellings of one op, the call that runs a GEMM, ...) are small
tables defined here, next to the entries, each with the stage that reads it.
"""
from __future__ import annotations

import functools

from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace
from enum import Enum


class OpClass(str, Enum):
    POINTWISE = "pointwise"  # elementwise, incl. type conversion and broadcasting
    REDUCTION = "reduction"  # sum/mean/amax/... and softmax-like row ops
    NORM = "norm"  # layer_norm, rms_norm, group_norm, batch_norm
    MATMUL = "matmul"  # mm/addmm/bmm/conv: fusion anchors (epilogues fuse into them)
    ATTENTION = "attention"  # fused attention kernels: barriers
    VIEW = "view"  # metadata only: see through to the ops inside
    COMPOSITE = "composite"  # calls other ops that do the work: see through to them
    DATA_MOVEMENT = "data_movement"  # cat, gather, index, transposing copies
    ALLOC = "alloc"  # allocation / no data touched
    COMMUNICATION = "communication"  # collectives and point-to-point (c10d, NCCL, gloo): barriers, never fused
    OTHER = "other"  # unknown to the registry: a barrier


# Classes whose ops never become graph nodes: the graph builder descends into their children.
TRANSPARENT = frozenset({OpClass.VIEW, OpClass.COMPOSITE, OpClass.ALLOC})
# Classes that are memory-bound: what the report calls "time in memory-bound kernels".
MEMORY_BOUND = frozenset({OpClass.POINTWISE, OpClass.REDUCTION, OpClass.NORM, OpClass.DATA_MOVEMENT})


@dataclass(frozen=True)
class OpInfo:
    name: str  # "aten::add" (overload-free)
    cls: OpClass
    inplace: bool = False  # writes its first tensor argument
    # Families the fusion rules ask about: rowwise (last-dim row ops), grouped, batchnorm, fusible_cat,
    # convert, factory, window (max-pooling); and those other stages ask about (`_tag` below says who and why).
    tags: frozenset = field(default_factory=frozenset)
    # Cost model. Bytes: every op moves its tensors' true sizes (read and written), whatever the op.
    # Flops: "output" counts one per output element; "matmul" 2 * output * K.
    flops: str = "output"
    # GEMMs: the role of each argument position, space-separated: `a` ([.., M, K]), `b` ([.., K, N]), `w`
    # (a [N, K] weight: linear's), `bias` (broadcast to the output), `-` (not a tensor). What the alignment
    # rule (`advisor.analysis.alignment`) reads to find M, N, K and which tensors a padded GEMM copies.
    gemm: str = ""
    # Code generation: the `advisor.ops.lowering.Lowering` attached to this entry, or why none is.
    lowering: object = None
    not_generated: str = ""

    @property
    def short(self) -> str:
        return self.name.split("::", 1)[-1]


_REGISTRY: dict[str, OpInfo] = {}


def register(name: str, cls: OpClass, **kw) -> OpInfo:
    info = OpInfo(name=name, cls=cls, **kw)
    _REGISTRY[name] = info
    return info


def not_generated(reason: str, names: str) -> None:
    """Mark registered ops (and their in-place twins) as never generated, with the reason users see."""
    for short in names.split():
        for name in (f"aten::{short}", f"aten::{short}_"):
            if name in _REGISTRY:
                _REGISTRY[name] = replace(_REGISTRY[name], not_generated=reason)


class _Lowerings(MutableMapping):
    """The lowering of every op that has one, as a mapping: a view of the registry entries (writing
    one attaches it to its entry; an op the registry does not know is refused)."""

    def __getitem__(self, name: str):
        low = _REGISTRY[name].lowering if name in _REGISTRY else None
        if low is None:
            raise KeyError(name)
        return low

    def __setitem__(self, name: str, low) -> None:
        if name not in _REGISTRY:
            raise KeyError(f"{name} has a lowering but no registry entry: the graph would never reach it")
        _REGISTRY[name] = replace(_REGISTRY[name], lowering=low)

    def __delitem__(self, name: str) -> None:
        self[name]  # KeyError when there is none
        _REGISTRY[name] = replace(_REGISTRY[name], lowering=None)

    def __iter__(self):
        return iter([name for name, info in _REGISTRY.items() if info.lowering is not None])

    def __len__(self) -> int:
        return sum(1 for info in _REGISTRY.values() if info.lowering is not None)


LOWERINGS = _Lowerings()


def lookup(name: str) -> OpInfo | None:
    """The registry entry for an op name ("aten::add" or "aten::add.Tensor"); None if unknown. Communication
    (`is_communication`) has an entry of class COMMUNICATION whatever its name."""
    info = _REGISTRY.get(name)
    if info is None and "." in name.split("::", 1)[-1]:
        info = _REGISTRY.get(name.rsplit(".", 1)[0])
    if info is None and is_communication(name):
        return _communication(name)
    return info


# Communication: torch.distributed's ops (c10d's and the functional collectives'), the backends' own scopes
# (`gloo:all_reduce`, `nccl:all_reduce`, `record_param_comms`) and NCCL's kernels (`ncclDevKernel_AllReduce_...`).
# Each is a barrier the analyzer never fuses (class COMMUNICATION is in no fusion rule) and the reports count
# apart (analysis.json's `communication`). Named by namespace or backend, or by a collective's name, which no
# aten op shares ("broadcast" alone would be aten's `broadcast_tensors`).
COMM_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::", "_c10d_functional_autograd::", "_dtensor::")
COMM_BACKENDS = ("nccl", "gloo:", "ucc:", "mpi:", "record_param_comms")
COMM_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "reducescatter", "alltoall",
              "all_to_all", "sendrecv")


def is_communication(name: str) -> bool:
    """Whether NAME (an op, a record-function scope or a kernel) is communication between ranks."""
    low = str(name).lower()
    return low.startswith(COMM_NAMESPACES + COMM_BACKENDS) or any(w in low for w in COMM_WORDS)


_COMM_ENTRIES: dict[str, OpInfo] = {}


def _communication(name: str) -> OpInfo:
    info = _COMM_ENTRIES.get(name)
    if info is None:
        info = _COMM_ENTRIES[name] = OpInfo(name=name, cls=OpClass.COMMUNICATION,
                                            not_generated="communication between ranks: never fused")
    return info


def tagged(name: str, tag: str) -> bool:
    """Whether the op belongs to a family the rules ask about ("window", "batchnorm", ...)."""
    info = lookup(name)
    return info is not None and tag in info.tags


def torch_function_op(fn) -> str | None:
    """The aten op a torch function runs, by name ("aten::scaled_dot_product_attention" for
    `torch.nn.functional.scaled_dot_product_attention`, a builtin of `torch._C._nn`; "aten::relu" for the Python
    function `torch.nn.functional.relu`, which dynamo keeps as it is): how a node of a dynamo graph, which calls
    torch's Python functions rather than aten ops, is read. None for anything else."""
    try:
        return _torch_function_op(fn)
    except TypeError:  # an unhashable callable: not one of torch's functions
        return None


@functools.lru_cache(maxsize=1024)  # (asked for every node of every graph captured)
def _torch_function_op(fn) -> str | None:
    name, module = getattr(fn, "__name__", None), getattr(fn, "__module__", None) or ""
    if not name or not (module in ("torch", "torch.nn.functional") or module.startswith("torch._C")):
        return None
    import torch  # (the registry reads traces without torch loaded; only graphs need it)

    packet = getattr(torch.ops.aten, name, None) if not name.startswith("__") else None
    return f"aten::{name}" if packet is not None else None


# Python's operators as a dynamo graph calls them on tensors (`x * 0.5`): the aten op each runs
PYTHON_OPERATORS = {"mul": "aten::mul", "add": "aten::add", "sub": "aten::sub", "truediv": "aten::div",
                    "pow": "aten::pow", "neg": "aten::neg", "abs": "aten::abs"}


def graph_node_op(kind: str, target) -> str | None:
    """The aten op a node of a dynamo graph runs: a torch function (`torch_function_op`), one of Python's operators
    (`operator.mul`), or a tensor method by name (`x.pow(3)`, kind "call_method"); None for anything else."""
    if kind == "call_method":
        return f"aten::{target}" if isinstance(target, str) and lookup(f"aten::{target}") else None
    if kind != "call_function":
        return None
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return PYTHON_OPERATORS.get(getattr(target, "__name__", ""))
    return torch_function_op(target)


def op_class(name: str) -> OpClass:
    info = lookup(name)
    return info.cls if info else OpClass.OTHER


def is_aten(name: str) -> bool:
    return name.startswith(("aten::", "prims::", "_c10d", "c10d::"))


# Annotations that look like ops but are scopes: our own module/region markers, and autograd's engine
# wrapping each backward node it runs (`autograd::engine::evaluate_function: MmBackward0`, the
# gradient accumulator): the aten ops inside are the work.
_SCOPES = ("nn.Module::", "advisor.region::", "autograd::engine::", "torch::autograd::")


# Scopes that say which part of a training step an op ran in (everything else is the forward): autograd's
# engine wraps each backward node it runs; torch.optim wraps an optimizer's step and zero_grad.
PHASE_SCOPES = {"backward": ("autograd::engine::evaluate_function",),
                "optimizer": ("Optimizer.step#", "Optimizer.zero_grad#")}


def is_operator(name: str) -> bool:
    """An op from some namespace (`aten::add`, `mylib::fused_thing`), as opposed to a user scope."""
    return "::" in name and not name.startswith(_SCOPES)


def all_ops() -> dict[str, OpInfo]:
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# The table. Pointwise ops also register their in-place twin ("add_"): same math, writes self.
_UNARY = """abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal sin cos tan asin acos atan
sinh cosh tanh asinh acosh atanh sigmoid relu relu6 gelu silu mish softplus hardswish hardsigmoid
hardtanh leaky_relu elu selu celu erf erfc erfinv floor ceil round trunc frac sign sgn bitwise_not
logical_not isnan isinf isfinite nan_to_num square positive logit threshold glu_jvp clamp clamp_min
clamp_max sin_ cos_ lgamma digamma signbit fill zero""".split()
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod pow float_power atan2 hypot maximum
minimum fmax fmin eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and bitwise_or
bitwise_xor copysign xlogy lerp addcmul addcdiv masked_fill where heaviside""".split()
# Other names of the ops above (torch.fix, torch.clip, ...): their own aten ops, one node each.
_ALIASES = "fix clip absolute negative".split()
_CONVERT = "_to_copy copy clone alias_copy _autocast_to_reduced_precision".split()
# Identity in eval: the registry treats them as pointwise (the generator lowers them to a copy/no-op).
_IDENTITY_IN_EVAL = "dropout native_dropout feature_dropout alpha_dropout".split()

for _n in _UNARY + _BINARY + _ALIASES + _CONVERT + _IDENTITY_IN_EVAL:
    register(f"aten::{_n}", OpClass.POINTWISE)
    register(f"aten::{_n.rstrip('_')}_", OpClass.POINTWISE, inplace=True)
register("aten::copy_", OpClass.POINTWISE, inplace=True, tags=frozenset({"convert"}))
# `_to_copy` may also move a tensor between devices: patching makes host-to-GPU ones recordable.
_REGISTRY["aten::_to_copy"] = replace(_REGISTRY["aten::_to_copy"], tags=frozenset({"device_copy"}))
# A fresh host copy of a graph's tensor constant (dynamo's graphs; never a GPU kernel).
register("aten::lift_fresh_copy", OpClass.COMPOSITE, tags=frozenset({"constant_lift"}))
register("aten::fill_", OpClass.POINTWISE, inplace=True)
register("aten::zero_", OpClass.POINTWISE, inplace=True)

# Reductions (over their `dim` argument; none = every dim) and row ops (over `dim`).
for _n in """sum mean amax amin max min prod var std var_mean std_mean norm linalg_vector_norm logsumexp
argmax argmin all any""".split():
    register(f"aten::{_n}", OpClass.REDUCTION)
for _n in ["softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"]:
    register(f"aten::{_n}", OpClass.REDUCTION, tags=frozenset({"rowwise"}))
for _n in ["cumsum", "cumprod"]:
    register(f"aten::{_n}", OpClass.DATA_MOVEMENT)  # scans: not fused in this version

# Norms over the last dim(s); batch_norm is per-channel and pointwise in eval.
for _n in ["layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"]:
    register(f"aten::{_n}", OpClass.NORM, tags=frozenset({"rowwise"}))
for _n in ["group_norm", "native_group_norm"]:
    register(f"aten::{_n}", OpClass.NORM, tags=frozenset({"grouped"}))
for _n in ["batch_norm", "_batch_norm_impl_index", "native_batch_norm", "cudnn_batch_norm",
           "_native_batch_norm_legit", "miopen_batch_norm"]:
    register(f"aten::{_n}", OpClass.NORM, tags=frozenset({"batchnorm"}))  # `training` read by name
register("aten::_native_batch_norm_legit_no_training", OpClass.NORM, tags=frozenset({"batchnorm"}))

# Fusion anchors.
for _n in ["mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm", "dot",
           "mv", "addmv", "einsum", "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
           "cudnn_convolution", "cudnn_convolution_relu", "cudnn_convolution_add_relu",
           "mkldnn_convolution", "_scaled_mm", "_int_mm", "conv_transpose2d", "embedding_bag",
           "_fused_linear_gelu"]:
    register(f"aten::{_n}", OpClass.MATMUL, flops="matmul")
for _n, _roles in [("mm", "a b"), ("bmm", "a b"), ("matmul", "a b"), ("linear", "a w bias"), ("addmm", "bias a b"),
                   ("baddbmm", "bias a b")]:
    register(f"aten::{_n}", OpClass.MATMUL, flops="matmul", gemm=_roles)

# The activations cuBLASLt applies in a GEMM's own epilogue (`torch._addmm_activation`: ReLU, and GELU as its tanh
# approximation), read after a linear by `patching.gemm_epilogues`.
LINEAR = "aten::linear"
ADDMM = "aten::addmm"  # (the form HF's Conv1D calls: GPT-2's MLP)
GEMM_EPILOGUE_ACTIVATIONS = {"aten::relu": "relu", "aten::gelu": "gelu"}


def cublaslt_epilogue(ops) -> bool:
    """Whether a pattern's ops are a linear and one activation cuBLASLt's epilogue applies."""
    return len(ops) == 2 and ops[0] == LINEAR and ops[1] in GEMM_EPILOGUE_ACTIVATIONS


for _n in ["scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_attention_math", "_flash_attention_forward", "_efficient_attention_forward",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"]:
    register(f"aten::{_n}", OpClass.ATTENTION)
# What the kernels of SDPA's fused backends are called (cuDNN's `..._sdpa_...`, FlashAttention's `flash_fwd...`,
# the memory-efficient `fmha_cutlass...`): an attention op that launched none of them ran SDPA's math backend
# (`analysis.attention_backends`).
FUSED_ATTENTION_KERNELS = ("sdpa", "flash", "fmha", "attention")


def is_fused_attention_kernel(kernel: str) -> bool:
    return any(fragment in kernel.lower() for fragment in FUSED_ATTENTION_KERNELS)


def fused_attention_refuses(last_size: int, last_stride: int) -> bool:
    """Whether an attention input's last dimension (its size and stride) keeps SDPA's fused kernels on CUDA off:
    every one of them needs stride 1 there (a dimension of one element has no stride to speak of)."""
    return last_size > 1 and last_stride != 1


# Their arguments for a mask added to the scores, and for causal masking done by the kernel itself
# (`patching.causal_masks`: a constant causal mask becomes `is_causal`).
ATTENTION_MASKS = ("attn_mask", "attn_bias")
ATTENTION_CAUSAL = "is_causal"

for _n in """view _unsafe_view reshape _reshape_alias flatten unflatten squeeze unsqueeze transpose t permute
expand expand_as slice select narrow split split_with_sizes chunk unbind as_strided detach alias
view_as unfold diagonal movedim swapaxes numpy_T real imag view_as_real view_as_complex lift_fresh
_conj resolve_conj resolve_neg squeeze_ unsqueeze_ transpose_ t_ as_strided_ set_ align_to
split_with_sizes_copy""".split():
    register(f"aten::{_n}", OpClass.VIEW)

# Composite ops: they launch nothing themselves; what they call does the work.
for _n in """to type_as contiguous dropout_ repeat_interleave expand_copy silu_backward
flatten_dense_tensors _has_compatible_shallow_copy_type""".split():
    register(f"aten::{_n}", OpClass.COMPOSITE)

for _n in """cat stack gather scatter scatter_add index index_select index_put index_put_ embedding
take masked_select masked_scatter repeat tile roll flip narrow_copy _index_put_impl_ constant_pad_nd pad
adaptive_avg_pool2d avg_pool2d _adaptive_avg_pool2d triu tril
sort topk arange linspace one_hot nonzero upsample_nearest2d upsample_bilinear2d im2col col2im
_unsafe_index slice_scatter select_scatter""".split():
    register(f"aten::{_n}", OpClass.DATA_MOVEMENT)
register("aten::cat", OpClass.DATA_MOVEMENT, tags=frozenset({"fusible_cat"}))
# Window reductions: each output element is the max over a window of the input. They end a fusion group (the
# chain before one is evaluated at each tap: `analysis.fusion`, rule 11), never start or extend one.
for _n in ["max_pool2d", "max_pool2d_with_indices"]:
    register(f"aten::{_n}", OpClass.DATA_MOVEMENT, tags=frozenset({"window"}))

for _n in """empty empty_like empty_strided new_empty new_empty_strided zeros_like_alloc resize_ _local_scalar_dense
item is_nonzero record_stream _assert_async size stride numel dim is_same_size result_type
_nested_tensor_from_mask_left_aligned scalar_tensor _to_dense _shape_as_tensor sym_size sym_stride
_assert_tensor_metadata lift to_dense""".split():
    register(f"aten::{_n}", OpClass.ALLOC)
# Factories that write memory: pointwise fills with no tensor inputs.
for _n in ["zeros", "ones", "zeros_like", "ones_like", "full_like", "rand", "randn", "randint",
           "rand_like", "randn_like", "normal_", "uniform_", "bernoulli_", "random_", "new_zeros",
           "new_ones", "new_full", "scalar_tensor_fill"]:
    register(f"aten::{_n}", OpClass.DATA_MOVEMENT, tags=frozenset({"factory"}))
# A constant tensor: pointwise (one literal at every index), so a kernel holds it in registers. Derived
# backwards pad a slice's gradient with it (`advisor.patching.backward`: slice_backward as a cat).
register("aten::full", OpClass.POINTWISE, tags=frozenset({"factory"}))
# Ops that are the identity outside training (`training=False`): what reads through them reads their input
IDENTITY_IN_EVAL = frozenset(f"aten::{_n}" for _n in _IDENTITY_IN_EVAL)
# Ops that draw random numbers (dropout in training mode; the others always): a call that runs one cannot
# be run twice and compared (`patching.verify.eval_if_unrepeatable`).
RANDOM = frozenset(f"aten::{_n}" for _n in [*_IDENTITY_IN_EVAL, *(f"{n}_" for n in _IDENTITY_IN_EVAL), "rand", "randn",
                   "randint", "rand_like", "randn_like", "randint_like", "randperm", "normal", "normal_", "uniform_",
                   "bernoulli", "bernoulli_", "random_", "multinomial", "exponential_", "geometric_", "cauchy_",
                   "log_normal_", "rrelu", "rrelu_with_noise", "poisson"])


# Arguments that make an op draw random numbers where they are non-zero: fused attention's own dropout
# (`_scaled_dot_product_flash_attention(..., dropout_p, ...)` and its siblings, in training mode).
RANDOM_ARGUMENTS = ("dropout_p",)


def draws_random(name: str, arguments: dict | None = None) -> bool:
    """Whether the op ("aten::bernoulli_" or with its overload, "aten::bernoulli_.float") draws random numbers;
    `arguments` (by name), where given, are read for `RANDOM_ARGUMENTS`."""
    if name in RANDOM or name.rsplit(".", 1)[0] in RANDOM:
        return True
    return bool(arguments) and any(arguments.get(a) for a in RANDOM_ARGUMENTS)


def _tag(tag: str, names: str) -> None:
    """Add `tag` to these registered ops (exactly these: in-place twins are named where they belong)."""
    for short in names.split():
        name = f"aten::{short}"
        if name not in _REGISTRY:
            raise KeyError(f"{name} is tagged {tag!r} but has no registry entry")
        _REGISTRY[name] = replace(_REGISTRY[name], tags=_REGISTRY[name].tags | {tag})


# Families the other stages ask about (after every entry is registered: registering again replaces one).
# Matching a program in a captured FX graph (`patching.match`): copies that change nothing when they keep the
# layout (eager's eval-mode dropout returns its input, the functional capture writes `clone`): seen through
# like views.
_tag("identity_copy", "clone")
# Derived backwards (`patching.backward`): the reductions autograd reduces a broadcast operand's gradient
# with (a reduction over other dims than the last: a column reduction, cut from the kernel) ...
_tag("column_reduction", "sum mean")
# ... and what may follow one on its way to a gradient (a clone: the gradient of a select that needs no zero
# padding), all of it done by `Tensor.sum_to_size` instead.
_tag("reduction_tail", "sum _to_copy clone")
# Ops whose backward reads none of their operands: eager's autograd saves nothing for them (the estimate of
# what eager keeps between the passes; their in-place twins count the same).
_tag("saves_nothing", "add sub neg _to_copy clone rsub")
# The SPLADE head's projection (`patching.splade`) as a trace records it (linear) or as the dispatcher does
# (addmm / mm on the flattened rows and the transposed weight); its operands are read by their `gemm` roles.
_tag("projection", "linear addmm mm")
# Matmuls the matmul-anchored generator (`codegen.matmul`) takes as the kernel's anchor: every one whose
# arguments it reads by their `gemm` roles.
_tag("matmul_anchor", "linear mm addmm matmul bmm baddbmm")
# Softmaxes flash attention (`codegen.attention`) computes online; the safe one gives 0 on a row of -inf
# scores, not NaN.
_tag("softmax", "softmax _softmax _safe_softmax")
_tag("safe_softmax", "_safe_softmax")
# The families a group is named after (`analysis.patterns`), beside "softmax", "grouped" (GroupNorm) and
# "batchnorm" above: a LayerNorm however a trace spells it, and a LogSoftmax (a loss's, not attention's).
_tag("layer_norm", "layer_norm native_layer_norm")
_tag("log_softmax", "log_softmax _log_softmax")
# Ops flash attention lets through between the softmax and P @ V: identities on the values (eval dropout,
# copies, a dtype conversion).
_tag("attention_identity", """dropout feature_dropout alpha_dropout native_dropout clone _to_copy contiguous
alias alias_copy positive""")
# Validation's inputs (`validate.inputs`): ops whose output is positive where their input is (copies,
# conversions, eval dropout, abs), so an op that needs positive values (log, sqrt, ...) reading one gets that
# input drawn positive (in-place twins count the same) ...
_tag("keeps_positive", """_to_copy clone copy alias_copy contiguous _autocast_to_reduced_precision dropout
native_dropout abs""")
# ... and powers, whose base must be positive where the exponent is a fractional float.
_tag("power", "pow pow_")

# Other spellings of one op: the capture and a replay of the trace may spell the same math and kernel
# differently (`patching.match` compares ops under these names; decompositions need no entry there, both
# sides are traced).
SPELLINGS = {"aten::true_divide": "aten::div", "aten::_unsafe_view": "aten::view"}

# The SPLADE head after its projection, op by op (`patching.splade` trains exactly this chain through its
# hand-written Function): relu, log1p, times the mask, max over the sequence.
SPLADE_CHAIN = ("aten::relu", "aten::log1p", "aten::mul", "aten::amax")

# Reductions a matmul-reduction kernel (`codegen.matmul_reduce`) folds over the leading dims, by how it
# combines the tiles.
REDUCE_KINDS = {"aten::amax": "max", "aten::amin": "min", "aten::sum": "sum", "aten::mean": "mean"}

# Score arithmetic that `scaled_dot_product_attention` takes as its own arguments (`codegen.attention`'s SDPA
# alternative): multiplying or dividing the scores by a scalar is its `scale` (by the operator that says
# which), adding a tensor its `attn_mask`.
SDPA_SCALE = {"aten::mul": "*", "aten::div": "/"}
SDPA_MASK = "aten::add"

# Each GEMM as the PyTorch call that runs it on padded operands (`codegen.padded`): a, b, bias are its `gemm`
# roles, beta and alpha its scalars.
GEMM_CALLS = {
    "aten::linear": "torch.nn.functional.linear(a, b, {bias})",
    "aten::mm": "torch.mm(a, b)",
    "aten::bmm": "torch.bmm(a, b)",
    "aten::matmul": "torch.matmul(a, b)",
    "aten::addmm": "torch.addmm(bias, a, b, beta={beta!r}, alpha={alpha!r})",
    "aten::baddbmm": "torch.baddbmm(bias, a, b, beta={beta!r}, alpha={alpha!r})",
}
# An eval conv's epilogue that cuDNN runs inside the conv's own kernel once a BatchNorm is folded into the conv's
# weight and bias (`codegen.conv`), by role: the conv, then optionally the norm and a residual add, then the ReLU
# (the one activation cuDNN's fused conv applies).
CONV_EPILOGUE = {"aten::conv2d": "conv", "aten::batch_norm": "norm", "aten::add": "add", "aten::add_": "add",
                 "aten::relu": "relu", "aten::relu_": "relu"}
CONV_ROLES = ("conv", "norm", "add", "relu")  # their order in an epilogue


def is_conv(name: str) -> bool:
    """A convolution (an anchor: `MATMUL` class)."""
    return "conv" in name.split("::")[-1]


def conv_epilogue_fits(ops: list[str]) -> bool:
    """Whether `ops` (the conv first) are an epilogue cuDNN's fused conv runs: conv [norm] [add] relu, each once.
    Any other conv epilogue (BatchNorm + hardswish or SiLU, an add without a ReLU) would be a conv then a pointwise
    kernel, which the pointwise group alone already is: measured no faster (docs/EXPERIMENTS.md: conv_bn_paths)."""
    roles = [CONV_EPILOGUE.get(o) for o in ops]
    if not roles or None in roles or roles[0] != "conv" or roles[-1] != "relu":
        return False
    ranks = [CONV_ROLES.index(r) for r in roles]
    return ranks == sorted(set(ranks))


for _table in (SPELLINGS, SPELLINGS.values(), SPLADE_CHAIN, REDUCE_KINDS, SDPA_SCALE, (SDPA_MASK,), GEMM_CALLS,
               CONV_EPILOGUE):
    for _n in _table:
        if _n not in _REGISTRY:
            raise KeyError(f"{_n} is in a registry table but has no registry entry")

# Ops the analyzer may fuse that the generator does not lower, and why (the reason reaches the user).
not_generated("no Triton math for it that runs in the interpreter as on the GPU (core tl has none; "
              "libdevice does not run in the interpreter)", "lgamma digamma erfinv")
not_generated("a backward helper, not seen in inference graphs", "glu_jvp")
not_generated("the training-mode variant normalises by batch statistics", "_native_batch_norm_legit")
not_generated("returns cuDNN/MIOpen reserve buffers and a backend index: call batch_norm instead",
              "_batch_norm_impl_index")
