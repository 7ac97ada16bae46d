"""Pictures of attention: heatmaps of a layer's heads, and a ViT rollout laid over its image.

Both functions return a `matplotlib.figure.Figure` drawn on the Agg canvas (no window, no
pyplot state): save it with `figure.savefig("attention.png")`. matplotlib is imported only
when a function here is called (`pip install 'kzoo[interpret]'`).

Example:
>>> maps = kzoo.interpret.attention_maps(model, inputs)
>>> plot_attention(maps, tokens=["The", "cat", "sat"], layer=1).savefig("heads.png")
"""

import math

import numpy as np

from kzoo.interpret.analysis import STACKS, _as_stack, _to_numpy


def _matplotlib():
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kzoo.interpret's pictures need matplotlib: pip install 'kzoo[interpret]' "
            "(or 'kzoo[data]', or matplotlib>=3.7).") from error
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def new_figure(**kwargs):
        figure = Figure(**kwargs)
        FigureCanvasAgg(figure)
        return figure

    return matplotlib, new_figure


# === Choosing one layer of one example ===

def _check_index(name, value, size, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            not 0 <= value < size:
        raise ValueError(f"`{name}`={value!r} is out of range: {what} has {size} (0..{size - 1}).")
    return int(value)


def select_map(maps, layer=0, batch=0, stack=None):
    """One example's maps of one layer, `(heads, query, key)` float64.

    `maps` is a dict of attention maps (pick the entry with `stack`; default "self", else
    "encoder"), a list of layers `(batch, heads, query, key)`, or one array: `(query, key)`,
    `(heads, query, key)` or `(batch, heads, query, key)` (then `layer` must be 0).
    """
    if isinstance(maps, dict):
        if stack is None:
            stack = next((key for key in ("self", "encoder", "decoder", "cross") if key in maps),
                         None)
        if stack not in maps:
            raise ValueError(
                f"`stack`={stack!r} is not in the maps; they hold {sorted(maps)} "
                f"(allowed stacks: {list(STACKS)}).")
        maps = maps[stack]
    elif stack is not None:
        raise ValueError(f"`stack`={stack!r} applies to a dict of maps only; got a "
                         f"{type(maps).__name__}.")
    if not isinstance(maps, (list, tuple)):
        array = np.asarray(_to_numpy(maps), dtype=np.float64)
        if array.ndim not in (2, 3, 4):
            raise ValueError(
                f"`maps` as one array must have rank 2 (query, key), 3 (heads, query, key) or "
                f"4 (batch, heads, query, key); got shape {array.shape} (rank {array.ndim}).")
        while array.ndim < 4:
            array = array[None]
        maps = [array]
    layers = _as_stack(maps)
    layer = _check_index("layer", layer, len(layers), "the maps' layer count")
    batch = _check_index("batch", batch, layers[layer].shape[0], "the maps' batch size")
    return layers[layer][batch]


def split_tokens(tokens, queries, keys):
    """(query_tokens, key_tokens) as lists of str, checked against the map's shape. `tokens`
    is one sequence (self-attention) or a pair of sequences (cross-attention); None gives
    position numbers."""
    if tokens is None:
        return [str(i) for i in range(queries)], [str(j) for j in range(keys)]
    if isinstance(tokens, tuple) and len(tokens) == 2 and not isinstance(tokens[0], str):
        query_tokens, key_tokens = list(tokens[0]), list(tokens[1])
    elif isinstance(tokens, str):
        raise ValueError(f"`tokens` must be a list of strings, one a position; got the string "
                         f"{tokens[:40]!r}.")
    else:
        query_tokens = key_tokens = list(tokens)
    if len(query_tokens) != queries or len(key_tokens) != keys:
        raise ValueError(
            f"`tokens` must have one entry a position: the map has {queries} queries and {keys} "
            f"keys; got {len(query_tokens)} query token(s) and {len(key_tokens)} key token(s).")
    return [str(t) for t in query_tokens], [str(t) for t in key_tokens]


# === Heatmaps ===

def plot_attention(maps_or_array, tokens=None, layer=0, head=None, *, batch=0, stack=None,
                   cmap="viridis", figsize=None, dpi=100, title=None):
    """Heatmap of attention weights: one head, or a grid of every head of a layer.

    Rows are queries (the token that looks), columns keys (the tokens looked at); a row of a
    real query sums to 1. Token labels go on both axes.

    Args:
        maps_or_array: a dict of attention maps (`attention_maps`' output), a list of layers
            `(batch, heads, query, key)`, or one array `(query, key)`, `(heads, query, key)`
            or `(batch, heads, query, key)`.
        tokens: the token strings, one a position (a pair `(query_tokens, key_tokens)` for
            cross-attention); None labels positions with numbers.
        layer: the layer to draw (0 for a single array).
        head: the head to draw; None draws every head of the layer in a grid.
        batch: which example of the batch.
        stack: for a dict of maps, "self", "encoder", "decoder" or "cross" (default "self",
            else "encoder").
        cmap: a matplotlib colour map name.
        figsize: `(width, height)` in inches; default grows with the number of heads.
        dpi: the figure's dots per inch (the saved PNG is `figsize * dpi` pixels).
        title: a title over the figure; default names the layer (and head).

    Returns:
        a `matplotlib.figure.Figure`.

    Example:
    >>> figure = plot_attention(maps, tokens=["a", "b", "c"], layer=0, head=1)
    >>> figure.savefig("layer0_head1.png")
    """
    _, new_figure = _matplotlib()
    weights = select_map(maps_or_array, layer, batch, stack)
    heads, queries, keys = weights.shape
    query_tokens, key_tokens = split_tokens(tokens, queries, keys)
    if head is not None:
        head = _check_index("head", head, heads, "the layer's head count")
        chosen = [head]
    else:
        chosen = list(range(heads))
    columns = math.ceil(math.sqrt(len(chosen)))
    rows = math.ceil(len(chosen) / columns)
    if figsize is None:
        side = 2.0 + 0.22 * max(queries, keys)
        figsize = (min(side * columns, 24.0), min(side * rows + 0.5, 24.0))
    figure = new_figure(figsize=figsize, dpi=dpi, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    image = None
    for slot, ax in enumerate(axes.flat):
        if slot >= len(chosen):
            ax.set_axis_off()
            continue
        h = chosen[slot]
        image = ax.imshow(weights[h], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        small = 7 if max(queries, keys) <= 24 else 5
        ax.set_xticks(range(keys), key_tokens, rotation=90, fontsize=small)
        ax.set_yticks(range(queries), query_tokens, fontsize=small)
        if slot % columns == 0:
            ax.set_ylabel("query")
        if slot // columns == rows - 1:
            ax.set_xlabel("key")
    figure.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    figure.suptitle(title if title is not None else
                    f"layer {layer}" + (f", head {head}" if head is not None else ", all heads"))
    return figure


# === Rollout over an image ===

def _upsample(grid_values, height, width):
    """Bilinear resize of a 2-D array to (height, width), sampling at pixel centres."""
    rows, columns = grid_values.shape

    def coords(n_out, n_in):
        return np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)

    y, x = coords(height, rows), coords(width, columns)
    along_x = np.stack([np.interp(x, np.arange(columns), row) for row in grid_values])
    return np.stack([np.interp(y, np.arange(rows), col) for col in along_x.T], axis=1)


def rollout_heatmap(rollout, image_size, patch_grid=None, *, token=0, num_prefix=1, batch=0):
    """The share of each patch in `token`'s rollout, as an image-sized array in [0, 1].

    Row `token` of the rollout (the class token by default), without the `num_prefix` prefix
    columns, is reshaped to the patch grid (row-major, as ViT cuts patches), scaled so that
    its largest value is 1, and resized bilinearly to `image_size` `(height, width)`.
    """
    rollout = _rollout_array(rollout, batch)
    seq = rollout.shape[-1]
    token = _check_index("token", token, seq, "the rollout's token count")
    if isinstance(num_prefix, bool) or not isinstance(num_prefix, int) or \
            not 0 <= num_prefix < seq:
        raise ValueError(f"`num_prefix`={num_prefix!r} must be an integer in 0..{seq - 1}.")
    patches = rollout[token, num_prefix:]
    if patch_grid is None:
        side = math.isqrt(patches.size)
        if side * side != patches.size:
            raise ValueError(
                f"`patch_grid`=None needs a square number of patches; the rollout has "
                f"{patches.size} (= {seq} tokens - num_prefix {num_prefix}): pass "
                "patch_grid=(rows, columns).")
        patch_grid = (side, side)
    patch_grid = tuple(patch_grid)
    if len(patch_grid) != 2 or patch_grid[0] * patch_grid[1] != patches.size:
        raise ValueError(
            f"`patch_grid`={patch_grid!r} must be (rows, columns) with rows * columns = "
            f"{patches.size} patches ({seq} tokens - num_prefix {num_prefix}).")
    grid = patches.reshape(patch_grid)
    top = grid.max()
    grid = grid / top if top > 0 else grid
    return _upsample(grid, *image_size)


def _rollout_array(rollout, batch):
    if isinstance(rollout, dict):
        if "self" not in rollout:
            raise ValueError(f"`rollout` as a dict needs a 'self' entry; it has {sorted(rollout)}.")
        rollout = rollout["self"]
    rollout = np.asarray(_to_numpy(rollout), dtype=np.float64)
    if rollout.ndim == 2:
        rollout = rollout[None]
    if rollout.ndim != 3 or rollout.shape[1] != rollout.shape[2]:
        raise ValueError(
            f"`rollout` must be (batch, seq, seq) or (seq, seq) as attention_rollout returns; "
            f"got shape {rollout.shape}.")
    batch = _check_index("batch", batch, rollout.shape[0], "the rollout's batch size")
    return rollout[batch]


def _display_image(image, batch):
    image = np.asarray(_to_numpy(image))
    if image.ndim == 4:
        batch = _check_index("batch", batch, image.shape[0], "the image batch size")
        image = image[batch]
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] not in (3, 4)):
        raise ValueError(
            f"`image` must be (height, width), (height, width, 1|3|4) or a batch of those; got "
            f"shape {image.shape}.")
    image = image.astype(np.float64)
    low, high = np.nanmin(image), np.nanmax(image)
    return (image - low) / (high - low) if high > low else np.zeros_like(image)


def plot_rollout(rollout, image, patch_grid=None, *, token=0, num_prefix=1, batch=0, alpha=0.5,
                 cmap="jet", figsize=(6.0, 3.2), dpi=100, title=None):
    """A ViT's attention rollout laid over its input image.

    Draws two panels: the image, and the image with `token`'s rollout over the patches (the
    class token by default: row 0 of the rollout, without the class column) reshaped to the
    patch grid, resized bilinearly to the image and blended in with `alpha`.

    Args:
        rollout: `attention_rollout`'s output for the image: `(batch, seq, seq)`,
            `(seq, seq)`, or its dict (the "self" entry is used).
        image: the image the model saw: `(height, width)`, `(height, width, channels)` or a
            batch of them (any value range: it is scaled to [0, 1] for display).
        patch_grid: `(rows, columns)` of patches; None for a square grid.
        token: the row of the rollout to show (0 = class token).
        num_prefix: leading non-patch tokens (1 for the class token, 0 without one).
        batch: which example of a batch.
        alpha: opacity of the rollout layer, in [0, 1].
        cmap: a matplotlib colour map name for the rollout.
        figsize, dpi: the figure's size in inches and dots per inch.
        title: a title over the figure.

    Returns:
        a `matplotlib.figure.Figure`.

    Example:
    >>> rollout = attention_rollout(attention_maps(vit, images))
    >>> plot_rollout(rollout, images, patch_grid=(4, 4)).savefig("rollout.png")
    """
    _, new_figure = _matplotlib()
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"`alpha`={alpha!r} must be a number in [0, 1].")
    shown = _display_image(image, batch)
    heat = rollout_heatmap(rollout, shown.shape[:2], patch_grid, token=token,
                           num_prefix=num_prefix, batch=batch)
    figure = new_figure(figsize=figsize, dpi=dpi, layout="constrained")
    left, right = figure.subplots(1, 2)
    gray = "gray" if shown.ndim == 2 else None
    for ax in (left, right):
        ax.imshow(shown, cmap=gray, interpolation="nearest")
        ax.set_axis_off()
    overlay = right.imshow(heat, cmap=cmap, alpha=alpha, vmin=0.0, vmax=1.0,
                           interpolation="nearest")
    left.set_title("image", fontsize=9)
    right.set_title(f"rollout of token {token}", fontsize=9)
    figure.colorbar(overlay, ax=right, shrink=0.8, label="share (max = 1)")
    if title is not None:
        figure.suptitle(title)
    return figure
