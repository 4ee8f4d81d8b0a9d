"""Compatibility with the oldest Triton the package supports (3.6; see ``pyproject.toml``).

* ``tl.to_tensor`` does not exist in triton 3.6: the kernels use ``tl.cast(x, dtype)``, which takes Python ints,
  scalars and tensors alike in every supported release (``rng.py``).
* Triton 3.6's interpreter (``TRITON_INTERPRET=1``) turns a scalar tensor into a Python int with
  ``int(handle.data)``; its scalars are one-element 1-d numpy arrays, which numpy >= 2.4 refuses to convert
  ("only 0-dimensional arrays can be converted to Python scalars"), so every ``range(...)`` whose bound is a
  kernel argument or ``tl.program_id`` fails. Later releases squeeze the array first. ``patch_interpreter()``
  makes 3.6's interpreter do the same. It changes no result: it only touches the interpreter's conversion of a
  one-element array to an int, nothing else.
"""

from __future__ import annotations


def _index(self):
    data = self.handle.data
    if getattr(data, "ndim", 0) > 0 and data.size == 1:
        data = data.reshape(())
    return int(data)


def patch_interpreter() -> bool:
    """Wrap the interpreter's tensor patching so ``__index__`` accepts one-element arrays; True if it patched."""
    try:
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no interpreter in this triton: nothing to fix
        return False
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_dspark_compat", False):
        return False

    def _patch_lang_tensor(tensor, scope, *args, **kwargs):
        out = orig(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _index)
        return out

    _patch_lang_tensor._dspark_compat = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
