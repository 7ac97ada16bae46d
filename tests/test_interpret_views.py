"""kzoo.interpret pictures: plot_attention, plot_rollout (matplotlib, Agg) and head_view_html.

The PNG tests read the rendered pixels back and compare them with matplotlib's own colour map
at the cell (or patch) the weights say. The HTML is checked for structure and escaping here,
and in a real headless chromium (`-m browser`, slow) for the lines it draws.
"""

import html.parser
import json
import os
import re
import shutil
import subprocess

import keras
import matplotlib
import matplotlib.image
import numpy as np
import pytest

import kzoo.presets
from kzoo.interpret import attention_rollout, head_view_html, plot_attention, plot_rollout
from kzoo.interpret.html import LINE_COLOR
from kzoo.interpret.plots import rollout_heatmap
from kzoo.layers.taps import Tap

TOKENS = ["</script><script>alert(1)</script>", "cat", "sat", "on", "the", "mat & co"]


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def maps():
    """Two layers, three heads, six tokens; layer 1 head 0 query 3 looks at key 1 only."""
    rng = np.random.default_rng(0)
    layers = [softmax(2.0 * rng.normal(size=(2, 3, 6, 6))) for _ in range(2)]
    layers[1][0, 0, 3] = np.eye(6)[1]
    return {"self": layers}


@pytest.fixture(scope="module")
def vit():
    """A tiny ViT on this backend (16 x 16 images, 4 x 4 patches + a class token), one image,
    and the raw backend tensors a Tap records from it."""
    keras.utils.set_random_seed(3)
    model = kzoo.presets.load("vit_tiny_patch16_224", image_size=16, patch_size=4, num_layers=2,
                              num_heads=2, hidden_dim=16, intermediate_dim=32, num_classes=3)
    image = np.random.default_rng(3).uniform(size=(1, 16, 16, 3)).astype("float32")
    with Tap() as tap:
        model(image)
    return image, [record.weights for record in tap.attention_records]


def rendered(figure, path, width, height):
    """Save the figure as a PNG, check the file, and return its RGB pixels in [0, 1] (one
    render: the saved pixels are those the axes' transforms point into)."""
    figure.savefig(path)
    return check_png(path, width, height)[..., :3]


def pixel_at(figure, pixels, ax, x, y):
    """The rendered colour at data point (x, y) of `ax` (display origin is bottom-left)."""
    px, py = ax.transData.transform((x, y))
    return pixels[pixels.shape[0] - 1 - int(round(py)), int(round(px))]


def check_png(path, width, height):
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0.05  # drawn content, not a blank canvas
    return image


# === plot_attention ===

def test_plot_attention_one_head_colours_follow_weights(maps, tmp_path):
    figure = plot_attention(maps, tokens=TOKENS, layer=1, head=2, batch=1, figsize=(5, 4), dpi=80)
    pixels = rendered(figure, tmp_path / "head.png", 400, 320)
    heat = figure.axes[0]
    assert [t.get_text() for t in heat.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in heat.get_yticklabels()] == TOKENS
    colours = matplotlib.colormaps["viridis"]
    weights = maps["self"][1][1, 2]
    for i, j in [(0, 0), (2, 5), (5, 1), (3, 3)]:
        np.testing.assert_allclose(pixel_at(figure, pixels, heat, j, i),
                                   colours(weights[i, j])[:3], atol=2.5 / 255)


def test_plot_attention_grid_of_all_heads(maps, tmp_path):
    figure = plot_attention(maps["self"], tokens=TOKENS, layer=0, figsize=(8, 6), dpi=50)
    pixels = rendered(figure, tmp_path / "grid.png", 400, 300)
    titled = [ax for ax in figure.axes if ax.get_title().startswith("head")]
    assert [ax.get_title() for ax in titled] == ["head 0", "head 1", "head 2"]
    colours = matplotlib.colormaps["viridis"]
    for h, ax in enumerate(titled):
        w = maps["self"][0][0, h]
        i, j = np.unravel_index(np.argmax(w), w.shape)
        np.testing.assert_allclose(pixel_at(figure, pixels, ax, j, i), colours(w[i, j])[:3],
                                   atol=2.5 / 255)


def test_plot_attention_takes_backend_tensors_and_single_arrays(vit, tmp_path):
    _, records = vit
    figure = plot_attention(records, layer=1, head=0, figsize=(4, 4), dpi=60)
    pixels = rendered(figure, tmp_path / "vit.png", 240, 240)
    weights = keras.ops.convert_to_numpy(records[1])[0, 0]
    colours = matplotlib.colormaps["viridis"]
    for i, j in [(0, 0), (16, 3), (5, 11)]:
        np.testing.assert_allclose(pixel_at(figure, pixels, figure.axes[0], j, i),
                                   colours(weights[i, j])[:3], atol=2.5 / 255)
    # one (query, key) array: a single head
    single = plot_attention(weights, figsize=(3, 3), dpi=60)
    assert [ax.get_title() for ax in single.axes[:1]] == ["head 0"]


# === plot_rollout ===

def test_rollout_heatmap_puts_each_patch_in_its_place():
    # 1 class token + a 2 x 3 patch grid; the class token's rollout is one-hot on patch (1, 2)
    rollout = np.full((7, 7), 1.0 / 7)
    rollout[0] = 0.0
    rollout[0, 1 + 1 * 3 + 2] = 1.0
    heat = rollout_heatmap(rollout, (8, 12), patch_grid=(2, 3))
    assert heat.shape == (8, 12) and heat.max() == pytest.approx(1.0)
    row, column = np.unravel_index(np.argmax(heat), heat.shape)
    assert 4 <= row < 8 and 8 <= column < 12  # inside patch (1, 2) of 4 x 4 pixels
    assert np.all(heat[:4, :4] == 0.0)  # far patches stay cold


def test_plot_rollout_over_a_vit_image(vit, tmp_path):
    # A tiny ViT's rollout over its 16 x 16 image (4 x 4 patches), then the overlay's colours:
    # hot where the class token's rollout is highest, cold where lowest.
    image, records = vit
    layers = [keras.ops.convert_to_numpy(weights) for weights in records]
    assert layers[0].shape == (1, 2, 17, 17)
    rollout = attention_rollout(layers)
    assert rollout.shape == (1, 17, 17)
    np.testing.assert_allclose(rollout.sum(-1), 1.0, rtol=1e-6)
    # make the class token's share sharp so the hot and cold patches are far apart in colour
    rollout[0, 0, 1:] = np.linspace(0.0, 1.0, 16)
    figure = plot_rollout(rollout, image, alpha=1.0, figsize=(6, 3), dpi=80)
    pixels = rendered(figure, tmp_path / "rollout.png", 480, 240)
    overlay = figure.axes[1]
    jet = matplotlib.colormaps["jet"]
    hot = pixel_at(figure, pixels, overlay, 14, 14)  # last patch (3, 3): share 1
    cold = pixel_at(figure, pixels, overlay, 1, 1)  # first patch (0, 0): share 0
    np.testing.assert_allclose(hot, jet(1.0)[:3], atol=0.05)
    np.testing.assert_allclose(cold, jet(0.0)[:3], atol=0.05)
    # the left panel is the image itself
    left = pixel_at(figure, pixels, figure.axes[0], 5, 9)
    shown = (image[0] - image.min()) / (image.max() - image.min())
    np.testing.assert_allclose(left, shown[9, 5], atol=2.5 / 255)


# === head_view_html: structure (fast) ===

class _Collect(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self._in = [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in = dict(attrs)
            self.scripts.append([dict(attrs), ""])

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = None

    def handle_data(self, data):
        if self._in is not None:
            self.scripts[-1][1] += data


def test_head_view_html_is_self_contained_and_escaped(maps, tmp_path):
    path = tmp_path / "view.html"
    page = head_view_html(maps, TOKENS, path=str(path), batch=0, title="<b>x</b>")
    assert path.read_text(encoding="utf-8") == page
    # (a) no network: no URL, no external resource of any kind
    for needle in ("http://", "https://", "src=", "href=", "@import", "url(", "//cdn"):
        assert needle not in page.lower(), needle
    # token text never reaches the page as markup
    assert "<script>alert" not in page and "</script><script>" not in page
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    parser = _Collect()
    parser.feed(page)
    names = [tag for tag, _ in parser.tags]
    assert names.count("script") == 2 and names.count("svg") == 1
    assert {attrs.get("id") for tag, attrs in parser.tags if tag == "select"} == {"layer", "head"}
    data = json.loads(next(text for attrs, text in parser.scripts
                           if attrs.get("type") == "application/json"))
    assert data["queries"] == TOKENS and data["keys"] == TOKENS
    assert data["layers"] == [0, 1] and data["heads"] == 3
    np.testing.assert_allclose(np.array(data["weights"]),
                               np.stack([m[0] for m in maps["self"]]), atol=5e-5)


def test_head_view_html_backend_tensors_and_options(vit):
    _, records = vit
    tokens = ["[CLS]"] + [f"patch {i}" for i in range(16)]
    page = head_view_html(records, tokens, layers=[1], decimals=3)
    data = json.loads(re.search(r'id="kzoo-head-view-data">(.*?)</script>', page, re.S).group(1))
    assert data["layers"] == [1]
    expected = keras.ops.convert_to_numpy(records[1])[0]
    np.testing.assert_allclose(np.array(data["weights"][0]), expected, atol=5e-4)


# === Bad arguments ===

def test_bad_arguments_raise_value_errors(maps):
    with pytest.raises(ValueError, match=r"`tokens`.*6 queries.*5 query token"):
        plot_attention(maps, tokens=TOKENS[:5])
    with pytest.raises(ValueError, match=r"`layer`=2 is out of range.*0\.\.1"):
        plot_attention(maps, layer=2)
    with pytest.raises(ValueError, match=r"`head`=3 is out of range.*0\.\.2"):
        plot_attention(maps, head=3)
    with pytest.raises(ValueError, match=r"`batch`=-1"):
        plot_attention(maps, batch=-1)
    with pytest.raises(ValueError, match=r"`stack`='cross' is not in the maps"):
        plot_attention(maps, stack="cross")
    with pytest.raises(ValueError, match=r"rank 2.*rank 5"):
        plot_attention(np.zeros((1, 1, 1, 2, 2)))
    with pytest.raises(ValueError, match=r"`tokens`.*6 queries"):
        head_view_html(maps, TOKENS + ["x"])
    with pytest.raises(ValueError, match=r"`layers`=5 is out of range"):
        head_view_html(maps, TOKENS, layers=[5])
    with pytest.raises(ValueError, match=r"`line_color`"):
        head_view_html(maps, TOKENS, line_color='red"><script>')
    with pytest.raises(ValueError, match=r"`patch_grid`=\(3, 3\)"):
        plot_rollout(np.eye(17)[None], np.zeros((8, 8)), patch_grid=(3, 3))
    with pytest.raises(ValueError, match=r"`alpha`=2"):
        plot_rollout(np.eye(17)[None], np.zeros((8, 8)), alpha=2)
    with pytest.raises(ValueError, match=r"`image` must be"):
        plot_rollout(np.eye(17)[None], np.zeros((8, 8, 2)))


# === head_view_html in a real browser (slow: two chromium launches) ===

def _chromium():
    binary = next((shutil.which(name) for name in ("chromium", "chromium-browser")
                   if shutil.which(name)), None)
    if binary is None:
        pytest.fail("the head-view browser test needs Debian's chromium: "
                    "`apt-get install -y chromium` (root), then rerun with -m browser.")
    return binary


def _run_chromium(tmp_path, url, *mode):
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run", "--disable-extensions", f"--user-data-dir={tmp_path / 'profile'}",
               "--window-size=900,500", "--virtual-time-budget=3000", *mode, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.browser
def test_head_view_in_headless_chromium(maps, tmp_path):
    path = tmp_path / "view.html"
    head_view_html(maps, TOKENS, path=str(path), batch=0)
    url = path.as_uri()
    # The fragment preselects layer 1, head 0, query token 3, which looks only at key 1.
    dom = _run_chromium(tmp_path, url + "#layer=1&head=0&token=3", "--dump-dom")
    lines = re.findall(r"<line [^>]*>", dom)
    assert len(lines) == 1, lines
    assert 'data-query="3"' in lines[0] and 'data-key="1"' in lines[0]
    assert 'stroke-opacity="1.0000"' in lines[0]
    # the hostile token is text in the SVG, not an element
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;</text>" in dom
    assert len(re.findall(r"<script", dom)) == 2
    # Without a fragment: every line of layer 0, head 0 above the 0.001 cut, each with its weight.
    dom = _run_chromium(tmp_path, url, "--dump-dom")
    weights = maps["self"][0][0, 0]
    drawn = {(int(q), int(k)): float(o) for o, q, k in re.findall(
        r'stroke-opacity="([0-9.]+)" data-query="(\d+)" data-key="(\d+)"', dom)}
    assert set(drawn) == {(int(i), int(j)) for i, j in zip(*np.nonzero(weights > 0.001))}
    for (i, j), opacity in drawn.items():
        assert opacity == pytest.approx(weights[i, j], abs=1e-4)
    # Hover, driven by events from a script appended to a copy of the page: entering query 2
    # shows row 2, leaving restores every line, entering key 4 shows column 4.
    driver = """<script>
      function keysOf() {
        return Array.from(document.querySelectorAll("#lines line")).map(
          function (l) { return l.getAttribute("data-query") + ":" + l.getAttribute("data-key"); });
      }
      var rects = function (side) { return document.querySelectorAll("g." + side + "-tokens rect"); };
      rects("query")[2].dispatchEvent(new MouseEvent("mouseenter"));
      document.body.setAttribute("data-hover-query", keysOf().join(" "));
      rects("query")[2].dispatchEvent(new MouseEvent("mouseleave"));
      document.body.setAttribute("data-after-leave", String(keysOf().length));
      rects("key")[4].dispatchEvent(new MouseEvent("mouseenter"));
      document.body.setAttribute("data-hover-key", keysOf().join(" "));
    </script></body>"""
    hovered = tmp_path / "hovered.html"
    hovered.write_text(path.read_text(encoding="utf-8").replace("</body>", driver),
                       encoding="utf-8")
    dom = _run_chromium(tmp_path, hovered.as_uri(), "--dump-dom")
    attrs = dict(re.findall(r'(data-hover-query|data-after-leave|data-hover-key)="([^"]*)"', dom))
    row = {f"2:{j}" for j in np.nonzero(weights[2] > 0.001)[0]}
    column = {f"{i}:4" for i in np.nonzero(weights[:, 4] > 0.001)[0]}
    assert set(attrs["data-hover-query"].split()) == row
    assert int(attrs["data-after-leave"]) == len(drawn)
    assert set(attrs["data-hover-key"].split()) == column
    # The screenshot shows the line in its colour (weight 1: the exact colour).
    shot = tmp_path / "shot.png"
    _run_chromium(tmp_path, url + "#layer=1&head=0&token=3", f"--screenshot={shot}")
    image = check_png(shot, 900, 500)
    colour = np.array([int(LINE_COLOR[k:k + 2], 16) for k in (1, 3, 5)]) / 255.0
    close = np.abs(image[..., :3] - colour).max(-1) < 0.03
    assert close.sum() > 200, close.sum()  # a 3-px line ~150 px long
    rows, columns = np.nonzero(close)
    assert columns.max() - columns.min() > 100  # a line across the gap, not a dot
