"""The payload of a disk cache entry: deferfuse's metadata as JSON, then XLA's own executable.

Nothing read back from disk is unpickled: a pickle runs code when it is read, and anyone who
could write an entry would run code in the process reading it.  JAX's
``jax.experimental.serialize_executable`` pickles its trees, and unpickles them on load; so an
entry holds instead (``serialize``/``parse``/``load``):

- one line of JSON of a fixed shape, at most ``METADATA_LIMIT`` bytes, every field's type
  checked when read: ``inputs`` (the program's inputs), ``results`` (its results), ``scalars``
  (its runtime scalars) and ``checks``, its runtime checks as ``[step, error, message]``, the
  error named from a fixed table (``ERRORS``): an entry naming another is refused;
- the executable as the backend serializes it (``client.serialize_executable``), which only
  XLA's deserializer reads.

A program is compiled with ``keep_unused=True`` (exec/executables.py): its executable takes
every input of the program, then the vector of runtime scalars (float64), and returns the
program's results, then, when it has checks, their flags and details.  ``LoadedProgram`` calls
it as a JAX ``Compiled`` of the program is called.  What does not fit that shape (constants
JAX hoisted into arguments, inputs XLA pruned) is not saved.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")

METADATA_LIMIT = 1 << 20

# The exceptions a runtime check may raise (lower/registry.py's runtime_check and bounds_check,
# and their callers in lower/), by the name an entry gives them.
ERRORS: dict[str, type] = {
    "IndexError": IndexError, "RuntimeError": RuntimeError, "ValueError": ValueError,
    "TypeError": TypeError, "ZeroDivisionError": ZeroDivisionError, "OverflowError": OverflowError,
    "NotImplementedError": NotImplementedError, "torch.linalg.LinAlgError": torch.linalg.LinAlgError,
}
_NAMES = {error: name for name, error in ERRORS.items()}


class Unsaveable(Exception):
    """Why an executable cannot be written as an entry."""


class Malformed(ValueError):
    """Why a payload's metadata is not one this version writes."""


def _program_trees(n_inputs: int, n_results: int, checked: bool) -> tuple[Any, Any]:
    """The trees of a Program's arguments and results (exec/program.py), as JAX flattens them."""
    leaf = 0
    inputs = jax.tree_util.tree_structure((([leaf] * n_inputs, leaf), {}))
    outputs = jax.tree_util.tree_structure(([leaf] * n_results, leaf, leaf) if checked
                                           else ([leaf] * n_results, None, None))
    return inputs, outputs


def serialize(compiled: Any, n_scalars: int, checks: Sequence[tuple[int, type, str]]) -> bytes:
    """The payload for ``compiled``, a JAX ``Compiled`` of a Program; raises Unsaveable."""
    if getattr(getattr(compiled, "_params", None), "const_args", None):
        raise Unsaveable("JAX passes it constants as arguments")
    checked = bool(checks)
    n_inputs = compiled.in_tree.num_leaves - 1
    n_results = compiled.out_tree.num_leaves - (2 if checked else 0)
    if n_inputs < 0 or n_results < 0 or (compiled.in_tree, compiled.out_tree) != _program_trees(
            n_inputs, n_results, checked):
        raise Unsaveable(f"it is not a program's executable (takes {compiled.in_tree}, "
                         f"returns {compiled.out_tree})")
    named = []
    for position, error, message in checks:
        if _NAMES.get(error) is None:
            raise Unsaveable(f"a runtime check raises {error.__qualname__}, which entries cannot name")
        named.append([int(position), _NAMES[error], str(message)])
    executable = compiled.runtime_executable()
    takes, returns = len(executable.get_parameter_layouts()), len(executable.get_output_layouts())
    if (takes, returns) != (n_inputs + 1, n_results + 2 * checked):
        raise Unsaveable(f"XLA's executable takes {takes} arguments and returns {returns} results, "
                         f"where the program has {n_inputs + 1} and {n_results + 2 * checked}")
    metadata = json.dumps({"inputs": n_inputs, "results": n_results, "scalars": int(n_scalars),
                           "checks": named}, sort_keys=True).encode()
    if len(metadata) >= METADATA_LIMIT:
        raise Unsaveable(f"its metadata takes {len(metadata)} bytes")
    return metadata + b"\n" + executable.client.serialize_executable(executable)


class Metadata:
    """What deferfuse knows of a saved executable besides XLA's bytes."""

    __slots__ = ("n_inputs", "n_results", "n_scalars", "checks")

    def __init__(self, n_inputs: int, n_results: int, n_scalars: int,
                 checks: list[tuple[int, type, str]]) -> None:
        self.n_inputs, self.n_results, self.n_scalars, self.checks = n_inputs, n_results, n_scalars, checks


def _count(fields: dict, name: str) -> int:
    value = fields.get(name)
    if type(value) is not int or value < 0:      # (not bool, not float)
        raise Malformed(f"its {name!r} is {value!r}, not a count")
    return value


def parse(payload: bytes) -> tuple[Metadata, bytes]:
    """The metadata of a payload and XLA's bytes after it; raises Malformed."""
    end = payload.find(b"\n", 0, METADATA_LIMIT)
    if end < 0:
        raise Malformed("no metadata line")
    try:
        fields = json.loads(payload[:end])
    except (ValueError, RecursionError) as exc:    # (not JSON, not UTF-8, nested too deep)
        raise Malformed(f"its metadata is not JSON ({exc})") from None
    if not isinstance(fields, dict) or set(fields) != {"inputs", "results", "scalars", "checks"}:
        raise Malformed("its metadata does not have this version's fields")
    checks = fields["checks"]
    if not isinstance(checks, list):
        raise Malformed("its checks are not a list")
    parsed = []
    for check in checks:
        if not (isinstance(check, list) and len(check) == 3 and type(check[0]) is int
                and check[0] >= 0 and isinstance(check[1], str) and isinstance(check[2], str)):
            raise Malformed(f"a check is {str(check)[:80]}, not [step, error, message]")
        if check[1] not in ERRORS:
            raise Malformed(f"a check raises {check[1][:80]!r}, which is not one of {sorted(ERRORS)}")
        parsed.append((check[0], ERRORS[check[1]], check[2]))
    metadata = Metadata(_count(fields, "inputs"), _count(fields, "results"),
                        _count(fields, "scalars"), parsed)
    return metadata, payload[end + 1:]


def load(metadata: Metadata, xla_bytes: bytes) -> "LoadedProgram":
    """XLA's executable from its bytes, called as the program's; raises what XLA raises, or
    Malformed when it does not take and return what the metadata says."""
    from jax._src.lib import xla_client
    client = jax.devices()[0].client
    executable = client.deserialize_executable(
        xla_bytes, executable_devices=xla_client.DeviceList(tuple(client.devices())))
    program = LoadedProgram(executable, metadata.n_inputs, metadata.n_results, bool(metadata.checks))
    takes, returns = len(executable.get_parameter_layouts()), len(executable.get_output_layouts())
    if (takes, returns) != (metadata.n_inputs + 1, program.n_outputs):
        raise Malformed(f"XLA's executable takes {takes} arguments and returns {returns} results, "
                        f"where its metadata says {metadata.n_inputs + 1} and {program.n_outputs}")
    return program


def _device_vector(scalars: np.ndarray) -> Any:
    """``scalars`` (float64) on the device as float64, whether 64-bit JAX is on or not."""
    put = _vector_put(scalars.shape)
    if put is None:                              # a jax without it: slower, as sure
        with jax.enable_x64(True):
            return jax.device_put(scalars)
    return put(scalars)


@functools.lru_cache(maxsize=64)
def _vector_put(shape: tuple[int, ...]) -> Optional[Callable[[np.ndarray], Any]]:
    """A put of float64 vectors of ``shape`` onto the default device: its abstract value and
    sharding made once (making them cost ~28 us a call, ten times the put)."""
    try:
        from jax._src import core
        from jax._src.lib import _jax
        from jax.sharding import SingleDeviceSharding
    except ImportError:
        return None
    put = getattr(_jax, "batched_device_put", None)
    if put is None:
        return None
    device = jax.devices()[0]
    aval, sharding, devices = core.ShapedArray(shape, np.float64), SingleDeviceSharding(device), [device]
    return lambda scalars: put(aval, sharding, [scalars], devices, True)


class LoadedProgram:
    """An executable loaded from disk, called as a JAX ``Compiled`` of its program is:
    ``(inputs, scalars) -> (results, failed, details)``, ``failed`` and ``details`` None when
    the program has no runtime checks.

    XLA's ``execute`` makes each result's array through a Python callback for its sharding
    (~3 us a result, more with cold caches: a decoding step's 13 results cost ~40 us a token
    inside generate()); after the first call, the results are made by handlers built once
    from the first call's (``_handlers``), as ``jax.jit``'s own dispatch makes them."""

    __slots__ = ("executable", "n_inputs", "n_results", "checked", "n_outputs", "handlers")

    def __init__(self, executable: Any, n_inputs: int, n_results: int, checked: bool) -> None:
        self.executable = executable
        self.n_inputs, self.n_results, self.checked = n_inputs, n_results, checked
        self.n_outputs = n_results + (2 if checked else 0)
        self.handlers: Optional[list] = None   # [] where they cannot be built: execute()

    def __call__(self, inputs: Sequence[Any], scalars: np.ndarray) -> tuple[list, Optional[Any], Optional[Any]]:
        if len(inputs) != self.n_inputs:
            raise ValueError(f"this executable takes {self.n_inputs} inputs, not {len(inputs)}")
        vector = scalars if isinstance(scalars, jax.Array) else _device_vector(np.asarray(scalars, dtype=np.float64))
        handlers = self.handlers
        if handlers:
            outputs = self.executable.execute_sharded([*inputs, vector]).consume_with_handlers(handlers)
        else:
            outputs = self.executable.execute([*inputs, vector])
            if handlers is None:
                self.handlers = _handlers(outputs)
        if not self.checked:
            return outputs, None, None
        return outputs[:self.n_results], outputs[-2], outputs[-1]


def _handlers(outputs: list) -> list:
    """Handlers that make arrays like ``outputs`` (their shapes, dtypes and shardings) from an
    execution's buffers, or [] with a JAX whose internals differ (``execute`` then serves)."""
    if not outputs:
        return []
    try:
        from jax._src.interpreters import pxla
        return list(pxla.global_avals_to_results_handler(
            [o.aval for o in outputs], [o.sharding for o in outputs], True).handlers)
    except Exception:  # noqa: BLE001 - any difference in JAX's internals: the public path
        return []
