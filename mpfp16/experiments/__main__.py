"""python -m mpfp16.experiments NAME [--out DIR] [--doc PATH] [--seeds 0,1,2] [--quick]

NAME: lost-updates (Micikevicius et al. §3.1), underflow (§3.2), regularizer (the
no-master regularizer claim, several seeds), loss-scale (a dynamic loss-scale trace),
accumulation (how far fp16 and fp32 sums of micro-batch gradients are from the exact
sum; writes docs/ACCUMULATION.md unless --doc is given), memory (16-bit and torchao's
low-bit optimizer states against fp32 ones: quality and bytes per parameter; writes
docs/MEMORY.md unless --doc is given), ema (the model EMA of 16-bit weights against
the fp32 EMA of the fp32 masters, against an fp64 one), or all. Each finishes in under
about 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import EXPERIMENTS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpfp16.experiments", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=EXPERIMENTS + ("all",), help="the experiment")
    parser.add_argument("--out", default="docs/img", help="where the plots go (default: docs/img)")
    parser.add_argument("--doc", default=None,
                        help="the markdown file whose section is written (default: docs/EXPERIMENTS.md; "
                             "docs/ACCUMULATION.md for accumulation)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the single-run experiments (default: 0)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the regularizer experiment (default: 0,1,2)")
    parser.add_argument("--quick", action="store_true", help="a tiny version in seconds (default: off)")
    parser.add_argument("--models", default=None,
                        help="accumulation only: comma-separated, of resnet18, imagegpt-s, gpt2 (default: all)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds is empty")
    from .accumulation import parse_models

    try:
        models = parse_models(args.models)
    except ValueError as exc:
        parser.error(str(exc))

    from . import accumulation, common, ema, loss_scale, lost_updates, memory, regularizer, underflow

    setup = common.quick(common.Setup()) if args.quick else common.Setup()
    names = EXPERIMENTS if args.name == "all" else (args.name,)
    for name in names:
        started = time.perf_counter()
        doc = args.doc or {"accumulation": accumulation.DOC, "memory": memory.DOC}.get(name, "docs/EXPERIMENTS.md")
        if name == "accumulation":
            accumulation.run(args.quick, doc, models)
        elif name == "memory":
            memory.run(args.quick, doc, args.seed)
        elif name == "lost-updates":
            lost_updates.run(setup, args.seed, args.out, doc)
        elif name == "underflow":
            underflow.run(setup, args.seed, args.out, doc)
        elif name == "regularizer":
            regularizer.run(setup, seeds, args.out, doc)
        elif name == "ema":
            ema.run(ema.quick() if args.quick else ema.EMASetup(), args.seed, args.out, doc)
        else:
            loss_scale.run(setup, args.seed, args.out, doc)
        print(f"{name}: done in {time.perf_counter() - started:.0f}s; section written to {doc}"
              + (f", plots in {args.out}" if name not in ("accumulation", "memory") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
