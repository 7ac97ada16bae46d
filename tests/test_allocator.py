"""kzoo.allocator: freed memory kept for reuse by glibc's malloc, and the user's opt-outs.

The effect is checked in fresh interpreters with glibc's own accounting (`mallinfo2`: the
bytes it holds in mmapped chunks) and the kernel's (`VmRSS`), not with kzoo's code.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kzoo
from kzoo import allocator
from kzoo.models.gpt import GPTBackbone, GPTCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import ctypes, json, os, sys, threading
if sys.argv[1:] == ["jax-first"]:  # a JAX computation before kzoo is imported
    import jax.numpy as jnp
    jnp.ones(3).block_until_ready()
if sys.argv[1:] == ["peers-alone"]:  # the peers benchmark's --same-allocator, no kzoo
    from benchmarks import peers
    peers.use_kzoo_allocator()
    alloc = None
else:
    import kzoo
    alloc = kzoo.allocator

libc = ctypes.CDLL("libc.so.6")
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

out = {"state": alloc.state() if alloc else None, "kzoo_imported": "kzoo" in sys.modules}
if os.environ["KERAS_BACKEND"] == "jax":
    import jax
    out["jax_async"] = jax.config.values["jax_cpu_enable_async_dispatch"]

def probe(key):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)  # every page touched
    out[key + "_mapped"] = libc.mallinfo2().hblkhd - before
    held = rss()
    libc.free(p)
    out[key + "_rss_change_on_free"] = rss() - held

probe("main")
worker = threading.Thread(target=probe, args=("thread",))  # a thread of its own: an arena?
worker.start()
worker.join()
held = rss()
out["released"] = bool(libc.malloc_trim(0)) if alloc is None else alloc.release_memory()
out["rss_change_on_release"] = rss() - held
print(json.dumps(out))
"""

MIB = 1 << 20


def _probe(*args, **env):
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3",
               **env)
    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "GLIBC_TUNABLES", "LD_PRELOAD"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _glibc_here():
    return allocator._glibc() is not None


def test_import_keeps_freed_memory_for_reuse_and_release_gives_it_back():
    """With kzoo imported, a 64 MiB block is served from malloc's heap, in the main thread
    and in another thread, stays in the process when freed, and `release_memory` gives it
    back to the kernel."""
    out = _probe()
    if not _glibc_here():
        assert out["state"]["applied"] is False and "glibc" in out["state"]["reason"]
        return
    on_jax = keras.backend.backend() == "jax"
    assert out["state"] == {"applied": True, "limit_mib": 1024, "reason": (
        "mmap and trim thresholds 1024 MiB, one arena"
        + ("; JAX's CPU programs run inline" if on_jax else ""))}
    assert out.get("jax_async") is (False if on_jax else None)
    assert out["main_mapped"] == 0 and out["thread_mapped"] == 0
    assert out["main_rss_change_on_free"] > -8 * MIB  # kept
    assert out["thread_rss_change_on_free"] > -8 * MIB
    assert out["released"] is True and out["rss_change_on_release"] < -48 * MIB


@pytest.mark.spread
def test_opting_out_leaves_glibcs_policy():
    """`KZOO_KEEP_FREED_MEMORY=0`: glibc maps the same block afresh and unmaps it on free,
    in the main thread and in another one (what the first test's figures are compared
    with)."""
    out = _probe(KZOO_KEEP_FREED_MEMORY="0")
    assert out["state"] == {"applied": False, "limit_mib": None,
                            "reason": "left alone: KZOO_KEEP_FREED_MEMORY=0"}
    assert out.get("jax_async") is (True if keras.backend.backend() == "jax" else None)
    if not _glibc_here():
        return
    assert out["main_mapped"] >= 64 * MIB and out["thread_mapped"] >= 64 * MIB
    assert out["main_rss_change_on_free"] < -48 * MIB


def test_the_peers_benchmark_gives_a_peer_the_same_settings_without_kzoo():
    """`benchmarks/peers.py --same-allocator`: a keras-hub or transformers worker gets kzoo's
    malloc settings (and on JAX inline CPU programs) without importing kzoo."""
    out = _probe("peers-alone")
    assert out["kzoo_imported"] is False
    assert out.get("jax_async") is (False if keras.backend.backend() == "jax" else None)
    if _glibc_here():
        assert out["main_mapped"] == 0 and out["thread_mapped"] == 0
        assert out["main_rss_change_on_free"] > -8 * MIB
        assert out["released"] is True and out["rss_change_on_release"] < -48 * MIB


def _slow_off_jax(test):
    """`slow` (make test-all) on torch and TensorFlow: there the probe only repeats the first
    test's result with JAX imported as well, ~30 s of imports on a busy machine."""
    return test if keras.backend.backend() == "jax" else pytest.mark.slow(test)


@_slow_off_jax
def test_jax_already_dispatching_asynchronously_leaves_malloc_alone():
    """On JAX, a computation run before `import kzoo` made XLA's CPU client dispatch
    asynchronously (the case where the heap could keep two steps' scratch buffers): malloc
    and the client are left as they are. Other backends: nothing to check but the same
    probe's normal result."""
    out = _probe("jax-first")
    if keras.backend.backend() != "jax" or not _glibc_here():
        assert out["state"]["applied"] is _glibc_here()
        return
    assert out["state"] == {"applied": False, "limit_mib": None,
                            "reason": "left alone: JAX's CPU client already dispatches "
                                      "asynchronously"}
    assert out["jax_async"] is True and out["main_mapped"] >= 64 * MIB


@pytest.mark.parametrize("environ, reason", [
    ({"KZOO_KEEP_FREED_MEMORY": "off"}, "KZOO_KEEP_FREED_MEMORY=off"),
    ({"KZOO_KEEP_FREED_MEMORY": "1", "MALLOC_ARENA_MAX": "4"},
     "the environment sets MALLOC_ARENA_MAX"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "the environment sets MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "GLIBC_TUNABLES sets glibc.malloc options"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
])
def test_the_users_own_allocator_choices_are_left_alone(environ, reason):
    before = allocator.state()
    try:
        assert allocator.apply_at_import(environ) is False
        assert allocator.state() == {"applied": False, "limit_mib": None,
                                     "reason": f"left alone: {reason}"}
    finally:
        allocator._state.update(before)
    assert allocator._user_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert allocator._user_choice({"KZOO_KEEP_FREED_MEMORY": "yes"}) is None


@pytest.mark.parametrize("value", ["maybe", "2", "-1"])
def test_a_bad_environment_value_is_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"KZOO_KEEP_FREED_MEMORY='{value}'.*use 0 .* or 1"):
        allocator.apply_at_import({"KZOO_KEEP_FREED_MEMORY": value})


@pytest.mark.parametrize("limit", [0, -5, 1.5, True, "512", 2048])
def test_a_bad_limit_is_refused(limit):
    """2048 MiB would be 2**31 bytes, beyond mallopt's C int (ctypes would wrap it)."""
    with pytest.raises(ValueError, match=r"limit_mib=.*whole number of MiB from 1 to 2047"):
        allocator.keep_freed_memory(limit)


def test_the_limit_can_be_changed():
    if not _glibc_here():
        assert allocator.keep_freed_memory(256) is False
        return
    try:
        assert allocator.keep_freed_memory(256) is True
        assert allocator.state()["limit_mib"] == 256
        assert allocator.keep_freed_memory(allocator.MAX_LIMIT_MIB) is True
    finally:
        allocator.keep_freed_memory(allocator.DEFAULT_LIMIT_MIB)
    assert allocator.state()["limit_mib"] == allocator.DEFAULT_LIMIT_MIB


def test_the_looping_methods_give_the_memory_back_when_they_end(monkeypatch):
    """`fit`, `evaluate` and `predict` release what malloc kept when they end (also when
    they fail); `train_on_batch` and `predict_on_batch` keep it for the next call."""
    calls = []
    monkeypatch.setattr(kzoo.allocator, "release_memory", lambda: calls.append(1) or True)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=37, num_layers=1, num_heads=2, hidden_dim=8,
                                 intermediate_dim=16, max_sequence_length=12, dropout=0.0))
    lm.compile(optimizer="sgd")
    x, y, w = GPTCausalLM.lm_batch(np.random.default_rng(0).integers(0, 37, (3, 10)))
    lm.train_on_batch(x, y, sample_weight=w)
    lm.predict_on_batch(x)
    assert calls == []
    lm.fit(x, y, sample_weight=w, epochs=1, verbose=0)
    assert len(calls) == 1
    lm.evaluate(x, y, sample_weight=w, verbose=0)
    assert len(calls) == 2
    lm.predict(x, verbose=0)
    assert len(calls) == 3
    with pytest.raises(ValueError):
        lm.fit({**x, "token_ids": x["token_ids"] + 100}, y, verbose=0)  # ids out of range
    assert len(calls) == 4
