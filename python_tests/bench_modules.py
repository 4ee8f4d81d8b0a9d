"""Imports a module of bench/ (not a package: its modules import each other by name) for the bench tests."""

import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load_bench(file: str):
    """bench/<file> as the module ``dspark_bench_<stem>`` (registered in sys.modules, where dataclasses look their
    module up), with bench/ on the path while it imports its siblings."""
    name = "dspark_bench_" + os.path.splitext(file)[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, file))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, BENCH)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH)
    return mod
