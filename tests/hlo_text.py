"""Reading an optimized HLO module's text (``executable.as_text()``) in tests."""

from __future__ import annotations

import math
import re


def largest_fused_output(computation: str) -> int:
    """The element count of a fused computation's largest result (its header's ``-> ...``)."""
    header = computation.split("\n", 1)[0]
    shapes = re.findall(r"\[([\d,]*)\]", header.split("->", 1)[1])
    return max(math.prod(int(d) for d in s.split(",") if d) for s in shapes)


def trig_evaluations(text: str) -> list[tuple[int, int]]:
    """(elements of the sine or cosine, elements of the fused computation that evaluates it) for
    each sine and cosine in an optimized HLO module: XLA evaluates it once per element of the
    fusion's result."""
    found = []
    for computation in re.split(r"\n(?=%fused)", text):
        if not computation.startswith("%fused"):
            continue
        for shape in re.findall(r"= \w+\[([\d,]*)\]\S* (?:cosine|sine)\(", computation):
            found.append((math.prod(int(d) for d in shape.split(",") if d), largest_fused_output(computation)))
    return found
