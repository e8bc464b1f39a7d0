"""Draw the time-series panels of vllm-kvbm.json into one PNG, from Prometheus' query API: the
dashboard without Grafana (scripts/launch_dashboard.sh uses it). Needs matplotlib only.

    python plot_panels.py http://127.0.0.1:9090 out.png [--seconds 600] [--rate-interval 15s]
        [--var model_name=REGEX] [--var engine=REGEX] [--dashboard vllm-kvbm.json]
"""

import argparse
import json
import math
import pathlib
import re
import time
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
STYLES = ["-", "--", ":", "-."]
BYTE_SCALES = [(1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1, "B/s")]


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list:
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=30) as r:
        reply = json.load(r)
    if reply["status"] != "success":
        raise RuntimeError(f"{expr}: {reply}")
    return reply["data"]["result"]


def legend(fmt: str, metric: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt) or str(metric)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prometheus")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=int, default=600, help="the time range: up to now")
    ap.add_argument("--rate-interval", default="15s", help="for $__rate_interval (4 scrape intervals)")
    ap.add_argument("--var", action="append", default=[], help="NAME=REGEX for a dashboard variable")
    ap.add_argument("--dashboard", default=str(HERE / "vllm-kvbm.json"))
    args = ap.parse_args()
    end = time.time()
    start = end - args.seconds
    step = max(1.0, (end - start) / 300)
    values = {"model_name": ".*", "engine": ".*", "__rate_interval": args.rate_interval,
              "__range": f"{args.seconds}s", **dict(v.split("=", 1) for v in args.var)}
    panels = [p for p in json.loads(pathlib.Path(args.dashboard).read_text())["panels"] if p["type"] == "timeseries"]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.6 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        series = []
        for t in p["targets"]:
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], t["expr"])
            for s in query_range(args.prometheus, expr, start, end, step):
                xs = [float(ts) - end for ts, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                series.append((legend(t.get("legendFormat", ""), s["metric"]), xs, ys))
        scale, label = 1, ""
        if unit == "Bps":
            top = max((y for _, _, ys in series for y in ys if math.isfinite(y)), default=0)
            scale, label = next((f, n) for f, n in BYTE_SCALES if top >= f or f == 1)
        elif unit == "percentunit":
            scale, label = 0.01, "%"
        for i, (name, xs, ys) in enumerate(sorted(series)):  # line styles: equal series stay visible
            ax.plot(xs, [y / scale for y in ys], label=name, linewidth=1.4, linestyle=STYLES[i % len(STYLES)])
        ax.set_title(p["title"], fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("seconds before now", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"vLLM KVBM tiers ({args.prometheus}, last {args.seconds} s, "
                 f"rate over {args.rate_interval})", fontsize=12)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"[plot] {len(panels)} panels -> {args.out}")


if __name__ == "__main__":
    main()
