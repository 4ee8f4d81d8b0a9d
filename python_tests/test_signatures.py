"""Every spelling of an op's signature agrees with the schema its ``define_op`` gives (dspark_kernels/ops/_registry.py):
the registered ``dspark::`` op, the fake, the reference, the Triton twin, the C++ schema strings of
csrc/torch/registration.cpp and the C ABI's argument structs in csrc/capi/dspark.h. Reads sources only: no build."""

import inspect
import os
import re

import pytest
import torch

import dspark_kernels  # noqa: F401  (defines the ops)
from cpp_sources import registration_schemas
from dspark_kernels.distributed.ops import KERNEL_PIECES as DIST_CUDA_PIECES
from dspark_kernels.ops._registry import OPS, CpuKernel, CudaKernel, TritonKernel, schema_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(OPS)

# C ABI fields that are sizes of the tensors the schema passes (a tensor knows its shape, a pointer does not)
CAPI_SIZES = {"N", "K", "V", "VT", "R", "D", "P", "NB", "KB", "total_rows", "max_blocks", "num_stops", "draft_width"}
# schema parameters the C ABI spells otherwise: draft_block's logits output is NULL instead of return_logits=False
CAPI_OMITS = {"draft_block": {"return_logits"}}


def _args(schema) -> list:
    return [(a.name, str(a.type), a.alias_info is not None and a.alias_info.is_write) for a in schema.arguments]


def _python_params(fn) -> list:
    params = list(inspect.signature(fn).parameters.values())
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params), \
        f"{fn.__module__}.{fn.__qualname__} must take the schema's parameters positionally, without defaults"
    return [p.name for p in params]


def _capi_inputs(name: str) -> list:
    """The input fields of ``dspark_<name>_args`` in dspark.h (everything before ``/* outputs``), or the parameters
    of ``dspark_<name>(...)`` for an op without a struct, minus sizes, dtype fields and the CUDA stream."""
    with open(os.path.join(ROOT, "csrc", "capi", "dspark.h")) as f:
        text = f.read()
    base = name.rstrip("_")
    m = re.search(rf"typedef struct dspark_{base}_args \{{(.*?)\}} dspark_{base}_args;", text, re.S)
    if m is not None:
        body = re.sub(r"/\*.*?\*/", lambda c: " OUTPUTS; " if c.group(0).startswith("/* outputs") else " ",
                      m.group(1), flags=re.S)
        decls = body.split("OUTPUTS;")[0].split(";")
        # "int64_t N, K;" declares N and K; the name is the last word of each comma-separated part
        fields = [re.findall(r"\w+", part)[-1] for d in decls if d.strip() for part in d.split(",")]
    else:
        m = re.search(rf"DSPARK_API int dspark_{base}\((.*?)\);", text, re.S)
        assert m is not None, f"dspark.h declares neither dspark_{base}_args nor dspark_{base}()"
        fields = [re.findall(r"\w+", p)[-1] for p in m.group(1).split(",")]
        fields = [f for f in fields if f != "s"]  # the cudaStream_t
    return [f for f in fields if f not in CAPI_SIZES and not f.endswith("_dtype")]


def test_every_op_is_defined_once_everywhere():
    assert NAMES == sorted(["rng_uniform_", "draft_block", "verify_chain", "accept_prefix_scan",
                            "schedule_verify_lens"])
    assert sorted(registration_schemas()) == sorted(NAMES + list(DIST_CUDA_PIECES))


@pytest.mark.parametrize("piece", DIST_CUDA_PIECES)
def test_cpp_schema_of_a_distributed_piece_equals_its_python_schema(piece):
    """A local piece of dspark_kernels.distributed with a CUDA kernel: dspark_C::<piece> is the dspark_dist op's
    schema without its ``backend`` parameter."""
    dist = getattr(torch.ops.dspark_dist, piece).default._schema
    cpp = torch._C.parse_schema("dspark_C::" + registration_schemas()[piece])
    assert _args(dist) == _args(cpp) + [("backend", "str", False)]
    assert [str(r.type) for r in cpp.returns] == [str(r.type) for r in dist.returns]


@pytest.mark.parametrize("name", NAMES)
def test_registered_op_is_the_schema_plus_backend(name):
    d = OPS[name]
    registered = _args(getattr(torch.ops.dspark, name).default._schema)
    declared = _args(torch._C.parse_schema(f"dspark::{name}{d.schema}"))
    assert registered == declared + [("backend", "str", False)]
    assert tuple(n for _, n in schema_params(d.schema)) == d.params == tuple(a[0] for a in declared)


@pytest.mark.parametrize("name", NAMES)
def test_fake_and_backends_take_the_schema_parameters_in_order(name):
    d = OPS[name]
    assert set(d.impls) == {"reference", "cpu", "triton", "cuda"}
    assert _python_params(d.fake) == list(d.params)
    for backend, impl in d.impls.items():
        if isinstance(impl, CudaKernel):
            assert impl.name == name  # its signature is the C++ schema, checked below
            continue
        if isinstance(impl, CpuKernel):  # dspark_cpu's schema is this op's schema (_ext.load_cpu defines it)
            assert impl.name == name and impl.reference is d.impls["reference"]
            continue
        fn = impl.resolve() if isinstance(impl, TritonKernel) else impl
        assert _python_params(fn) == list(d.params), f"{name}: the {backend} function's parameters drifted"


@pytest.mark.parametrize("name", NAMES)
def test_cpp_schema_equals_the_python_schema(name):
    cpp = torch._C.parse_schema("dspark_C::" + registration_schemas()[name])
    py = torch._C.parse_schema(f"dspark_C::{name}{OPS[name].schema}")
    assert _args(cpp) == _args(py)
    assert [str(r.type) for r in cpp.returns] == [str(r.type) for r in py.returns]


@pytest.mark.parametrize("name", NAMES)
def test_capi_arguments_follow_the_schema(name):
    expected = [p for p in OPS[name].params if p not in CAPI_OMITS.get(name, ())]
    assert _capi_inputs(name) == expected


def test_the_checks_can_fail():
    """The parsers see a drift: a reordered reference, a renamed C ABI field, a changed C++ type."""
    def reordered(a, c, b):
        pass
    with pytest.raises(AssertionError):
        assert _python_params(reordered) == ["a", "b", "c"]
    with pytest.raises(AssertionError):
        _python_params(lambda a, b=None: None)
    assert "rng_key" in _capi_inputs("rng_uniform_") and "draft_logprobs" in _capi_inputs("verify_chain")
    int_stream = torch._C.parse_schema("x::rng_uniform_(Tensor(a!) out, Tensor rng_key, float stream) -> ()")
    assert _args(int_stream) != _args(torch._C.parse_schema("x::rng_uniform_" + OPS["rng_uniform_"].schema))
