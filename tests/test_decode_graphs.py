"""CUDA graphs in PyTorch's decode loop (`kzoo.generation.StepGraph`).

On a CUDA device the torch loop captures the model's step once and replays it at every step.
No CUDA here: these tests run the loop's graph protocol with a stand-in (`ReplayedStep`) that
follows `StepGraph`'s contract (warm-up, same-state check, one static logits tensor written
at each replay), so they check everything around the capture itself: the step reads its
tokens and index from the tensors the loop overwrites (a scalar tensor index, not a Python
int), the caches are written in place, beam search reorders them in place, and the tokens
equal those of the loop without graphs (`KZOO_CUDA_GRAPHS=0`) for GPT (learned and rotary
positions), T5, stop tokens and every strategy. Then where graphs are tried at all (CUDA, the
fast decode path, the variable), and the fallbacks (a model that copies its state, a capture
that fails). The capture on a real GPU is checked by `benchmarks/gpu.py` (its decode worker
compares the tokens with and without graphs).

On JAX and TensorFlow the loop is compiled whole and never tries graphs: there
`test_where_graphs_are_tried` checks by default that they are not tried; the others, marked
`torch_path`, check with `make test-all` that no graph is made and the tokens are those of
`KZOO_CUDA_GRAPHS=0`.
"""

import keras
import numpy as np
import pytest

from kzoo import generation
from kzoo.layers import fast_decode
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM

TORCH = keras.backend.backend() == "torch"
# Graphs a decode call captures: one on torch, none where the loop is compiled whole.
GRAPHS = 1 if TORCH else 0


class ReplayedStep(generation.StepGraph):
    """`StepGraph` without CUDA: `replay` runs the step again and copies its logits into the
    tensor the "capture" returned, as a graph replay writes into its static output."""

    replays = 0
    built = 0

    def _warm_up(self, run):
        run()
        return run()

    def _capture(self, run):
        type(self).built += 1
        self.run = run
        return run()[0].clone()

    def replay(self):
        type(self).replays += 1
        self.logits.copy_(self.run()[0])
        return self.logits


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs "available" on this CPU, captured by `ReplayedStep`; yields the class."""
    monkeypatch.setattr(generation, "_cuda_available", lambda: True)
    monkeypatch.setattr(generation, "_on_cuda", lambda tensors: True)
    monkeypatch.setattr(generation, "GRAPH_CLASS", ReplayedStep)
    monkeypatch.setattr(ReplayedStep, "replays", 0)
    monkeypatch.setattr(ReplayedStep, "built", 0)
    monkeypatch.delenv(generation.GRAPHS_ENV, raising=False)
    return ReplayedStep


def _gpt(style, seed=5):
    extra = {} if style == "gpt2" else dict(norm="rmsnorm", position="rotary",
                                             feedforward="gated", activation="silu",
                                             num_kv_heads=1, use_bias=False)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(vocabulary_size=97, num_layers=2, num_heads=2,
                                   hidden_dim=16, intermediate_dim=32, max_sequence_length=40,
                                   **extra))


def _without_graphs(monkeypatch, fn):
    monkeypatch.setenv(generation.GRAPHS_ENV, "0")
    try:
        return fn()
    finally:
        monkeypatch.delenv(generation.GRAPHS_ENV)


STRATEGIES = [("greedy", {}), ("sample", dict(top_k=20, seed=3)), ("beam", dict(num_beams=3))]
# On JAX and TensorFlow (nothing graphed; each case compiles its loops) the greedy cases only.
CASES = STRATEGIES if TORCH else STRATEGIES[:1]


@pytest.mark.torch_path
@pytest.mark.parametrize("style", ["gpt2", "llama"] if TORCH else ["gpt2"])
@pytest.mark.parametrize("strategy,kwargs", CASES, ids=[s for s, _ in CASES])
def test_gpt_tokens_equal_the_loop_without_graphs(stand_in, monkeypatch, style, strategy,
                                                  kwargs):
    lm = _gpt(style)
    prompts = [[5, 6, 7, 8], [9, 10]]  # (left padding in the second row)

    def run():
        return lm.generate(prompts, max_new_tokens=10, strategy=strategy, **kwargs)

    graphed = run()
    assert stand_in.built == GRAPHS and stand_in.replays >= 8 * GRAPHS  # steps 1..9
    plain = _without_graphs(monkeypatch, run)
    assert stand_in.built == GRAPHS  # (not tried with the variable set)
    assert graphed == plain
    assert all(len(row) == 10 for row in graphed)


@pytest.mark.torch_path
def test_stop_tokens_and_early_end(stand_in, monkeypatch):
    lm = _gpt("gpt2", seed=2)
    prompts = [[5, 6, 7, 8], [9, 10], [11]]
    free = _without_graphs(monkeypatch, lambda: lm.generate(prompts, max_new_tokens=24))
    stop = free[0][3]  # a token the first row produces: that row ends there
    graphed = lm.generate(prompts, max_new_tokens=24, stop_token_ids=[stop])
    plain = _without_graphs(
        monkeypatch, lambda: lm.generate(prompts, max_new_tokens=24, stop_token_ids=[stop]))
    assert graphed == plain
    assert graphed[0] == free[0][:free[0].index(stop) + 1]


@pytest.mark.torch_path
@pytest.mark.parametrize("strategy,kwargs", [STRATEGIES[0], STRATEGIES[2]][:1 + TORCH],
                         ids=["greedy", "beam"][:1 + TORCH])
def test_t5_tokens_equal_the_loop_without_graphs(stand_in, monkeypatch, strategy, kwargs):
    keras.utils.set_random_seed(4)
    lm = T5Seq2SeqLM(T5Backbone(vocabulary_size=61, num_layers=2, num_decoder_layers=2,
                                num_heads=4, hidden_dim=16, key_value_dim=6,
                                intermediate_dim=24, dropout=0.0,
                                relative_attention_num_buckets=8,
                                relative_attention_max_distance=16))
    prompts = [[5, 6, 7, 8, 9], [10, 11]]

    def run():
        return lm.generate(prompts, max_new_tokens=9, strategy=strategy,
                           stop_token_ids=None, **kwargs)

    graphed = run()
    assert stand_in.built == GRAPHS and stand_in.replays >= 7 * GRAPHS
    assert graphed == _without_graphs(monkeypatch, run)


@pytest.mark.torch_path
def test_a_step_that_copies_its_state_is_not_graphed(stand_in, monkeypatch):
    lm = _gpt("gpt2")
    step = lm.generation_step

    def copying(token_ids, state, constants, index):
        logits, new = step(token_ids, state, constants, index)
        return logits, keras.tree.map_structure(keras.ops.copy, new)

    monkeypatch.setattr(lm, "generation_step", copying)
    prompts = [[5, 6, 7], [8]]
    tokens = lm.generate(prompts, max_new_tokens=6)
    assert stand_in.built == 0 and stand_in.replays == 0
    assert tokens == _without_graphs(monkeypatch, lambda: lm.generate(prompts,
                                                                      max_new_tokens=6))


@pytest.mark.torch_path
def test_a_failed_capture_warns_and_decodes_without_graphs(stand_in, monkeypatch):
    class Broken(ReplayedStep):
        def _capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(generation, "GRAPH_CLASS", Broken)
    lm = _gpt("gpt2")
    prompts = [[5, 6, 7], [8]]
    if TORCH:
        with pytest.warns(UserWarning, match=r"no CUDA graph for GPTCausalLM.*not permitted"
                                             r".*KZOO_CUDA_GRAPHS=0"):
            tokens = lm.generate(prompts, max_new_tokens=6)
    else:
        tokens = lm.generate(prompts, max_new_tokens=6)  # (never tried: no warning)
    assert tokens == _without_graphs(monkeypatch, lambda: lm.generate(prompts,
                                                                      max_new_tokens=6))


def test_where_graphs_are_tried(monkeypatch):
    """Only inside the torch loop's fast-path block, with CUDA, the fast path on, no tap and
    the variable not "0"; `compile=False` (the debugging loop) and one new token never; on
    JAX and TensorFlow never."""
    from kzoo.layers.taps import Tap

    assert not generation.graphs_apply()  # outside the loop
    with fast_decode.fast_steps(), _no_grad():
        assert generation.graphs_apply() == (TORCH and generation._cuda_available())
        monkeypatch.setattr(generation, "_cuda_available", lambda: True)
        assert generation.graphs_apply() == TORCH
        monkeypatch.setenv(generation.GRAPHS_ENV, "0")
        assert not generation.graphs_apply()
        monkeypatch.delenv(generation.GRAPHS_ENV)
        monkeypatch.setenv("KZOO_FAST_DECODE", "0")
        assert not generation.graphs_apply()
        monkeypatch.delenv("KZOO_FAST_DECODE")
        with Tap():
            assert not generation.graphs_apply()
    tried = []
    monkeypatch.setattr(generation, "_graphed_step", lambda *a: tried.append(1))
    lm = _gpt("gpt2")
    lm.generate([[5, 6]], max_new_tokens=4, compile=False)
    lm.generate([[5, 6]], max_new_tokens=1)
    assert tried == []
    assert len(lm.generate([[5, 6]], max_new_tokens=4)[0]) == 4
    assert tried == [1] * GRAPHS


def _no_grad():
    if not TORCH:
        import contextlib

        return contextlib.nullcontext()
    import torch

    return torch.no_grad()
