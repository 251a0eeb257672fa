"""One figure for ``hpcckpt bench --plot FILE``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .limits import GB


def plot_bench(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(result["engines"])
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    sizes = [row["state_bytes"] / GB for row in result["sizes"]]
    for name in engines:
        a.plot(sizes, [row[name]["stall_s"] for row in result["sizes"]], marker="o", label=f"{name} stall")
    memcpy = result["limits"]["memcpy_gbps"]
    a.plot(sizes, [s / memcpy for s in sizes], ls="--", color="gray", label="state / memcpy bandwidth")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("state size (GB)")
    a.set_ylabel("visible stall per checkpoint (s)")
    a.set_title("training blocked per checkpoint")
    a.legend()

    labels = ["persist", "load"]
    width = 0.8 / len(engines)
    for k, name in enumerate(engines):
        e = result["engines"][name]
        b.bar([i + k * width for i in range(2)], [e["persist_gbps"], e["load_gbps"]], width, label=name)
    b.axhline(result["limits"]["write_gbps"], color="C3", ls="--", label="raw direct write + fsync")
    b.axhline(result["limits"]["read_gbps"], color="C4", ls=":", label="raw cold read")
    b.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(2)], labels)
    b.set_ylabel("GB/s")
    b.set_title(f"at {result['state_bytes'] / GB:.2f} GB of state")
    b.legend(fontsize=8)

    for name, per in result["overhead"].items():
        xs = sorted(per, key=int)
        c.plot([int(x) for x in xs], [100 * per[x] for x in xs], marker="o", label=name)
    c.axhline(3, color="gray", ls="--", label="3% target")
    c.set_xscale("log")
    c.set_xlabel("checkpoint every N steps")
    c.set_ylabel("training time overhead (%)")
    c.set_title("demo model, vs no checkpointing")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_peers(result: dict[str, Any], path: Path) -> None:
    """``bench --peers --plot``: stall, persist and cold restore per method; overhead by interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.8))
    figures = [("stall_s", "stall"), ("persist_s", "persist"), ("restore_s", "cold restore")]
    width = 0.8 / len(figures)
    for k, (key, label) in enumerate(figures):
        a.bar([i + k * width for i in range(len(names))], [methods[n][key] for n in names], width, label=label)
    a.set_xticks([i + width for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("seconds")
    a.set_title(f"{result['device']}, {result['state_bytes'] / GB:.2f} GB of state")
    a.legend(fontsize=8)
    for n in names:
        per = methods[n]["overhead"]
        xs = sorted(per, key=int)
        b.plot([int(x) for x in xs], [100 * per[x] for x in xs], marker="o", label=n)
    b.set_xscale("log")
    b.set_xlabel("checkpoint every N steps")
    b.set_ylabel("training time overhead (%)")
    b.set_title("same model, vs no checkpointing")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
