"""python -m deferfuse [--mode M] script.py [args...]

Runs an unchanged script under an eager mode (default: TORCHTPU_MODE, else defer), as if it had
been started with ``python script.py args...``: same sys.argv, ``__name__ == "__main__"``, the
script's folder first on sys.path, its exit code, and its traceback.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deferfuse",
        description="Run a Python script under a deferfuse eager mode.")
    parser.add_argument("--mode", default=None,
                        help="strict, debug or defer (TorchTPU names accepted); "
                             "default: $TORCHTPU_MODE, else defer")
    parser.add_argument("script", help="path of the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
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
        runpy.run_path(script, run_name="__main__")
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
