"""The paper experiments, each one command: ``python -m mpfp16.experiments NAME``.

Each runs small-scale on a CPU, is deterministic given its seed, saves PNG plots and
writes its section of docs/EXPERIMENTS.md (replacing the previous one).
"""

EXPERIMENTS = ("lost-updates", "underflow", "regularizer", "loss-scale", "accumulation", "memory", "ema")
