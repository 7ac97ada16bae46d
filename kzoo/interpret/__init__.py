"""Interpretation tools for every family on every backend.

Attention maps, entropy, rollout and flow, attention x gradient, integrated gradients,
the logit lens, head masking and head importance, pictures (heatmaps, rollout over an image,
a self-contained HTML head view), and attention distillation. Everything here works through
`kzoo.layers.taps`: a forward pass that does not ask for interpretation runs exactly as before.

The names below are imported from their modules when first used, so `import kzoo` stays light
(matplotlib and networkx are imported only by the functions that need them).
"""

import importlib

# public name -> module of this package that defines it
_EXPORTS = {
    # maps.py
    "attention_maps": "maps",
    "masked_heads": "maps",
    # gradients.py
    "attention_gradient": "gradients",
    "integrated_gradients": "gradients",
    "logit_lens": "gradients",
    "head_importance": "gradients",
    # analysis.py
    "attention_entropy": "analysis",
    "attention_rollout": "analysis",
    "attention_flow": "analysis",
    # plots.py / html.py
    "plot_attention": "plots",
    "plot_rollout": "plots",
    "head_view_html": "html",
    # distill.py
    "AttentionDistillationLoss": "distill",
    "AttentionDistiller": "distill",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kzoo.interpret' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kzoo.interpret.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
