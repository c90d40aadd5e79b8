"""The Adam kernel variants, one flat buffer each, against torch's fused fp32 AdamW on
the same number of elements: the table behind the choices in mpfp16/stores/kernels.py
and mpfp16/stores/native.cpp.

    python -m mpfp16.bench.kernels [--numel 25557032] [--threads 1,2] [--json PATH]

``mpfp16.bench.step`` times whole ``step()`` calls over a model's shapes; this one
times single kernels on one buffer (ResNet-50's parameter count by default), so that
the variants of one kernel can be compared with nothing else in the way. Rows:

  torch fused AdamW      ``torch._fused_adamw_`` on one fp32 tensor (28 bytes/param);
  check                  ``grad_stats``: the overflow check over the fp16 gradients (2);
  AdamW, masters         the fused kernel (28), as shipped;
  ... both lerp branches the same with eager lerp's two formulas computed and one
                         selected per element (the formulation before issue 16);
  ... SIMD 256           the shipped kernel compiled with inductor's ``cpp.simdlen=256``
                         (256-bit vectors) instead of the CPU's widest;
  AdamW, no masters      reads the fp16 weight for the fp32 value (22);
  Adam, no masters, 1 pass   coupled weight decay, in one kernel (22);
  Adam, no masters, 2 passes ``adam_moments`` then ``adam_apply`` (32), the inductor
                         kernels for stochastic and Kahan rounding;
  native check           the C++ overflow check (``native.nonfinite``, 2), as shipped on
                         CPU: four interleaved read streams per thread;
  ... 1 stream           the same built to read one stream per thread;
  native AdamW, masters  the C++ kernel (``native.adam_update``, 28), as shipped on CPU:
                         the 16-bit weights stored around the cache (non-temporal);
  ... ordinary weight stores  the same built with ordinary stores for the weights;
  ... AVX2               the same built for 256-bit AVX2 (on an AVX-512 machine);
  native AdamW, masters, bf16 moments   the same with both moments in bf16 (20), as
                         shipped: with AVX512-BF16's conversion where the CPU has it;
  ... at::vec's bf16 conversion   the same built without that instruction (where the
                         CPU has it): at::vec's integer rounding for every bf16 store;
  native AdamW, no masters / native Adam, no masters   (22 each), as shipped;
  torch read-only pass   ``torch.sum`` over an fp32 buffer (4): what a pass that only
                         reads gets of this machine's bandwidth, the yardstick of the
                         overflow check, which only reads.

After each table, **the bound** of the step with fp32 masters and bf16 moments (the
fused step's two passes: the native check, then the native kernel): the two measured
alone and summed, then the same sum with the check's 2 bytes moved at the read-only
pass's GB/s (the floor a separate check allows here) and at torch's fused AdamW's
(the floor if reading alone were as fast as reading and writing), each over torch's
fused AdamW. The check must finish before anything is written (a skipped step leaves
every state as it was), so the two passes add up.

Each inductor variant is compiled as the fused backend compiles it
(``kernels.compiled``: examples of one size class, fp16 casts kept exact); each native
variant is a build of native.cpp (``native.build``). All are timed alternately, one
call each per round after warm-up rounds; the table gives medians and the ratio to
torch's fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types

import torch

from .step import _thread_counts, compare, cpu_model


# the rows the bound reads (bound())
TORCH, CHECK, KERNEL, READ = ("torch fused AdamW (fp32)", "native check", "native AdamW, masters, bf16 moments",
                               "torch read-only pass (fp32 sum)")


def _variants(numel: int, device: torch.device) -> dict:
    import torch._inductor.config

    from ..stores import kernels as K
    from ..stores import native

    sc = lambda v: K.scalar(v, device)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(numel, generator=g) * 1e-3).to(device, torch.float16)
    weights = torch.randn(numel, generator=g).to(device, torch.float16)
    master = weights.float()
    exp_avg = torch.zeros(numel, device=device)
    exp_avg_sq = torch.zeros(numel, device=device)
    scalars = [sc(v) for v in (1.0, 1.0, 1e-2, 1 - 1e-5, 0.1, 0.999, 1e-3, 0.03, 1e-8, -1e-3)]
    inv, clip, wd, _, b1, b2, ob2, bc2, eps, nss = scalars

    def adam(master_weights: bool, decoupled: bool, lerp_low, simdlen=None):
        fn = K.adam_update
        if simdlen is not None:  # a function of its own, compiled (at its first call) with that vector width
            fn = types.FunctionType(fn.__code__, fn.__globals__, f"adam_update_simd{simdlen}", fn.__defaults__)
        kernel = K.compiled(fn, has_master=master_weights, has_weight_decay=True, decoupled=decoupled,
                            maximize=False, lerp_low=lerp_low, rounding="nearest")

        def call():
            return kernel(weights, grad, master if master_weights else None, exp_avg, exp_avg_sq, None, None,
                          *scalars)

        if simdlen is not None:
            with torch._inductor.config.patch({"cpp.simdlen": simdlen}):
                call()
        return call

    bf16_moments = (exp_avg.bfloat16(), exp_avg_sq.bfloat16())
    reads = torch.rand(numel, generator=g).to(device)

    def cpp(master_weights: bool, decoupled: bool, library=None, moments=(exp_avg, exp_avg_sq)):
        hyper = dict(inv_scale=1 / 1024, clip_coef=1.0, weight_decay=1e-2, decay_factor=1 - 1e-5,
                     one_minus_beta1=0.1, beta2=0.999, one_minus_beta2=1e-3, bias_correction2_sqrt=0.03, eps=1e-8,
                     neg_step_size=-1e-3, has_weight_decay=True, decoupled=decoupled, maximize=False, lerp_low=True)
        return lambda: native.adam_update(weights, grad, master if master_weights else None, *moments,
                                          library=library, **hyper)

    one_stream = native.build(defines={"MPFP16_CHECK_STREAMS": 1})
    cpp_variants = {
        CHECK: (lambda: native.nonfinite(grad, 1 / 1024), 2),
        "native check, 1 stream": (lambda: native.nonfinite(grad, 1 / 1024, library=one_stream), 2),
        "native AdamW, masters": (cpp(True, True), 28),
    }
    cpp_variants["native AdamW, masters, ordinary weight stores"] = (
        cpp(True, True, native.build(defines={"MPFP16_STREAM_WEIGHTS": 0})), 28)
    if native.isa() == "AVX512":
        cpp_variants["native AdamW, masters, AVX2"] = (cpp(True, True, native.build("AVX2")), 28)
    cpp_variants[KERNEL] = (cpp(True, True, moments=bf16_moments), 20)
    if native.build_isa() == "AVX512_BF16":
        cpp_variants["... at::vec's bf16 conversion"] = (
            cpp(True, True, native.build("AVX512"), moments=bf16_moments), 20)
    cpp_variants["native AdamW, no masters"] = (cpp(False, True), 22)
    cpp_variants["native Adam, no masters"] = (cpp(False, False), 22)
    moments = K.compiled(K.adam_moments, maximize=False, lerp_low=True)
    apply = K.compiled(K.adam_apply, rounding="nearest")
    check = K.compiled(K.grad_stats, with_norm=False)
    ref = [[master.clone()], [grad.float()], [exp_avg.clone()], [exp_avg_sq.clone()], [], [torch.tensor(1.0)]]
    return {
        TORCH: (lambda: torch._fused_adamw_(
            *ref, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False), 28),
        "check (grad_stats)": (lambda: check(grad, inv), 2),
        "AdamW, masters": (adam(True, True, True), 28),
        "AdamW, masters, both lerp branches": (adam(True, True, None), 28),
        "AdamW, masters, SIMD 256": (adam(True, True, True, simdlen=256), 28),
        "AdamW, no masters": (adam(False, True, True), 22),
        "Adam, no masters, 1 pass": (adam(False, False, True), 22),
        "Adam, no masters, 2 passes": (lambda: (
            moments(weights, grad, exp_avg, exp_avg_sq, inv, clip, wd, b1, b2, ob2),
            apply(weights, exp_avg, exp_avg_sq, None, None, bc2, eps, nss)), 32),
        **cpp_variants,
        READ: (lambda: reads.sum(), 4),
    }


def bound(medians: dict[str, float], moved: dict[str, int]) -> dict[str, float] | None:
    """The step with fp32 masters and bf16 moments as its two passes, each over torch's
    fused AdamW (module docstring): ``measured`` (the check and the kernel, each timed
    alone), ``check`` (its share alone), ``read_only_floor`` and ``mixed_floor`` (the
    kernel as measured, the check's bytes at the read-only pass's rate, and at torch's
    fused AdamW's). ``medians``: seconds per row; ``moved``: each row's bytes per
    parameter. None where a row is missing (no native kernels)."""
    if not all(name in medians for name in (TORCH, CHECK, KERNEL, READ)):
        return None
    ref, kernel = medians[TORCH], medians[KERNEL]

    def at_rate_of(row: str) -> float:  # seconds for the check's bytes, moved at that row's rate
        return medians[row] * moved[CHECK] / moved[row]

    return {"measured": (medians[CHECK] + kernel) / ref, "check": medians[CHECK] / ref,
            "read_only_floor": (kernel + at_rate_of(READ)) / ref, "mixed_floor": (kernel + at_rate_of(TORCH)) / ref}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_557_032, help="elements (default: ResNet-50's 25,557,032)")
    parser.add_argument("--threads", default="1,2", metavar="N[,N...]", help="thread counts (default: 1,2)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON (default: none)")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--numel and --rounds must be >= 1, --warmup >= 0")
    try:
        threads = _thread_counts(args.threads)
    except ValueError:
        parser.error(f"--threads must be positive integers separated by commas, got {args.threads!r}")
    device = torch.device("cpu")
    print(f"# Adam kernel variants on {args.numel:,} elements; cpu ({cpu_model()}); median of {args.rounds} rounds")
    results = []
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            variants = _variants(args.numel, device)
            times = compare({name: (None, fn) for name, (fn, _) in variants.items()}, args.rounds, args.warmup,
                            device)
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            moved = {name: bytes_per_param for name, (_, bytes_per_param) in variants.items()}
            ref = medians[TORCH]
            print(f"\n## {n} thread{'s' if n > 1 else ''}")
            print(f"{'variant':<40}{'ms':>9}{'vs torch':>10}{'B/param':>9}{'GB/s':>8}")
            rows = []
            for name, t in medians.items():
                gbs = moved[name] * args.numel / t / 1e9
                rows.append({"variant": name, "median_ms": t * 1e3, "ratio": t / ref, "bytes_per_param": moved[name],
                             "gb_per_s": gbs})
                print(f"{name:<40}{t * 1e3:>9.2f}{t / ref:>10.2f}{moved[name]:>9}{gbs:>8.1f}")
            limits = bound(medians, moved)
            if limits is not None:
                print(f"the bound, masters and bf16 moments (check + kernel, over torch's fused AdamW): "
                      f"measured {limits['measured']:.2f} (the check {limits['check']:.2f}); with the check "
                      f"at the read-only pass's GB/s {limits['read_only_floor']:.2f}, "
                      f"at torch AdamW's {limits['mixed_floor']:.2f}")
            results.append({"threads": n, "rows": rows, "bound": limits})
    finally:
        torch.set_num_threads(before)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
