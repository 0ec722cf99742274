"""The client corpus (corpus/): plain PyTorch programs, each run the ways users run it
(corpus/run.py: strict, TORCHTPU_MODE=defer cold, with no exploration budget cold and warm,
always_compile), printing strict's output every way.  ``make test`` runs the quick programs
(corpus.run.FAST); ``make test-all`` runs every program (the ``slow`` mark)."""

from __future__ import annotations

import pytest

from corpus import run as corpus


def _cases():
    for program in corpus.programs():
        marks = [] if program.stem in corpus.FAST else [pytest.mark.slow]
        known = corpus.KNOWN_DIFFERENCES.get(program.stem)
        if known is not None:
            marks.append(pytest.mark.xfail(reason=known, strict=False))
        yield pytest.param(program, id=program.stem, marks=marks)


@pytest.mark.parametrize("program", list(_cases()))
def test_a_client_program_prints_what_strict_prints(program):
    verdicts = corpus.check(program)
    bad = {way: why for way, why in verdicts.items() if why is not None}
    assert not bad, f"{program.name}: " + "; ".join(f"{way}: {why}" for way, why in bad.items())
