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
2. Every ``@triton.jit`` helper call re-patched the language modules its launch had patched already: skipped
   (``patch_lang_once``; ``launch`` tells it which modules the running launch patched).
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
    """The scope of a helper call whose language modules the running launch has patched: nothing to restore."""

    def restore(self) -> None:
        pass


_launch: set[int] | None = None  # ids of the language modules the running launch patched; None: no launch


def patch_lang_once(fn):
    """``interpreter._patch_lang`` that skips a ``@triton.jit`` helper call when the running launch has patched
    its language modules already: each helper call re-patched them (``inspect.getmembers`` over ``tl``,
    ``tl.core``, ``tl.tensor`` and ``tl.math``), re-setting what the launch had set to the same functions, a
    fifth of the interpreted time of the quantize kernels. Outside a launch, and for modules the launch has not
    patched, Triton's own patch (a helper's patch is never restored, in Triton as here)."""
    import inspect

    from triton import language as tl

    global _launch
    langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
    if _launch is not None and langs and langs <= _launch:
        return _Unpatched()
    scope = _tritons_patch_lang(fn)
    if _launch is not None:
        _launch |= langs
    return scope


def launch(self, *args, **kwargs):
    """``GridExecutor.__call__`` (a kernel launch) with ``patch_lang_once`` told which modules it patched."""
    global _launch
    outer, _launch = _launch, set()
    try:
        return _tritons_launch(self, *args, **kwargs)
    finally:
        _launch = outer


_tritons_generic_reduce = None
_tritons_patch_lang = None
_tritons_launch = None


def install() -> bool:
    """Replace the interpreter's ``ReduceOps.generic_reduce``, ``_patch_lang`` and ``GridExecutor.__call__``
    (once); False when Triton or one of them is missing (another Triton version: its own code stays)."""
    global _tritons_generic_reduce, _tritons_patch_lang, _tritons_launch
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    ops, grid = getattr(interpreter, "ReduceOps", None), getattr(interpreter, "GridExecutor", None)
    if ops is None or grid is None or not hasattr(ops, "generic_reduce") or not hasattr(interpreter, "_patch_lang"):
        return False
    if _tritons_generic_reduce is None:
        _tritons_generic_reduce, _tritons_patch_lang, _tritons_launch = (
            ops.generic_reduce, interpreter._patch_lang, grid.__call__)
        ops.generic_reduce = vectorized_generic_reduce
        interpreter._patch_lang = patch_lang_once
        grid.__call__ = launch
    return True
