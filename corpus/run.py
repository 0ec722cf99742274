"""Run the client corpus: plain PyTorch programs nobody changed for deferfuse, each run the ways
users run it, its output compared with strict's.

    python -m corpus.run [names ...] [--ways strict,defer,deferred,warm,compiled] [--jobs 2]
                         [--fast] [--keep DIR]

Each program (``corpus/*.py`` but this file) runs in a fresh process, from the repository root:

- ``strict``:   ``python prog.py`` (the reference);
- ``defer``:    ``TORCHTPU_MODE=defer python -m deferfuse prog.py`` on a fresh disk-cache folder,
                every setting at its default (a short program mostly runs at once: the tiers'
                exploration budget);
- ``deferred``: the same with ``DEFERFUSE_EXPLORE_SHARE=1`` (no budget: the tiers try the
                deferred way from the first run), on a fresh folder;
- ``warm``:     ``deferred`` again on that folder (executables from the disk cache);
- ``compiled``: ``DEFERFUSE_ALWAYS_COMPILE=1`` (every flush through XLA, no eager tier).

Standard output must match strict's line by line, numbers within rounding: a number may differ
from strict's by two units of its last printed digit or by 1e-3 of its value (XLA may reassociate
float sums; a training loop carries that over its steps), integers and words exactly.  A program's
first line of docstring says what it covers; ``FAST`` below lists the ones ``make test`` runs
(tests/test_corpus.py), all of them run in ``make test-all``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WAYS = ("strict", "defer", "deferred", "warm", "compiled")
# The quick program ``make test`` runs every way (each program costs 15-30 s of the suite's time,
# five processes; ``make test-slow`` runs the rest, numpy_view_writes among them;
# tests/test_value_errors.py and tests/test_foreign_memory.py test the mechanisms themselves)
FAST = ("one_hot_checks",)
# Programs whose output differs where deferfuse documents that it does, and why: the runner
# still runs them every way and reports the difference (tests/test_corpus.py expects it to fail
# there, not to pass).  A fix makes the program pass and its entry go.
KNOWN_DIFFERENCES = {
    "tensor_type_names": "a value still pending when the program looks at it is a DeferredTensor: "
                         "type(t) is torch.Tensor is False (docs/semantics.md, Known differences: type(t))",
    "tensor_subclass": "a __torch_function__ that returns func's result with subclass dispatch off "
                       "hands back the pending value, a DeferredTensor (docs/semantics.md, Known differences: type(t))",
    "lbfgs_closure": "always_compile runs tanh and the loss's reductions on XLA, which round otherwise than torch's "
                     "kernels in the last bits, and 50 strong-Wolfe iterations amplify that to ~3e-3 of the printed "
                     "loss: strict itself, with a tanh written as (e^2x-1)/(e^2x+1), prints 0.02465 and makes 58 "
                     "closure calls for 0.02463 and 57 (docs/semantics.md, Known differences: reproducibility)",
}
TIMEOUT_S = 900
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf")


def programs(names: Optional[list[str]] = None) -> list[Path]:
    found = sorted(p for p in HERE.glob("*.py") if p.name not in ("run.py", "__init__.py"))
    if names:
        wanted = {n.removesuffix(".py") for n in names}
        found = [p for p in found if p.stem in wanted]
        missing = wanted - {p.stem for p in found}
        if missing:
            raise SystemExit(f"no such corpus program: {', '.join(sorted(missing))}")
    return found


def default_settings_env(**overrides: str) -> dict[str, str]:
    """The environment for a child process that runs deferfuse at its default settings: this
    one's, less every ``DEFERFUSE_*`` setting and ``TORCHTPU_MODE``, plus ``overrides``.  A child
    that stands for a user's run must not inherit the caller's settings: under the test suite
    (tests/conftest.py turns the tiers off) bench.read_cost's MLP ran every step deferred, 4.7x
    strict, where a user's process runs it at once.  (bench.harness re-exports it.)"""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("DEFERFUSE_") and key != "TORCHTPU_MODE"}
    env.update(overrides)
    return env


def _command(program: Path, way: str, cache: str) -> tuple[list[str], dict]:
    env = default_settings_env(DEFERFUSE_CACHE_DIR=cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if way == "strict":
        return [sys.executable, str(program)], env
    env["TORCHTPU_MODE"] = "defer"
    if way in ("deferred", "warm"):
        env["DEFERFUSE_EXPLORE_SHARE"] = "1"
    elif way == "compiled":
        env["DEFERFUSE_ALWAYS_COMPILE"] = "1"
    return [sys.executable, "-m", "deferfuse", str(program)], env


def run_way(program: Path, way: str, cache: str) -> subprocess.CompletedProcess:
    command, env = _command(program, way, cache)
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(command, -9, exc.stdout or "", f"timed out after {TIMEOUT_S} s")


def _numbers_close(expected: str, actual: str) -> bool:
    if expected == actual:
        return True
    if expected in ("nan", "inf") or actual in ("nan", "inf"):
        return False
    e, a = float(expected), float(actual)
    digits = len(expected.split(".")[1].split("e")[0].split("E")[0]) if "." in expected else 0
    unit = 10.0 ** -digits
    if "e" in expected.lower():
        unit *= 10.0 ** int(expected.lower().split("e")[1])
    return abs(e - a) <= max(2 * unit, 1e-3 * abs(e))


def same_output(expected: str, actual: str) -> Optional[str]:
    """None where ``actual`` matches ``expected`` within rounding, else the first difference."""
    e_lines, a_lines = expected.splitlines(), actual.splitlines()
    if len(e_lines) != len(a_lines):
        return f"{len(a_lines)} lines where strict printed {len(e_lines)}"
    for n, (e, a) in enumerate(zip(e_lines, a_lines), 1):
        if e == a:
            continue
        e_nums, a_nums = _NUMBER.findall(e), _NUMBER.findall(a)
        if _NUMBER.sub("#", e) != _NUMBER.sub("#", a) or len(e_nums) != len(a_nums) \
                or not all(_numbers_close(x, y) for x, y in zip(e_nums, a_nums)):
            return f"line {n}: strict {e!r}, got {a!r}"
    return None


def check(program: Path, ways: tuple[str, ...] = WAYS) -> dict[str, Optional[str]]:
    """{way: None if it printed strict's output, else what differed} for one program."""
    verdicts: dict[str, Optional[str]] = {}
    with tempfile.TemporaryDirectory(prefix="corpus-") as folder:
        strict = run_way(program, "strict", os.path.join(folder, "strict"))
        if strict.returncode != 0:
            return {"strict": f"strict failed ({strict.returncode}): {strict.stderr.strip()[-800:]}"}
        for way in ways:
            if way == "strict":
                continue
            # (deferred and warm share a folder: warm is the second process on it)
            cache = os.path.join(folder, "deferred" if way in ("deferred", "warm") else way)
            done = run_way(program, way, cache)
            if done.returncode != 0:
                verdicts[way] = f"exit {done.returncode}: {done.stderr.strip()[-800:]}"
            else:
                verdicts[way] = same_output(strict.stdout, done.stdout)
    return verdicts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--fast", action="store_true", help="only the programs make test runs")
    args = parser.parse_args(argv)
    found = programs(args.names or (list(FAST) if args.fast else None))
    ways = tuple(w for w in args.ways.split(",") if w)
    failures = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for program, verdicts in zip(found, pool.map(lambda p: check(p, ways), found)):
            bad = {w: v for w, v in verdicts.items() if v is not None}
            known = KNOWN_DIFFERENCES.get(program.stem)
            failures += bool(bad) and known is None
            cells = " ".join(f"{w}:{'ok' if verdicts.get(w) is None else 'DIFF'}" for w in ways if w != "strict")
            print(f"{program.stem:32s} {cells}{'  (known: ' + known + ')' if bad and known else ''}", flush=True)
            for way, why in bad.items():
                print(f"    {way}: {why}")
    print(f"\n{len(found) - failures} of {len(found)} programs print strict's output every way, or differ "
          f"only where docs/semantics.md says they do")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
