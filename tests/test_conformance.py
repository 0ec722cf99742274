"""The fast OpInfo conformance subset (conformance/subset.py), one test per OpInfo.

Each OpInfo's cases -- (dtype, variant) over its first few samples -- run under strict and under
defer (always compiling).  No case may fail unless it is listed in KNOWN_FAILURES with its
reason; a listed case that no longer fails makes the test fail too, so the list stays true.
The full sweep is `make conformance` (docs/conformance.md).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root

from conformance import cases
from conformance.subset import FAST_MAX_SAMPLES, FAST_OPS

# "OpInfo|dtype|variant" -> why it fails today (the bug to fix, not a reason to keep it).
KNOWN_FAILURES: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _ops_by_name() -> dict:
    return {cases.op_name(op): op for op in cases.op_db()}


# The OpInfos make test runs, one or two a family (~3-8 s each on 2 cores); the rest of the
# subset carries the slow mark (make test-all).
QUICK_OPS = frozenset({
    "abs", "sigmoid", "logical_not", "add", "div.no_rounding_mode", "where", "sum", "argmax",
    "cumsum", "reshape", "cat", "__getitem__", "index_put", "gather", "mm", "softmax",
    "nn.functional.layer_norm", "nn.functional.conv2d", "full", "bernoulli", "nonzero", "chalf",
})


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK_OPS else (pytest.mark.slow,))
                                  for n in FAST_OPS])
def test_opinfo_conformance(name: str) -> None:
    op = _ops_by_name()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = list(cases.run_op(op, max_samples=FAST_MAX_SAMPLES))
    assert results, f"{name}: no cases ran"
    known = {k: v for k, v in KNOWN_FAILURES.items() if k.split("|")[0] == name}
    unexpected = [f"{r.key}: {r.reason}" for r in results if r.status == "fail" and r.key not in known]
    fixed = [k for k in known if not any(r.key == k and r.status == "fail" for r in results)]
    problems = []
    if unexpected:
        problems.append("new failures:\n  " + "\n  ".join(unexpected))
    if fixed:
        problems.append("known failures that no longer fail (remove them from KNOWN_FAILURES):\n  "
                        + "\n  ".join(fixed))
    assert not problems, f"{name}:\n" + "\n".join(problems)


def test_known_failures_are_in_the_subset() -> None:
    for key in KNOWN_FAILURES:
        op, dtype, variant = key.split("|")
        assert op in FAST_OPS, f"{key}: not an OpInfo of the fast subset"
        assert dtype in cases.DTYPES and variant in cases.VARIANTS, key
    assert QUICK_OPS <= set(FAST_OPS)
