"""One definition per op: its schema, its one fake, and its backends.

``define_op(name, schema, fake, impls)`` registers ``torch.ops.dspark.<name>`` from the schema (mutation declared
in it, as ``Tensor(a!) out``) with one more parameter, ``str backend``, and dispatches on that parameter through
``impls`` ("reference" | "cpu" | "triton" | "cuda" -> a function of the schema's parameters, in the schema's
order). The
fake (also a function of exactly those parameters) is registered for ``dspark::<name>`` and, when they load, for
the CUDA extension's ``dspark_C::<name>``, the SIMT build's ``dspark_simt::<name>`` (whose C++ schemas,
``csrc/torch/registration.cpp``, must equal ``schema``; ``python_tests/test_signatures.py`` checks every spelling) and
the CPU kernels' ``dspark_cpu::<name>`` (defined from ``schema`` itself: ``_ext.define_cpu_schema``).

Arguments are checked here too, for callers of ``torch.ops.dspark.<name>`` itself: each op's ``check`` (a function
of the schema's parameters that raises a ValueError or TypeError naming the argument) runs before every backend but
"cuda", whose C++ launchers check every argument themselves. The ``dk.*`` wrappers check their own, friendlier
arguments before they call the op. No kernel reads or writes out of bounds for arguments that pass.

Contiguity is decided here, once for every op: the kernel backends ("cpu", "triton", "cuda") get every tensor input
contiguous (a copy where it is not); a tensor the op writes must be contiguous already. The reference takes any
strides. The C++ launchers check contiguity and never copy.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from .. import _ext

LIBRARY = "dspark"  # torch.ops.dspark
BACKEND_PARAM = "str backend"
SELF_CHECKING = ("cuda",)  # backends whose launchers check every argument (csrc/torch)

_PARAM = re.compile(r"^\s*(?P<type>[A-Za-z]+(?:\([a-z]!?\))?\??(?:\[\])?)\s+(?P<name>\w+)\s*$")


def schema_params(schema: str) -> Tuple[Tuple[str, str], ...]:
    """``(type, name)`` of each parameter of ``"(Tensor x, int y) -> ..."`` (types as written, alias included)."""
    inside = schema[schema.index("(") + 1:schema.index(") ->")]
    out = []
    for part in filter(None, (p.strip() for p in inside.split(","))):
        m = _PARAM.match(part)
        if m is None:
            raise ValueError(f"cannot parse schema parameter {part!r} of {schema!r}")
        out.append((m.group("type"), m.group("name")))
    return tuple(out)


@dataclass(frozen=True)
class OpDef:
    """A registered op: ``schema`` (without ``backend``), its parameter names, the fake and the backends."""

    name: str
    schema: str
    params: Tuple[str, ...]
    fake: Callable
    impls: Mapping[str, Callable]
    op: Callable  # torch.ops.dspark.<name>
    check: Optional[Callable] = None

    def __call__(self, *args, backend: str):
        return self.op(*args, backend)


OPS: Dict[str, OpDef] = {}


class TritonKernel:
    """The Triton twin ``dspark_kernels.triton.<module>.<function>``, imported on first call (Triton loads slowly
    and is needed only where it runs)."""

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function

    def resolve(self) -> Callable:
        return getattr(importlib.import_module(f"dspark_kernels.triton.{self.module}"), self.function)

    def __call__(self, *args):
        return self.resolve()(*args)


class CpuKernel:
    """``torch.ops.dspark_cpu.<name>``, the C++ CPU kernel (``csrc/cpu``, built on first use); the reference where
    the library has no kernel for the op or ``supports(*args)`` says a mode has none (backend "cpu" is chosen only
    where the kernels load: :func:`resolve_backend`)."""

    def __init__(self, name: str, reference: Callable, supports: Optional[Callable[..., bool]] = None):
        self.name, self.reference, self.supports = name, reference, supports

    def __call__(self, *args):
        kernel = _ext.cpu_kernel(self.name) if self.supports is None or self.supports(*args) else None
        return (kernel or self.reference)(*args)


class CudaKernel:
    """``torch.ops.dspark_C.<name>`` for tensors on a GPU, ``torch.ops.dspark_simt.<name>`` for CPU tensors under
    ``DSPARK_SIMT=1`` (the device of the first tensor argument decides)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return getattr(_ext.kernels(device), self.name)(*args)


def _kernel_inputs(args: tuple, written: Tuple[int, ...], names: Tuple[str, ...]) -> tuple:
    """``args`` with every tensor input made contiguous; the tensors the op writes must be contiguous."""
    for i in written:
        if not args[i].is_contiguous():
            raise ValueError(f"{names[i]} must be contiguous (the op writes it in place)")
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) and i not in written else a
                 for i, a in enumerate(args))


def define_op(name: str, schema: str, fake: Callable, impls: Mapping[str, Callable],
              check: Optional[Callable] = None) -> OpDef:
    """Register ``torch.ops.dspark.<name>`` with ``schema`` + ``str backend``, the fake, the backend table and the
    argument check (see the module docstring)."""
    if name in OPS:
        raise RuntimeError(f"dspark::{name} is defined twice")
    params = schema_params(schema)
    names = tuple(n for _, n in params)
    written = tuple(i for i, (t, _) in enumerate(params) if "!" in t)
    impl_table = dict(impls)

    def dispatch(*args):
        *op_args, backend = args
        try:
            impl = impl_table[backend]
        except KeyError:
            raise ValueError(f"dspark::{name}: backend must be one of {tuple(impl_table)}, got {backend!r}") from None
        if check is not None and backend not in SELF_CHECKING:
            check(*op_args)
        if backend != "reference":
            op_args = _kernel_inputs(tuple(op_args), written, names)
        return impl(*op_args)

    head, tail = schema.split(") ->", 1)
    full_schema = f"{head}, {BACKEND_PARAM}) ->{tail}" if params else f"({BACKEND_PARAM}) ->{tail}"
    op = torch.library.custom_op(f"{LIBRARY}::{name}", dispatch, schema=full_schema,
                                 mutates_args=tuple(names[i] for i in written))
    op.register_fake(lambda *args: fake(*args[:-1]))
    _ext.register_fake(name, fake)
    _ext.define_cpu_schema(name, schema)
    definition = OpDef(name, schema, names, fake, impl_table, getattr(getattr(torch.ops, LIBRARY), name), check)
    OPS[name] = definition
    return definition
