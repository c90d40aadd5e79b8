"""8-bit codes with a scale per row: the arithmetic of the ``fp8_compress`` and
``int8_compress`` wires (:mod:`mpfp16.parallel.wires`), with no communication.

A row is :data:`ROW` consecutive elements of one parameter's gradient (its last row
padded with zeros). Each row's scale is its largest magnitude over the format's largest
code, so the row's largest value lands on the largest code and nothing overflows; a
row of zeros gets scale 1. A row holding inf or NaN gets a NaN scale, so that it
decodes to NaN and the step that sent it is skipped on every rank, whatever the
format can represent (int8 has no NaN, e4m3 no inf).

    codes, scales = encode(x, "e4m3")     # x: [rows, ROW] fp32
    y = decode(codes, scales)              # fp32, y[i] = codes[i] * scales[i]

Codes travel as bytes (``codes.view(torch.uint8)``): gloo and NCCL both carry uint8.
"""

from __future__ import annotations

import torch

__all__ = ["ROW", "FORMATS", "CODE_DTYPES", "LARGEST", "encode", "decode", "check_format"]

ROW = 256  # elements per scale: a 4-byte fp32 scale adds 1.6% to the 8-bit payload

CODE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}
FORMATS = tuple(CODE_DTYPES)
LARGEST = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}  # the largest finite code of each


def check_format(fmt: str, say=lambda name, value: f"{name}={value!r}") -> None:
    """Refuse, in one line, a format that is not one of :data:`FORMATS`."""
    if fmt not in CODE_DTYPES:
        raise ValueError(f"unknown {say('fp8_format', fmt)}; choose one of e4m3, e5m2")


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of fp32 ``x`` ([rows, ROW]) as 8-bit codes of format ``fmt`` and one fp32
    scale per row (module docstring). int8 rounds to nearest, ties to even; the fp8
    formats round as torch's cast does (to nearest)."""
    largest = LARGEST[fmt]
    amax = x.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    scales = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    scales = torch.where(finite, scales, torch.full_like(amax, float("nan")))
    scaled = (x / scales.unsqueeze(1)).clamp_(-largest, largest)
    scaled = torch.where(finite.unsqueeze(1), scaled, torch.zeros_like(scaled))
    if fmt == "int8":
        scaled = scaled.round_()
    return scaled.to(CODE_DTYPES[fmt]), scales


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` ([rows, ROW], an 8-bit dtype) at ``scales`` ([rows])."""
    return codes.float() * scales.unsqueeze(1)
