"""python -m deferfuse [--mode M] script.py [args...]
python -m deferfuse --compare script.py [args...]

Runs an unchanged script under an eager mode (default: TORCHTPU_MODE, else defer), as if it had
been started with ``python script.py args...``: same sys.argv, ``__name__ == "__main__"``, the
script's folder first on sys.path, its exit code, and its traceback.

``--compare`` runs the script twice, in strict mode and under defer, from the same random
states, and prints where their values first part (``deferfuse.compare``, debugging/compare.py);
the exit status is 0 where they agree, 1 where they do not.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import io
import os
import sys
import traceback
import types


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deferfuse",
        description="Run a Python script under a deferfuse eager mode.")
    parser.add_argument("--mode", default=None,
                        help="strict, debug or defer (TorchTPU names accepted); "
                             "default: $TORCHTPU_MODE, else defer")
    parser.add_argument("--compare", action="store_true",
                        help="run the script in strict mode and under defer, from the same seeds, "
                             "and report the first op whose outputs differ")
    parser.add_argument("script", help="path of the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.compare:
        return _compare(options.script, options.args)
    from . import config
    from .modes import parse_mode
    chosen = options.mode if options.mode is not None else config.requested_mode() or "defer"
    mode = parse_mode(chosen, source="--mode" if options.mode is not None else "TORCHTPU_MODE")
    # the script (and any subprocess it starts) sees the mode it runs under
    config.pass_mode_to_children(mode.value)

    import deferfuse
    script = options.script
    sys.argv = [script, *options.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    deferfuse.set_mode("strict")
    deferfuse.set_mode(mode)
    try:
        _run_as_main(script)
    except SystemExit as exc:
        _finish()
        raise exc
    except BaseException as exc:  # noqa: BLE001 - print it as python would, without our frames
        _finish()
        tb = exc.__traceback__
        while tb is not None and not _is_script_frame(tb, script):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)
        return 1
    _finish()
    return 0


def _compare(script: str, args: list[str]) -> int:
    import deferfuse
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    deferfuse.set_mode("strict")

    def run() -> None:
        try:
            _run_as_main(script)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(f"the script exited with status {exc.code}") from None

    report = deferfuse.compare(run)
    print(report)
    return 0 if report.agree else 1


def _run_as_main(script: str) -> None:
    """Run ``script`` as ``python script`` runs it: in a fresh ``__main__`` module whose
    ``__file__`` (and so every traceback and warning location) is the absolute path, whose
    ``__builtins__`` is the builtins module, with ``sys.argv[0]`` as typed.  (``runpy.run_path``
    gives a relative ``__file__``, a dict of builtins and, with an absolute path, an absolute
    ``sys.argv[0]``.)"""
    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__builtins__ = builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__annotations__ = {}
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _is_script_frame(tb, script: str) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(script)


def _finish() -> None:
    import deferfuse
    try:
        deferfuse.set_mode("strict")
    except Exception:  # noqa: BLE001 - never mask the script's own outcome
        pass


if __name__ == "__main__":
    sys.exit(main())
