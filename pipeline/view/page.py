"""The page itself: one HTML file holding its data, style and script, with no network use.

The data (a dict built by pipeline/view) travels as JSON inside <script type="application/json">,
with every "<" written as \\u003c so no text in it (a reply holding "</script>") can end the
element; above COMPRESS_ABOVE bytes it travels gzipped and base64-encoded instead, and the
browser inflates it with DecompressionStream. The script builds the page with createElement
and textContent only: model replies, dataset items and arguments are always text, never markup.

Order on the page: the answer (a comparison's or a study's), a study grid's removed-vs-damaged
section (pipeline/view/grid.py), a lead table (the ground truth's planted / measured / after, the
answer's evidence), the plots, the other tables (a long one folded: the rest one click away), the
items, then provenance and the tail tables (a study's stages and their times) last.
Figures are shown at their own pixel size (shrunk only to fit a narrow window): eval/plots.py
makes them to be read at that size.

Data layout (what the script reads):
  title, subtitle
  answer: optional {title, note, notes: [text], charts: [{protocol, title, src}],
          verdicts: [{condition, target, damage, text, details: [{title, lines: [text]}]}]}
          (pipeline/view/answer.py; a chart of another kind is one more entry of charts)
  grid: optional {title, note, chart: {title, src}, table: a table as below}  (a study --grid)
  provenance: [[key, value], ...]
  tables: [{id, title, note, lead, columns: [[key, label], ...], rows: [{key, cells: {col: cell}}]}]
          (lead: true shows the table before the plots)
          a cell is a string or {t: text, v: raw value, c: css class}
  tail_tables: optional tables shown after provenance (a study's stages)
  plots: [{title, src}]  (data: URIs of PNG files)
  entries: [{id, type, dataset, case, condition, item, summary, diff, panels: [panel]}]
          panel = {title, facts: [[k, v]], messages: [[role, text]], reply}
  filters: [[field, label], ...]  the entry fields offered as filters
"""

from __future__ import annotations

import base64
import gzip
import html
import json
from typing import Any

COMPRESS_ABOVE = 256 * 1024  # bytes of JSON: larger data goes gzipped + base64 (a third to a tenth of the size)
PAGE_SIZE = 100  # entries rendered per page of the list

CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d232a;background:#f6f7f9}
header{background:#1f3a5f;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.85}
main{padding:12px 24px 48px;max-width:1500px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;margin:14px 0;padding:10px 16px}
h2{font-size:16px;margin:6px 0 10px}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #e6e9ed;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}
td.num{text-align:right;white-space:nowrap}
.note{color:#55606d;font-size:13px;margin:4px 0 8px;white-space:pre-wrap}
.scroll{overflow-x:auto}
.flag{color:#b3261e;font-weight:600}
.plots img{max-width:100%;height:auto;border:1px solid #e6e9ed;margin:4px 8px 4px 0}
.plots figure{display:inline-block;margin:0 12px 8px 0;vertical-align:top;max-width:100%}
.plots figcaption{font-size:13px}
.list{max-height:42vh;overflow:auto;border:1px solid #e6e9ed}
.list thead th{position:sticky;top:0}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin-bottom:8px}
.controls label{font-size:13px;color:#55606d}
.controls input{width:240px}
#entries tbody tr{cursor:pointer}
#entries tbody tr:hover{background:#eef4fb}
#entries tbody tr.sel{background:#dbe9f8}
.pill{display:inline-block;border-radius:9px;padding:0 7px;font-size:12px;background:#e6e9ed}
.t-deference,.t-flipped,.t-broken{background:#fde2e1}
.t-skepticism{background:#fff0c2}
.t-invalid{background:#e8e0f8}
.t-fixed,.t-held{background:#dcf3e1}
.panels{display:grid;grid-template-columns:repeat(auto-fit,minmax(380px,1fr));gap:12px}
.panel{border:1px solid #dde1e6;border-radius:6px;padding:8px;min-width:0}
.panel h3{font-size:14px;margin:0 0 6px}
.msg{margin:6px 0}
.role{font-size:12px;color:#55606d;text-transform:uppercase;letter-spacing:.04em}
pre{white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-word;background:#f6f7f9;border-radius:4px;
    padding:6px 8px;margin:2px 0;max-height:420px;overflow-y:auto;font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre.reply{background:#eef4fb}
mark{background:#ffe08a;padding:0}
.facts td{border:0;padding:1px 8px 1px 0;font-size:13px}
.pager button{margin:0 4px}
#answer{border-color:#1f3a5f;border-width:2px}
#answer-verdicts{margin:8px 0 4px;padding-left:20px;font-size:15px}
#answer-verdicts li{margin:8px 0;max-width:1200px}
#answer-verdicts .verdict{margin:0}
#answer-verdicts details{margin:2px 0 0;font-size:13px;color:#33404d}
#answer-verdicts summary{cursor:pointer;color:#1f5fa8}
#answer-verdicts h4{font-size:13px;margin:6px 0 2px}
#answer-verdicts ul{margin:0;padding-left:18px}
.answer-note{color:#7a4b00}
details.long>summary{cursor:pointer;color:#1f5fa8;margin:4px 0}
"""

JS = r"""
(function () {
  "use strict";
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function cellOf(td, cell) {
    if (cell !== null && typeof cell === "object") {
      td.textContent = cell.t === undefined || cell.t === null ? "" : String(cell.t);
      if (cell.v !== undefined && cell.v !== null) td.setAttribute("data-value", String(cell.v));
      if (cell.c) td.className = cell.c;
    } else {
      td.textContent = cell === undefined || cell === null ? "" : String(cell);
    }
  }
  function table(spec) {
    var wrap = el("div", {"class": "scroll"});
    var t = el("table", {id: "table-" + spec.id});
    var tr = el("tr");
    spec.columns.forEach(function (c) { tr.appendChild(el("th", {"data-col": c[0]}, c[1])); });
    var thead = el("thead"); thead.appendChild(tr); t.appendChild(thead);
    var tbody = el("tbody");
    spec.rows.forEach(function (row) {
      var r = el("tr", {"data-row": row.key});
      spec.columns.forEach(function (c) {
        var td = el("td", {"data-col": c[0]});
        cellOf(td, row.cells[c[0]]);
        r.appendChild(td);
      });
      tbody.appendChild(r);
    });
    t.appendChild(tbody); wrap.appendChild(t);
    return wrap;
  }
  function section(id, title, note) {
    var s = el("section", {id: id});
    s.appendChild(el("h2", null, title));
    if (note) s.appendChild(el("p", {"class": "note"}, note));
    return s;
  }

  // what differs between two texts, word by word: [[text, marked], ...] per side. A common prefix and
  // suffix are kept plain; the middle is aligned by longest common subsequence when it is small enough
  // (MAX_CELLS), else marked whole, so any length stays fast.
  var MAX_CELLS = 3000000;
  function push(out, text, marked) {
    if (!text) return;
    var last = out[out.length - 1];
    if (last && last[1] === marked) last[0] += text; else out.push([text, marked]);
  }
  function diffParts(a, b) {
    var ta = a.split(/(\s+)/), tb = b.split(/(\s+)/);
    var p = 0;
    while (p < ta.length && p < tb.length && ta[p] === tb[p]) p++;
    var s = 0;
    while (s < ta.length - p && s < tb.length - p && ta[ta.length - 1 - s] === tb[tb.length - 1 - s]) s++;
    var ma = ta.slice(p, ta.length - s), mb = tb.slice(p, tb.length - s);
    var oa = [], ob = [];
    push(oa, ta.slice(0, p).join(""), false); push(ob, tb.slice(0, p).join(""), false);
    var n = ma.length, m = mb.length;
    if ((n + 1) * (m + 1) > MAX_CELLS) {
      push(oa, ma.join(""), true); push(ob, mb.join(""), true);
    } else {
      var w = m + 1, dp = new Uint32Array((n + 1) * w);
      for (var i = n - 1; i >= 0; i--)
        for (var j = m - 1; j >= 0; j--)
          dp[i * w + j] = ma[i] === mb[j] ? dp[(i + 1) * w + j + 1] + 1 : Math.max(dp[(i + 1) * w + j], dp[i * w + j + 1]);
      var x = 0, y = 0;
      while (x < n && y < m) {
        if (ma[x] === mb[y]) { push(oa, ma[x++], false); push(ob, mb[y++], false); }
        else if (dp[(x + 1) * w + y] >= dp[x * w + y + 1]) push(oa, ma[x++], !/^\s+$/.test(ma[x - 1]));
        else push(ob, mb[y++], !/^\s+$/.test(mb[y - 1]));
      }
      while (x < n) push(oa, ma[x++], true);
      while (y < m) push(ob, mb[y++], true);
    }
    push(oa, ta.slice(ta.length - s).join(""), false); push(ob, tb.slice(tb.length - s).join(""), false);
    return [oa, ob];
  }
  function preWith(parts, cls) {
    var pre = el("pre", cls ? {"class": cls} : null);
    if (typeof parts === "string") { pre.textContent = parts; return pre; }
    parts.forEach(function (part) { pre.appendChild(part[1] ? el("mark", null, part[0]) : document.createTextNode(part[0])); });
    return pre;
  }
  function lastUser(panel) {
    var m = panel.messages || [];
    for (var i = m.length - 1; i >= 0; i--) if (m[i][0] === "user") return i;
    return -1;
  }
  function renderDetail(box, entry) {
    box.textContent = "";
    box.appendChild(el("h2", null, entry.summary));
    var grid = el("div", {"class": "panels"});
    var marks = null;
    if (entry.diff && entry.panels.length === 2) {
      var i0 = lastUser(entry.panels[0]), i1 = lastUser(entry.panels[1]);
      if (i0 >= 0 && i1 >= 0) marks = [i0, i1, diffParts(entry.panels[0].messages[i0][1], entry.panels[1].messages[i1][1])];
    }
    entry.panels.forEach(function (p, pi) {
      var d = el("div", {"class": "panel", "data-panel": String(pi)});
      d.appendChild(el("h3", null, p.title));
      if (p.facts && p.facts.length) {
        var ft = el("table", {"class": "facts"});
        p.facts.forEach(function (f) {
          var r = el("tr"); r.appendChild(el("td", null, f[0])); r.appendChild(el("td", {"data-fact": f[0]}, f[1])); ft.appendChild(r);
        });
        d.appendChild(ft);
      }
      (p.messages || []).forEach(function (m, mi) {
        var md = el("div", {"class": "msg"});
        md.appendChild(el("div", {"class": "role"}, m[0]));
        md.appendChild(preWith(marks && mi === marks[pi] ? marks[2][pi] : m[1], "prompt"));
        d.appendChild(md);
      });
      if (p.reply !== undefined && p.reply !== null) {
        var rd = el("div", {"class": "msg"});
        rd.appendChild(el("div", {"class": "role"}, "reply"));
        rd.appendChild(preWith(p.reply, "reply"));
        d.appendChild(rd);
      }
      grid.appendChild(d);
    });
    box.appendChild(grid);
  }

  function entriesSection(data) {
    var entries = data.entries || [];
    var s = section("flips", data.entries_title || "Items", data.entries_note);
    var controls = el("div", {"class": "controls"});
    var selects = {};
    (data.filters || []).forEach(function (f) {
      var values = {};
      entries.forEach(function (e) { if (e[f[0]] !== undefined && e[f[0]] !== null && e[f[0]] !== "") values[e[f[0]]] = (values[e[f[0]]] || 0) + 1; });
      var keys = Object.keys(values).sort();
      if (keys.length < 1) return;
      var lab = el("label", null, f[1] + " ");
      var sel = el("select", {id: "filter-" + f[0], "data-filter": f[0]});
      sel.appendChild(el("option", {value: ""}, "all (" + entries.length + ")"));
      keys.forEach(function (k) { sel.appendChild(el("option", {value: k}, k + " (" + values[k] + ")")); });
      lab.appendChild(sel); controls.appendChild(lab);
      selects[f[0]] = sel;
    });
    var search = el("input", {id: "search", type: "search", placeholder: "search item, prompt, reply"});
    controls.appendChild(search);
    var count = el("span", {id: "count"});
    controls.appendChild(count);
    s.appendChild(controls);
    var t = el("table", {id: "entries"});
    var head = el("tr");
    ["type", "dataset", "case", "condition", "item", "summary"].forEach(function (h) { head.appendChild(el("th", null, h)); });
    var thead = el("thead"); thead.appendChild(head); t.appendChild(thead);
    var tbody = el("tbody"); t.appendChild(tbody);
    var wrap = el("div", {"class": "list"}); wrap.appendChild(t); s.appendChild(wrap);
    var pager = el("div", {"class": "pager"});
    var prev = el("button", {id: "prev", type: "button"}, "< previous"), next = el("button", {id: "next", type: "button"}, "next >");
    var pageInfo = el("span", {id: "page"});
    pager.appendChild(prev); pager.appendChild(pageInfo); pager.appendChild(next); s.appendChild(pager);
    var detail = el("div", {id: "detail"}); s.appendChild(detail);

    var haystack = null, shown = [], page = 0, size = data.page_size || 100;
    function text(e) {
      var parts = [e.item, e.summary, e.dataset, e.case, e.condition, e.type];
      e.panels.forEach(function (p) {
        (p.messages || []).forEach(function (m) { parts.push(m[1]); });
        parts.push(p.reply);
        (p.facts || []).forEach(function (f) { parts.push(f[1]); });
      });
      return parts.join("\n").toLowerCase();
    }
    function apply() {
      var q = search.value.trim().toLowerCase();
      if (q && !haystack) haystack = entries.map(text);
      shown = [];
      entries.forEach(function (e, i) {
        for (var f in selects) if (selects[f].value && String(e[f]) !== selects[f].value) return;
        if (q && haystack[i].indexOf(q) < 0) return;
        shown.push(i);
      });
      page = 0; draw();
    }
    function draw() {
      tbody.textContent = "";
      var pages = Math.max(1, Math.ceil(shown.length / size));
      if (page >= pages) page = pages - 1;
      shown.slice(page * size, (page + 1) * size).forEach(function (i) {
        var e = entries[i];
        var r = el("tr", {"data-entry": e.id, "data-type": e.type});
        var tc = el("td"); tc.appendChild(el("span", {"class": "pill t-" + e.type}, e.type)); r.appendChild(tc);
        [e.dataset, e.case, e.condition, e.item, e.summary].forEach(function (v) { r.appendChild(el("td", null, v)); });
        r.addEventListener("click", function () {
          var old = tbody.querySelector("tr.sel"); if (old) old.className = "";
          r.className = "sel"; renderDetail(detail, e); detail.scrollIntoView({block: "nearest"});
        });
        tbody.appendChild(r);
      });
      count.textContent = shown.length + " of " + entries.length + " shown";
      pageInfo.textContent = " page " + (page + 1) + " of " + pages + " ";
      prev.disabled = page === 0; next.disabled = page >= pages - 1;
    }
    prev.addEventListener("click", function () { page--; draw(); });
    next.addEventListener("click", function () { page++; draw(); });
    for (var f in selects) selects[f].addEventListener("change", apply);
    search.addEventListener("input", apply);
    apply();
    return s;
  }

  function figure(pl, attrs, caption) {
    var fig = el("figure", attrs); var img = el("img", {alt: pl.title}); img.src = pl.src;
    fig.appendChild(img);
    if (caption !== false) fig.appendChild(el("figcaption", {"class": "note"}, pl.title));
    return fig;
  }
  // the answer first: a line per mitigation (its verdict, the numbers folded under it), then a before/after
  // chart per protocol (and any other chart the answer carries), then how to read it
  function answerSection(a) {
    var s = section("answer", a.title || "The answer");
    (a.notes || []).forEach(function (n) { s.appendChild(el("p", {"class": "note answer-note"}, n)); });
    if (a.verdicts && a.verdicts.length) {
      // one line per mitigation, its verdict first; the numbers behind it one click away
      var ul = el("ul", {id: "answer-verdicts"});
      a.verdicts.forEach(function (x) {
        var li = el("li", {"data-condition": x.condition});
        var line = el("p", {"class": "verdict"});
        line.appendChild(el("strong", null, x.condition + ":"));
        line.appendChild(document.createTextNode(" "));
        line.appendChild(el("span", {"class": "target"}, x.target));
        line.appendChild(document.createTextNode("; "));
        line.appendChild(el("span", {"class": "damage"}, x.damage));
        line.appendChild(document.createTextNode("."));
        li.appendChild(line);
        if (x.details && x.details.length) {
          var d = el("details", {"class": "why"});
          d.appendChild(el("summary", null, "the numbers behind it"));
          x.details.forEach(function (part) {
            d.appendChild(el("h4", null, part.title));
            var lines = el("ul");
            part.lines.forEach(function (t) { lines.appendChild(el("li", null, t)); });
            d.appendChild(lines);
          });
          li.appendChild(d);
        }
        ul.appendChild(li);
      });
      s.appendChild(ul);
    }
    if (a.charts && a.charts.length) {
      var cd = el("div", {"class": "plots", id: "answer-charts"});
      a.charts.forEach(function (c) { cd.appendChild(figure(c, {"data-protocol": c.protocol}, false)); });
      s.appendChild(cd);
    }
    if (a.note) s.appendChild(el("p", {"class": "note", id: "answer-legend"}, a.note));  // how to read it, after it
    return s;
  }
  // a recipe grid (pipeline/view/grid.py): the removed-vs-damaged chart, then the variant table
  function gridSection(g) {
    var s = section("grid", g.title, g.note);
    if (g.chart) {
      var d = el("div", {"class": "plots", id: "grid-chart"});
      d.appendChild(figure(g.chart));
      s.appendChild(d);
    }
    if (g.table.note) s.appendChild(el("p", {"class": "note"}, g.table.note));
    s.appendChild(table(g.table));
    return s;
  }
  // a table of more than LONG rows is folded: its heading and note stay, the rows one click away
  var LONG = 25;
  function tableSection(spec) {
    var s = section("sec-" + spec.id, spec.title, spec.note);
    if (spec.rows.length > LONG) {
      var d = el("details", {"class": "long"});
      d.appendChild(el("summary", null, "show its " + spec.rows.length + " rows"));
      d.appendChild(table(spec));
      s.appendChild(d);
    } else {
      s.appendChild(table(spec));
    }
    return s;
  }
  function render(data) {
    document.title = data.title;
    var header = el("header");
    header.appendChild(el("h1", {id: "title"}, data.title));
    if (data.subtitle) header.appendChild(el("p", null, data.subtitle));
    document.body.appendChild(header);
    var main = el("main");
    if (data.answer) main.appendChild(answerSection(data.answer));
    if (data.grid) main.appendChild(gridSection(data.grid));
    // a table that is the answer's evidence (the ground truth's planted / measured / after) before the plots
    var tables = data.tables || [];
    tables.filter(function (t) { return t.lead; }).forEach(function (spec) { main.appendChild(tableSection(spec)); });
    if (data.plots && data.plots.length) {
      var ps = section("plots", "Plots");
      var pd = el("div", {"class": "plots"});
      data.plots.forEach(function (pl) { pd.appendChild(figure(pl)); });
      ps.appendChild(pd); main.appendChild(ps);
    }
    tables.filter(function (t) { return !t.lead; }).forEach(function (spec) { main.appendChild(tableSection(spec)); });
    if (data.entries) main.appendChild(entriesSection(data));
    // provenance and a study's stage times last: who made the numbers, after the numbers
    if (data.provenance && data.provenance.length) {
      var p = section("provenance", "Provenance");
      var pt = el("table", {id: "table-provenance"});
      data.provenance.forEach(function (kv) {
        var r = el("tr", {"data-row": kv[0]}); r.appendChild(el("th", null, kv[0])); r.appendChild(el("td", null, kv[1])); pt.appendChild(r);
      });
      p.appendChild(pt); main.appendChild(p);
    }
    (data.tail_tables || []).forEach(function (spec) { main.appendChild(tableSection(spec)); });
    document.body.appendChild(main);
    if (window.performance && performance.mark) performance.mark("fg-ready");
    document.body.setAttribute("data-ready", "1");
  }
  function fail(err) {
    document.body.appendChild(el("pre", {id: "error"}, "flipguard view: cannot read the embedded data: " + err));
    document.body.setAttribute("data-ready", "error");
  }
  var node = document.getElementById("fg-data");
  if (node.getAttribute("data-encoding") === "gzip-base64") {
    var bin = atob(node.textContent.trim()), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text()
      .then(function (t) { render(JSON.parse(t)); }).catch(fail);
  } else {
    try { render(JSON.parse(node.textContent)); } catch (err) { fail(err); }
  }
})();
"""


# Every page starts with these bytes (an earlier page in a manifest is recognised by them: view.earlier_page).
# No network: a Content-Security-Policy that allows only this file's own inline style, script and data: images.
PAGE_HEAD = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
             "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
             "script-src 'unsafe-inline'; img-src data:\">\n").encode("utf-8")


def embed_json(data: Any) -> str:
    """JSON safe inside a <script> element: no "<" (so no "</script>" or "<!--"), no raw U+2028/9."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(data: dict[str, Any], compress: bool | None = None) -> str:
    """The whole page; `compress` None = gzip the data when its JSON is over COMPRESS_ABOVE bytes."""
    data = {**data, "page_size": PAGE_SIZE}
    payload = embed_json(data)
    if compress is None:
        compress = len(payload.encode("utf-8")) > COMPRESS_ABOVE
    if compress:
        packed = base64.b64encode(gzip.compress(payload.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")
        script = f'<script type="application/json" id="fg-data" data-encoding="gzip-base64">{packed}</script>'
    else:
        script = f'<script type="application/json" id="fg-data" data-encoding="json">{payload}</script>'
    title = html.escape(str(data.get("title", "flipguard view")))
    return (PAGE_HEAD.decode("utf-8") +
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{title}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{script}\n<script>{JS}</script>\n</body></html>\n")
