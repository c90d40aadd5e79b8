"""What the benchmarks' command lines share: a configuration from ``--quick`` or the
defaults, with each flag given taking the place of its value, checked in argparse's
words; and a flag that takes a list of names."""

from __future__ import annotations

import argparse


def sized_config(parser, args, quick: dict, defaults: dict, counts: tuple[str, ...]) -> dict:
    """A benchmark's configuration: ``quick`` (``--quick``) or ``defaults``, each value
    replaced by its flag where one was given; each name in ``counts`` at least 1 and
    ``warmup`` at least 0, else ``parser.error`` naming the flag."""
    base = quick if args.quick else defaults
    config = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in base.items()}
    for name in counts:
        if config[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {config[name]}")
    if config["warmup"] < 0:
        parser.error(f"--warmup must be 0 or more, got {config['warmup']}")
    return config


def list_of(choices):
    """An argparse ``type``: a comma-separated list of distinct names among ``choices``."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of distinct {', '.join(choices)}; "
                                             f"got {text!r}")
        return items
    return parse
