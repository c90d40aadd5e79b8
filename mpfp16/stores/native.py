"""The fused step's hand-vectorized CPU kernels: Adam/AdamW's update and the overflow
check, in C++ on ATen's ``at::vec`` (mpfp16/stores/native.cpp), as torch's own fused CPU
Adam is written. The inductor kernels of mpfp16/stores/kernels.py do the same
arithmetic with more instructions per element; these run about level with torch's
fused AdamW (docs/BENCHMARKS.md, issue 29).

The library is built at first use, as inductor builds its kernels: with the C++
compiler ``$CXX`` (else ``c++``), torch's headers, the vector ISA torch's own CPU
kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``), and OpenMP, which
resolves to the runtime torch already loaded. It is kept under inductor's cache
directory (``$TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``), keyed by
the source, the flags, the compiler and the torch version, so a later run only loads
it. A build that fails raises ``OSError`` (a ``FileNotFoundError`` without a compiler),
one line that says why, which the fused step's compile agreement across ranks handles
as it handles an inductor compile that fails.

Used for Adam and AdamW on AVX2 and AVX-512 CPUs under Linux with round-to-nearest
weights (:func:`handles`); SGD, stochastic and Kahan rounding, remainders, other CPUs
and systems, and CUDA keep the inductor kernels.
"""

from __future__ import annotations

import ctypes
import functools
import getpass
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ..errors import last_error_line

logger = logging.getLogger("mpfp16")

__all__ = ["handles", "isa", "build", "load", "adam_update", "nonfinite", "DTYPES", "SOURCE"]

SOURCE = Path(__file__).with_name("native.cpp")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# The (weight, gradient) dtypes the library steps (native.cpp's mpfp16_adam).
PAIRS = {(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)}
# native.cpp's flag bits
COUPLED, DECOUPLED, MAXIMIZE, LERP_LOW, UNSCALE, CLIP = 1, 2, 4, 8, 16, 32

# The compiler flags of each vector ISA torch dispatches to (ATen's CPU_CAPABILITY).
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma", "-mf16c"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}

_LIBRARY: ctypes.CDLL | None = None
BUILD_S = 0.0  # seconds this process has spent building libraries (the test suite's rules leave them aside)


def handles(device: torch.device, weight_dtype: torch.dtype, grad_dtype: torch.dtype, rounding: str) -> bool:
    """Whether these kernels step a segment: on an AVX2 or AVX-512 CPU under Linux (the
    build's flags are GCC's and Clang's there), with round-to-nearest weights."""
    return device.type == "cpu" and rounding == "nearest" and (weight_dtype, grad_dtype) in PAIRS and _machine_ok()


@functools.cache
def _machine_ok() -> bool:
    """This process's CPU and system can build and run the library (asked once: every
    step asks :func:`handles`)."""
    return isa() in ISA_FLAGS and sys.platform.startswith("linux")


def isa() -> str:
    """The vector ISA torch's own CPU kernels dispatch to. The library is built only
    for AVX2 and AVX-512: at::vec's portable code (``DEFAULT``) computes a fused
    multiply-add as a multiply and an add, two roundings where torch's vector kernels
    on these CPUs round once, so elsewhere the inductor kernels step."""
    return torch.backends.cpu.get_cpu_capability()


def _command(source: Path, output: Path, isa_name: str, defines: dict) -> list[str]:
    include = Path(torch.__file__).parent / "include"
    return [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
            *ISA_FLAGS[isa_name], *(f"-D{k}={v}" for k, v in sorted(defines.items())), f"-I{include}",
            str(source), "-o", str(output)]


def _cache_dir() -> Path:
    """Inductor's cache directory, found as inductor finds it (without importing it)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        root = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(root) / "mpfp16"


def _build(command: list[str], path: Path) -> None:
    """Run the compile ``command`` into ``path``, through a temporary name, so that
    ranks that build at once never load a half-written library."""
    if shutil.which(command[0]) is None:
        raise FileNotFoundError(f"no C++ compiler: {command[0]!r} is not on PATH (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial{path.suffix}")
    command = [*command[:-1], str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            output = (done.stderr + done.stdout).strip()
            raise OSError(f"building the fused step's C++ kernels failed: {Path(command[0]).name} exited with "
                          f"status {done.returncode}" + (f": {last_error_line(output)}" if output else ""))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def build(isa_name: str | None = None, defines: dict | None = None) -> ctypes.CDLL:
    """The library built for ``isa_name`` (default :func:`isa`) with the preprocessor
    ``defines`` (native.cpp's tuning constants; ``mpfp16.bench.kernels`` builds
    variants), from the cache when it is there (module docstring)."""
    global BUILD_S
    isa_name, defines = isa_name or isa(), defines or {}
    if isa_name not in ISA_FLAGS:
        raise ValueError(f"native kernels are built for {' or '.join(ISA_FLAGS)}, not {isa_name}")
    command = _command(SOURCE, Path("native.so"), isa_name, defines)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(command[:-3]).encode(),
                                     torch.__version__.encode(), sysconfig.get_config_var("SOABI").encode()]))
    path = _cache_dir() / f"native-{key.hexdigest()[:20]}.so"
    if not path.exists():
        logger.debug("fused step: building %s", path.name)
        started = time.perf_counter()
        try:
            _build(command, path)
        finally:
            BUILD_S += time.perf_counter() - started
    library = ctypes.CDLL(str(path))
    library.mpfp16_adam.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 6 + [
        ctypes.c_int, ctypes.c_int]
    library.mpfp16_adam.restype = ctypes.c_int
    library.mpfp16_nonfinite.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    library.mpfp16_nonfinite.restype = ctypes.c_int
    return library


def load() -> ctypes.CDLL:
    """The library the fused step uses, built on first use; once per process."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = build()
    return _LIBRARY


def _pointer(t: torch.Tensor | None):
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("native kernels step contiguous buffers only")
    return t.data_ptr()


def adam_update(weights: torch.Tensor, grad: torch.Tensor, master: torch.Tensor | None, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, library: ctypes.CDLL | None = None, inv_scale: float,
                clip_coef: float, weight_decay: float, decay_factor: float, one_minus_beta1: float, beta2: float,
                one_minus_beta2: float, bias_correction2_sqrt: float, eps: float, neg_step_size: float,
                has_weight_decay: bool, decoupled: bool, maximize: bool, lerp_low: bool) -> None:
    """kernels.adam_update with round-to-nearest weights, on one flat segment, in
    place. The scalars are Python floats, rounded to fp32 here as eager rounds them."""
    flags = ((DECOUPLED if decoupled else COUPLED) if has_weight_decay else 0) | (MAXIMIZE if maximize else 0) | (
        LERP_LOW if lerp_low else 0)
    values = (inv_scale, clip_coef, weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2,
              bias_correction2_sqrt, eps, neg_step_size)
    scalars = (ctypes.c_float * len(values))(*values)
    if ctypes.c_float(inv_scale).value != 1.0:
        flags |= UNSCALE
    if ctypes.c_float(clip_coef).value != 1.0:
        flags |= CLIP
    status = (library or load()).mpfp16_adam(
        weights.numel(), DTYPES[weights.dtype], DTYPES[grad.dtype], _pointer(grad), _pointer(master),
        _pointer(exp_avg), _pointer(exp_avg_sq), _pointer(weights), ctypes.addressof(scalars), flags,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native Adam: no kernel for {weights.dtype} weights with {grad.dtype} gradients")


def nonfinite(grad: torch.Tensor, inv_scale: float, library: ctypes.CDLL | None = None) -> bool:
    """Whether any element of ``grad.float() * inv_scale`` is inf or NaN."""
    found = (library or load()).mpfp16_nonfinite(grad.numel(), DTYPES[grad.dtype], _pointer(grad), inv_scale,
                                                 torch.get_num_threads())
    if found < 0:
        raise ValueError(f"native overflow check: no kernel for {grad.dtype} gradients")
    return bool(found)
