"""Freed memory kept for reuse: how kzoo sets the C allocator (glibc's malloc) of its process.

A training or prediction step makes the same large tensors again and again: the logits of
8 x 256 tokens over a vocabulary of 8,192 are 64 MiB, XLA's scratch buffer of a GPT training
step at that size ~310 MiB. glibc's malloc serves a request above its mmap threshold (128 KiB,
growing with what was freed to at most 32 MiB) with fresh pages from the kernel and unmaps
them when the tensor is freed, so the next step's tensor of the same size faults in and zeroes
every page again (~20 ms per 64 MiB on the 2-core test machine). The worker threads of XLA
(JAX) and TensorFlow allocate from arenas of their own, whose heaps hold at most 64 MiB, so
their large buffers are unmapped on free whatever the threshold.

At `import kzoo` (Linux with glibc only) kzoo therefore asks malloc to

- serve requests up to `limit_mib` (default 1,024 MiB) from its heap (`M_MMAP_THRESHOLD`),
- give the top of its heap back to the kernel only beyond `limit_mib` free
  (`M_TRIM_THRESHOLD`),
- use one arena for every thread (`M_ARENA_MAX` = 1), so that the frameworks' worker
  threads share that heap.

Freed memory then stays in the process and serves the next step, as the caching allocators of
the GPU runtimes do. `fit`, `evaluate` and `predict` of a kzoo model give the free memory back
(`release_memory`) when their loop ends; between `train_on_batch` / `predict_on_batch` calls
it stays. Measured in fresh processes (`benchmarks/peers.py`' kzoo worker, 2 rounds, this
module on / off): GPT training on JAX +33%, TensorFlow +9%; forward passes +10% on torch,
+5-30% on TensorFlow and JAX (docs/PERFORMANCE.md).

On the JAX backend kzoo also runs XLA's CPU programs on the calling thread
(`jax_cpu_enable_async_dispatch=False`, set before JAX's CPU client exists). Dispatched
asynchronously, a training step's scratch buffer was sometimes allocated before the previous
step's was freed, and the heap then kept both (GPT training peak 500 MiB in half the
processes, 800-1,125 in the others); run inline, the steps were as fast and the peak stayed at
~505 MiB in every process. If JAX ran a computation before `import kzoo`, its client already
dispatches asynchronously and kzoo leaves malloc alone; setting the flag back to True after
`import kzoo` brings back that risk.

Nothing is changed where the user chose: `KZOO_KEEP_FREED_MEMORY=0` in the environment, any
of glibc's own malloc variables (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, ...,
`GLIBC_TUNABLES` with a `glibc.malloc.` entry), or another allocator in `LD_PRELOAD`
(jemalloc, tcmalloc, mimalloc). `state()` says what was done and why.
"""

import ctypes
import os
import sys

ENV_VAR = "KZOO_KEEP_FREED_MEMORY"
DEFAULT_LIMIT_MIB = 1024
MAX_LIMIT_MIB = 2047  # mallopt takes a C int of bytes: below 2 GiB

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# glibc's environment variables for malloc: a user who set one chose the allocator's policy
_GLIBC_MALLOC_VARS = ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_THRESHOLD_",
                      "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state = {"applied": False, "limit_mib": None, "reason": "not asked yet"}


def state():
    """What kzoo did to the allocator: `{"applied": bool, "limit_mib": int or None,
    "reason": str}` (the reason says why not, or what was set)."""
    return dict(_state)


def _glibc():
    """The process' C library as a ctypes handle if it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _user_choice(environ):
    """Why kzoo leaves malloc alone under `environ` (a mapping of names to strings), or None."""
    value = environ.get(ENV_VAR)
    if value is not None:
        text = value.strip().lower()
        if text in ("0", "false", "no", "off"):
            return f"{ENV_VAR}={value}"
        if text not in ("1", "true", "yes", "on", ""):
            raise ValueError(
                f"The environment variable {ENV_VAR}={value!r} is not understood: use 0 (leave "
                "the C allocator as it is) or 1 (keep freed memory for reuse, the default).")
    for name in _GLIBC_MALLOC_VARS:
        if name in environ:
            return f"the environment sets {name}"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc options"
    preload = environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD loads {name}"
    return None


def keep_freed_memory(limit_mib=DEFAULT_LIMIT_MIB):
    """Ask glibc's malloc to keep up to `limit_mib` MiB of freed memory for reuse (see the
    module's docstring); returns whether it was done (False where the C library is not
    glibc). `import kzoo` calls it unless the environment chose otherwise; call it again to
    change the limit.

    Example:
    >>> kzoo.allocator.keep_freed_memory(limit_mib=2000)  # logits of a larger vocabulary
    True
    """
    if isinstance(limit_mib, bool) or not isinstance(limit_mib, int) or not (
            1 <= limit_mib <= MAX_LIMIT_MIB):
        raise ValueError(f"limit_mib={limit_mib!r}: expected a whole number of MiB from 1 to "
                         f"{MAX_LIMIT_MIB} (glibc's mallopt takes the bytes as a C int; the "
                         f"default is {DEFAULT_LIMIT_MIB}).")
    libc = _glibc()
    if libc is None:
        _state.update(applied=False, limit_mib=None, reason="the C library is not glibc")
        return False
    limit = limit_mib << 20
    done = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, limit), (_M_TRIM_THRESHOLD, limit), (_M_ARENA_MAX, 1)))
    _state.update(applied=done, limit_mib=limit_mib if done else None,
                  reason=f"mmap and trim thresholds {limit_mib} MiB, one arena" if done
                  else "glibc refused the settings (mallopt returned 0)")
    return done


def release_memory():
    """Give the free memory malloc holds back to the kernel (glibc's `malloc_trim(0)`);
    returns whether any was given back. Cheap next to a training loop: `fit`, `evaluate` and
    `predict` call it when they end."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def _jax_dispatch_blocker():
    """On the JAX backend: why XLA's CPU programs cannot be made to run inline (then malloc
    is left alone), or None (they can, or another backend runs)."""
    if _keras_backend() != "jax":
        return None
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        import jax

        if jax.config.values["jax_cpu_enable_async_dispatch"]:
            return "JAX's CPU client already dispatches asynchronously"
    return None


def apply_at_import(environ=None):
    """`keep_freed_memory()` unless `environ` (default `os.environ`) chose otherwise; on
    JAX with XLA's CPU programs run inline (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    reason = _user_choice(environ) or (_glibc() is not None and _jax_dispatch_blocker())
    if reason:
        _state.update(applied=False, limit_mib=None, reason=f"left alone: {reason}")
        return False
    done = keep_freed_memory()
    if done and _keras_backend() == "jax":
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
        _state["reason"] += "; JAX's CPU programs run inline"
    return done


def _keras_backend():
    import keras  # (keras is imported by now: kzoo/__init__.py)

    return keras.config.backend()
