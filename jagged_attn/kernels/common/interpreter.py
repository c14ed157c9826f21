"""Running kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by CI).

``INTERPRETED`` tells launchers which mode the kernels were built in (``triton.jit`` decides at
decoration time). Importing this module in interpreted mode also fixes one interpreter bug.
"""

import triton

INTERPRETED = bool(triton.knobs.runtime.interpret)


def _let_interpreted_scalars_bound_loops():
    """Triton 3.6's interpreter turns a scalar loop bound into a Python int with ``int()`` of a
    one-element array, which numpy >= 2.4 rejects; a loop up to a loaded length then fails. Make
    the interpreter read the element instead (no effect on compiled kernels)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _let_interpreted_scalars_bound_loops()
