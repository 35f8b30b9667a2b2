"""Dtype names as the traces spell them, mapped to torch's names and sizes."""
from __future__ import annotations

_ALIASES = {
    "float": "float32", "float32": "float32", "double": "float64", "float64": "float64",
    "c10::BFloat16": "bfloat16", "BFloat16": "bfloat16", "bfloat16": "bfloat16",
    "c10::Half": "float16", "Half": "float16", "float16": "float16",
    "long int": "int64", "long": "int64", "int64_t": "int64", "int64": "int64",
    "int": "int32", "int32": "int32", "short int": "int16", "signed char": "int8", "unsigned char": "uint8",
    "bool": "bool", "c10::complex<float>": "complex64", "c10::Float8_e4m3fn": "float8_e4m3fn",
}
_SHORT = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}


def torch_dtype_name(trace_name: str) -> str:
    """'c10::BFloat16' -> 'bfloat16'; unknown names pass through unchanged."""
    return _ALIASES.get(trace_name, trace_name)


def short(trace_name: str) -> str:
    n = torch_dtype_name(trace_name)
    return _SHORT.get(n, n)
