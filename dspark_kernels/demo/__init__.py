"""The demo: a tiny Qwen3-style target and DSpark drafters trained on the Python standard library (``train.py``),
shipped in ``assets/``, and ``python -m dspark_kernels.demo`` (``demo.py``), which shows DSpark's effects on them."""
