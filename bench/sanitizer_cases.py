#!/usr/bin/env python
"""Small cases of every CUDA kernel, for compute-sanitizer (memcheck, racecheck) in ``bench/gpu_check.sh``.

    compute-sanitizer --tool memcheck python bench/sanitizer_cases.py
    python bench/sanitizer_cases.py --device cpu       # the same calls on CPU tensors (DSPARK_SIMT=1: SIMT harness)

Calls every op with ``backend="cuda"`` on odd, small shapes (V = 17 and 1000, N = 1 and 3, K = 1 and 5, fp32 and
bf16, greedy and sampled, draft_block's full and top-k proposals, verify_chain's sampled forms; and for draft_block's
tensor-core sweeps N = 9 and 40 with every head, with and without the confidence head, a bf16 and an fp8 W2: the
same case builders as ``bench/run.py``), synchronising after each call so a fault is attributed to its case. Exit
status 1 if any call raised.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("DSPARK_USE_INSTALLED") != "1":  # bench/gpu_check.sh sets it to run an installed wheel
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cases import OPS, VERIFY_FORMS, cases_for  # noqa: E402

GRIDS = [  # top_k: draft_block's full proposal (0) and its top-k proposal kernels; forms: every verify_chain kernel
    # (the rows pass with and without draft rows' statistics, block's mass pass, the sample pass; dense, reduced and
    # top-k draft rows)
    dict(N=[1], K=[1], V=[17], dtype=["fp32"], mode=["greedy", "sampled"], top_k=[0, 5], forms=list(VERIFY_FORMS)),
    dict(N=[3], K=[5], V=[1000], dtype=["fp32", "bf16"], mode=["greedy", "sampled"], top_k=[0, 64],
         forms=list(VERIFY_FORMS)),
    # draft_block's tensor-core sweeps (16- and 64-request groups, lo rows with a gate / rnn), its draft_head kernels
    dict(N=[9, 40], K=[3], V=[1000], dtype=["bf16"], mode=["greedy", "sampled"], w2=["same", "fp8"],
         head=["vanilla", "gated", "rnn"], conf=[0, 1]),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--op", nargs="+", choices=OPS, default=OPS)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    failed, ran = [], 0
    with torch.no_grad():
        for op in args.op:
            for grid in GRIDS:
                for case in cases_for(op, dev, grid, "quick"):
                    params = " ".join(f"{k}={v}" for k, v in case.params.items())
                    x = case.inputs()
                    sync()
                    try:
                        case.run("cuda", x)
                        sync()
                    except Exception as e:  # noqa: BLE001
                        print(f"sanitizer_cases: FAIL {op} {params}: {type(e).__name__}: {e}", flush=True)
                        failed.append(f"{op} {params}")
                        continue
                    ran += 1
                    print(f"sanitizer_cases: ran {op} {params}", flush=True)
    print(f"sanitizer_cases: {ran} calls ran, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
