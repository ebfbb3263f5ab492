"""The element types refit moves: one table, read by the model spec, the planners, the
safetensors reader/writer and the executor.

Each row names a dtype the way refit does (and torch does), its width, its safetensors header
code, and the attribute of the ``torch`` module that holds it — a string, so that planning stays
torch-free; the executor resolves it with ``getattr(torch, dtype.torch)``.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str  # refit's name (a ModelConfig.dtype, a TensorSpec.dtype)
    nbytes: int  # bytes per element
    safetensors: str  # code in a .safetensors header
    torch: str  # attribute of the torch module


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("bfloat16", 2, "BF16", "bfloat16"),
    DType("float16", 2, "F16", "float16"),
    DType("float32", 4, "F32", "float32"),
    DType("float8_e4m3fn", 1, "F8_E4M3", "float8_e4m3fn"),
    DType("uint8", 1, "U8", "uint8"),  # MXFP8's e8m0 block scales, as vLLM holds them
)}

# Views of the table for the hot loops of planning and for the safetensors header codes.
DTYPE_BYTES: dict[str, int] = {name: d.nbytes for name, d in DTYPES.items()}
FROM_SAFETENSORS: dict[str, str] = {d.safetensors: name for name, d in DTYPES.items()}
TO_SAFETENSORS: dict[str, str] = {name: d.safetensors for name, d in DTYPES.items()}
