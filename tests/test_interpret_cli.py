"""`python -m kzoo.interpret`: the files it writes for a GPT (text through the tokenizer saved
beside the model), a T5 (token ids) and a ViT (an image), and its errors.

Entropy in the CSV is checked against the NumPy formula on the maps of
`kzoo.interpret.attention_maps` (which tests/test_interpret_maps.py checks against
transformers)."""

import csv
import os

import matplotlib.image
import numpy as np
import pytest

import kzoo
from kzoo.interpret.__main__ import main

TEXT = "the cat sat on the mat. the dog sat on the log. a cat and a dog met on a mat. " * 20


def _png_ok(path):
    picture = matplotlib.image.imread(path)
    assert picture.ndim == 3 and min(picture.shape[:2]) > 50, path
    assert picture[..., :3].std() > 0.02, f"{path} is blank"


def _entropy_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _numpy_mean_entropy(layer_map):
    """(heads,) mean over queries of -sum p log p, one example, no padding."""
    p = np.asarray(layer_map, "float64")[0]
    terms = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(-1).mean(-1)


def test_gpt_text_through_its_saved_tokenizer(tmp_path, capsys):
    tokenizer = kzoo.data.train_bpe_tokenizer(TEXT, 280, special_tokens=("[PAD]",),
                                              min_frequency=1)
    model = kzoo.presets.load("gpt_mini", num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, vocabulary_size=tokenizer.get_vocab_size(),
                              max_sequence_length=32)
    source = str(tmp_path / "model")
    kzoo.presets.save(model, source)
    tokenizer.save(os.path.join(source, "tokenizer.json"))
    out = str(tmp_path / "out")
    assert main([source, "--text", "the cat sat on the log", "--out", out]) == 0
    printed = capsys.readouterr().out
    names = ["attention_self_layer0.png", "attention_self_layer1.png", "head_view.html",
             "entropy.csv"]
    assert sorted(os.listdir(out)) == sorted(names)
    for name in names:
        assert os.path.relpath(os.path.join(out, name)) in printed
    for name in names[:2]:
        _png_ok(os.path.join(out, name))
    with open(os.path.join(out, "head_view.html"), encoding="utf-8") as f:
        html = f.read()
    assert "http://" not in html and "https://" not in html
    ids = np.asarray(tokenizer.encode("the cat sat on the log").ids, "int32")[None]
    maps = kzoo.interpret.attention_maps(
        kzoo.presets.load(source), {"token_ids": ids, "padding_mask": np.ones_like(ids)})
    rows = _entropy_rows(os.path.join(out, "entropy.csv"))
    assert [(r["stack"], int(r["layer"]), int(r["head"])) for r in rows] == [
        ("self", layer, head) for layer in range(2) for head in range(2)]
    for row in rows:
        expected = _numpy_mean_entropy(maps["self"][int(row["layer"])])[int(row["head"])]
        assert abs(float(row["mean_entropy_nats"]) - expected) < 1e-5


def test_t5_ids_give_encoder_decoder_and_cross_maps(tmp_path):
    model = kzoo.presets.load("t5_small", num_layers=1, num_decoder_layers=1, num_heads=2,
                              hidden_dim=16, key_value_dim=8, intermediate_dim=32,
                              vocabulary_size=50)
    source = str(tmp_path / "t5")
    kzoo.presets.save(model, source)
    out = str(tmp_path / "out")
    assert main([source, "--ids", "5,6,7,8,1", "--out", out]) == 0
    assert sorted(os.listdir(out)) == sorted([
        "attention_encoder_layer0.png", "attention_decoder_layer0.png",
        "attention_cross_layer0.png", "head_view.html", "entropy.csv"])
    stacks = {r["stack"] for r in _entropy_rows(os.path.join(out, "entropy.csv"))}
    assert stacks == {"encoder", "decoder", "cross"}


def test_t5_target_text_without_a_tokenizer_names_target(tmp_path):
    # (was "pass token ids with --ids instead of --text" to a user who had passed --ids and
    # --target: --target is the text that needed the tokenizer)
    model = kzoo.presets.load("t5_small", num_layers=1, num_decoder_layers=1, num_heads=2,
                              hidden_dim=16, key_value_dim=8, intermediate_dim=32,
                              vocabulary_size=50)
    source = str(tmp_path / "t5")
    kzoo.presets.save(model, source)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"No tokenizer was found for .*t5'.*`--target` "
                                         r"'le chat' is text"):
        main([source, "--ids", "5,6,7", "--target", "le chat", "--out", out])
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match=r"`--text` 'the cat' is text.*--ids instead of --text"):
        main([source, "--text", "the cat", "--out", out])
    # (an empty --target was silently the same as none)
    with pytest.raises(ValueError, match=r"`--target` is empty \(got --target ''\)"):
        main([source, "--ids", "5,6,7", "--target", "", "--out", out])
    assert not os.path.exists(out)


@pytest.mark.spread
def test_vit_image_gets_a_rollout_picture(tmp_path):
    model = kzoo.presets.load("vit_tiny_patch16_224", image_size=8, patch_size=2,
                              num_channels=1, num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, num_classes=3)
    source = str(tmp_path / "vit.keras")
    model.save(source)
    image = np.zeros((8, 8), "float32")
    image[2:6, 3:5] = 1.0
    np.save(tmp_path / "digit.npy", image)
    out = str(tmp_path / "out")
    assert main([source, "--image", str(tmp_path / "digit.npy"), "--out", out]) == 0
    assert sorted(os.listdir(out)) == sorted([
        "attention_self_layer0.png", "attention_self_layer1.png", "entropy.csv",
        "rollout.png"])
    _png_ok(os.path.join(out, "rollout.png"))


def test_an_8_bit_jpeg_is_read_in_0_1_like_a_png(tmp_path):
    # matplotlib reads a JPEG as uint8 0..255 (a PNG as floats in [0, 1]); the CLI fed the
    # 0..255 values to the model, so a JPEG's maps and entropies were those of an image 255
    # times too bright (the scaling to [0, 1] sat in dead code after a `raise`).
    from PIL import Image

    from kzoo.interpret import attention_maps

    model = kzoo.presets.load("vit_tiny_patch16_224", image_size=8, patch_size=2,
                              num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
                              num_classes=3)
    source = str(tmp_path / "vit.keras")
    model.save(source)
    pixels = (np.random.RandomState(0).rand(8, 8, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(tmp_path / "photo.jpg", quality=95)
    decoded = np.asarray(Image.open(tmp_path / "photo.jpg"), "float32") / 255.0
    out = str(tmp_path / "out")
    assert main([source, "--image", str(tmp_path / "photo.jpg"), "--out", out]) == 0
    maps = attention_maps(model, decoded[None])["self"]
    rows = _entropy_rows(os.path.join(out, "entropy.csv"))
    assert len(rows) == 2
    expected = _numpy_mean_entropy(maps[0])
    for row in rows:
        assert abs(float(row["mean_entropy_nats"]) - expected[int(row["head"])]) < 1e-5, row


def test_an_image_that_cannot_be_read_is_named(tmp_path):
    model = kzoo.presets.load("vit_tiny_patch16_224", image_size=8, patch_size=2,
                              num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
                              num_classes=3)
    source = str(tmp_path / "vit.keras")
    model.save(source)
    (tmp_path / "bad.png").write_text("not an image")
    (tmp_path / "bad.npy").write_text("not an array")
    for name in ("bad.png", "bad.npy"):
        with pytest.raises(ValueError, match=f"`--image` .*{name}' could not be read"):
            main([source, "--image", str(tmp_path / name), "--out", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out")


def test_a_crash_while_writing_leaves_no_partial_file(tmp_path, monkeypatch):
    # (each file was written in place: a crash or a full disk in savefig or in the CSV's
    # rows left a truncated PNG, or an entropy.csv with its header only, under the final
    # name, which a later reader took for a complete result)
    import matplotlib.figure

    import kzoo.interpret

    model = kzoo.presets.load("gpt_mini", num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, vocabulary_size=40, max_sequence_length=16)
    source = str(tmp_path / "model")
    kzoo.presets.save(model, source)
    out = tmp_path / "out"
    savefig = matplotlib.figure.Figure.savefig

    def full_disk(self, fname, *args, **kwargs):
        if "layer1" in os.fspath(fname):
            with open(fname, "wb") as f:
                f.write(b"\x89PNG\r\n")  # the first bytes, then the disk is full
            raise OSError(28, "No space left on device")
        return savefig(self, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main([source, "--ids", "1,2,3", "--out", str(out)])
    assert sorted(os.listdir(out)) == ["attention_self_layer0.png"]
    _png_ok(str(out / "attention_self_layer0.png"))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)

    entropy = kzoo.interpret.attention_entropy

    def interrupted(layers, padding_mask=None):  # Ctrl-C while the rows are written
        raise KeyboardInterrupt

    monkeypatch.setattr(kzoo.interpret, "attention_entropy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main([source, "--ids", "1,2,3", "--out", str(out)])
    assert "entropy.csv" not in os.listdir(out), "a CSV with its header only was left"
    assert not [name for name in os.listdir(out) if "tmp" in name], os.listdir(out)
    monkeypatch.setattr(kzoo.interpret, "attention_entropy", entropy)
    assert main([source, "--ids", "1,2,3", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == sorted([
        "attention_self_layer0.png", "attention_self_layer1.png", "head_view.html",
        "entropy.csv"])


def test_errors_name_the_option(tmp_path):
    model = kzoo.presets.load("gpt_mini", num_layers=1, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, vocabulary_size=40, max_sequence_length=16)
    source = str(tmp_path / "model")
    kzoo.presets.save(model, source)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="--ids"):
        main([source, "--text", "no tokenizer here", "--out", out])
    with pytest.raises(ValueError, match="--text or --ids, not --image"):
        main([source, "--image", "x.png", "--out", out])
    with pytest.raises(ValueError, match="comma-separated integers"):
        main([source, "--ids", "1,two", "--out", out])
    with pytest.raises(ValueError, match=r"holds id 40 at batch row 0, token 1; .*\[0, 40\)"):
        main([source, "--ids", "1,40", "--out", out])  # the model's id check, every backend
    with pytest.raises(ValueError, match=r"holds id -2 at batch row 0, token 0"):
        main([source, "--ids=-2,1", "--out", out])
    assert not os.path.exists(out)  # nothing written for refused ids
    taken = tmp_path / "a_file"
    taken.write_text("x")
    with pytest.raises(ValueError, match=r"`--out` .*a_file' exists and is not a directory"):
        main([source, "--ids", "1,2", "--out", str(taken)])
    # (was a FileNotFoundError from os.makedirs after the maps were computed)
    with pytest.raises(ValueError, match=r"--out must be a directory that can be made or "
                                         r"written in; .*'/proc/self' is not writable"):
        main([source, "--ids", "1,2", "--out", "/proc/self/kzoo_maps"])
    with pytest.raises(SystemExit):  # argparse: --out is required
        main([source, "--ids", "1,2"])


def test_target_is_refused_for_a_model_without_a_decoder(tmp_path):
    # (--target was silently ignored for GPT, BERT and ViT: the maps were those of --text
    # alone, as if no target had been given)
    gpt = kzoo.presets.load("gpt_mini", num_layers=1, num_heads=2, hidden_dim=16,
                            intermediate_dim=32, vocabulary_size=40, max_sequence_length=16)
    bert = kzoo.presets.load("bert_tiny_uncased", num_layers=1, num_heads=2,
                             hidden_dim=16, intermediate_dim=32, vocabulary_size=40,
                             max_sequence_length=16)
    for family, model in (("gpt", gpt), ("bert", bert)):
        source = str(tmp_path / family)
        kzoo.presets.save(model, source)
        out = str(tmp_path / f"out_{family}")
        with pytest.raises(ValueError, match=rf"`--target` is the decoder text of a T5 .*"
                                             rf"this is a {family} model.*got --target "
                                             r"'le chat'.*--text \(or --ids\)"):
            main([source, "--ids", "5,6,7", "--target", "le chat", "--out", out])
        assert not os.path.exists(out)
