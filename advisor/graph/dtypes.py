"""Dtypes as the traces spell them: by name (mapped to torch's names and sizes), by c10::ScalarType code
(how the execution trace, and so a program, writes a dtype argument), and the torch.dtype of either.

torch is imported only where a torch.dtype is asked for: the graph builder and the analyzer read names."""
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

# c10::ScalarType codes (stable across torch releases) -> torch's dtype names. Codes 12-14 are the
# quantized types, which no program holds.
SCALAR_TYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
                7: "float64", 8: "complex32", 9: "complex64", 10: "complex128", 11: "bool", 15: "bfloat16"}
_SCALAR_TYPE_CODES = {name: code for code, name in SCALAR_TYPES.items()}


def torch_dtype_name(trace_name: str) -> str:
    """'c10::BFloat16' -> 'bfloat16'; unknown names pass through unchanged."""
    return _ALIASES.get(trace_name, trace_name)


def short(trace_name: str) -> str:
    n = torch_dtype_name(trace_name)
    return _SHORT.get(n, n)


def torch_dtype(name: str):
    """The torch.dtype a program names ('bfloat16'); ValueError for a name torch has no dtype of."""
    import torch

    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def scalar_type(code: int):
    """The torch.dtype of a c10::ScalarType code; ValueError for a code the table does not hold."""
    if code not in SCALAR_TYPES:
        raise ValueError(f"unknown ScalarType code {code}")
    return torch_dtype(SCALAR_TYPES[code])


def scalar_type_code(dtype) -> int:
    """The c10::ScalarType code of a torch.dtype: how a trace writes it as an argument."""
    return _SCALAR_TYPE_CODES[str(dtype).removeprefix("torch.")]
