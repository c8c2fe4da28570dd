"""curves.png: train loss, eval metrics and learning rate against optimizer steps, epochs marked; runs overlaid.

Drawn from metrics.jsonl alone with matplotlib's Agg canvas (no pyplot: a user's own backend is never changed).
"""

from __future__ import annotations

import math
from pathlib import Path

from accel_train.run.layout import read_lines
from accel_train.run.summaries import eval_metrics

NOT_PLOTTED = {"lr"}  # a panel of its own
SPLIT_STYLE = {"val": {"linestyle": "-", "marker": "o"}, "test": {"linestyle": "--", "marker": "x"}}


def plot_runs(folders: list[Path], output: Path, names: list[str]) -> Path:
    """One PNG with a panel for the train loss terms, one per eval metric, and one for the learning rate."""
    figure = draw_runs(folders, names)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100, pil_kwargs={"compress_level": 1})  # fast; the picture is small anyway
    return output


def draw_runs(folders: list[Path], names: list[str]):
    """The figure plot_runs saves; eval panels show the splits the runs evaluated (val, test) and no other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    runs = [(name, read_lines(folder)) for name, folder in zip(names, folders)]
    train_terms = ordered({key for _, lines in runs for line in lines if line["split"] == "train"
                           for key in eval_metrics(line)} - NOT_PLOTTED)
    evals = [line for _, lines in runs for line in lines if line["split"] != "train"]
    counts = {key for line in evals for key, value in line.items() if isinstance(value, int)}  # num_samples, correct
    metrics = ordered({key for line in evals for key in eval_metrics(line)} - NOT_PLOTTED - counts)
    splits = {split: style for split, style in SPLIT_STYLE.items() if any(line["split"] == split for line in evals)}
    panels = [("train loss", "train", train_terms)] if train_terms else []
    panels += [(f"eval {metric}", "eval", [metric]) for metric in metrics]
    panels.append(("learning rate", "train", ["lr"]))
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    height = 3.4 * rows + 0.6
    figure = Figure(figsize=(5 * columns, height))  # fixed margins: a layout engine would double the drawing time
    figure.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.75 / height, wspace=0.25,
                           hspace=1.1 / 3.4)
    FigureCanvasAgg(figure)
    for index, (title, kind, keys) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        for number, (_, lines) in enumerate(runs):
            color = f"C{number % 10}"
            for boundary in epoch_ends(lines):
                axes.axvline(boundary, color=color, linestyle=":", linewidth=0.8, alpha=0.5)
            if kind == "train":
                for term, style in zip(keys, ("-", "--", "-.", ":")):
                    axes.plot(*series(lines, ("train",), term), color=color, linestyle=style)
            else:
                for split, style in splits.items():
                    axes.plot(*series(lines, (split,), keys[0]), color=color, markersize=4, **style)
        if kind == "train" and len(keys) > 1:
            axes.legend([Line2D([], [], color="black", linestyle=s) for s in ("-", "--", "-.", ":")[:len(keys)]],
                        keys, fontsize="small")
        if kind == "eval":
            axes.legend([Line2D([], [], color="black", **style) for style in splits.values()], list(splits),
                        fontsize="small")
        axes.set_title(title)
        axes.set_xlim(left=0)
        axes.set_xlabel("optimizer step (dotted: epoch ends)")
        axes.grid(alpha=0.3)
    figure.legend([Line2D([], [], color=f"C{n % 10}") for n in range(len(runs))], [name for name, _ in runs],
                  loc="upper center", ncols=min(4, len(runs)), frameon=False)
    return figure


def series(lines: list[dict], splits: tuple[str, ...], key: str) -> tuple[list[int], list[float]]:
    points = [(line["step"], line[key]) for line in lines if line["split"] in splits and key in line]
    return [step for step, _ in points], [value for _, value in points]


def epoch_ends(lines: list[dict]) -> list[int]:
    """The last step of every epoch but the last one seen (an epoch's end evaluation has exactly that step)."""
    last_step: dict[int, int] = {}
    for line in lines:
        last_step[line["epoch"]] = max(line["step"], last_step.get(line["epoch"], 0))
    return [last_step[epoch] for epoch in sorted(last_step)[:-1]]


def ordered(names: set[str]) -> list[str]:
    """loss first (the term optimised), then the rest by name."""
    return sorted(names, key=lambda name: (name != "loss", name))


STATE_MARKERS = {"complete": {"marker": "o"}, "pruned": {"marker": "x"}}


def plot_parameters(trials: list[dict], searched: list[tuple[str, bool, tuple | None]], metric: str,
                    output: Path) -> Path:
    """A sweep's metric against each searched value into `output` (draw_parameters)."""
    figure = draw_parameters(trials, searched, metric)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100, pil_kwargs={"compress_level": 1})
    return output


def draw_parameters(trials: list[dict], searched: list[tuple[str, bool, tuple | None]], metric: str):
    """One panel per searched key: complete trials as dots, pruned ones as crosses at their last evaluation, the best
    ringed; a choice's values in the order the command gave them. `searched`: (key, log scale, the choices or None)
    per key."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(3, len(searched))
    rows = math.ceil(len(searched) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    scored = [trial for trial in trials if trial["value"] is not None and trial["state"] in STATE_MARKERS]
    best = next((trial for trial in scored if trial["state"] == "complete"), None)
    for index, (key, log, choices) in enumerate(searched):
        axes = figure.add_subplot(rows, columns, index + 1)
        labels = [str(choice) for choice in choices or ()]  # in the order the command gave them
        position = (lambda value, labels=labels: labels.index(str(value))) if choices else (lambda value: value)
        for state, style in STATE_MARKERS.items():
            points = [(position(t["params"][key]), t["value"]) for t in scored if t["state"] == state and key in
                      t["params"]]
            if points:
                axes.scatter(*zip(*points), label=state, color="C0" if state == "complete" else "C3", **style)
        if best is not None and key in best["params"]:
            axes.scatter([position(best["params"][key])], [best["value"]], s=160, facecolors="none",
                         edgecolors="black", label="best")
        if choices:
            axes.set_xticks(range(len(labels)), labels)
        elif log:
            axes.set_xscale("log")
        axes.set_xlabel(key)
        axes.set_ylabel(metric)
        axes.grid(alpha=0.3)
        if index == 0:
            axes.legend(fontsize="small")
    return figure
