"""Two shortcuts in Triton's CPU interpreter, installed by ``conftest.py`` (tests only); the kernels run the
same operations and give the same bits (``test_kernels.py::test_vectorized_interpreter_reduce_equals_tritons``
runs a kernel with and without them).

1. ``tl.reduce(x, axis, combine_fn)`` with a combine function of its own (not max, min, sum or argmax) runs in
   ``ReduceOps.generic_reduce``: one Python call of ``combine_fn`` per *element*, on scalar tensors. The
   quantize tile's NaN-block flag (``nvfp4_quant._quantize_tile``: ``tl.reduce(a3, 2, _max_nan)``) is one, in
   every quantize kernel, and took about half of the interpreted time of the kernel tests.
   ``vectorized_generic_reduce`` folds the same ``combine_fn`` along the axis over whole slices: for every
   output element the same calls in the same order (``acc = x[0]``, then ``acc = combine_fn(acc, x[j])`` for
   ``j = 1 .. n-1``, the accumulator stored in the input's dtype after each step, as Triton's loop does);
   combine functions are elementwise (the interpreter applies them to scalars), so a slice is as good as an
   element.
2. Every ``@triton.jit`` helper call re-patches the language modules the launch has patched already
   (``patch_lang_once``).
"""

from __future__ import annotations

import numpy as np


def vectorized_generic_reduce(self, input):
    """``ReduceOps.generic_reduce`` (triton/runtime/interpreter.py) with the loop over output elements
    vectorized; Triton's own loop for an empty axis."""
    from triton.runtime import interpreter

    if any(arg.handle.data.size == 0 for arg in input):
        return _tritons_generic_reduce(self, input)
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    datas = [arg.handle.data for arg in input]
    n = datas[0].shape[axis]
    acc = [np.ascontiguousarray(np.take(d, 0, axis=axis)) for d in datas]
    for j in range(1, n):
        accs = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input))
        xs = tuple(self.to_tensor(np.take(d, j, axis=axis), arg.dtype) for d, arg in zip(datas, input))
        ret = self.combine_fn.fn(*accs, *xs)
        ret = ret if isinstance(ret, tuple) else (ret,)
        for i, r in enumerate(ret):
            value = r.handle.data if isinstance(r, interpreter.tl.core.tensor) else r
            out = np.empty_like(acc[i])
            out[...] = np.reshape(value, out.shape) if np.size(value) == out.size else value
            acc[i] = out
    result = []
    for i, data in enumerate(acc):
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(datas[i].ndim):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        result.append(self.to_tensor(data, input[i].dtype))
    return result


class _Unpatched:
    """The scope of a nested call that found its language modules patched already: nothing to restore."""

    def restore(self) -> None:
        pass


_live: set[frozenset] = set()  # the language modules (ids) of the kernel launches whose patch is in force


def patch_lang_once(fn):
    """``interpreter._patch_lang`` that patches a function's language modules only when no enclosing
    launch has patched the same ones: every ``@triton.jit`` helper call re-patched them (``inspect.getmembers``
    over ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math``), re-setting what the launch had set to the same
    functions, a fifth of the interpreted time of the quantize kernels."""
    import inspect

    from triton import language as tl

    key = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    if key in _live:
        return _Unpatched()
    scope = _tritons_patch_lang(fn)
    restore = scope.restore

    def restore_and_forget() -> None:
        _live.discard(key)
        restore()

    scope.restore = restore_and_forget
    _live.add(key)
    return scope


_tritons_generic_reduce = None
_tritons_patch_lang = None


def install() -> bool:
    """Replace the interpreter's ``ReduceOps.generic_reduce`` and ``_patch_lang`` (once); False when Triton
    or either is missing (another Triton version: its own code stays)."""
    global _tritons_generic_reduce, _tritons_patch_lang
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or not hasattr(ops, "generic_reduce") or not hasattr(interpreter, "_patch_lang"):
        return False
    if _tritons_generic_reduce is None:
        _tritons_generic_reduce, _tritons_patch_lang = ops.generic_reduce, interpreter._patch_lang
        ops.generic_reduce = vectorized_generic_reduce
        interpreter._patch_lang = patch_lang_once
    return True
