"""What one recorded op costs, next to the floor of any recorder built on a Python dispatch mode.

    python -m bench.dispatch_floor               # 200 dependent ops on 64x64, 9 shuffled rounds
    python -m bench.dispatch_floor --ops 1000 --rounds 15

Every row runs the same chain of dependent ``x + 0.5`` / ``x * 0.5`` ops (bench.workloads'
per-op workload) and reports microseconds per op (the minimum over rounds of each round's mean,
the lanes in a new seeded order each round):

- ``strict``: torch's own dispatch and kernel;
- ``mode, nothing recorded``: a ``TorchDispatchMode`` whose ``__torch_dispatch__`` returns its
  first argument (torch's trip into Python and back, no kernel);
- ``mode + a wrapper tensor``: the same mode returning a new ``_make_wrapper_subclass`` tensor of
  the op's shape, as deferfuse's ``DeferredTensor`` is made: the least any recorder that hands
  the user a tensor per op from a Python dispatch mode pays;
- ``deferfuse, recorded``: ``with deferfuse.defer():`` with the block tier and the at-once
  shortcuts off, so every op is recorded (the chain's result is never read, so nothing runs).

The difference between the last two rows is deferfuse's own recording; the wrapper row is the
floor a native (C++) recorder behind the same Python mode would still pay.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.workloads import chained_ops


class _Wrapper(torch.Tensor):
    """A data-less tensor of a shape and dtype, made as DeferredTensor is."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> "_Wrapper":
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} reached a wrapper outside its mode")


class _Returning(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return args[0]


class _Wrapping(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _Wrapper(args[0])


def lanes(ops: int) -> dict[str, Callable[[], object]]:
    import deferfuse
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def in_mode(mode_type) -> Callable[[], object]:
        def run():
            with mode_type():
                return chained_ops(x, ops)
        return run

    def recorded():
        with deferfuse.defer():
            return chained_ops(x, ops)

    return {"strict": lambda: chained_ops(x, ops), "mode, nothing recorded": in_mode(_Returning),
            "mode + a wrapper tensor": in_mode(_Wrapping), "deferfuse, recorded": recorded}


def measure(ops: int, rounds: int, calls: int, seed: int = 0) -> dict[str, float]:
    """Microseconds per op for each lane: the minimum over rounds of the round's mean."""
    import deferfuse
    # (the block tier and the at-once shortcuts off for the whole run: every op recorded)
    with deferfuse.config.override(eager_blocks=False, eager_unseen_ops=False, eager_lone_ops=False):
        return _measure(lanes(ops), ops, rounds, calls, seed)


def _measure(runs: dict, ops: int, rounds: int, calls: int, seed: int) -> dict[str, float]:
    for run in runs.values():   # (warm: deferfuse's metadata cached, every lane's code hot)
        for _ in range(30):
            run()
    best = {name: float("inf") for name in runs}
    order = list(runs)
    shuffle = random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            started = time.perf_counter()
            for _ in range(calls):
                runs[name]()
            best[name] = min(best[name], (time.perf_counter() - started) / calls / ops * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20, help="chains per lane per round")
    args = parser.parse_args(argv)
    best = measure(args.ops, args.rounds, args.calls)
    print(f"{args.ops} dependent ops on 64x64 floats, us per op (min over {args.rounds} shuffled rounds):")
    for name, us in best.items():
        print(f"  {name:<26}{us:7.2f}")
    floor = best["mode + a wrapper tensor"]
    print(f"deferfuse's own recording: {best['deferfuse, recorded'] - floor:.2f} us per op over the floor "
          f"of a Python dispatch mode handing out a tensor ({floor:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
