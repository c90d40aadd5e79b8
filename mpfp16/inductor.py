"""How mpfp16 asks inductor to compile its CPU kernels: the settings every compile of
the package runs under (the fused step's kernels, mpfp16/stores/kernels.py; the
fp32-accumulate hook's reduction, mpfp16/parallel/hooks.py).

The CPU's vector instructions are taken as cpuid names them, without inductor's check
of each: that check builds a test program with torch's headers for every candidate ISA
(AVX-512 VNNI, AVX-512, AVX2 here) before the first kernel: 11.6 s alone here, in a
cold first step of 18.1-18.5 s (``python -m mpfp16.bench.coldstart``; 7.6-8.0 s without
it and the unused norm variants). The pick is the same ISA; a compiler that cannot
build it fails the kernel's compile, which each caller handles (the fused step's
agreement across ranks; the hook's eager fallback). CUDA kernels are unaffected. The
settings apply inside these compiles only: a user's own ``torch.compile`` still checks.

Importing this module imports nothing from torch's compiler; :func:`settings` does.
"""

from __future__ import annotations

SETTINGS = {"cpp.vec_isa_ok": True}


def settings(**more):
    """A context under which inductor compiles with :data:`SETTINGS` (and ``more``)."""
    import torch._inductor.config

    return torch._inductor.config.patch(**SETTINGS, **more)
