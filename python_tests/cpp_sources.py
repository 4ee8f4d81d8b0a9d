"""What the tests read from the C++ sources without building them."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def registered_schemas(namespace: str) -> dict:
    """name -> schema string of every op the loaded libraries registered in ``namespace`` (e.g. ``dspark_simt``)."""
    import torch

    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith(namespace + "::")}
    ns = getattr(torch.ops, namespace)
    return {n: str(getattr(ns, n).default._schema) for n in sorted(names)}


def registration_schemas() -> dict:
    """name -> schema string of every ``m.def("..." "...")`` in csrc/torch/registration.cpp (adjacent literals
    joined): the one schema text both builds of the extension compile."""
    with open(os.path.join(ROOT, "csrc", "torch", "registration.cpp")) as f:
        text = f.read()
    out = {}
    for body in re.findall(r"m\.def\(((?:\s*\"[^\"]*\")+)\s*\)", text):
        schema = "".join(re.findall(r"\"([^\"]*)\"", body))
        out[schema[:schema.index("(")]] = schema
    return out
