"""PNG plots rendered from a results file (``python -m bench.plot RESULTS.json`` redraws them).

One figure per op; one panel per (mode, dtype); x: the case's shape label; y: GB/s when the
case counts bytes, else TFLOP/s, else milliseconds; one line per provider.
"""
import json
import sys


def _metric(rows):
    if any(r.get("gbps") is not None for r in rows):
        return "gbps", "GB/s"
    if any(r.get("tflops") is not None for r in rows):
        return "tflops", "TFLOP/s"
    return "ms", "ms (lower is better)"


def _label(row):
    return "x".join(str(v) for v in row["shape"].values())


def plot_results(data: dict, stem: str) -> list:
    """Writes ``<stem>-<op>.png`` for each op with at least one timing; returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["measurements"] if r.get("ms") is not None]
    copy_gbps = (data.get("ceilings") or {}).get("copy_gbps")
    paths = []
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        panels = list(dict.fromkeys((r["mode"], r["dtype"]) for r in op_rows))
        ncols = min(3, len(panels))
        nrows = (len(panels) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
        for ax, (mode, dtype) in zip(axes.flat, panels):
            panel = [r for r in op_rows if r["mode"] == mode and r["dtype"] == dtype]
            key, unit = _metric(panel)
            labels = list(dict.fromkeys(_label(r) for r in panel))
            for provider in dict.fromkeys(r["provider"] for r in panel):
                pts = {_label(r): r[key] for r in panel if r["provider"] == provider and r[key] is not None}
                xs = [i for i, lab in enumerate(labels) if lab in pts]
                ax.plot(xs, [pts[labels[i]] for i in xs], marker="o", label=provider)
            if key == "gbps" and copy_gbps:
                ax.axhline(copy_gbps, color="gray", linestyle="--", linewidth=1, label="copy bandwidth")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{op} {mode} {dtype}")
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        env = data.get("environment", {})
        fig.suptitle(f"{env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}  {env.get('date', '')[:10]}",
                     fontsize=9)
        fig.tight_layout()
        path = f"{stem}-{op.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m bench.plot RESULTS.json [...]")
        return 2
    for path in argv:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for p in plot_results(data, path[:-5] if path.endswith(".json") else path):
            print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
