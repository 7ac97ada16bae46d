"""A self-contained HTML head view: pick a layer and a head, hover a token, see its attention.

One file, inline CSS and JavaScript, no network access and no CDN, so it opens from disk in
any browser, offline. Two columns of tokens (queries on the left, keys on the right) are
joined by SVG lines whose opacity is the attention weight. With no token under the mouse every
query's lines are drawn; hovering a query token on the left shows where it looks, hovering a
key token on the right shows who looks at it.

The URL fragment preselects a view: `head_view.html#layer=1&head=2&token=3` opens layer 1,
head 2 with query token 3 selected (`head=mean` averages the heads). Token text is escaped:
it is placed in the page as JSON data and drawn with `textContent`, never parsed as HTML.

Example:
>>> maps = kzoo.interpret.attention_maps(model, inputs)
>>> head_view_html(maps, tokens=["The", "cat", "sat"], path="head_view.html")
"""

import html
import json
import os

import numpy as np

from kzoo.interpret.plots import _check_index, select_map, split_tokens

LINE_COLOR = "#d9480f"


def _json_for_script(value):
    """JSON that is safe inside a <script> element: no '<', '>', '&' or line separators
    that could end the element or the string early."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


_STYLE = """
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; }
#controls { margin-bottom: 12px; font-size: 14px; }
#controls select { margin: 0 12px 0 4px; }
#view text { font-size: 13px; fill: #222; pointer-events: none; }
#view text.active { font-weight: bold; fill: #000; }
#view rect.hit { fill: transparent; cursor: default; }
#view rect.hit.active { fill: #dde6f3; }
#note { font-size: 12px; color: #666; margin-top: 8px; }
"""

_SCRIPT = """
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("kzoo-head-view-data").textContent);
  var view = document.getElementById("view");
  // the HTML parser puts an inline <svg> in the SVG namespace: reuse it for new elements
  var svgNS = view.namespaceURI;
  var layerBox = document.getElementById("layer");
  var headBox = document.getElementById("head");
  var rowHeight = 22, top = 12, leftX = 10, gap = 150;
  var width = data.width, nq = data.queries.length, nk = data.keys.length;
  var leftEdge = leftX + width, rightX = leftEdge + gap;
  var state = {layer: 0, head: 0, query: null, key: null};
  var tokenNodes = {query: [], key: []};

  function option(box, value, label) {
    var o = document.createElement("option");
    o.value = String(value); o.textContent = label; box.appendChild(o);
  }
  for (var l = 0; l < data.weights.length; l++) option(layerBox, l, String(data.layers[l]));
  for (var h = 0; h < data.heads; h++) option(headBox, h, String(h));
  option(headBox, "mean", "mean of heads");

  function el(name, attrs, parent) {
    var node = document.createElementNS(svgNS, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    parent.appendChild(node);
    return node;
  }

  view.setAttribute("width", rightX + width + 20);
  view.setAttribute("height", top * 2 + Math.max(nq, nk) * rowHeight);
  var lines = el("g", {id: "lines"}, view);

  // Token columns are built once; hovering only redraws the lines and the highlights.
  function column(tokens, x, anchor, side) {
    var g = el("g", {"class": side + "-tokens"}, view);
    for (var i = 0; i < tokens.length; i++) {
      var hit = el("rect", {
        x: x, y: top + i * rowHeight, width: width, height: rowHeight,
        "class": "hit", "data-index": i
      }, g);
      var t = el("text", {
        x: anchor === "end" ? x + width - 4 : x + 4, y: top + (i + 0.5) * rowHeight,
        "text-anchor": anchor, "dominant-baseline": "middle"
      }, g);
      t.textContent = tokens[i];
      hit.addEventListener("mouseenter", hover(side, i));
      hit.addEventListener("mouseleave", unhover);
      tokenNodes[side].push([hit, t]);
    }
  }
  column(data.queries, leftX, "end", "query");
  column(data.keys, rightX, "start", "key");

  function matrix() {
    var heads = data.weights[state.layer];
    if (state.head !== "mean") return heads[state.head];
    var out = [];
    for (var i = 0; i < nq; i++) {
      var row = [];
      for (var j = 0; j < nk; j++) {
        var s = 0;
        for (var h = 0; h < heads.length; h++) s += heads[h][i][j];
        row.push(s / heads.length);
      }
      out.push(row);
    }
    return out;
  }

  function draw() {
    while (lines.firstChild) lines.removeChild(lines.firstChild);
    var a = matrix();
    for (var i = 0; i < nq; i++) {
      if (state.query !== null && state.query !== i) continue;
      for (var j = 0; j < nk; j++) {
        if (state.key !== null && state.key !== j) continue;
        var w = a[i][j];
        if (!(w > 0.001)) continue;
        el("line", {
          x1: leftEdge + 4, y1: top + (i + 0.5) * rowHeight,
          x2: rightX - 4, y2: top + (j + 0.5) * rowHeight,
          stroke: data.color, "stroke-width": 3, "stroke-opacity": w.toFixed(4),
          "data-query": i, "data-key": j
        }, lines);
      }
    }
    ["query", "key"].forEach(function (side) {
      tokenNodes[side].forEach(function (pair, i) {
        var active = state[side] === i;
        pair[0].setAttribute("class", active ? "hit active" : "hit");
        pair[1].setAttribute("class", active ? "active" : "");
      });
    });
  }

  function hover(side, i) {
    return function () {
      state.query = side === "query" ? i : null;
      state.key = side === "key" ? i : null;
      draw();
    };
  }
  function unhover() { readFragment(); draw(); }

  function readFragment() {
    var params = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (part) {
      var kv = part.split("=");
      if (kv.length === 2) params[decodeURIComponent(kv[0])] = decodeURIComponent(kv[1]);
    });
    var l = parseInt(params.layer, 10);
    if (l >= 0 && l < data.weights.length) state.layer = l;
    if (params.head === "mean") state.head = "mean";
    else {
      var h = parseInt(params.head, 10);
      if (h >= 0 && h < data.heads) state.head = h;
    }
    var t = parseInt(params.token, 10);
    state.query = (t >= 0 && t < nq) ? t : null;
    state.key = null;
    layerBox.value = String(state.layer);
    headBox.value = String(state.head);
  }

  layerBox.addEventListener("change", function () { state.layer = +layerBox.value; draw(); });
  headBox.addEventListener("change", function () {
    state.head = headBox.value === "mean" ? "mean" : +headBox.value; draw();
  });
  window.addEventListener("hashchange", function () { readFragment(); draw(); });
  readFragment();
  draw();
})();
"""


def head_view_html(maps, tokens, path=None, *, batch=0, stack=None, layers=None,
                   title="Attention head view", decimals=4, line_color=LINE_COLOR):
    """A self-contained interactive HTML page of attention: layer and head select boxes,
    tokens in two columns, lines whose opacity is the attention weight.

    Every weight of the chosen example goes into the page (rounded to `decimals`), so its size
    grows as layers x heads x tokens**2: fine for sentences, large for long inputs (pass
    `layers` to keep fewer).

    Args:
        maps: a dict of attention maps (`attention_maps`' output) or a list of layers
            `(batch, heads, query, key)`.
        tokens: the token strings, one a position (a pair `(query_tokens, key_tokens)` for
            cross-attention).
        path: where to write the file (UTF-8); None writes nothing.
        batch: which example of the batch.
        stack: for a dict of maps, "self", "encoder", "decoder" or "cross" (default "self",
            else "encoder").
        layers: the layer indices to include (default all).
        title: the page title (escaped).
        decimals: digits kept for each weight.
        line_color: CSS colour of the lines.

    Returns:
        the HTML text.

    Example:
    >>> page = head_view_html(maps, ["The", "cat", "sat"], path="head_view.html")
    >>> "<svg" in page
    True
    """
    _check_path(path)
    layer_stack = maps[_default_stack(maps, stack)] if isinstance(maps, dict) else maps
    if isinstance(layer_stack, np.ndarray) and layer_stack.ndim == 4:
        layer_stack = [layer_stack]
    if not isinstance(layer_stack, (list, tuple)):
        raise ValueError(f"`maps` must be a dict of attention maps or a list of arrays "
                         f"(batch, heads, query, key); got {type(layer_stack).__name__}.")
    count = len(layer_stack)
    if layers is None:
        layers = list(range(count))
    else:
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise ValueError(
                f"`layers` must be None or a sequence of layer indices (e.g. [{layers!r}]); "
                f"got layers={layers!r}."
            )
        layers = [_check_index("layers", l, count, "the maps' layer count") for l in layers]
        if not layers:
            raise ValueError("`layers`=[] must name at least one layer.")
    weights = [select_map(maps, l, batch, stack) for l in layers]
    heads, queries, keys = weights[0].shape
    query_tokens, key_tokens = split_tokens(tokens, queries, keys)
    if isinstance(decimals, bool) or not isinstance(decimals, (int, np.integer)) \
            or not 1 <= decimals <= 8:
        raise ValueError(f"`decimals`={decimals!r} must be an integer in 1..8.")
    decimals = int(decimals)
    if not isinstance(line_color, str) or not line_color or any(c in line_color for c in "<>\"'&;"):
        raise ValueError(f"`line_color`={line_color!r} must be a CSS colour such as '#d9480f'.")
    longest = max(len(t) for t in query_tokens + key_tokens)
    data = {
        "queries": query_tokens,
        "keys": key_tokens,
        "layers": layers,
        "heads": heads,
        "weights": [np.round(w, decimals).tolist() for w in weights],
        "color": line_color,
        "width": int(min(max(40, 8 * longest + 12), 320)),
    }
    page = "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(str(title))}</title>",
        f"<style>{_STYLE}</style>",
        "</head><body>",
        f"<h3>{html.escape(str(title))}</h3>",
        '<div id="controls"><label>Layer<select id="layer"></select></label>'
        '<label>Head<select id="head"></select></label></div>',
        '<svg id="view" role="img" '
        'aria-label="attention lines between tokens"></svg>',
        '<div id="note">Hover a token on the left to see where it looks, on the right to see '
        "who looks at it. Line opacity = attention weight. URL fragment: "
        "#layer=L&amp;head=H&amp;token=T.</div>",
        '<script type="application/json" id="kzoo-head-view-data">'
        f"{_json_for_script(data)}</script>",
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
        "",
    ])
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(page)
    return page


def _check_path(path):
    """`path` None or a file path whose directory exists (an int was taken by `open` as a
    file descriptor and written to; a directory or a missing parent failed in `open` after
    the page was built)."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"`path` must be None or a file path; got path={path!r}.")
    if os.path.isdir(path):
        raise ValueError(f"`path` must be a file path; {os.fspath(path)!r} is a directory.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(
            f"`path` must be in an existing directory; got path={os.fspath(path)!r}, whose "
            f"directory {parent!r} does not exist."
        )


def _default_stack(maps, stack):
    if stack is None:
        stack = next((key for key in ("self", "encoder", "decoder", "cross") if key in maps), None)
    if stack not in maps:
        raise ValueError(f"`stack`={stack!r} is not in the maps; they hold {sorted(maps)}.")
    return stack
