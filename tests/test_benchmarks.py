"""The peers benchmark's bookkeeping (medians, ratios, FLOPs, tables) on synthetic numbers,
checked against values worked out by hand. No timing is measured or asserted here."""

import os

import numpy as np
import pytest

from benchmarks import peers

ROUNDS = [
    {"kzoo/jax": {"gpt": {"train": 100.0, "forward": 400.0, "decode": 10.0}, "matmul": 50.0},
     "keras-hub/jax": {"gpt": {"train": 50.0, "forward": 200.0, "decode": None},
                       "matmul": 40.0},
     "transformers/torch": {"gpt": {"train": 80.0, "forward": 500.0, "decode": 20.0},
                            "matmul": 60.0}},
    {"kzoo/jax": {"gpt": {"train": 120.0, "forward": 300.0, "decode": 14.0}, "matmul": 70.0},
     "keras-hub/jax": {"gpt": {"train": 40.0, "forward": 250.0, "decode": None},
                       "matmul": 30.0},
     "transformers/torch": {"gpt": {"train": 60.0, "forward": 600.0, "decode": 30.0},
                            "matmul": 62.0}},
    {"kzoo/jax": {"gpt": {"train": 90.0, "forward": 350.0, "decode": 12.0}, "matmul": 55.0},
     "keras-hub/jax": {"gpt": {"train": 60.0, "forward": 150.0, "decode": None},
                       "matmul": 35.0},
     "transformers/torch": {"gpt": {"train": 100.0, "forward": 700.0, "decode": 25.0},
                            "matmul": 58.0}},
]
# A size small enough to count FLOPs by hand.
TINY = dict(vocab=10, layers=1, width=4, heads=1, ff=8, batch=1, seq=2, matmul=8)


def test_median_over_rounds_skips_missing_values():
    med = peers.median_results(ROUNDS)
    assert med["kzoo/jax"]["gpt"] == {"train": 100.0, "forward": 350.0, "decode": 12.0}
    assert med["keras-hub/jax"]["gpt"] == {"train": 50.0, "forward": 200.0, "decode": None}
    assert med["transformers/torch"]["gpt"] == {"train": 80.0, "forward": 600.0, "decode": 25.0}
    assert med["kzoo/jax"]["matmul"] == 55.0 and med["transformers/torch"]["matmul"] == 60.0
    # A value one round lacks: the median of the others.
    two = peers.median_results([{"a/jax": {"gpt": {"train": 1.0}}},
                                {"a/jax": {"gpt": {"train": None}}},
                                {"a/jax": {"gpt": {"train": 4.0}}}])
    assert two["a/jax"]["gpt"]["train"] == 2.5


def test_ratios_and_comparison_rows():
    assert peers.ratio(3.0, 2.0) == 1.5
    assert peers.ratio(None, 2.0) is None and peers.ratio(1.0, None) is None
    assert peers.ratio(1.0, 0.0) is None
    rows = peers.comparison_rows(peers.median_results(ROUNDS), ["jax"], ["gpt"])
    assert rows == [
        ("gpt", "train", "jax", 100.0, 50.0, 80.0, 1.25, 2.0),
        ("gpt", "forward", "jax", 350.0, 200.0, 600.0, 350 / 600, 1.75),
        ("gpt", "decode", "jax", 12.0, None, 25.0, 0.48, None),
    ]
    # A backend that did not run: its kzoo and keras-hub cells and ratios are missing.
    torch_rows = peers.comparison_rows(peers.median_results(ROUNDS), ["torch"], ["gpt"])
    assert torch_rows[0] == ("gpt", "train", "torch", None, None, 80.0, None, None)


def test_flops_per_token_by_hand():
    # Per layer: 2 * (4 * 4*4 + 2 * 4*8) = 256 projection FLOPs + 2 * 2 * 2*4 = 32 attention.
    assert peers.forward_flops_per_token("gpt", TINY) == 288 + 2 * 4 * 10  # + tied LM head
    assert peers.forward_flops_per_token("bert", TINY) == 288 + 32 + 80  # + head transform
    assert peers.train_flops_per_token("gpt", TINY) == 3 * 368
    # BERT trains its head at the masked positions only: 1 of the 2 here (15% of 2 -> 1),
    # and its last layer (here the only one) there too, but for its keys and values:
    # k/v 2 * 2 * 4*4 = 64 a token; q, output, feed-forward (192) and attention (32) and
    # the head (112) at half the tokens.
    assert peers.masked_count(TINY) == 1
    assert peers.train_flops_per_token("bert", TINY) == 3 * (64 + (192 + 32 + 112) / 2)
    assert peers.masked_count({**TINY, "seq": 256}) == 38
    with pytest.raises(ValueError, match="model='t5'"):
        peers.forward_flops_per_token("t5", TINY)


def test_matmul_peak_and_utilisation():
    med = peers.median_results(ROUNDS)
    peak, per_backend = peers.matmul_peak(med)
    assert per_backend == {"jax": 55.0, "torch": 60.0}  # best system per backend
    assert peak == 60.0
    rows = peers.utilisation_rows(med, TINY, ["gpt"], peak)
    by_system = {r[1]: r for r in rows}
    assert set(by_system) == {"kzoo/jax", "keras-hub/jax", "transformers/torch"}
    model, system, tps, gflops, fraction = by_system["kzoo/jax"]
    assert (model, tps) == ("gpt", 100.0)
    assert gflops == pytest.approx(1104 * 100 / 1e9)
    assert fraction == pytest.approx(1104 * 100 / 1e9 / 60.0)
    # T5 is not trained: no utilisation row.
    assert peers.utilisation_rows(med, TINY, ["t5"], peak) == []


def test_format_table_and_report_text():
    text = peers.format_table(("a", "b", "c", "n"), [("gpt", "x", "jax", "1.5"),
                                                     ("t5", "yy", "", "10")])
    assert text.splitlines() == [
        "a    b   c      n",
        "---  --  ---  ---",
        "gpt  x   jax  1.5",
        "t5   yy        10",
    ]
    out = peers.report(peers.median_results(ROUNDS), ["jax"], ["gpt"], TINY, 3,
                       notes=["keras-hub/jax gpt: example"])
    lines = out.splitlines()
    assert lines[0].startswith("Medians of 3 round(s)")
    train = next(line for line in lines if line.startswith("gpt") and "train (" in line)
    assert train.split()[-5:] == ["100", "50.0", "80.0", "1.25x", "2.00x"]
    decode = next(line for line in lines if "decode (" in line)
    assert decode.split()[-5:] == ["12.0", "n/a", "25.0", "0.48x", "n/a"]
    assert "jax 55.0, torch 60.0 GFLOP/s" in out
    assert lines[-1] == "note: keras-hub/jax gpt: example"
    # Utilisation: 1104 FLOPs/token x 1e7 tokens/s = 11.04 GFLOP/s = 18.4% of 60 GFLOP/s.
    fast = {"kzoo/jax": {"gpt": {"train": 1e7}, "matmul": 60.0}}
    util = [line.split() for line in peers.report(fast, ["jax"], ["gpt"], TINY, 1).splitlines()
            if line.startswith("gpt") and "kzoo/jax" in line]
    assert util == [["gpt", "kzoo/jax", "10,000,000", "11.0", "18.4%"]]


def test_round_ratios_pair_each_round_with_itself():
    rows = {(m, k, b): (r1, r2) for m, k, b, r1, r2 in peers.round_ratio_rows(
        ROUNDS, ["jax", "torch"], ["gpt"])}
    # train, kzoo/transformers: 100/80, 120/60, 90/100 -> 1.25, 2.0, 0.9 (the ratio of the
    # medians, 100/80, is the middle one only by chance); kzoo/keras-hub: 2.0, 3.0, 1.5.
    assert rows["gpt", "train", "jax"] == ((1.25, 0.9, 2.0), (2.0, 1.5, 3.0))
    # forward: 400/500, 300/600, 350/700 -> 0.8, 0.5, 0.5; keras-hub: 2.0, 1.2, 2.333...
    (mid, low, high), kh = rows["gpt", "forward", "jax"]
    assert (mid, low, high) == (0.5, 0.5, 0.8)
    assert kh[0] == 2.0 and kh[1] == 1.2 and abs(kh[2] - 350 / 150) < 1e-12
    # keras-hub never decoded, and no round has kzoo on torch: no ratio.
    assert rows["gpt", "decode", "jax"][1] is None
    assert rows["gpt", "train", "torch"] == (None, None)
    text = peers.report(peers.median_results(ROUNDS), ["jax"], ["gpt"], TINY, 3,
                        per_round=ROUNDS)
    section = text.split("Ratios round by round")[1].splitlines()
    assert section[3].split() == ["gpt", "train", "jax", "1.25x", "(0.90-2.00)", "2.00x",
                                  "(1.50-3.00)"]
    assert section[5].split() == ["gpt", "decode", "jax", "0.48x", "(0.47-0.50)", "n/a"]
    assert "Ratios round by round" in text
    # One round: nothing to pair, no section.
    one = peers.report(peers.median_results(ROUNDS[:1]), ["jax"], ["gpt"], TINY, 1,
                       per_round=ROUNDS[:1])
    assert "Ratios round by round" not in one


def test_count_new_tokens_of_lists_and_arrays():
    assert peers.count_new_tokens([[1, 2, 3], [4], []]) == 4
    assert peers.count_new_tokens(np.zeros((4, 128), "int32")) == 512


def test_token_count_notes_flag_short_decodes():
    med = {"kzoo/jax": {"gpt": {"decode": 5.0, "new_tokens": 512.0}, "matmul": 1.0},
           "keras-hub/jax": {"gpt": {"decode": 9.0, "new_tokens": 500.0}},
           "transformers/torch": {"gpt": {"train": 1.0}}}
    assert peers.token_count_notes(med, ["gpt"], 512) == [
        "keras-hub/jax gpt: decoded 500 new tokens, not 512; its decode rate is not comparable."]
    assert peers.token_count_notes(med, ["t5"], 512) == []


def test_gemm_shapes_by_hand():
    # TINY: d=4, ff=8, heads=1, t=2, b=1, vocab=10; rows = 2.
    layer = [(1, 2, 4, 12), (1, 2, 4, 4), (1, 2, 4, 8), (1, 2, 8, 4), (1, 2, 4, 2), (1, 2, 2, 4)]
    assert peers.gemm_shapes("gpt", TINY) == layer + [(1, 2, 4, 10)]
    # The forward FLOPs agree with the utilisation's count (fused q/k/v = 3 projections).
    assert peers.gemm_flops(peers.gemm_shapes("gpt", TINY)) == peers.forward_flops_per_token(
        "gpt", TINY) * TINY["seq"]
    assert peers.gemm_shapes("bert", TINY) == layer + [(1, 2, 4, 4), (1, 2, 4, 10)]
    train = peers.gemm_shapes("bert", TINY, train=True)
    # The last layer's keys and values at both rows; its queries, output, feed-forward,
    # attention products and the head at the 1 masked position.
    forward = [(1, 2, 4, 8), (1, 1, 4, 4), (1, 1, 4, 4), (1, 1, 4, 8), (1, 1, 8, 4),
               (1, 1, 4, 2), (1, 1, 2, 4), (1, 1, 4, 4), (1, 1, 4, 10)]
    assert train[:len(forward)] == forward
    assert (1, 2, 8, 4) in train and (1, 4, 2, 8) in train  # dA = dC B^T, dB = A^T dC
    assert peers.gemm_flops(train) == 3 * peers.gemm_flops(forward)
    assert peers.gemm_flops(train) == peers.train_flops_per_token("bert", TINY) * TINY["seq"]


def test_floor_rows():
    med = {"kzoo/jax": {"gpt": {"train": 50.0, "train_floor": 100.0, "forward": 80.0,
                                "forward_floor": 160.0, "decode": 30.0, "decode_floor": 40.0},
                        "t5": {"decode": 9.0, "decode_floor": 12.0}},
           "keras-hub/jax": {"gpt": {"train": 20.0, "decode": 25.0}},
           "transformers/torch": {"gpt": {"train": 40.0, "forward": 200.0, "decode": 16.0},
                                  "t5": {"decode": 8.0}}}
    rows = peers.floor_rows(med, ["jax", "torch"], ["gpt", "t5"])
    assert rows == [("gpt", "train", "jax", 100.0, 50.0, 0.5, 2.5, 5.0),
                    ("gpt", "forward", "jax", 160.0, 80.0, 0.5, 0.8, None),
                    ("gpt", "decode", "jax", 40.0, 30.0, 0.75, 2.5, 1.6),
                    ("t5", "decode", "jax", 12.0, 9.0, 0.75, 1.5, None)]
    text = peers.report(med, ["jax"], ["gpt"], {**TINY, "matmul": 8}, 1)
    assert "Matmul floor" in text and "0.80x" in text and "50.0%" in text and "1.60x" in text


def test_decode_shapes_by_hand():
    # d=4, ff=8, 2 heads of 2, 3 prompts of 5 tokens, 6 new ones, vocabulary 10, 1 layer.
    size = dict(vocab=10, layers=1, width=4, heads=2, ff=8, prompts=3, prompt_len=5,
                new_tokens=6)
    qkv, out, up, down = (1, 3, 4, 12), (1, 3, 4, 4), (1, 3, 4, 8), (1, 3, 8, 4)
    head = (1, 3, 4, 10)
    assert peers.decode_shapes("gpt", size) == [
        qkv, (6, 1, 2, 11), (6, 1, 11, 2), out, up, down, head]
    assert peers.decode_shapes("t5", size) == [
        qkv, (6, 1, 2, 6), (6, 1, 6, 2), out,  # self-attention over the 6 new tokens
        (1, 3, 4, 4), (6, 1, 2, 5), (6, 1, 5, 2), (1, 3, 4, 4),  # cross-attention: 5 keys
        up, down, head]
    assert peers.decode_shapes("gpt", {**size, "layers": 2}) == [
        qkv, (6, 1, 2, 11), (6, 1, 11, 2), out, up, down] * 2 + [head]
    with pytest.raises(ValueError, match="model='bert'"):
        peers.decode_shapes("bert", size)


def test_decode_loop_matches_numpy():
    """The floor's loop on this test's backend computes what the chain of products says:
    each product's operand the previous output's values in order, repeated to size."""
    import keras

    shapes = [(1, 2, 3, 5), (4, 1, 2, 3), (1, 2, 8, 4)]  # 10 -> 8 values, 12 -> 16
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=(n, k, q)[n == 1:]).astype("float32") / 3
               for n, m, k, q in shapes]
    start = rng.normal(size=6).astype("float32")

    def fit(x, count):
        return np.resize(x, count)  # (NumPy repeats the values in order)

    x = start
    for _ in range(3):
        for (n, m, k, q), w in zip(shapes, weights):
            x = (fit(x, n * m * k).reshape((n, m, k)[n == 1:]) @ w).ravel()
        x = fit(x, 6)
    got = peers.decode_loop(keras.backend.backend(), shapes, 3, weights, start)()
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)
    assert got.shape == (6,)


def test_memory_rows_and_report():
    med = {"kzoo/jax": {"gpt": {"train": 5.0, "train_peak_mib": 300.0}},
           "keras-hub/jax": {"gpt": {"train": 4.0, "train_peak_mib": 600.0}},
           "transformers/torch": {"gpt": {"train": 4.0, "train_peak_mib": 200.0}}}
    rows = peers.memory_rows(med, ["jax", "torch"], ["gpt", "t5"])
    assert rows == [("gpt", "jax", 300.0, 600.0, 200.0, 1.5, 0.5)]
    text = peers.report(med, ["jax"], ["gpt"], {**TINY, "matmul": 8}, 1)
    assert "Training memory" in text and "1.50x" in text and "0.50x" in text
    assert "Model and training memory" not in text  # no row has that figure
    med["kzoo/jax"]["gpt"]["model_peak_mib"] = 700.0
    med["transformers/torch"]["gpt"]["model_peak_mib"] = 1000.0
    assert peers.memory_rows(med, ["jax"], ["gpt"], "model_peak_mib") == [
        ("gpt", "jax", 700.0, None, 1000.0, 0.7, None)]
    text = peers.report(med, ["jax"], ["gpt"], {**TINY, "matmul": 8}, 1)
    section = text.split("Model and training memory")[1].splitlines()
    assert section[3].split() == ["gpt", "jax", "700", "n/a", "1,000", "0.70x", "n/a"]


def test_timed_training_reports_the_memory_a_step_adds():
    """40 MiB a call, kept: above glibc's largest mmap threshold (32 MiB), so every call maps
    fresh pages whatever the process freed before (smaller blocks may reuse freed memory).
    In a fresh, small process: the figure is the high-water mark minus the resident set
    before, and inside a pytest worker the kernel (DAMON here) reclaimed enough of the
    worker's cold pages during the calls to hide the blocks (10 of 120 MiB seen, in a
    fresh-clone `make test`). The kernel may still reclaim cold blocks of earlier calls, so
    the peak is at least one block, at most the three and some slack."""
    import subprocess
    import sys

    code = ("import numpy as np; from benchmarks import peers; held = []; "
            "s, p, m = peers._timed_training(lambda: held.append(np.ones(40 * 2 ** 20 // 8)), "
            "{'steps': 2, 'warmup': 1}); print(s, p, m)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, timeout=120)
    seconds, peak, model_peak = out.stdout.split()
    assert float(seconds) >= 0 and 40 * 0.9 <= float(peak) <= 3 * 40 + 32
    assert model_peak == "None"  # no baseline was marked


def test_model_peak_counts_what_building_took_and_freed():
    """After `mark_baseline`, a "build" that touches 200 MiB and frees it (glibc unmaps blocks
    this large, so the resident set falls back), then three training calls keeping 40 MiB
    each: the training figure sees the calls only, the model figure the build's peak too."""
    import subprocess
    import sys

    code = ("import numpy as np; from benchmarks import peers; peers.mark_baseline(); "
            "build = np.ones(200 * 2 ** 20 // 8); del build; held = []; "
            "s, p, m = peers._timed_training(lambda: held.append(np.ones(40 * 2 ** 20 // 8)), "
            "{'steps': 2, 'warmup': 1}); print(p, m)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, timeout=120)
    peak, model_peak = map(float, out.stdout.split())
    assert 40 * 0.9 <= peak <= 3 * 40 + 32
    assert 200 * 0.9 <= model_peak <= 200 + 3 * 40 + 32


def test_rounds_run_every_model_of_every_system_in_its_own_process(monkeypatch, capsys):
    calls = []
    matmul = {"gpt": 10.0, "bert": 30.0}

    def fake_run_system(library, backend, models, size_name, timeout, same_allocator=False):
        calls.append((library, backend, tuple(models)))
        (model,) = models
        if library == "keras-hub" and model == "bert":
            return {}, "exit 1: boom"
        values = {model: {"train": float(len(calls)), "train_peak_mib": 5.0},
                  "matmul": matmul[model]}
        if library == "transformers" and model == "gpt":
            values[model]["note"] = "a remark"
        return values, None

    monkeypatch.setattr(peers, "run_system", fake_run_system)
    order = peers.systems(["jax"])
    per_round, notes = peers.run_rounds(order, ["gpt", "bert"], 2, "quick", 10)
    assert len(calls) == 2 * 3 * 2 and all(len(models) == 1 for _, _, models in calls)
    for r in range(2):
        done = calls[6 * r:6 * (r + 1)]
        assert sorted(done) == sorted((lib, b, (m,)) for lib, b in order
                                      for m in ("gpt", "bert"))
    # Round 2 starts with another system and another model.
    assert calls[0][:2] != calls[6][:2] and calls[0][2] != calls[6][2]
    first = per_round[0]
    assert set(first) == {"kzoo/jax", "keras-hub/jax", "transformers/torch"}
    assert set(first["kzoo/jax"]) == {"gpt", "bert", "matmul"}
    assert first["kzoo/jax"]["matmul"] == 30.0  # the best of the two processes
    assert set(first["keras-hub/jax"]) == {"gpt", "matmul"}
    assert "note" not in first["transformers/torch"]["gpt"]
    assert notes.count("transformers/torch gpt: a remark") == 1
    assert "keras-hub/jax bert, round 1: exit 1: boom" in notes
    assert "keras-hub/jax bert, round 2: exit 1: boom" in notes
    med = peers.median_results(per_round)
    assert med["kzoo/jax"]["bert"]["train_peak_mib"] == 5.0
    assert "round 1/2 kzoo/jax gpt" in capsys.readouterr().err


_PROCESSOR = """vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
cache size\t: 1024 KB
flags\t\t: fpu sse2 avx2 avx512f avx512bw
"""
# Two logical CPUs' blocks of a Zen 5 machine's /proc/cpuinfo.
CPUINFO = "\n".join(f"processor\t: {i}\n{_PROCESSOR}" for i in range(2))


def test_machine_reads_the_first_processor_and_counts_them():
    info = peers.machine(CPUINFO, versions={"keras": "3.0", "jax": "0.1"})
    assert info["cpu"] == "AMD EPYC" and (info["family"], info["model"]) == ("26", "2")
    assert info["logical_cpus"] == 2 and info["avx512"] is True
    assert info["cache"] == "1024 KB"  # a text given: /proc/cpuinfo's figure, not sysfs
    assert peers.machine_line(info) == (
        "Machine: AMD EPYC (family 26, model 2); 2 logical CPUs; cache 1024 KB; AVX-512. "
        "Versions: keras 3.0, jax 0.1.")
    plain = peers.machine(CPUINFO.replace(" avx512f avx512bw", ""), versions={})
    assert plain["avx512"] is False
    assert peers.machine_line(plain).endswith("; no AVX-512.")
    bare = peers.machine("", versions={})  # no /proc/cpuinfo (macOS, Windows)
    assert bare["avx512"] is None and bare["cache"] is None and bare["logical_cpus"] >= 1
    assert peers.machine_line(bare).count(";") == 1  # name and CPU count only
    assert set(peers.machine()["versions"]) <= set(peers.VERSIONED)


def test_last_level_cache_from_a_sysfs_tree(tmp_path):
    for name, level, kind, size in (("index0", 1, "Data", "48K"),
                                    ("index1", 1, "Instruction", "32K"),
                                    ("index2", 2, "Unified", "1024K"),
                                    ("index3", 3, "Unified", "32768K")):
        (tmp_path / name).mkdir()
        for field, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(f"{value}\n")
    assert peers._last_level_cache(str(tmp_path)) == "L3 32768K"
    (tmp_path / "index3" / "level").write_text("not a number")
    assert peers._last_level_cache(str(tmp_path)) == "L2 1024K"
    assert peers._last_level_cache(str(tmp_path / "missing")) is None


# === benchmarks/gpu.py: the GPU report's bookkeeping (no GPU needed) ===


def test_gpu_report_ratios_and_mfu_by_hand():
    from benchmarks import gpu

    results = {
        "kzoo/jax": {"train": 200.0, "decode": 30.0, "train_gpu_mib": 5000.0, "loss": 8.5,
                     "matmul_tflops": 700.0, "device": "GPU X"},
        "kzoo/torch+jit": {"train": 90.0, "decode": 5.0, "matmul_tflops": 800.0},
        "keras-hub/jax": {"train": 100.0, "decode": 10.0},
        "keras-hub/torch": {},  # a system that failed: n/a, not a crash
        "transformers/torch": {"train": 50.0, "decode": 20.0, "matmul_tflops": 750.0},
    }
    size = dict(TINY, seq=2)
    flops = peers.train_flops_per_token("gpt", size)
    # by hand: per layer 2 * (4 * 16 + 2 * 32) + 2 * 2 * 2 * 4 = 288; head 2 * 4 * 10 = 80
    assert flops == 3 * (288 + 80)
    text = gpu.report(results, size, peak_tflops=1e-9)
    speed = text.split("\n\nMFU")[0]  # the first table: speed and ratios
    rows = {line.split()[0]: line for line in speed.splitlines()[3:]}
    assert "4.00x" in rows["kzoo/jax"] and "1.50x" in rows["kzoo/jax"]  # vs transformers
    assert "2.00x" in rows["kzoo/jax"] and "3.00x" in rows["kzoo/jax"]  # vs keras-hub
    assert "n/a" in rows["keras-hub/torch"]
    # MFU against the datasheet peak (1e-9 TFLOP/s = 1000 FLOP/s) and the best measured one.
    achieved = flops * 200.0 / 1e12
    assert f"{100 * achieved / 1e-9:.1f}%" in text
    assert f"{100 * achieved / 800.0:.1f}%" in text
    assert gpu._split("kzoo/torch+jit") == ("kzoo", "torch")
    # The profile table: a step's ms from tokens/s (1e3 * 4 x 2 tokens / 200 = 40 ms; 50
    # tok/s: 160 ms); bound by the host past 1.15x the kernels' time.
    results["kzoo/jax"]["profile"] = {"kernels_ms": 30.0, "launches": 120.0, "waits": 13.0}
    results["transformers/torch"]["profile"] = {"kernels_ms": 150.0, "launches": 9.0,
                                                "waits": 2.0}
    results["kzoo/torch+jit"]["profile"] = {"kernels_ms": None, "launches": 0, "waits": 0}
    text = gpu.report(results, dict(size, batch=4), peak_tflops=1e-9)
    table = text.split("Where a training step's time goes")[1]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:] if line.strip()}
    assert rows["kzoo/jax"][1:] == ["40.0", "30.0", "120", "13.0", "host"]
    assert rows["transformers/torch"][1:] == ["160", "150", "9.00", "2.00", "device"]
    assert rows["kzoo/torch+jit"][-1] == "n/a"


def test_gpu_cli_rejects_unknown_systems(capsys):
    from benchmarks import gpu

    for bad in ("kzoo/mxnet", "transformers/torch+jit", ""):
        with pytest.raises(SystemExit):
            gpu.main(["--systems", bad])
        assert "--systems must name some of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--peak-tflops", "0"])
    assert "--peak-tflops must be > 0" in capsys.readouterr().err


# === benchmarks/decode_families.py ===


def test_decode_families_rows_and_table_by_hand():
    from benchmarks import decode_families as fam

    medians = {"kzoo/jax": {"llama": {"decode": 300.0}},
               "keras-hub/jax": {"llama": {"decode": 100.0}},
               "transformers/torch": {"llama": {"decode": 200.0}, "mixtral": {"decode": 50.0}},
               "kzoo/torch": {"mixtral": {"decode": 125.0}}}
    rows = fam.rows(medians, ["llama", "mixtral"], ["jax", "torch"])
    assert rows == [("llama", "jax", 300.0, 100.0, 200.0, 1.5, 3.0),
                    ("llama", "torch", None, None, 200.0, None, None),
                    ("mixtral", "jax", None, None, 50.0, None, None),
                    ("mixtral", "torch", 125.0, None, 50.0, 2.5, None)]
    text = fam.table(rows).splitlines()
    assert text[2] == "| llama | jax | 300 | 100 | 200 | 1.50x | 3.00x |"
    assert text[5] == "| mixtral | torch | 125 | - | 50 | 2.50x | - |"


def test_decode_families_cli_rejects_unknown_kinds_and_rounds():
    from benchmarks import decode_families as fam

    with pytest.raises(SystemExit, match="--only must be a comma-separated subset of llama"):
        fam.main(["--only", "llama,gpt5"])
    with pytest.raises(SystemExit, match="--rounds must be a positive integer; got --rounds=-1"):
        fam.main(["--rounds", "-1", "--backends", "jax"])


@pytest.mark.spread
@pytest.mark.parametrize("kind", ["llama", "mistral", "mixtral", "t5_v1_1"])
def test_decode_families_models_are_the_kinds_named(kind):
    """The kzoo models the benchmark times are what its docstring says (the window shorter
    than the positions decoded, the experts, untied heads), and decode every new token."""
    from benchmarks import decode_families as fam

    size = fam.SIZES["quick"]
    model, prompts = fam.kzoo_model(kind, size)
    backbone = model.backbone
    if kind == "t5_v1_1":
        block = backbone.decoder_layers[0]
        assert block.feedforward == "gated" and model.lm_head is not None
    else:
        block = backbone.transformer_layers[0]
        assert backbone.position == "rotary" and not backbone.token_embedding.tie_weights
        assert block.self_attention._kv_heads == size["kv_heads"]
        assert block.feedforward == {"llama": "gated", "mistral": "gated",
                                     "mixtral": "moe"}[kind]
        if kind == "mistral":
            assert block.attention_options["window"] == size["window"] < (
                size["prompt_len"] + size["new_tokens"])
        if kind == "mixtral":
            moe = block.feedforward_layer
            assert (moe.num_experts, moe.top_k) == (size["experts"], size["top_k"])
    out = model.generate(prompts, max_new_tokens=size["new_tokens"], stop_token_ids=None)
    assert peers.count_new_tokens(out) == size["prompts"] * size["new_tokens"]


@pytest.mark.spread
def test_gpu_quick_worker_trains_and_decodes_kzoo():
    """The GPU benchmark's kzoo worker at its quick size (what `--quick` runs on a CPU): it
    trains (a finite loss near ln(vocabulary) for random tokens), decodes every asked token
    and reports the matmul peak. The quick size's vocabulary (512) holds no GPT-2 stop id:
    building it once failed on `stop_token_ids=[50256]`."""
    import keras

    from benchmarks import gpu

    size = gpu.SIZES["quick"]
    out = gpu.run_worker(f"kzoo/{keras.config.backend()}", size, profile=True)
    assert out["train"] > 0 and out["decode"] > 0 and out["matmul_tflops"] > 0
    if keras.config.backend() == "torch":  # (the CPU: no kernels timed, launched or awaited)
        assert out["profile"] == {"kernels_ms": None, "launches": 0, "waits": 0}
    else:
        assert "profile" not in out
    assert abs(out["loss"] - np.log(size["vocab"])) < 1.0
    assert out["new_tokens"] == size["prompts"] * size["new_tokens"]
    assert out["device"]
