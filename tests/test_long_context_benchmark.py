"""The long-context benchmark's bookkeeping (slopes, crossovers, guards, tables, child
processes) on synthetic numbers worked out by hand, and one tiny real run of every method on
the current backend. No timing is asserted."""

import json
import math
import sys

import numpy as np
import pytest
from keras import ops

from benchmarks import long_context as lc


def _row(method, length, ms=None, mib=None, *, skipped=None, backend="jax", pass_="fwd",
         timing="interleaved", label=""):
    r = {"method": method, "length": length, "pass": pass_, "backend": backend,
         "causal": True, "window": 256, "label": label}
    if skipped is None:
        r.update(ms=ms, extra_mib=mib, timing=timing)
    else:
        r["skipped"] = skipped
    return r


def test_fit_slope_by_hand():
    # y = n^2 exactly.
    assert lc.fit_slope([(1000, 1.0), (2000, 4.0), (4000, 16.0)]) == pytest.approx(2.0)
    # log2 points (0, 0), (1, 1), (2, 3): slope = sum dx*dy / sum dx^2 = 3 / 2.
    assert lc.fit_slope([(1, 1.0), (2, 2.0), (4, 8.0)]) == pytest.approx(1.5)
    # Missing, zero and non-finite values are left out; one length left is no fit.
    assert lc.fit_slope([(1, 1.0), (2, None), (4, 4.0), (8, 0.0)]) == pytest.approx(1.0)
    assert lc.fit_slope([(1, 1.0), (2, math.nan)]) is None
    assert lc.fit_slope([]) is None
    # The local slope uses the last two usable points only.
    assert lc.local_slope([(1, 5.0), (2, 1.0), (4, 4.0)]) == pytest.approx(2.0)
    assert lc.local_slope([(1, 1.0)]) is None


def test_crossover_by_hand():
    lengths = [1024, 2048, 4096, 8192]
    full = {1024: 10.0, 2048: 20.0, 4096: 80.0, 8192: 320.0}
    # Below from 2048 on.
    assert lc.crossover(lengths, {1024: 12.0, 2048: 19.0, 4096: 40.0, 8192: 80.0},
                        full) == 2048
    # Below at 1024, above at 2048 (noise), below after: the crossing is the later one.
    assert lc.crossover(lengths, {1024: 9.0, 2048: 21.0, 4096: 40.0, 8192: 80.0},
                        full) == 4096
    # Below everywhere but the longest length: no crossing within the lengths run.
    assert lc.crossover(lengths, {1024: 1.0, 2048: 1.0, 4096: 1.0, 8192: 400.0},
                        full) is None
    # Full attention skipped by a guard (inf) counts as slower; the method missing there
    # (None / NaN) never counts as faster.
    assert lc.crossover(lengths, {1024: 20.0, 2048: 30.0, 4096: 70.0, 8192: 200.0},
                        {**full, 8192: math.inf}) == 4096
    assert lc.crossover(lengths, {1024: 1.0, 2048: 1.0, 4096: 1.0, 8192: math.nan},
                        full) is None
    assert lc.crossover(lengths, {1024: 1.0, 2048: 1.0, 4096: 1.0}, full) is None
    # Full attention failed (missing): no comparison, no crossing.
    assert lc.crossover(lengths, {n: 1.0 for n in lengths},
                        {1024: 10.0, 2048: 20.0, 4096: 80.0}) is None


def test_guard_by_hand():
    kw = dict(time_budget_s=60.0, memory_limit_mib=1000.0)
    # Quadratic full attention: 20 s at 16k -> 80 s at 32k.
    assert lc.guard("full", 32768, [(16384, 20.0, 10.0)], **kw) == (
        "predicted 80 s per call > 60 s budget")
    # Linear methods: 20 s -> 40 s, runs; strided n^1.5: 20 * 2^1.5 = 56.6 s runs, 25 s does not.
    assert lc.guard("sliding_window", 32768, [(16384, 20.0, 10.0)], **kw) is None
    assert lc.guard("strided", 32768, [(16384, 20.0, 10.0)], **kw) is None
    assert lc.guard("strided", 32768, [(16384, 25.0, 10.0)], **kw) == (
        "predicted 71 s per call > 60 s budget")
    # Memory 100 -> 400 MiB (slope 2) predicts 1600 MiB at 4096 > 1000.
    assert lc.guard("linear_elu", 4096, [(1024, 0.1, 100.0), (2048, 0.2, 400.0)], **kw) == (
        "predicted 1600 MiB > 1000 MiB limit")
    # A slope below 1 is taken as 1: 550 -> 1100 MiB > 1000.
    assert lc.guard("linear_elu", 4096, [(1024, 0.1, 500.0), (2048, 0.2, 550.0)], **kw) == (
        "predicted 1100 MiB > 1000 MiB limit")
    assert lc.guard("linear_elu", 4096, [(1024, 0.1, 200.0), (2048, 0.2, 400.0)], **kw) is None
    # The reference kernel's (1, 4, n, n) float32 scores: 4 * 32768^2 * 4 B = 16384 MiB.
    assert lc.guard("full", 32768, [], kernel="reference", **kw) == (
        "the (n, n) scores alone take 16384 MiB > 1000 MiB limit")
    assert lc.guard("full", 1024, [], kernel="reference", **kw) is None  # 16 MiB
    assert lc.guard("full", 1024, [], **kw) is None  # nothing measured yet: run it


def test_rounds_and_interleave_plan():
    assert lc.rounds_for([1.0, 1.0]) == lc.MAX_ROUNDS  # 20 s / 2 s = 10 rounds, capped
    assert lc.rounds_for([0.5, 2.0]) == 8  # 20 / 2.5
    assert lc.rounds_for([5.0, 5.0]) == lc.MIN_ROUNDS  # 2, raised to the minimum
    rows = [_row("full", 1024, 100.0, 1.0), _row("sliding_window", 1024, 3000.0, 1.0),
            _row("full", 2048, 6000.0, 1.0), _row("sliding_window", 2048, 50.0, 1.0),
            _row("linear_elu", 2048, skipped="predicted 99 s per call > 60 s budget")]
    assert lc.interleave_plan(rows) == {1024: (["full", "sliding_window"], 6),
                                        2048: (["sliding_window"], lc.MAX_ROUNDS)}
    lc.apply_times(rows, 1024, {"full": 90.0})
    assert (rows[0]["ms"], rows[0]["timing"]) == (90.0, "interleaved")
    assert rows[1]["ms"] == 3000.0


def _synthetic_rows():
    return [
        _row("full", 1024, 10.0, 40.0, label="reference"),
        _row("full", 2048, 40.0, 20.0, label="chunked"),
        _row("full", 4096, skipped="predicted 80 s per call > 60 s budget"),
        _row("sliding_window", 1024, 20.0, 10.0, label="w=256"),
        _row("sliding_window", 2048, 20.0, 20.0, label="w=256"),
        _row("sliding_window", 4096, 40.0, 40.0, label="w=256", timing="single"),
    ]


def test_table_and_crossover_lines_by_hand():
    text = lc.table(_synthetic_rows())
    assert text.splitlines() == [
        "| method | runs | n=1024 | n=2048 | n=4096 | time slope | memory slope |",
        "|---|---|---|---|---|---|---|",
        "| full | chunked, reference | 10.0 ms (1.00×) · 40 MiB (1.00×) | "
        "40.0 ms (1.00×) · 20 MiB (1.00×) | — (predicted 80 s per call > 60 s budget) | "
        "2.00 | -1.00 |",
        # Ratios: 20/10, 10/40; 20/40, 20/20; no full at 4096. Slopes: time log2 (1024..4096)
        # points (0, 0), (1, 0), (2, 1) -> 1/2; memory 10, 20, 40 -> 1.
        "| sliding_window | w=256 | 20.0 ms (2.00×) · 10 MiB (0.25×) | "
        "20.0 ms (0.50×) · 20 MiB (1.00×) | 40.0* ms · 40 MiB | 0.50 | 1.00 |",
    ]
    # Time: below from 2048 (full skipped at 4096 counts as slower). Memory: below at 1024,
    # equal at 2048, so no crossing.
    assert lc.crossover_lines(_synthetic_rows()) == (
        "- sliding_window: time crosses below full at n = 2048; "
        "memory not within the lengths run")


def test_report_from_json(tmp_path, capsys):
    path = tmp_path / "rows.json"
    rows = _synthetic_rows() + [dict(r, backend="torch", label="") for r in _synthetic_rows()]
    path.write_text(json.dumps(rows))
    text = lc.main(["--from-json", str(path)])
    assert "### jax, fwd" in text and "### torch, fwd" in text and "fwd+bwd" not in text
    assert "causal, window 256" in text
    assert text.count("| sliding_window |") == 2


def test_children_partial_output_and_failures():
    # A child that reported one row and then hung: the row survives, the reason says why.
    hang = [sys.executable, "-c",
            "import time; print('ROW {}', flush=True); time.sleep(30)"]
    lines, failure = lc._run_child(None, hang, timeout=2)
    assert lines == ["ROW {}"] and failure == "process ran past 2 s"
    die = [sys.executable, "-c",
           "import sys; print('ROW {}'); sys.stderr.write('boom\\n'); sys.exit(3)"]
    lines, failure = lc._run_child(None, die, timeout=30)
    assert lines == ["ROW {}"] and failure == "process died (exit 3): boom"


def test_bad_arguments():
    with pytest.raises(ValueError, match="--window=0"):
        lc.main(["--window", "0", "--in-process"])
    with pytest.raises(ValueError, match="--lengths='1k'"):
        lc.main(["--lengths", "1k", "--in-process"])
    with pytest.raises(ValueError, match="--passes='bwd'"):
        lc.main(["--passes", "bwd", "--in-process"])
    with pytest.raises(ValueError, match="method='dense'"):
        lc.attend_function("dense", 64, 16, True)


def test_layout_local_plus_first_column():
    causal = lc._layout(4, True)[0]
    assert causal.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    both = lc._layout(4, False)[0]
    assert both.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]


@pytest.fixture(scope="module")
def tiny_run():
    # One length, forward only: every method compiled once (the bookkeeping over several
    # lengths is checked above on synthetic numbers).
    args = lc.parse_args(["--quick", "--in-process", "--lengths", "40", "--window", "16",
                          "--passes", "fwd"])
    runs = {}
    rows = lc.run_in_process(args, args.pass_list, runs)
    return lc.report(rows, [rows[0]["backend"]], [False], True, 16), rows, runs


# Compiling all ten methods once took 30-170 s a backend on this machine: these two run with
# `make test-all` (the kernels themselves are checked in test_sparse_attention.py and
# test_linear_attention.py, the bookkeeping above).
@pytest.mark.slow
def test_tiny_real_run_has_every_method_and_finite_numbers(tiny_run):
    text, rows, _ = tiny_run
    assert [r["method"] for r in rows] == list(lc.METHODS)
    for r in rows:
        if r["method"] == "full_chunked" and lc.full_kernel(r["length"], True) == "chunked":
            assert r["skipped"].startswith("= full")
            continue
        assert "skipped" not in r, r
        assert math.isfinite(r["ms"]) and r["ms"] > 0
        assert math.isfinite(r["extra_mib"]) and r["extra_mib"] >= 0
    for m in lc.METHODS:
        assert f"| {m} |" in text
    assert text.count("crosses below full") + text.count("not within the lengths run") == (
        2 * (len(lc.METHODS) - 1))


@pytest.mark.slow
def test_tiny_real_run_outputs_are_finite(tiny_run):
    _, _, runs = tiny_run
    assert {m for m, _, _ in runs} >= set(lc.METHODS) - {"full_chunked"}
    for (method, length, backward), run in runs.items():
        out = ops.convert_to_numpy(run())
        assert out.shape == (1, length, lc.HEADS, lc.HEAD_DIM), method
        assert np.isfinite(out).all(), method
