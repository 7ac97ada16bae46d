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
    document_mask,
    document_positions,
    merge_masks,
    normalize_mask,
    padding_mask,
    sliding_window_mask,
)
from kzoo.layers.attention import MultiHeadAttention  # noqa: F401,E402
from kzoo.layers.blocks import TransformerBlock  # noqa: F401,E402
from kzoo.layers.embedding import PatchEmbedding, TokenEmbedding  # noqa: F401,E402
from kzoo.layers.feedforward import FeedForward, GatedFeedForward, get_activation  # noqa: F401,E402
from kzoo.layers.moe import MixtureOfExperts  # noqa: F401,E402
from kzoo.layers.norm import LayerNorm, RMSNorm  # noqa: F401,E402
from kzoo.layers.position import (  # noqa: F401,E402
    ALiBiBias,
    PositionEmbedding,
    RelativePositionBias,
    RotaryEmbedding,
    SinusoidalPositionEncoding,
    alibi_slopes,
    relative_position_bucket,
)
from kzoo.layers.taps import AttentionRecord, BlockRecord, Tap, active_tap  # noqa: F401,E402
from kzoo.layers.sparse_attention import (  # noqa: F401,E402
    bigbird_attention,
    bigbird_layout,
    block_sparse_attention,
    longformer_attention,
    sliding_window_attention,
    strided_attention,
)
from kzoo.layers.linear_attention import (  # noqa: F401,E402
    feature_map_features,
    linear_attention,
    linear_attention_state,
    linear_attention_step,
    random_projection,
)
