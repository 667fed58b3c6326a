"""Scale of `flipguard view`: file size and time to interactive in headless Chromium
for a full-benchmark DDS run with reasoning text.

Two runs, both from the DialDefer authors' released Qwen-2.5-7B-Instruct records (real prompts,
replies and reasoning; ../shared/data/dialdefer/records):
  released   the records as imported (flipguard import-records): every item they hold
  full       the same records cycled under new item ids up to 3,244 items x 4 cases (the size
             of the full DialDefer benchmark), so flips and text keep their real shape
For each: `flipguard report` (not timed here), `flipguard view` (timed), the page's size, and in
headless Chromium (the system's, via playwright): navigation start to the page's data-ready mark
(data inflated, JSON parsed, tables and the first 100 rows built), a filter change, a search and
a click on a flip. Median of --repeats loads in a fresh page each.

    python bench/view_scale.py [--records DIR] [--out DIR] [--repeats 5] [--screenshot docs/view.png]

Writes bench/view_scale.json and prints the markdown rows of bench/view_scale.md.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
DEFAULT_RECORDS = BENCH.parent.parent / "shared" / "data" / "dialdefer" / "records" / "qwen-2.5-7b-instruct"
FULL_ITEMS = 3244


def flipguard(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], check=True, stdout=subprocess.DEVNULL)


def cycled(src: Path, dst: Path, n_items: int) -> None:
    """dst: src's records repeated under new item ids (and keys) until n_items items."""
    rows = [json.loads(line) for line in (src / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    items = list(dict.fromkeys((r["dataset"], r["item_id"]) for r in rows))
    by_item: dict[tuple, list] = {}
    for r in rows:
        by_item.setdefault((r["dataset"], r["item_id"]), []).append(r)
    dst.mkdir(parents=True)
    out = []
    for i in range(n_items):
        rep, key = divmod(i, len(items))
        for r in by_item[items[key]]:
            out.append({**r, "item_id": f"{r['item_id']}~{rep}" if rep else r["item_id"], "key": f"{r['key']}~{rep}"})
    (dst / "records.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    shutil.copy(src / "run.json", dst / "run.json")


def measure(page_path: Path, repeats: int, chromium: str, screenshot: Path | None = None) -> dict:
    from playwright.sync_api import sync_playwright

    url = page_path.resolve().as_uri()
    out: dict[str, list[float]] = {"interactive_ms": [], "filter_ms": [], "search_ms": [], "click_ms": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for i in range(repeats):
            context = browser.new_context(viewport={"width": 1280, "height": 860})
            requests: list[str] = []
            context.on("request", lambda r: requests.append(r.url))
            page = context.new_page()
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']")
            out["interactive_ms"].append(page.evaluate(
                "performance.getEntriesByName('fg-ready')[0].startTime"))
            for name, action, done in (
                ("filter_ms", lambda: page.select_option("#filter-type", "deference"), "#entries tbody tr"),
                ("search_ms", lambda: page.fill("#search", "speaker 2"), "#entries tbody tr"),
                ("click_ms", lambda: page.locator("#entries tbody tr").first.click(), "#detail .panel"),
            ):
                t = time.perf_counter()
                action()
                page.wait_for_selector(done)
                out[name].append((time.perf_counter() - t) * 1000)
            assert requests == [url], requests
            if screenshot and i == 0:
                page.fill("#search", "")
                page.select_option("#filter-dataset", "bbq")
                page.locator("#entries tbody tr").first.click()
                page.evaluate("window.scrollBy(0, document.getElementById('flips').getBoundingClientRect().top + 150)")
                page.screenshot(path=str(screenshot))
                from PIL import Image  # 64 colours: the README's PNG stays small (about 70 kB)

                Image.open(screenshot).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(
                    screenshot, optimize=True)
            context.close()
        browser.close()
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=str(DEFAULT_RECORDS), help="DialDefer-format records folder")
    ap.add_argument("--out", default="runs/view_scale", help="scratch folder (replaced)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--screenshot", default=None, help="also save the README screenshot (the released run's page) here")
    args = ap.parse_args()
    chromium = os.environ.get("FLIPGUARD_CHROMIUM") or shutil.which("chromium")
    if not chromium:
        sys.exit("no chromium on PATH (apt-get install -y chromium)")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    released, full = out / "released", out / "full"
    flipguard("import-records", args.records, "--out", str(released))
    cycled(released, full, FULL_ITEMS)
    results = {"machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}",
               "chromium": subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout.strip(), "runs": {}}
    for name, run in (("released", released), ("full", full)):
        flipguard("report", str(run), "--n_boot", "200")
        t = time.perf_counter()
        flipguard("view", str(run), "--out", str(out / f"{name}.html"))
        view_s = time.perf_counter() - t
        rows = [json.loads(line) for line in (run / "records.jsonl").open(encoding="utf-8")]
        n, items = len(rows), len({(r["dataset"], r["item_id"]) for r in rows})
        shot = Path(args.screenshot) if args.screenshot and name == "released" else None
        html = (out / f"{name}.html").read_text(encoding="utf-8")
        packed = html.split('data-encoding="gzip-base64">', 1)[1].split("<", 1)[0] if "gzip-base64" in html else ""
        raw_kb = round(len(gzip.decompress(base64.b64decode(packed))) / 1024) if packed else None
        row = {"records": n, "data_json_kb": raw_kb, "items": items, "records_mb": round((run / "records.jsonl").stat().st_size / 2**20, 1),
               "page_kb": round((out / f"{name}.html").stat().st_size / 1024), "view_s": round(view_s, 1),
               **measure(out / f"{name}.html", args.repeats, chromium, shot)}
        results["runs"][name] = row
        print(f"| {name} | {items} | {n} | {row['records_mb']} MB | {raw_kb} kB | {row['page_kb']} kB | {row['view_s']} s | "
              f"{row['interactive_ms']:.0f} ms | {row['filter_ms']:.0f} ms | {row['search_ms']:.0f} ms | {row['click_ms']:.0f} ms |")
    (BENCH / "view_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
