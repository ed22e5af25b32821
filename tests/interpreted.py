"""Start a script (or ``-c code``) under Triton's CPU interpreter, with one redundant cost removed:

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
"""
from __future__ import annotations

import os
import runpy
import sys


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
        print(f"tests/interpreted.py: Triton's interpreter differs ({exc!r}): helper calls re-patch as before",
              file=sys.stderr)
        return False
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


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: TRITON_INTERPRET=1 python tests/interpreted.py SCRIPT [ARGS...] | -c CODE [ARGS...]")
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MEGATRON_BURST_INTERPRETER_REPATCH") != "1":
        skip_nested_repatching()
    if argv[1] == "-c":
        sys.argv = ["-c"] + argv[3:]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
