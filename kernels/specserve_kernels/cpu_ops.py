"""The C kernels' torch operators implemented in C++ (cpu_ops.cpp), for compiled graphs.

Compiled graphs call the kernels as torch operators (`torch.ops.specserve.int4_product`,
`paged_attention`). Implemented in Python, a call also runs the Python function and ctypes'
conversion of its arguments: a 576 x 576 int4 product of one row took 15.8 us through the
operator against 11.7 us with the same kernel behind a C++ implementation, and a batch-1 decode
step of the default model makes 151 such calls. So each operator's CPU implementation is
cpu_ops.cpp's where that builds (a C++ compiler and torch's headers; compiled on first use into
kernels/specserve_kernels/c_library.py's cache), calling the kernel the Python module loaded for this CPU, and the
Python function elsewhere: the two compute the same thing.

    implement(library, name, fallback, kernel)   register operator `name`'s CPU implementation
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
from collections.abc import Callable

import torch
import torch.utils.cpp_extension

from specserve_kernels import c_library

SOURCE = pathlib.Path(__file__).with_suffix(".cpp")


def implement(library: torch.library.Library, name: str, fallback: Callable,
              kernel: Callable[[], ctypes._CFuncPtr | None]) -> str:
    """Registers the CPU implementation of `library`'s operator `name` (its schema defined): the
    C++ one calling `kernel()` (a C function; None where the kernel does not run here) where
    cpu_ops.cpp loads, else `fallback`. Returns which: "c++" or "python"."""
    function = kernel() if _loads() else None
    if function is not None and _library().specserve_implement(name.encode(), ctypes.cast(function, ctypes.c_void_p)):
        return "c++"
    library.impl(name, fallback, "CPU")
    return "python"


@functools.cache
def _loads() -> bool:
    """Whether cpu_ops.cpp runs here (built now if not cached): where the C kernels do."""
    return c_library.runs(_library, "compiled graphs call the kernels through Python")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = c_library.load(SOURCE, _flags())
    lib.specserve_implement.restype = ctypes.c_int
    lib.specserve_implement.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    return lib


def _flags() -> tuple[str, ...]:
    """g++ flags for a library of torch operators, as torch.utils.cpp_extension builds one."""
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    library = torch.utils.cpp_extension.library_paths()[0]
    return ("-O2", "-std=c++20", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes,
            f"-L{library}", f"-Wl,-rpath,{library}", "-lc10", "-ltorch_cpu")
