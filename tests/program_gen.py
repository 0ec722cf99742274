"""The program generator: a hypothesis strategy building well-typed random programs.

`Gen` builds a program one step at a time and runs each step on meta tensors, so every choice
(operand, dim, index, shape) is made knowing the shapes and dtypes of the values that exist.
A step whose meta run raises ends the program.  Each op registers a draw function and its
source template with `register`; `FAMILIES` weight the ops into program families.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from program_model import (DTYPES, FLOATS, INTS, OPS, Guard, Index, InputSpec, Lit, Program,
                           Step, compiled, register, render, renderer, operand_source)

MAX_NUMEL = 2000
MAX_RANK = 6
MAX_STEPS = 30

# --------------------------------------------------------------------------- generator

@dataclasses.dataclass
class Info:
    vid: int
    shape: tuple
    dtype: torch.dtype
    root: int  # the value that owns the storage (an input's id for inputs and their views)
    overlap: bool  # some elements share memory (an expanded view): in-place writes raise

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def integral(self) -> bool:
        return not self.dtype.is_floating_point


def _is_integral(operand: Any, gen: "Gen") -> bool:
    if isinstance(operand, Lit):
        return not isinstance(operand.value, float)
    return gen.info(operand.vid if isinstance(operand, Guard) else operand).integral


def _broadcast(*shapes: tuple) -> tuple | None:
    try:
        shape = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None
    return shape if len(shape) <= MAX_RANK and math.prod(shape) <= MAX_NUMEL else None


INT_LITS = (2, 1, 0, -1, 3, -3, 7)
FLOAT_LITS = (0.5, 2.0, -1.5, 0.0, 1.0, 3.25, -0.1, 1e-3, 100.0)
ODD_FLOATS = (math.inf, -math.inf, math.nan)


class Gen:
    """Builds a program one step at a time, tracking every value as a meta tensor."""

    def __init__(self, draw: Callable, family: "Family", inputs: tuple) -> None:
        self.draw = draw
        self.family = family
        self.n_inputs = len(inputs)
        self.namespace: dict = {"torch": torch, "_observe": lambda *args: None}
        self.values: list[Info] = []
        self.roots: dict[int, int] = {}  # id(storage-owning meta tensor) -> root value id
        self.steps: list[Step] = []
        for i, spec in enumerate(inputs):
            tensor, base = spec.build("meta")
            self.namespace[f"_base{i}"] = base  # keep alive so ids stay unique
            self.roots[id(base)] = i
            self._add(i, tensor)

    # -- bookkeeping
    def _add(self, vid: int, tensor: torch.Tensor) -> None:
        self.namespace[f"v{vid}"] = tensor
        owner = tensor._base if tensor._base is not None else tensor
        root = self.roots.setdefault(id(owner), vid)
        overlap = torch._debug_has_internal_overlap(tensor) != 0
        self.values.append(Info(vid, tuple(tensor.shape), tensor.dtype, root, overlap))

    def info(self, vid: int) -> Info:
        return self.values[vid]

    def run(self, op: str, args: tuple, params: tuple = ()) -> bool:
        """Append a step; False when its meta run raised (the program ends there)."""
        out = len(self.values) if OPS[op].produces else None
        step = Step(op, args, params, out)
        self.steps.append(step)
        try:
            exec(compiled(step.source()), self.namespace)
        except Exception:
            return False
        for info in self.values:
            tensor = self.namespace[f"v{info.vid}"]
            info.shape, info.dtype = tuple(tensor.shape), tensor.dtype
        if out is not None:
            result = self.namespace[f"v{out}"]
            if not isinstance(result, torch.Tensor):
                return False
            self._add(out, result)
        return True

    # -- choices
    def chance(self, percent: int) -> bool:
        return self.draw(st.integers(0, 99)) >= 100 - percent

    def fuzz(self) -> bool:
        """Rarely allow an ill-typed choice, so error paths are exercised too."""
        return self.chance(2)

    def choose(self, options):
        return self.draw(st.sampled_from(tuple(options)))

    def pick(self, pred: Callable[[Info], bool] = lambda i: True, exact: bool = False) -> Info | None:
        """A value satisfying `pred` (`exact`: always; otherwise rarely any value)."""
        fuzz = not exact and self.fuzz()
        candidates = [i for i in self.values if fuzz or pred(i)]
        return self.choose(candidates) if candidates else None

    def target(self, pred: Callable[[Info], bool] = lambda i: True) -> Info | None:
        """An in-place target: mostly inputs and views of inputs, without internal overlap."""
        fuzz = self.fuzz()
        ok = [i for i in self.values if fuzz or (pred(i) and not i.overlap)]
        preferred = [i for i in ok if i.root < self.n_inputs]
        if preferred and self.chance(80):
            return self.choose(preferred)
        return self.choose(ok) if ok else None

    def scalar(self, like: torch.dtype | None = None) -> Lit:
        if like is None:
            kind = self.choose(("float", "int", "bool"))
        elif like == torch.bool:
            kind = "bool" if self.chance(60) else self.choose(("int", "float"))
        elif like.is_floating_point:
            kind = "float" if self.chance(65) else self.choose(("int", "bool"))
        else:
            kind = "int" if self.chance(70) else self.choose(("float", "bool"))
        if kind == "bool":
            return Lit(self.draw(st.booleans()))
        if kind == "int":
            return Lit(self.choose(INT_LITS))
        if self.chance(4):
            return Lit(self.choose(ODD_FLOATS))
        return Lit(self.draw(st.one_of(st.sampled_from(FLOAT_LITS),
                                       st.floats(-8, 8, width=32, allow_subnormal=False))))

    def partner(self, a: Info, percent_scalar: int | None = None, into: bool = False,
                pred: Callable[[Info], bool] = lambda i: True) -> Any:
        """A second operand for `a`: a Python scalar or a tensor that broadcasts with it
        (`into`: broadcasts to exactly a's shape, for in-place ops)."""
        percent = self.family.percent_scalar if percent_scalar is None else percent_scalar
        if self.chance(percent):
            return self.scalar(a.dtype)
        fuzz = self.fuzz()
        candidates = [i for i in self.values
                      if fuzz or (pred(i) and (_broadcast(a.shape, i.shape) == a.shape if into
                                               else _broadcast(a.shape, i.shape) is not None))]
        return self.choose(candidates).vid if candidates else self.scalar(a.dtype)

    def dim(self, info: Info) -> int:
        n = max(info.ndim, 1)
        return self.draw(st.integers(-n, n - 1))

    def meta_shape(self, expr: str) -> tuple | None:
        try:
            return tuple(eval(expr, self.namespace).shape)
        except Exception:
            return None


# --------------------------------------------------------------------------- ops

UNARY = ("exp", "log", "sqrt", "tanh", "sigmoid", "sin", "cos", "abs")


@register(UNARY, lambda name: f"torch.{name}({{0}})")
def draw_unary(g: Gen, name: str) -> bool:
    a = g.pick(lambda i: i.dtype != torch.bool or name != "abs")
    return a is not None and g.run(name, (a.vid,))


@register(("neg", "logical_not", "bitwise_not"),
          lambda name: {"neg": "-{0}", "logical_not": "torch.logical_not({0})",
                        "bitwise_not": "~{0}"}[name])
def draw_unary_special(g: Gen, name: str) -> bool:
    allowed = {"neg": lambda i: i.dtype != torch.bool, "logical_not": lambda i: True,
               "bitwise_not": lambda i: i.integral}[name]
    a = g.pick(allowed)
    return a is not None and g.run(name, (a.vid,))


ARITH = {"+": "{0} + {1}", "-": "{0} - {1}", "*": "{0} * {1}", "/": "{0} / {1}",
         "//": "{0} // {1}", "%": "{0} % {1}", "**": "{0} ** {1}",
         "add": "torch.add({0}, {1}{alpha})", "sub": "torch.sub({0}, {1}{alpha})",
         "mul": "torch.mul({0}, {1})", "div": "torch.div({0}, {1}{rounding_mode})",
         "remainder": "torch.remainder({0}, {1})", "fmod": "torch.fmod({0}, {1})",
         "pow": "torch.pow({0}, {1})", "maximum": "torch.maximum({0}, {1})",
         "minimum": "torch.minimum({0}, {1})"}
OPERATOR_FORMS = ("+", "-", "*", "/", "//", "%", "**")


@renderer
def render_arith(step: Step) -> str:
    operands = list(map(operand_source, step.args))
    extras = {"alpha": "", "rounding_mode": ""}
    if step.param("alpha") is not None:
        extras["alpha"] = f", alpha={render(step.param('alpha'))}"
    if step.param("rounding_mode", "none") != "none":
        extras["rounding_mode"] = f", rounding_mode={step.param('rounding_mode')!r}"
    return ARITH[step.op].format(*operands, **extras)


@register(tuple(ARITH), render_arith)
def draw_arith(g: Gen, name: str) -> bool:
    a = g.pick(lambda i: i.dtype != torch.bool or name in ("+", "*", "add", "mul", "maximum",
                                                           "minimum", "/"))
    if a is None:
        return False
    subtraction = name in ("-", "sub")
    b = g.partner(a, percent_scalar=0 if name in ("maximum", "minimum") else None,
                  pred=lambda i: i.dtype != torch.bool or not subtraction)
    if subtraction and isinstance(b, Lit) and isinstance(b.value, bool):
        b = Lit(int(b.value))
    args = [a.vid, b]
    if name in OPERATOR_FORMS and isinstance(b, Lit) and g.chance(35):
        args.reverse()  # a Python scalar on the left: __radd__, __rpow__, ...
    params: list = []
    if name in ("add", "sub") and g.chance(50):
        integral = _is_integral(a.vid, g) and _is_integral(b, g)
        params.append(("alpha", g.choose((2, -1, 3) if integral else (2, -0.5, 1.5))))
    rounding = "none"
    if name == "div":
        rounding = g.choose(("none", "trunc", "floor"))
        params.append(("rounding_mode", rounding))
    integral_division = (name in ("//", "%", "remainder", "fmod")
                         or (name == "div" and rounding != "none"))
    if integral_division and not all(_is_integral(x, g) for x in args) and any(
            isinstance(x, int) and x >= g.n_inputs for x in args):
        # floor-based ops are discontinuous: on a computed float, a last-bit difference that the
        # contract allows (tanh(8) is 1 - 2**-22 in torch, 1.0 in XLA) becomes a jump of 1
        return False
    if integral_division and all(_is_integral(x, g) for x in args):
        if isinstance(args[1], Lit):
            args[1] = Lit(g.choose((2, 3, -2, 5)))
        else:
            args[1] = Guard(args[1], "divisor")
    if name in ("**", "pow") and _is_integral(args[0], g) and _is_integral(args[1], g):
        if isinstance(args[1], Lit):
            args[1] = Lit(g.choose((2, 0, 1, 3)) if not g.fuzz() else -1)
        elif isinstance(args[1], int) and g.info(args[1]).dtype != torch.bool:
            args[1] = Guard(args[1], "exponent")
    return g.run(name, tuple(args), tuple(params))


COMPARE = {"==": "{0} == {1}", "!=": "{0} != {1}", "<": "{0} < {1}", "<=": "{0} <= {1}",
           ">": "{0} > {1}", ">=": "{0} >= {1}", "eq": "torch.eq({0}, {1})",
           "lt": "torch.lt({0}, {1})", "ge": "torch.ge({0}, {1})"}


@register(tuple(COMPARE), lambda name: COMPARE[name])
def draw_compare(g: Gen, name: str) -> bool:
    a = g.pick()
    if a is None:
        return False
    b = g.partner(a)
    args = (a.vid, b)
    if any(isinstance(x, int) and x >= g.n_inputs and not _is_integral(x, g) for x in args):
        # a comparison is discontinuous too: computed floats may differ in the last bit
        return False
    if isinstance(b, Lit) and not name.isalpha() and g.chance(30):
        args = (b, a.vid)
    return g.run(name, args)


LOGICAL = {"logical_and": "torch.logical_and({0}, {1})", "logical_or": "torch.logical_or({0}, {1})",
           "logical_xor": "torch.logical_xor({0}, {1})", "&": "{0} & {1}", "|": "{0} | {1}",
           "^": "{0} ^ {1}"}


@register(tuple(LOGICAL), lambda name: LOGICAL[name])
def draw_logical(g: Gen, name: str) -> bool:
    bitwise = not name.startswith("logical")
    a = g.pick(lambda i: i.integral or not bitwise)
    if a is None:
        return False
    b = g.partner(a, percent_scalar=None if bitwise else 0, pred=lambda i: i.integral or not bitwise)
    if isinstance(b, Lit) and isinstance(b.value, float) and not g.fuzz():
        b = Lit(g.choose((True, False, 1, 3, -2)))
    return g.run(name, (a.vid, b))


@register("where", "torch.where({0}, {1}, {2})")
def draw_where(g: Gen, name: str) -> bool:
    a = g.pick()
    if a is None:
        return False
    cond = g.pick(lambda i: i.dtype == torch.bool and _broadcast(i.shape, a.shape) is not None)
    if cond is None:
        return False
    other = g.partner(a, pred=lambda i: _broadcast(i.shape, a.shape, cond.shape) is not None)
    first = g.scalar(a.dtype) if g.chance(15) else a.vid
    return g.run(name, (cond.vid, first, other))


@renderer
def render_clamp(step: Step) -> str:
    a = operand_source(step.args[0])
    if step.op == "clamp_tensor":
        return f"torch.clamp({a}, {operand_source(step.args[1])}, {operand_source(step.args[2])})"
    bounds = ", ".join(f"{k}={render(v)}" for k, v in step.params if v is not None)
    return f"{a}.clamp_({bounds})" if step.op == "clamp_" else f"torch.clamp({a}, {bounds})"


@register(("clamp", "clamp_", "clamp_tensor"), render_clamp)
def draw_clamp(g: Gen, name: str) -> bool:
    a = (g.target if name == "clamp_" else g.pick)(lambda i: i.dtype != torch.bool)
    if a is None:
        return False
    if name == "clamp_tensor":
        lo = g.partner(a, percent_scalar=0)
        hi = g.partner(a, percent_scalar=0)
        if isinstance(lo, Lit) or isinstance(hi, Lit):
            return False
        return g.run(name, (a.vid, lo, hi))
    lo, hi = g.scalar(a.dtype).value, g.scalar(a.dtype).value
    if a.integral and name == "clamp_" and not g.fuzz():
        lo, hi = int(lo) if math.isfinite(lo) else 0, int(hi) if math.isfinite(hi) else 1
    choice = g.choose(("both", "min", "max"))
    return g.run(name, (a.vid,), (("min", None if choice == "max" else lo),
                                  ("max", None if choice == "min" else hi)))


@renderer
def render_cast(step: Step) -> str:
    return f"{operand_source(step.args[0])}.to({render(step.param('dtype'))})"


@register("to", render_cast)
def draw_cast(g: Gen, name: str) -> bool:
    a = g.pick()
    if a is None:
        return False
    dtype = g.choose(DTYPES)
    src = a.vid
    if a.dtype.is_floating_point and dtype in INTS:
        src = Guard(a.vid, "finite")
    return g.run(name, (src,), (("dtype", dtype),))


@renderer
def render_reduction(step: Step) -> str:
    text = f"torch.{step.op}({operand_source(step.args[0])}"
    for key in ("dim", "keepdim", "dtype"):
        if step.param(key, "absent") != "absent":
            text += f", {key}={render(step.param(key))}"
    return text + ")"


REDUCTIONS = ("sum", "mean", "amax", "amin", "prod", "argmax", "any", "all", "cumsum",
              "softmax", "log_softmax")


@register(REDUCTIONS, render_reduction)
def draw_reduction(g: Gen, name: str) -> bool:
    floaty = name in ("mean", "softmax", "log_softmax")
    a = g.pick(lambda i: i.dtype != torch.bool or name != "argmax")
    if a is None:
        return False
    params: list = []
    whole = name not in ("cumsum", "softmax", "log_softmax") and g.chance(30)
    if whole and a.numel == 0 and name in ("amax", "amin", "argmax") and not g.fuzz():
        return False  # strict raises: no identity for an empty max
    if not whole:
        dim: Any = g.dim(a)
        if name in ("amax", "amin", "argmax") and a.ndim and not g.fuzz():
            nonempty = [d for d, size in enumerate(a.shape) if size]  # else strict raises
            if not nonempty:
                return False
            dim = g.choose(nonempty)
        if name in ("sum", "mean", "amax", "amin") and a.ndim >= 2 and g.chance(25):
            dim = tuple(sorted({g.dim(a) % a.ndim, g.dim(a) % a.ndim}))
        params.append(("dim", dim))
        if name not in ("cumsum", "softmax", "log_softmax"):
            params.append(("keepdim", g.draw(st.booleans())))
    elif name == "argmax" and g.chance(50):
        params += [("dim", None), ("keepdim", g.draw(st.booleans()))]
    if name in ("sum", "mean", "prod", "cumsum", "softmax", "log_softmax"):
        if (floaty and a.integral and not g.fuzz()) or g.chance(15):
            # a float -> int conversion of nan/inf would be undefined behaviour
            params.append(("dtype", g.choose(FLOATS if floaty or not a.integral else DTYPES[:4])))
    return g.run(name, (a.vid,), tuple(params))


@register(("@", "matmul"), lambda name: "{0} @ {1}" if name == "@" else "torch.matmul({0}, {1})")
def draw_matmul(g: Gen, name: str) -> bool:
    a = g.pick(lambda i: i.dtype.is_floating_point and i.ndim >= 1, exact=True)
    if a is None:
        return False
    k = a.shape[-1]

    def fits(i: Info) -> bool:
        if i.dtype != a.dtype or i.ndim < 1 or i.shape[-2 if i.ndim >= 2 else 0] != k:
            return False
        return i.ndim <= 2 or a.ndim <= 2 or _broadcast(a.shape[:-2], i.shape[:-2]) is not None
    b = g.pick(fits, exact=True)
    if b is not None:
        return g.run(name, (a.vid, b.vid))
    if a.ndim == 1:
        return g.run(name, (a.vid, a.vid))
    # a @ a.mT always fits: a view step, then the product
    return g.run("mT", (a.vid,)) and g.run(name, (a.vid, g.values[-1].vid))


def _factor_shape(g: Gen, numel: int) -> tuple:
    rank = g.draw(st.integers(0 if numel == 1 else 1, 4))
    if numel == 0:
        shape = [g.draw(st.integers(0, 3)) for _ in range(rank)]
        return tuple(shape[:-1] + [0]) if shape else (0,)
    shape = [1] * max(rank, 1)
    remaining = numel
    for p in (2, 3, 5, 7):
        while remaining % p == 0:
            remaining //= p
            shape[g.draw(st.integers(0, len(shape) - 1))] *= p
    shape[0] *= remaining
    if rank == 0:
        return ()
    if g.chance(25):
        shape[g.draw(st.integers(0, len(shape) - 1))] = -1
    return tuple(shape)


VIEWS = {"reshape": "{0}.reshape({shape})", "view": "{0}.view({shape})",
         "transpose": "{0}.transpose({d0}, {d1})", "t": "{0}.t()", "mT": "{0}.mT",
         "permute": "{0}.permute({perm})", "unsqueeze": "{0}.unsqueeze({dim})",
         "squeeze": "{0}.squeeze({dim})", "expand": "{0}.expand({shape})",
         "getitem": "{0}[{index}]", "select": "{0}.select({dim}, {index})",
         "narrow": "{0}.narrow({dim}, {start}, {length})",
         "diagonal": "{0}.diagonal(offset={offset}, dim1={d0}, dim2={d1})",
         "clone": "{0}.clone()", "contiguous": "{0}.contiguous()"}


@register(tuple(VIEWS), lambda name: VIEWS[name])
def draw_view(g: Gen, name: str) -> bool:
    need = {"t": 0, "mT": 2, "transpose": 1, "select": 1, "narrow": 1, "diagonal": 2}.get(name, 0)
    a = g.pick(lambda i: i.ndim >= need and (name != "t" or i.ndim <= 2), exact=need > 0)
    if a is None:
        return False
    return g.run(name, (a.vid,), _view_params(g, name, a))


def _view_params(g: Gen, name: str, a: Info) -> tuple:
    if name in ("reshape", "view"):
        return (("shape", _factor_shape(g, a.numel)),)
    if name == "transpose":
        return (("d0", g.dim(a)), ("d1", g.dim(a)))
    if name == "permute":
        return (("perm", tuple(g.draw(st.permutations(range(a.ndim))))),)
    if name == "unsqueeze":
        return (("dim", g.draw(st.integers(-a.ndim - 1, a.ndim))),) if a.ndim < MAX_RANK else (("dim", 0),)
    if name == "squeeze":
        ones = [d for d, s in enumerate(a.shape) if s == 1]
        return (("dim", g.choose(ones) if ones and g.chance(60) else g.dim(a)),)
    if name == "expand":
        shape = [g.choose((s, -1, 3, 2)) if s == 1 else g.choose((s, -1)) for s in a.shape]
        if len(shape) < 4 and g.chance(40):
            shape.insert(0, g.choose((2, 1, 3)))
        return (("shape", tuple(shape)),)
    if name == "getitem":
        return (("index", _index(g, a.shape)),)
    if name in ("select", "narrow"):
        dim = g.dim(a)
        nonempty = [d for d, size in enumerate(a.shape) if size]
        if name == "select" and nonempty and not g.fuzz():
            dim = g.choose(nonempty)  # selecting from an empty dim raises IndexError
        size = a.shape[dim]
        if name == "select":
            return (("dim", dim), ("index", g.draw(st.integers(-size, size - 1)) if size else 0))
        start = g.draw(st.integers(-size, size)) if size else 0
        stop = size if start >= 0 else 0
        length = g.draw(st.integers(0, stop - start if start >= 0 else -start))
        return (("dim", dim), ("start", start), ("length", length))
    if name == "diagonal":
        d0 = g.dim(a)
        others = [d for d in range(a.ndim) if d != d0 % a.ndim]
        d1 = g.dim(a) if g.fuzz() else g.choose(others)
        return (("offset", g.choose((0, 1, -1, 2))), ("d0", d0), ("d1", d1))
    return ()


def _index(g: Gen, shape: tuple) -> Index:
    items: list = []
    count = g.draw(st.integers(0 if not shape else 1, max(len(shape), 1)))
    for size in shape[:count]:
        kind = g.choose(("slice", "slice", "int", "full", "none"))
        if kind == "int" and size > 0:
            items.append(g.draw(st.integers(-size, size - 1)))
        elif kind == "full":
            items.append(slice(None))
        elif kind == "none":
            items.append(None)
            items.append(slice(None))
        else:
            start = g.choose((None, 0, 1, -1, -2, 2))
            stop = g.choose((None, -1, 2, 3, size))
            items.append(slice(start, stop, g.choose((None, 2, 3))))
    if not shape:
        items = [g.choose((Ellipsis, None))] if g.chance(70) else []
    elif count < len(shape) and g.chance(15):
        items.insert(0, Ellipsis)
    return Index(tuple(items))


@renderer
def render_join(step: Step) -> str:
    tensors = ", ".join(map(operand_source, step.args))
    return f"torch.{step.op}([{tensors}], dim={step.param('dim')})"


@register(("cat", "stack"), render_join)
def draw_join(g: Gen, name: str) -> bool:
    a = g.pick(lambda i: i.ndim >= 1 or name == "stack", exact=True)
    if a is None:
        return False
    dim = g.dim(a) if name == "cat" else g.draw(st.integers(-a.ndim - 1, a.ndim))
    axis = dim % max(a.ndim, 1)

    def fits(i: Info) -> bool:
        if name == "stack":
            return i.shape == a.shape
        return i.ndim == a.ndim and all(x == y for d, (x, y) in enumerate(zip(i.shape, a.shape))
                                        if d != axis)
    others = [i for i in g.values if fits(i)]
    extra = [g.choose(others).vid for _ in range(g.draw(st.integers(0, 2)))]
    numel = a.numel * (1 + len(extra))
    if numel > MAX_NUMEL:
        return False
    return g.run(name, (a.vid, *extra), (("dim", dim),))


INPLACE_ARITH = {"add_": "{0}.add_({1})", "sub_": "{0}.sub_({1})", "mul_": "{0}.mul_({1})",
                 "div_": "{0}.div_({1})", "div_rounding_": "{0}.div_({1}, rounding_mode={mode})",
                 "iadd": "{0} += {1}", "imul": "{0} *= {1}", "getitem_iadd": "{0}[{index}] += {1}"}


def _can_hold(target: torch.dtype, value: Any, g: Gen) -> bool:
    if target.is_floating_point:
        return True
    if isinstance(value, Lit):
        return not isinstance(value.value, float) and (target != torch.bool or isinstance(value.value, bool))
    other = g.info(value).dtype
    return not other.is_floating_point and (target != torch.bool or other == torch.bool)


@register(tuple(INPLACE_ARITH), lambda name: INPLACE_ARITH[name], produces=False)
def draw_inplace_arith(g: Gen, name: str) -> bool:
    t = g.target(lambda i: i.dtype != torch.bool or name in ("mul_", "imul", "add_", "iadd"))
    if t is None:
        return False
    params: tuple = ()
    shape = t.shape
    if name == "getitem_iadd":
        index = _index(g, t.shape)
        shape = g.meta_shape(f"v{t.vid}[{render(index)}]")
        if shape is None:
            return False
        params = (("index", index),)
    view = Info(-1, shape, t.dtype, -1, False)
    # mostly read a value that does not share memory with the target: a partial overlap makes
    # strict raise, which is worth checking now and then, not in every other program
    other_root = not g.chance(20)
    subtraction = name == "sub_"
    value = g.partner(view, into=True, pred=lambda i: _can_hold(t.dtype, i.vid, g) and (
        i.root != t.root or not other_root) and (i.dtype != torch.bool or not subtraction))
    if subtraction and isinstance(value, Lit) and isinstance(value.value, bool):
        value = Lit(int(value.value))
    if not _can_hold(t.dtype, value, g) and not g.fuzz():
        value = Lit(g.choose(INT_LITS[:4]) if t.dtype != torch.bool else True)
    if name == "div_rounding_":
        params = (("mode", g.choose(("trunc", "floor"))),)
        if t.integral and isinstance(value, Lit):
            value = Lit(g.choose((2, 3, -2)))
        elif t.integral and _is_integral(value, g):
            value = Guard(value, "divisor")
    elif name == "div_" and t.integral and not g.fuzz():
        return False  # strict raises: a float quotient cannot be written into an int tensor
    return g.run(name, (t.vid, value), params)


@register(("neg_", "abs_", "exp_", "sigmoid_", "zero_"), lambda name: f"{{0}}.{name}()",
          produces=False)
def draw_inplace_unary(g: Gen, name: str) -> bool:
    t = g.target(lambda i: name == "zero_" or i.dtype != torch.bool and (
        i.dtype.is_floating_point or name in ("neg_", "abs_")))
    return t is not None and g.run(name, (t.vid,))


@register("masked_fill", "{0}.masked_fill({1}, {2})")
def draw_masked_fill(g: Gen, name: str) -> bool:
    return draw_fill(g, name)


@register(("fill_", "copy_", "masked_fill_"),
          lambda name: {"fill_": "{0}.fill_({1})", "copy_": "{0}.copy_({1})",
                        "masked_fill_": "{0}.masked_fill_({1}, {2})"}[name],
          produces=False)
def draw_fill(g: Gen, name: str) -> bool:
    t = g.target() if name != "masked_fill" else g.pick()
    if t is None:
        return False
    if name == "fill_":
        zero_dim = g.pick(lambda i: i.ndim == 0) if g.chance(25) else None
        if zero_dim is None:
            return g.run(name, (t.vid, _fill_value(g, t)))
        finite = zero_dim.dtype.is_floating_point and t.integral
        return g.run(name, (t.vid, Guard(zero_dim.vid, "finite") if finite else zero_dim.vid))
    if name == "copy_":
        src = g.partner(t, percent_scalar=0, into=True)
        if isinstance(src, Lit):
            return False
        if g.info(src).dtype.is_floating_point and t.integral:
            src = Guard(src, "finite")
        return g.run(name, (t.vid, src))
    mask = g.pick(lambda i: i.dtype == torch.bool and _broadcast(t.shape, i.shape) == t.shape)
    if mask is None:
        return False
    return g.run(name, (t.vid, mask.vid, _fill_value(g, t)))


def _fill_value(g: Gen, t: Info) -> Lit:
    value = g.scalar(t.dtype)
    if t.integral and isinstance(value.value, float) and not math.isfinite(value.value) \
            and not g.fuzz():
        value = Lit(1.5)  # strict raises on nan/inf into an integer tensor; keep that rare
    return value


@register(("setitem", "setitem_mask"),
          lambda name: "{0}[{index}] = {1}" if name == "setitem" else "{0}[{1}] = {2}",
          produces=False)
def draw_setitem(g: Gen, name: str) -> bool:
    t = g.target()
    if t is None:
        return False
    if name == "setitem_mask":
        mask = g.pick(lambda i: i.dtype == torch.bool and i.shape == t.shape, exact=True)
        return mask is not None and g.run(name, (t.vid, mask.vid, _fill_value(g, t)))
    index = _index(g, t.shape)
    shape = g.meta_shape(f"v{t.vid}[{render(index)}]")
    if shape is None:
        return False
    if g.chance(40):
        value: Any = _fill_value(g, t)
    else:
        value = g.partner(Info(-1, shape, t.dtype, -1, False), percent_scalar=0, into=True)
        if isinstance(value, int) and g.info(value).dtype.is_floating_point and t.integral:
            value = Guard(value, "finite")
    return g.run(name, (t.vid, value), (("index", index),))


@register(("t_", "unsqueeze_", "squeeze_"),
          lambda name: {"t_": "{0}.t_()", "unsqueeze_": "{0}.unsqueeze_({dim})",
                        "squeeze_": "{0}.squeeze_({dim})"}[name], produces=False)
def draw_inplace_view(g: Gen, name: str) -> bool:
    t = g.target(lambda i: i.ndim <= 2 if name == "t_" else i.ndim < MAX_RANK)
    if t is None:
        return False
    params = () if name == "t_" else (("dim", g.draw(st.integers(-t.ndim - 1, t.ndim))
                                       if name == "unsqueeze_" else g.dim(t)),)
    return g.run(name, (t.vid,), params)


@register("observe", "_observe({0}, {how})", produces=False)
def draw_observe(g: Gen, name: str) -> bool:
    a = g.pick()
    if a is None:
        return False
    how = g.choose(("tolist", "item", "bool", "numpy") if a.numel == 1 else ("tolist", "numpy"))
    return g.run(name, (a.vid,), (("how", how),))


DATA_DEPENDENT = {"nonzero": "torch.nonzero({0})", "masked_read": "{0}[{1}]",
                  "index_select": "torch.index_select({0}, {dim}, {1})"}


@register(tuple(DATA_DEPENDENT), lambda name: DATA_DEPENDENT[name])
def draw_data_dependent(g: Gen, name: str) -> bool:
    """Ops whose output shape depends on values: defer must flush just enough to know it."""
    a = g.pick(lambda i: name != "index_select" or any(i.shape), exact=name == "index_select")
    if a is None:
        return False
    if name == "nonzero":
        return g.run(name, (a.vid,))
    if name == "masked_read":
        mask = g.pick(lambda i: i.dtype == torch.bool and i.shape == a.shape)
        return g.run(name, (a.vid, mask.vid if mask else Guard(a.vid, "mask")))
    dim = g.choose([d for d, size in enumerate(a.shape) if size])
    index = g.pick(lambda i: i.integral and 0 < i.numel <= 8, exact=True)
    if index is None:
        return False
    return g.run(name, (a.vid, Guard(index.vid, "index", a.shape[dim])), (("dim", dim),))


REORDER = {"flip": "torch.flip({0}, {dims})", "roll": "torch.roll({0}, {shifts}, {dims})"}


@register(tuple(REORDER), lambda name: REORDER[name])
def draw_reorder(g: Gen, name: str) -> bool:
    a = g.pick(lambda i: i.ndim >= 1, exact=True)
    if a is None:
        return False
    dims = tuple(sorted({g.dim(a) % a.ndim for _ in range(g.draw(st.integers(1, 2)))}))
    if name == "flip":
        return g.run(name, (a.vid,), (("dims", dims),))
    shifts = tuple(g.draw(st.integers(-6, 6)) for _ in dims)
    return g.run(name, (a.vid,), (("shifts", shifts), ("dims", dims)))


# --------------------------------------------------------------------------- families

@dataclasses.dataclass(frozen=True)
class Family:
    ops: tuple  # op names, repeated to weight them
    dtypes: tuple  # input dtypes, repeated to weight them
    percent_scalar: int = 25
    percent_zero_dim: int = 10


def _weighted(**groups: tuple) -> tuple:
    weights = {"x1": 1, "x2": 2, "x3": 3, "x4": 4}
    return tuple(name for key, names in groups.items() for name in names for _ in range(weights[key]))


POINTWISE = UNARY + ("neg", "logical_not", "bitwise_not") + tuple(ARITH) + tuple(COMPARE) \
    + tuple(LOGICAL) + ("where", "clamp", "clamp_tensor", "to", "masked_fill")
SOME_VIEWS = ("reshape", "transpose", "unsqueeze", "expand", "getitem", "select")
ALL_VIEWS = tuple(VIEWS) + ("cat", "stack")
MUTATIONS = tuple(INPLACE_ARITH) + ("neg_", "abs_", "exp_", "sigmoid_", "zero_", "fill_", "copy_",
                                    "masked_fill_", "setitem", "setitem_mask", "clamp_")

FAMILIES = {
    "pointwise": Family(_weighted(x3=POINTWISE, x1=SOME_VIEWS + ("observe",)),
                        DTYPES + FLOATS),
    "reductions": Family(_weighted(x4=REDUCTIONS + ("@", "matmul"), x1=POINTWISE + SOME_VIEWS,
                                   x2=("cat", "stack", "to") + tuple(DATA_DEPENDENT) + tuple(REORDER)),
                         DTYPES + FLOATS + FLOATS),
    "mutation": Family(_weighted(x3=ALL_VIEWS + MUTATIONS, x1=tuple(ARITH) + ("where", "sum", "to"),
                                 x2=("observe", "t_", "unsqueeze_", "squeeze_") + tuple(DATA_DEPENDENT)
                                 + tuple(REORDER)),
                       DTYPES + FLOATS),
    "promotion": Family(_weighted(x4=tuple(ARITH) + tuple(COMPARE), x2=("to", "where", "clamp", "add_",
                                                                        "mul_", "fill_", "sum", "cat"),
                                  x1=tuple(LOGICAL) + UNARY + ("getitem", "observe")),
                        DTYPES, percent_scalar=50, percent_zero_dim=40),
    "mixed": Family(tuple(OPS), DTYPES + FLOATS),
}


def _input_specs(draw: Callable, family: Family) -> tuple:
    sizes = st.sampled_from((1, 2, 3, 4, 5, 3))
    rank = draw(st.integers(0, 4)) if draw(st.integers(0, 99)) >= family.percent_zero_dim else 0
    base = [draw(sizes) for _ in range(rank)]
    if rank and draw(st.integers(0, 99)) >= 90:
        base[draw(st.integers(0, rank - 1))] = 0
    specs = []
    for _ in range(draw(st.integers(1, 4))):
        shape = list(base)
        how = draw(st.sampled_from(("same", "suffix", "ones", "own")))
        if how == "suffix":
            shape = shape[draw(st.integers(0, len(shape))):]
        elif how == "ones":
            shape = [1 if draw(st.booleans()) else s for s in shape]
        elif how == "own":
            shape = [draw(sizes) for _ in range(draw(st.integers(0, 3)))]
        layout = draw(st.sampled_from(("contiguous", "contiguous", "permuted", "strided")))
        if not shape or (layout == "permuted" and len(shape) < 2):
            layout = "contiguous"
        specs.append(InputSpec(tuple(shape), draw(st.sampled_from(family.dtypes)), layout,
                               draw(st.sampled_from(("int", "uniform", "special", "uniform"))),
                               draw(st.integers(0, 2**16))))
    return tuple(specs)


@st.composite
def programs(draw: Callable, family_name: str) -> Program:
    family = FAMILIES[family_name]
    inputs = _input_specs(draw, family)
    gen = Gen(draw, family, inputs)
    # one "another step?" draw per step, as st.lists does, so that the shrinker can delete any
    # step (with its draws) from the middle of a failing program
    before = 0
    for _ in range(3 * MAX_STEPS):  # a drawn op may not apply to the values at hand: draw again
        if len(gen.steps) >= MAX_STEPS or (len(gen.steps) > before and not gen.chance(95)):
            break
        name = draw(st.sampled_from(family.ops))
        before = len(gen.steps)
        ok = OPS[name].draw(gen, name)
        if not ok and len(gen.steps) > before:
            break  # the last step raised on meta tensors: the program ends there
    return Program(inputs, tuple(gen.steps))
