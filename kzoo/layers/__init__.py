"""kzoo's shared layers: attention, masks, positional encodings, feed-forwards, MoE, norms."""

from kzoo.layers.kernels import (  # noqa: F401
    KERNELS,
    attention_kernel,
    choose_kernel,
    chunked_attention,
    dot_product_attention,
    fused_attention,
    get_attention_kernel_override,
    reference_attention,
    set_attention_kernel,
)
from kzoo.layers.masks import (  # noqa: F401
    causal_mask,
    merge_masks,
    normalize_mask,
    padding_mask,
    sliding_window_mask,
)
