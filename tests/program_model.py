"""Random programs as data: the pieces a generated program is made of.

A `Program` is input specifications plus a tuple of `Step`s.  Each step names an op from `OPS`,
its operands (value ids, Python scalars as `Lit`, guarded operands as `Guard`) and its
parameters; `Step.source()` renders it as the line of Python the interpreter executes, so a
printed program is exactly what ran.  The ops themselves (how each is drawn) live in
program_gen.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import torch

FLOATS = (torch.float32, torch.float64)
INTS = (torch.int64, torch.int32)
DTYPES = FLOATS + INTS + (torch.bool,)

# --------------------------------------------------------------------------- program as data

@dataclasses.dataclass(frozen=True)
class Lit:
    """A Python scalar operand (int, float or bool)."""
    value: Any


@dataclasses.dataclass(frozen=True)
class Guard:
    """A tensor operand wrapped so that the program stays free of value-dependent errors and
    undefined behaviour: a nonzero divisor for integer division, a small non-negative exponent
    for integer powers, finite in-range values before a float -> int conversion, in-bounds
    positions for an index tensor (and a bool mask made from a value)."""
    vid: int
    kind: str  # "divisor" | "exponent" | "finite" | "index" | "mask"
    bound: int = 0  # for "index": the size of the indexed dimension


@dataclasses.dataclass(frozen=True)
class Index:
    """A basic-indexing subscript: ints, slices, None, Ellipsis."""
    items: tuple


def render(x: Any) -> str:
    if isinstance(x, Lit):
        text = render(x.value)
        return f"({text})" if text.startswith("-") else text
    if isinstance(x, Guard):
        v = f"v{x.vid}"
        if x.kind == "divisor":
            return f"torch.where(({v} == 0) | ({v} == -1), 2, {v})"
        if x.kind == "exponent":
            return f"({v}.abs() % 4)"
        if x.kind == "index":
            return f"({v}.flatten().long().abs() % {x.bound})"
        if x.kind == "mask":
            return f"({v} > 0)"
        return f"{v}.nan_to_num(0.0, 0.0, 0.0).clamp(-1000, 1000)"
    if isinstance(x, Index):
        if not x.items:
            return "()"
        return ", ".join(_render_index_item(i) for i in x.items)
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "float('nan')"
        if math.isinf(x):
            return "float('inf')" if x > 0 else "-float('inf')"
        return repr(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, tuple):
        inner = ", ".join(render(i) for i in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    return repr(x)


def _render_index_item(item: Any) -> str:
    if item is Ellipsis:
        return "..."
    if isinstance(item, slice):
        parts = ["" if p is None else str(p) for p in (item.start, item.stop)]
        text = ":".join(parts)
        return text if item.step is None else f"{text}:{item.step}"
    return repr(item)


def operand_source(a: Any) -> str:
    return f"v{a}" if isinstance(a, int) and not isinstance(a, bool) else render(a)


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    args: tuple  # value ids (int), Lit, Guard
    params: tuple = ()  # ((name, value), ...)
    out: int | None = None

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def source(self) -> str:
        template = OPS[self.op].template
        if callable(template):
            expr = template(self)
        else:
            expr = template.format(*map(operand_source, self.args),
                                   **{k: render(v) for k, v in self.params})
        return expr if self.out is None else f"v{self.out} = {expr}"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    shape: tuple
    dtype: torch.dtype
    layout: str  # "contiguous" | "permuted" | "strided": the latter two are views of a hidden base
    style: str  # "int" | "uniform" | "special"
    seed: int

    def base_shape(self) -> tuple:
        if self.layout == "permuted":
            return tuple(reversed(self.shape))
        if self.layout == "strided":
            return self.shape[:-1] + (2 * self.shape[-1],)
        return self.shape

    def view_suffix(self) -> str:
        if self.layout == "permuted":
            return f".permute{render(tuple(reversed(range(len(self.shape)))))}"
        return "[..., ::2]" if self.layout == "strided" else ""

    def build(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        if device == "meta":
            base = torch.empty(self.base_shape(), dtype=self.dtype, device="meta")
        else:
            base = _values(self.base_shape(), self.dtype, self.style, self.seed)
        if self.layout == "permuted":
            return base.permute(tuple(reversed(range(base.dim())))), base
        if self.layout == "strided":
            return base[..., ::2], base
        return base, base

    def __repr__(self) -> str:
        return (f"{str(self.dtype)[6:]}{list(self.shape)} {self.layout} "
                f"style={self.style} seed={self.seed}")


def _values(shape: tuple, dtype: torch.dtype, style: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if style == "int" or (style == "uniform" and not dtype.is_floating_point):
        high = 5 if style == "int" else 101
        return torch.randint(-high + 1, high, shape, generator=gen).to(dtype)
    values = (torch.rand(shape, generator=gen, dtype=torch.float64) * 8 - 4).to(dtype)
    if style == "special":
        if dtype.is_floating_point:
            specials = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e30, -1e30, 1e-30],
                                    dtype=dtype)
        else:
            info = torch.iinfo(dtype)
            values = torch.randint(-3, 4, shape, generator=gen).to(dtype)
            specials = torch.tensor([0, -1, info.max, info.min, info.max - 1], dtype=dtype)
        pick = torch.randint(0, len(specials), shape, generator=gen)
        mask = torch.rand(shape, generator=gen) < 0.4
        values = torch.where(mask, specials[pick], values)
    return values


@dataclasses.dataclass(frozen=True)
class Program:
    inputs: tuple
    steps: tuple

    def lines(self) -> list[str]:
        return [step.source() for step in self.steps]

    def __repr__(self) -> str:
        head = [f"# v{i}: {spec!r}" for i, spec in enumerate(self.inputs)]
        return "Program:\n" + "\n".join("    " + line for line in head + self.lines())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints with this
        printer.text(repr(self))

    def repro(self) -> str:
        """A standalone script: the literal inputs, then the program."""
        out = ["import torch", "import deferfuse", "nan, inf = float('nan'), float('inf')",
               "observed = []", "def _observe(t, how):",
               "    observed.append(t.tolist() if how == 'tolist' else t.item() if how == 'item' "
               "else t.numpy().tolist() if how == 'numpy' else bool(t))", ""]
        for i, spec in enumerate(self.inputs):
            _, base = spec.build()
            out.append(f"v{i} = torch.tensor({base.tolist()!r}, dtype={spec.dtype})"
                       f".reshape({render(tuple(base.shape))}){spec.view_suffix()}")
        out.append("with deferfuse.config.override(always_compile=True), deferfuse.defer():")
        out.extend("    " + line for line in self.lines())
        return "\n".join(out)


def observe_value(t: torch.Tensor, how: str) -> Any:
    """What an observation step `_observe(t, how)` reads from a tensor, as a Python value."""
    if how == "tolist":
        return t.tolist()
    if how == "item":
        return t.item()
    if how == "numpy":
        return t.numpy().tolist()
    return bool(t)


@functools.lru_cache(maxsize=8192)
def compiled(source: str):
    return compile(source, "<program>", "exec")


# --------------------------------------------------------------------------- op registry

@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    template: str | Callable[[Step], str]
    draw: Callable[..., bool]  # (gen, name) -> whether the step ran on meta tensors
    produces: bool = True


OPS: dict[str, OpDef] = {}


def register(names, template, produces: bool = True):
    """Register `draw(gen, name) -> bool` for each name; `template` may be a format string or
    a function of the name returning one (or returning a Step renderer)."""
    def wrap(draw):
        for name in ([names] if isinstance(names, str) else names):
            if name in OPS:
                raise RuntimeError(f"op {name!r} registered twice")
            text = template(name) if callable(template) and not _is_renderer(template) else template
            OPS[name] = OpDef(name, text, draw, produces)
        return draw
    return wrap


def _is_renderer(fn) -> bool:
    return getattr(fn, "is_renderer", False)


def renderer(fn):
    fn.is_renderer = True
    return fn

