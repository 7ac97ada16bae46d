"""`python -m kzoo.interpret SOURCE --text "..." | --ids 1,2,3 | --image FILE --out DIR`.

Loads SOURCE (a preset name, a saved kzoo directory, a `.keras` file or a Hugging Face
directory: anything `kzoo.presets.load` takes), runs one input through it and writes, into
DIR:

- `attention_<stack>_layer<L>.png`: every head of each layer as a heatmap, token labels on
  both axes (stack: `self`, or `encoder` / `decoder` / `cross` for T5);
- `head_view.html`: one self-contained page (no network) to pick a layer and a head and hover
  tokens to see their attention;
- `entropy.csv`: the mean attention entropy (nats) of every layer and head, real queries only;
- `rollout.png` (ViT): the class token's attention rollout laid over the image.

It prints where each file is. Each file is written to a temporary name and renamed into
place, so a crash (a full disk, Ctrl-C) leaves no truncated file behind. Text needs a tokenizer: the one saved with the model (a Hugging
Face directory's, or `tokenizer.json` next to the model or in the run directory above it, as
the training recipes write it); otherwise pass token ids with `--ids`. `--target` is a T5's
decoder text (its decoder otherwise gets only the start token); it is refused for every other
family, which has no decoder input (a GPT would read it as more context: put it in `--text`).

Example:
    python -m kzoo.interpret runs/demo/model --text "The old man said" --out runs/demo/attention
"""

import argparse
import csv
import os
import sys

import numpy as np

TEXT_FAMILIES = ("gpt", "bert", "t5")
MAX_TOKENS = 128


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m kzoo.interpret",
        description="Attention heatmaps, an HTML head view and attention entropy of one input.")
    p.add_argument("source", help="preset name, saved model directory, .keras file or "
                                  "Hugging Face directory")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--text", help="input text (BERT, GPT, T5; needs a tokenizer)")
    given.add_argument("--ids", help="comma-separated token ids (BERT, GPT, T5)")
    given.add_argument("--image", help="image file (PNG/JPEG, read with matplotlib) or .npy "
                                       "array, values in [0, 1] (integer pixels are scaled "
                                       "by their type's range, 0..255 for 8 bits) (ViT)")
    p.add_argument("--target", help="T5 only: decoder text (default: only the start "
                                    "token); refused for other models")
    p.add_argument("--out", required=True, help="directory for the PNGs, HTML and CSV")
    return p


def _tokenizer_for(source, model):
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    if not os.path.isdir(source):
        return None
    for directory in (source, os.path.dirname(os.path.abspath(source))):
        path = os.path.join(directory, "tokenizer.json")
        if os.path.isfile(path):
            import tokenizers

            return tokenizers.Tokenizer.from_file(path)
    return None


def _ids(args, source, model, text, option="--text"):
    """Token ids (int32 array) and their labels for `text` (or `--ids`); `option` names
    where `text` came from (`--text` or `--target`) in errors."""
    tokenizer = _tokenizer_for(source, model)
    if args.ids is not None and text is args.text:
        try:
            ids = [int(piece) for piece in args.ids.split(",") if piece.strip()]
        except ValueError:
            raise ValueError(f"`--ids` must be comma-separated integers; got {args.ids!r}.")
    else:
        if tokenizer is None:
            # (--target is text only: the decoder then gets just the start token)
            remedy = ("pass token ids with --ids instead of --text" if option == "--text"
                      else "leave --target out (the decoder gets only the start token)")
            raise ValueError(
                f"No tokenizer was found for {source!r} (none saved with the model, no "
                f"tokenizer.json beside it), and `{option}` {text!r} is text: {remedy}.")
        ids = list(tokenizer.encode(text).ids)
    if not ids:
        raise ValueError("The input has no tokens: give a non-empty --text or --ids.")
    if len(ids) > MAX_TOKENS:
        raise ValueError(f"The input has {len(ids)} tokens; at most {MAX_TOKENS} make "
                         "readable pictures: shorten it.")
    if tokenizer is not None:
        labels = [tokenizer.id_to_token(i) or str(i) for i in ids]
    else:
        labels = [str(i) for i in ids]
    return np.asarray(ids, "int32")[None], labels


def _image(path, backbone):
    import keras

    if not os.path.isfile(path):
        raise ValueError(f"`--image` {path!r} is not a file.")
    try:
        if path.endswith(".npy"):
            image = np.load(path, allow_pickle=False)
        else:
            import matplotlib.image

            image = np.asarray(matplotlib.image.imread(path))
        # Integer pixels (matplotlib reads a JPEG as uint8 0..255, a PNG as floats in
        # [0, 1]) are scaled to [0, 1] by their type's range.
        scale = np.iinfo(image.dtype).max if image.dtype.kind in "iu" else 1.0
        image = image.astype("float32") / np.float32(scale)
    except (OSError, SyntaxError, ValueError, TypeError) as error:  # (PIL: SyntaxError)
        raise ValueError(
            f"`--image` {path!r} could not be read as a PNG/JPEG image or a .npy array of "
            f"numbers: {error}") from None
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3:
        raise ValueError(f"`--image` must be a (height, width[, channels]) image; "
                         f"{path!r} has shape {image.shape}.")
    channels = backbone.num_channels
    if image.shape[-1] == 4:  # drop alpha
        image = image[..., :3]
    if image.shape[-1] != channels:
        image = (image.mean(-1, keepdims=True) if channels == 1
                 else np.repeat(image[..., :1], channels, axis=-1))
    size = backbone.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    resized = keras.ops.image.resize(image[None], size, interpolation="bilinear")
    return np.asarray(keras.ops.convert_to_numpy(resized), "float32")


def _inputs(args, family, model):
    """(model inputs, labels: {stack: tokens for head_view/plots}, padding mask, image)."""
    from kzoo.interpret.maps import _backbone_of

    if args.target is not None and family != "t5":
        # (was silently ignored: the maps were those of --text alone.) A GPT would only read
        # the target as more context and a BERT pair needs its segments: neither is a
        # decoder input, so the whole input belongs in --text / --ids.
        raise ValueError(
            f"`--target` is the decoder text of a T5 (encoder-decoder) model; this is a "
            f"{family} model, which has no decoder to feed it: got --target "
            f"{args.target!r}. Leave --target out and put the whole input in "
            + ("--image." if family == "vit" else "--text (or --ids)."))
    if family in TEXT_FAMILIES and args.image is not None:
        raise ValueError(f"A {family} model reads text: pass --text or --ids, not --image.")
    if family == "vit":
        if args.image is None:
            raise ValueError("A ViT model reads images: pass --image FILE.")
        images = _image(args.image, _backbone_of(model))
        return {"images": images} if _takes_dict(model) else images, None, None, images[0]
    if family not in TEXT_FAMILIES:
        raise ValueError(f"`python -m kzoo.interpret` reads text (BERT, GPT, T5) or images "
                         f"(ViT); for a {family} model call kzoo.interpret.attention_maps "
                         "from Python with its graph inputs.")
    ids, labels = _ids(args, args.source, model, args.text)
    ones = np.ones_like(ids)
    if family == "gpt":
        return {"token_ids": ids, "padding_mask": ones}, {"self": labels}, ones, None
    if family == "bert":
        return ({"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": ones},
                {"self": labels}, ones, None)
    # T5: the decoder starts from the start token (id 0), then the --target text if any.
    decoder = np.zeros((1, 1), "int32")
    decoder_labels = ["<start>"]
    if args.target is not None:
        if not args.target.strip():
            # (was silently the same as leaving --target out)
            raise ValueError(
                f"`--target` is empty (got --target {args.target!r}): give the decoder text, "
                "or leave --target out for a decoder that gets only the start token.")
        target, target_labels = _ids(args, args.source, model, args.target,
                                     option="--target")
        decoder = np.concatenate([decoder, target], axis=1)
        decoder_labels += target_labels
    inputs = {"encoder_token_ids": ids, "encoder_padding_mask": ones,
              "decoder_token_ids": decoder, "decoder_padding_mask": np.ones_like(decoder)}
    return inputs, {"encoder": labels, "decoder": decoder_labels,
                    "cross": (decoder_labels, labels)}, None, None


def _write_atomically(path, write):
    """`write(tmp)` to a temporary file beside `path`, then renamed onto it: a crash (a full
    disk, Ctrl-C) leaves no truncated file under the final name, and no temporary one."""
    tmp = f"{path}.tmp-{os.getpid()}{os.path.splitext(path)[1]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def _write_entropy_csv(tmp, maps, padding_mask):
    from kzoo.interpret import attention_entropy

    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["stack", "layer", "head", "mean_entropy_nats"])
        for stack, layers in maps.items():
            mask = padding_mask if stack in ("self", "encoder") else None
            result = attention_entropy(layers, padding_mask=mask)
            per_head = np.asarray(result["per_head"] if isinstance(result, dict)
                                  else result.per_head)
            for layer in range(per_head.shape[0]):
                for head in range(per_head.shape[1]):
                    writer.writerow([stack, layer, head, f"{per_head[layer, head]:.6f}"])


def _takes_dict(model):
    return isinstance(model.input, dict)


def main(argv=None):
    args = _parser().parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"`--out` {args.out!r} exists and is not a directory.")
    import kzoo

    kzoo.presets._check_writable_directory(args.out, "--out")  # (before the model loads)
    from kzoo.interpret import (attention_maps, attention_rollout, head_view_html,
                                plot_attention, plot_rollout)

    model = kzoo.presets.load(args.source)
    family = kzoo.registry.for_model(model).name
    inputs, labels, padding_mask, image = _inputs(args, family, model)
    maps = attention_maps(model, inputs)
    os.makedirs(args.out, exist_ok=True)
    written = []

    for stack, layers in maps.items():
        tokens = labels.get(stack) if labels else None
        for index in range(len(layers)):
            figure = plot_attention(maps, tokens, layer=index, head=None, stack=stack,
                                    title=f"{family} {stack} attention, layer {index}")
            path = os.path.join(args.out, f"attention_{stack}_layer{index}.png")
            _write_atomically(path, lambda tmp: figure.savefig(tmp, format="png"))
            written.append(path)

    if labels:
        stack = "self" if "self" in maps else "encoder"
        path = os.path.join(args.out, "head_view.html")
        page = head_view_html(
            maps, labels[stack], stack=stack,
            title=f"{os.path.basename(os.path.normpath(args.source))}: {stack} attention")

        def write_page(tmp):
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(page)

        _write_atomically(path, write_page)
        written.append(path)

    path = os.path.join(args.out, "entropy.csv")
    _write_atomically(path, lambda tmp: _write_entropy_csv(tmp, maps, padding_mask))
    written.append(path)

    if family == "vit":
        rollout = attention_rollout(maps["self"])
        figure = plot_rollout(rollout, image, title="class-token attention rollout")
        path = os.path.join(args.out, "rollout.png")
        _write_atomically(path, lambda tmp: figure.savefig(tmp, format="png"))
        written.append(path)

    print(f"Wrote {len(written)} files for {args.source!r} ({family}):")
    for path in written:
        print(f"  {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
