"""Start a script (or ``-c code``) under Triton's CPU interpreter, with redundant costs removed:

    TRITON_INTERPRET=1 python tests/interpreted.py tests/triton_masked_cases.py [args...]
    TRITON_INTERPRET=1 python tests/interpreted.py -c "code" [args...]

(tests/harness.py's ``run_interpreted`` starts every interpreter run this way.)

The interpreter swaps triton.language's builtins for numpy ones at each kernel launch
(``_patch_lang``, undone when the launch ends) and again at *every call of a @triton.jit helper*
inside the kernel -- a walk of triton.language's members with ``inspect.getmembers`` per call,
whose changes it then drops (the launch's undo restores the same attributes). Our kernels call
helpers per tile, so that walk was about a third of the interpreter's time (cProfile of
tests/triton_masked_cases.py, Triton 3.9). Inside a launch the language is already patched:
:func:`skip_nested_repatching` makes the helpers' calls skip it. The kernels compute the same
thing: ``tests/test_interpreted.py`` runs the masked-attention kernels forward and backward with
and without it and compares every output bit for bit (the JSON of tests/triton_masked_cases.py was
identical too, 2026-11-27). When Triton's internals differ (another version), nothing is changed and the reason
goes to stderr -- the runs are then only slower. ``MEGATRON_BURST_INTERPRETER_REPATCH=1`` keeps
Triton's own behaviour (the comparison test installs the change itself).

Second, rounding (:func:`round_downcasts_to_nearest`): the interpreter turns fp32 into bf16 by
truncating the mantissa (and its explicit round-to-nearest mode drops the carry into the exponent),
while a GPU's ``x.to(tl.bfloat16)`` rounds to nearest even. Truncation is biased -- every value
shrinks by half an ulp on average -- so precision comparisons under the interpreter (a kernel's
bf16 gradient against torch's unfused bf16 path, which rounds to nearest) would measure the
interpreter, not the kernel. fp32 -> bf16 / fp16 downcasts (but an explicit round-toward-zero)
round to nearest even here, as the GPU does (``tests/test_interpreted.py`` checks them against
torch's bit for bit). ``MEGATRON_BURST_INTERPRETER_TRUNCATE=1`` keeps Triton's own rounding.

Third, the interpreter's Triton -> numpy dtype lookup reads a cache (:func:`memoize_numpy_dtypes`).

Fourth, each block shape's frontend objects are built once (:func:`share_block_shapes`: 22 % less
time in tests/triton_masked_cases.py, bit-identical); ``MEGATRON_BURST_INTERPRETER_SHARED_SHAPES=0``
keeps Triton's own.
"""
from __future__ import annotations

import os
import runpy
import sys


def _unchanged(exc: Exception, what: str) -> bool:
    """A change whose Triton internals are not there (another version): say so, change nothing."""
    print(f"tests/interpreted.py: Triton's interpreter differs ({exc!r}): {what}", file=sys.stderr)
    return False


def skip_nested_repatching() -> bool:
    """Make ``_patch_lang`` a no-op for a helper whose language modules (``triton.language`` and/or
    ``triton.language.core`` among its globals) this kernel launch has already patched; a helper
    reaching one not yet patched (triton's own ``tl.zeros`` reads ``core``) patches as before.
    Returns whether the change was made (False, with a line on stderr, on an unknown Triton)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it

        launch, patch, scope_type = it.GridExecutor.__call__, it._patch_lang, it._LangPatchScope
        lang_modules = (tl, tl.core)
    except (ImportError, AttributeError) as exc:
        return _unchanged(exc, "helper calls re-patch as before")
    patched: set[int] = set()  # ids of the language modules this launch has patched
    langs_of: dict[int, frozenset] = {}  # a module's globals (by id) -> ids of the language modules in them
    lang_ids = {id(m) for m in lang_modules}

    def patch_once(fn):
        langs = langs_of.get(id(fn.__globals__))
        if langs is None:
            langs = langs_of[id(fn.__globals__)] = frozenset(id(v) for v in fn.__globals__.values()) & lang_ids
        if patched and langs <= patched:
            return scope_type()  # an empty scope: the launch's own undoes the patch
        scope = patch(fn)
        patched.update(langs)
        return scope

    def launch_and_forget(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()  # the launch restored the language

    it._patch_lang = patch_once
    it.GridExecutor.__call__ = launch_and_forget
    return True


def round_downcasts_to_nearest() -> bool:
    """Make the interpreter's fp32 -> bf16 / fp16 conversions round to nearest even (the GPU's)
    instead of truncating; an explicit round-toward-zero keeps Triton's conversion. numpy only (no
    torch tensor: tests count the tensors an op creates). Returns whether the change was made
    (False, with a line on stderr, on an unknown Triton)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as it

        convert, rtz = it._convert_float, it._ir.ROUNDING_MODE.RTZ
    except (ImportError, AttributeError) as exc:
        return _unchanged(exc, "fp32 -> bf16 truncates as before")

    def to_nearest(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or rounding_mode == rtz or output_dtype not in (tl.bfloat16, tl.float16):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        x = np.ascontiguousarray(input, dtype=np.float32)
        if output_dtype == tl.float16:
            return x.astype(np.float16).view(np.uint16).reshape(np.shape(input))
        u = x.view(np.uint32).astype(np.uint64)
        # add half an ulp of bf16 minus one, plus the kept part's lowest bit (ties to even): the carry
        # runs into the exponent as it should (up to inf); NaN stays a quiet NaN
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded.reshape(np.shape(input))

    it._convert_float = to_nearest
    return True


def memoize_numpy_dtypes() -> bool:
    """Make the interpreter's Triton -> numpy dtype lookup (``_get_np_dtype``: it builds a 20-entry
    dict of Triton types, each hashed, at every call -- several per interpreted operation; 2-6 % of
    tests/fused_loss_cases.py's time) read a cache of its own answers instead. The answer depends
    on the element type alone (a pointer's is uint64), so caching by it changes nothing
    (``tests/test_interpreted.py`` compares the two for every Triton type). Returns whether the
    change was made (False, with a line on stderr, on an unknown Triton)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it

        lookup, block_type, pointer_type = it._get_np_dtype, tl.block_type, tl.pointer_type
    except (ImportError, AttributeError) as exc:
        return _unchanged(exc, "dtype lookups as before")
    answers: dict = {}

    def cached(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        if isinstance(element, pointer_type):
            return lookup(element)
        answer = answers.get(element)
        if answer is None:
            answer = answers[element] = lookup(element)
        return answer

    it._get_np_dtype = cached
    return True


def share_block_shapes() -> bool:
    """Make Triton's type bookkeeping, which the interpreter runs for every operation of every
    program, build each block shape's frontend objects once. A ``block_type`` holds its shape as a
    ``tl.tuple`` (a tuple type of constexpr types inside), a ``tensor`` its shape again as constexprs;
    the interpreter made both afresh for each of the ~10^6 values a test file's kernels produce
    (a fifth of its time in tests/triton_masked_cases.py). Here a block type or tensor of a shape
    seen before gets the same (immutable) shape objects, and broadcasting two blocks whose types share
    them -- the same shape -- returns them unchanged at once, as Triton's own walk over the dimensions
    does. Nothing the kernels compute changes (``tests/test_interpreted.py`` compares results bit for
    bit and the objects field by field); a shape Triton refuses is refused as before (only accepted
    shapes are remembered). Returns whether the change was made (False, with a line on stderr, on an
    unknown Triton)."""
    try:
        import triton.language.core as core
        from triton.language.semantic import TritonSemantic

        block_type, tensor, constexpr, tl_tuple = core.block_type, core.tensor, core.constexpr, core.tuple
        block_init, stock_tensor_init, broadcast = block_type.__init__, tensor.__init__, TritonSemantic.broadcast_impl_value
    except (ImportError, AttributeError) as exc:
        return _unchanged(exc, "block types built as before")
    by_ints: dict = {}  # shape as python ints -> (block_type's shape, its str, numel, tensor's shape, tensor's numel)
    by_shape: dict = {}  # id(a block_type's shared shape) -> the same entry (entries keep the shapes alive)
    scalar = (None, None, None, tl_tuple([]), constexpr(1))  # a tensor of a scalar type

    def block_type_init(self, element_ty, shape):
        try:
            if not isinstance(shape, (list, tl_tuple)):  # Triton refuses the rest, a python tuple too
                raise TypeError
            key = tuple(s.value if isinstance(s, constexpr) else s for s in shape)
            if not all(type(s) is int for s in key):  # 2.0 or True would find 2's or 1's entry
                key = None
            hit = None if key is None else by_ints.get(key)
        except TypeError:  # not a list, not iterable, unhashable elements: Triton's own checks answer
            key = hit = None
        if hit is None:
            block_init(self, element_ty, shape)
            if key is not None:
                hit = by_ints[key] = (self.shape, str(self.shape), self.numel,
                                      tl_tuple([constexpr(s) for s in self.shape]), constexpr(self.numel))
                by_shape[id(self.shape)] = hit
            return
        self.element_ty = element_ty
        self.shape, self.numel = hit[0], hit[2]
        self.name = f"<{hit[1]}, {element_ty}>"

    def tensor_init(self, handle, type):
        hit = by_shape.get(id(type.shape)) if type.is_block() else scalar
        if hit is None:  # a block type built before the change
            return stock_tensor_init(self, handle, type)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = hit[3], hit[4]

    def broadcast_same_shape(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if lt.is_block() and rt.is_block() and lt.shape is rt.shape:  # one shape object: one shape
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    block_type.__init__, tensor.__init__ = block_type_init, tensor_init
    TritonSemantic.broadcast_impl_value = broadcast_same_shape
    return True


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: TRITON_INTERPRET=1 python tests/interpreted.py SCRIPT [ARGS...] | -c CODE [ARGS...]")
    if os.environ.get("TRITON_INTERPRET") == "1":
        if os.environ.get("MEGATRON_BURST_INTERPRETER_REPATCH") != "1":
            skip_nested_repatching()
        if os.environ.get("MEGATRON_BURST_INTERPRETER_TRUNCATE") != "1":
            round_downcasts_to_nearest()
        memoize_numpy_dtypes()
        if os.environ.get("MEGATRON_BURST_INTERPRETER_SHARED_SHAPES") != "0":
            share_block_shapes()
    if argv[1] == "-c":
        sys.argv = ["-c"] + argv[3:]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
