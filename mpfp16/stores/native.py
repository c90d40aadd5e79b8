"""The fused step's hand-vectorized CPU kernels: Adam/AdamW's update and the overflow
check, in C++ on ATen's ``at::vec`` (mpfp16/stores/native.cpp), as torch's own fused CPU
Adam is written. The inductor kernels of mpfp16/stores/kernels.py do the same
arithmetic with more instructions per element; these run about level with torch's
fused AdamW (docs/BENCHMARKS.md, "How fast is the step").

The library is built at first use, as inductor builds its kernels: with the C++
compiler ``$CXX`` (else ``c++``; split as a shell splits it, so ``ccache g++`` or
``g++ -O2`` run that program with those arguments before the project's flags), torch's
headers, the vector ISA torch's own CPU kernels dispatch to
(``torch.backends.cpu.get_cpu_capability()``; on AVX-512, with AVX512-BF16's conversion
instruction too where the CPU has it: :func:`build_isa`), and OpenMP, which resolves to the runtime
torch already loaded. It is kept under inductor's cache directory
(``$TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``), in the folder
``mpfp16``, keyed by the source, the whole compiler command, the torch version and the
Python ABI, so a later run only loads it: ``native-<key>.json`` records the size and
SHA-256 of the library it names, ``native-<key>-<digest>.so``. Both are written under
temporary names and renamed into place, the library first, and the library is named by
its digest, so ranks that build at once (on one node or on many that share the folder)
never find a manifest whose library is not whole.

A cached library is checked against its manifest before it is mapped (ctypes maps a
truncated library whose ELF header survived, and the process dies of SIGBUS when it
reaches past the end of the file); one that is damaged (another size or digest, another
shared object in its place, its manifest missing or unreadable) is rebuilt, with one
INFO line on the ``mpfp16`` logger naming the file and what is wrong. One that matches
its manifest and still does not load is not rebuilt: the same command would build the
same bytes. A build that fails, or a library that does not load, raises ``OSError`` (a
``FileNotFoundError`` without a compiler), one line that says why and names the cache
folder or the file, which the fused step's compile agreement across ranks handles as it
handles an inductor compile that fails: under ``fused=None`` each run says so in its one
warning.

Used for Adam and AdamW on AVX2 and AVX-512 CPUs under Linux with round-to-nearest
weights (:func:`handles`); SGD, stochastic and Kahan rounding, remainders, other CPUs
and systems, and CUDA keep the inductor kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import getpass
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import torch

from ..errors import last_error_line

logger = logging.getLogger("mpfp16")

__all__ = ["handles", "handles_states", "isa", "build_isa", "build", "load", "adam_update", "nonfinite", "DTYPES",
           "SOURCE"]

SOURCE = Path(__file__).with_name("native.cpp")
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# The (weight, gradient) dtypes the library steps (native.cpp's mpfp16_adam).
PAIRS = {(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)}
# The dtypes each of Adam's moments may have (FP16Optimizer's state_dtypes).
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# native.cpp's flag bits
COUPLED, DECOUPLED, MAXIMIZE, LERP_LOW, UNSCALE, CLIP = 1, 2, 4, 8, 16, 32

# The compiler flags of each vector ISA torch dispatches to (ATen's CPU_CAPABILITY).
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma", "-mf16c"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
# AVX-512 with AVX512-BF16: the same code, but bf16 values stored with VCVTNE2PS2BF16 where
# that gives .to()'s bits (native.cpp's narrow).
ISA_FLAGS["AVX512_BF16"] = [*ISA_FLAGS["AVX512"], "-mavx512bf16"]

# What a build's output says when the file system refused a write (the cache folder
# full, over quota, read-only, or not the user's): the line that says so is the cause, not
# the linker's summary after it ("collect2: error: ld returned 1 exit status").
REFUSED_WRITES = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                       errno.EPERM, errno.EFBIG, errno.EIO))

_LIBRARY: ctypes.CDLL | None = None
BUILD_S = 0.0  # seconds this process has spent building libraries (the test suite's rules leave them aside)


def handles(device: torch.device, weight_dtype: torch.dtype, grad_dtype: torch.dtype, rounding: str) -> bool:
    """Whether these kernels step a segment: on an AVX2 or AVX-512 CPU under Linux (the
    build's flags are GCC's and Clang's there), with round-to-nearest weights."""
    return device.type == "cpu" and rounding == "nearest" and (weight_dtype, grad_dtype) in PAIRS and _machine_ok()


def handles_states(exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> bool:
    """Whether these kernels step Adam's moments in these dtypes: each fp32 or bf16,
    a bf16 moment rounded to nearest-even when it is stored."""
    return exp_avg_dtype in MOMENT_DTYPES and exp_avg_sq_dtype in MOMENT_DTYPES


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


def build_isa() -> str:
    """The ISA the library is built for here: :func:`isa`, or ``AVX512_BF16`` where that
    is AVX-512 and the CPU also has AVX512-BF16 (its ``avx512_bf16`` flag in
    /proc/cpuinfo). The flag is part of the cache key, so a library built with it is
    never loaded by a CPU without it."""
    name = isa()
    return "AVX512_BF16" if name == "AVX512" and "avx512_bf16" in _cpu_flags() else name


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (none where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _compiler() -> list[str]:
    """``$CXX`` (else ``c++``) split as a shell splits it: the program and the arguments
    it takes before the project's flags (``ccache g++``, ``g++ -O2``, a quoted path)."""
    text = os.environ.get("CXX", "c++")
    try:
        words = shlex.split(text)
    except ValueError as exc:  # an unclosed quote or a trailing escape
        raise OSError(f"CXX={text!r} does not parse as a command line: {exc}") from None
    if not words:
        raise FileNotFoundError(f"no C++ compiler: CXX={text!r} names none (unset it for c++)")
    return words


def _command(source: Path, output: Path, isa_name: str, defines: dict) -> list[str]:
    include = Path(torch.__file__).parent / "include"
    return [*_compiler(), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
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


def _key(command: list[str]) -> str:
    """The cache key of a build: the source, the whole compile command but its input and
    output (every word of ``$CXX`` among them), the torch version and the Python ABI."""
    return hashlib.sha256(b"\0".join([SOURCE.read_bytes(), "\0".join(command[:-3]).encode(),
                                      torch.__version__.encode(),
                                      sysconfig.get_config_var("SOABI").encode()])).hexdigest()[:20]


def _cause(output: str) -> str:
    """The line of a failed build's ``output`` that says why: the last that names a
    write the file system refused (:data:`REFUSED_WRITES`; ld then sums it up as "ld
    returned 1 exit status"), else :func:`last_error_line`'s."""
    refused = [line.strip() for line in output.splitlines() if any(words in line for words in REFUSED_WRITES)]
    return refused[-1] if refused else last_error_line(output)


def _cached(folder: Path, key: str) -> tuple[Path | None, str | None]:
    """The library cached under ``key``, checked against its manifest before anything
    maps it: ``(path, None)`` when it matches, ``(None, what is wrong)`` when a cached
    file is damaged, ``(None, None)`` when none was built."""
    manifest = folder / f"native-{key}.json"
    try:
        record = json.loads(manifest.read_text())
        name, size, digest = record["library"], record["bytes"], record["sha256"]
        # a library of this key in this folder, named by its digest
        valid = (isinstance(name, str) and isinstance(size, int) and isinstance(digest, str)
                 and re.fullmatch(rf"native-{key}-{re.escape(digest[:16])}\.so", name) is not None)
    except (FileNotFoundError, NotADirectoryError):
        stray = sorted(folder.glob(f"native-{key}-*.so")) if folder.is_dir() else []
        return None, (f"{stray[0]} has no manifest ({manifest.name}) to check it against" if stray else None)
    except OSError as exc:
        return None, f"its manifest {manifest} cannot be read ({exc.strerror or exc})"
    except (ValueError, KeyError, TypeError):  # not JSON, not UTF-8, or not the record build() writes
        valid = False
    if not valid:
        return None, f"its manifest {manifest} is not one that mpfp16 wrote"
    path = folder / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{path}, which {manifest.name} names, is missing"
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"
    if len(data) != size:
        return None, f"{path} is {len(data)} bytes, not the {size} it was built with"
    if hashlib.sha256(data).hexdigest() != digest:
        return None, f"{path} does not match the digest it was built with"
    return path, None


def _build(command: list[str], folder: Path, key: str) -> Path:
    """Run the compile ``command`` into ``folder`` and record the library in its
    manifest (:func:`_cached`); return the library's path. Both files are written under
    names of this process's own and renamed into place, the library first."""
    if shutil.which(command[0]) is None:
        raise FileNotFoundError(f"no C++ compiler: {command[0]!r} is not on PATH (set CXX)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # the reason alone would name no path (errors.one_line)
        raise OSError(f"the fused step's C++ kernels cannot be cached in {folder}: {exc.strerror or exc}") from None
    # pids repeat across the nodes that may share the folder
    token = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    partial = folder / f"native-{key}.{token}.partial.so"
    partial_manifest = folder / f"native-{key}.{token}.partial.json"
    compiler = Path(command[0]).name
    try:
        try:
            done = subprocess.run([*command[:-1], str(partial)], capture_output=True, text=True, errors="replace")
        except OSError as exc:  # found on PATH, yet not a program this system runs
            raise OSError(f"building the fused step's C++ kernels failed: {command[0]} cannot be run "
                          f"({exc.strerror or exc})") from None
        if done.returncode != 0 or not partial.is_file():
            output = (done.stderr + done.stdout).strip()
            said = ", and wrote no library" if done.returncode == 0 else f": {_cause(output)}" if output else ""
            raise OSError(f"building the fused step's C++ kernels in {folder} failed: {compiler} exited with "
                          f"status {done.returncode}{said}")
        try:
            data = partial.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            path = folder / f"native-{key}-{digest[:16]}.so"
            os.replace(partial, path)
            partial_manifest.write_text(json.dumps({"library": path.name, "bytes": len(data), "sha256": digest}))
            os.replace(partial_manifest, folder / f"native-{key}.json")
        except OSError as exc:
            raise OSError(f"caching the fused step's C++ kernels in {folder} failed: {exc.strerror or exc}") from None
    finally:
        for leftover in (partial, partial_manifest):
            with contextlib.suppress(OSError):  # a read-only folder refuses this too; the error above says why
                leftover.unlink(missing_ok=True)
    return path


def _open(path: Path, built: bool) -> ctypes.CDLL:
    """The library at ``path`` loaded, its two functions declared. Whatever fails
    (dlopen's refusal, a missing symbol) raises ``OSError``, one line naming the file;
    ``built``: whether this process built it just now."""
    try:
        library = ctypes.CDLL(str(path))
        library.mpfp16_adam.argtypes = [ctypes.c_int64] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 6 + [
            ctypes.c_int, ctypes.c_int]
        library.mpfp16_adam.restype = ctypes.c_int
        library.mpfp16_nonfinite.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                             ctypes.c_int]
        library.mpfp16_nonfinite.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        said = " ".join(str(exc).split()) or type(exc).__name__
        if str(path) not in said:
            said = f"{path}: {said}"
        raise OSError(f"loading the fused step's C++ kernels failed: {said}"
                      + (" (built just now)" if built else " (delete the file to rebuild it)")) from None
    return library


def build(isa_name: str | None = None, defines: dict | None = None) -> ctypes.CDLL:
    """The library built for ``isa_name`` (default :func:`build_isa`) with the preprocessor
    ``defines`` (native.cpp's tuning constants; ``mpfp16.bench.kernels`` builds
    variants), from the cache when it is there and whole, else built (module
    docstring)."""
    global BUILD_S
    isa_name, defines = isa_name or build_isa(), defines or {}
    if isa_name not in ISA_FLAGS:
        raise ValueError(f"native kernels are built for {' or '.join(ISA_FLAGS)}, not {isa_name}")
    command = _command(SOURCE, Path("native.so"), isa_name, defines)
    folder, key = _cache_dir(), _key(command)
    path, damaged = _cached(folder, key)
    if path is not None:
        return _open(path, built=False)
    if damaged:
        logger.info("fused step: rebuilding its C++ kernels: %s", damaged)
    else:
        logger.debug("fused step: building native-%s in %s", key, folder)
    started = time.perf_counter()
    try:
        path = _build(command, folder, key)
    finally:
        BUILD_S += time.perf_counter() - started
    return _open(path, built=True)


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
    place. The scalars are Python floats, rounded to fp32 here as eager rounds them. The
    moments are fp32 or bf16 (:func:`handles_states`); a bf16 moment is widened, stepped
    in fp32 and stored rounded to nearest-even."""
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
        weights.numel(), DTYPES[weights.dtype], DTYPES[grad.dtype], DTYPES[exp_avg.dtype],
        DTYPES[exp_avg_sq.dtype], _pointer(grad), _pointer(master),
        _pointer(exp_avg), _pointer(exp_avg_sq), _pointer(weights), ctypes.addressof(scalars), flags,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native Adam: no kernel for {weights.dtype} weights with {grad.dtype} gradients, "
                         f"{exp_avg.dtype} exp_avg and {exp_avg_sq.dtype} exp_avg_sq")


def nonfinite(grad: torch.Tensor, inv_scale: float, library: ctypes.CDLL | None = None) -> bool:
    """Whether any element of ``grad.float() * inv_scale`` is inf or NaN."""
    found = (library or load()).mpfp16_nonfinite(grad.numel(), DTYPES[grad.dtype], _pointer(grad), inv_scale,
                                                 torch.get_num_threads())
    if found < 0:
        raise ValueError(f"native overflow check: no kernel for {grad.dtype} gradients")
    return bool(found)
