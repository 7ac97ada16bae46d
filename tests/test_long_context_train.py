"""The bookkeeping of benchmarks/long_context_train.py (commands, metrics, table), checked
against values worked out by hand; the training runs themselves are the benchmark's."""

import argparse
import json

from benchmarks import long_context_train as lct

ARGS = argparse.Namespace(preset="gpt_mini", steps=7, batch_size=2, seq_len=32, window=5,
                          features=12, seed=3)


def test_each_variant_differs_only_in_its_attention_overrides():
    base = lct.command("full", "/tmp/x", ARGS)
    assert "--override" not in base
    assert base[base.index("--steps") + 1] == "7" and base[base.index("--seed") + 1] == "3"
    sliding = lct.command("sliding_window", "/tmp/x", ARGS)
    assert sliding[:len(base)] == base
    assert sliding[len(base):] == ["--override", "attention=sliding_window",
                                   "--override", "window=5"]
    performer = lct.command("performer", "/tmp/x", ARGS)
    assert performer[len(base):] == ["--override", "attention=performer",
                                     "--override", "num_features=12"]


def test_metrics_and_table(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"metrics": {"val_loss": 2.0, "val_perplexity": 7.5, "val_accuracy": 0.25}}))
    assert lct.read_metrics(str(tmp_path)) == {"val_loss": 2.0, "perplexity": 7.5,
                                               "accuracy": 0.25}
    rows = [{"variant": "full", "val_loss": 2.0, "perplexity": 7.39, "accuracy": 0.3,
             "seconds": 10.2},
            {"variant": "linear (elu)", "val_loss": 2.25, "perplexity": 9.49, "accuracy": None,
             "seconds": 9.7}]
    lines = lct.table(rows, ARGS).splitlines()
    assert lines[-2] == "| full | 2.0000 | 7.39 | 0.3000 | +0.0000 | 10 |"
    assert lines[-1] == "| linear (elu) | 2.2500 | 9.49 | — | +0.2500 | 10 |"


def test_every_variant_command_is_accepted_by_the_training_cli():
    """Each run's arguments parse with `python -m training`'s own parser (the benchmark
    passed `--sample-tokens 0`, which the recipe refuses: every run exited 2 and the
    benchmark stopped at its first variant). The sample stays as short as allowed."""
    from training.cli import build_parser

    for variant in lct.VARIANTS:
        argv = lct.command(variant, "/tmp/x", ARGS)
        assert argv[1:3] == ["-m", "training"]
        args = build_parser().parse_args(argv[3:])
        assert args.sample_tokens == 1
