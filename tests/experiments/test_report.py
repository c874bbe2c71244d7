"""Results files are strict JSON and written whole; reproduce-paper's table and plots read at a glance."""

import json
import math
import os

import pytest

from experiments.report import write_json, write_text


def test_write_json_is_strict_and_replaces_the_file(tmp_path):
    path = str(tmp_path / "sub" / "r.json")
    write_json(path, {"a": [1.5, math.inf, float("nan")], "b": {"c": -math.inf}})
    assert json.loads(open(path).read(), parse_constant=lambda c: pytest.fail(c)) == {"a": [1.5, None, None], "b": {"c": None}}
    write_json(path, {"a": 2})
    assert json.load(open(path)) == {"a": 2} and os.listdir(tmp_path / "sub") == ["r.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "t.md")
    write_text(path, "old")
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["t.md"]


# reproduce-paper's table and plots (experiments.paper_report): what a reader must see at a glance.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MACHINE = {"cpu": "Test CPU", "cpu_cores": 2, "torch_threads": 2, "device": "cpu"}


def _run(model, plain_w, pipedp_w, plain_acc, pipedp_acc, dataset="digits", stages=1):
    from experiments.paper_report import speedup_spread

    def side(windows, accs):
        return {"time_s": sum(windows), "final_acc": accs[-1], "window_s": windows,
                "epochs": [{"epoch": i + 1, "test_acc": a, "time_s": 1.0} for i, a in enumerate(accs)]}

    return {"model": model, "dataset": dataset, "speedup": sum(plain_w) / sum(pipedp_w),
            "plan_summary": f"{stages} stage(s) of 15 blocks, 4 microbatches",
            "speedup_windows": speedup_spread(plain_w, pipedp_w),
            "plain": side(plain_w, plain_acc), "pipedp": side(pipedp_w, pipedp_acc)}


def _results(runs, epochs, dataset="digits", quick=False):
    return {"machine": MACHINE, "runs": runs,
            "args": {"epochs": epochs, "batch_size": 64, "microbatches": 4, "device": "cpu", "window": 2,
                     "quick": quick, "stages": "auto"},
            "data": {"name": dataset, "train": 512, "test": 256, "classes": 10, "image_size": 32}}


@pytest.fixture
def plt():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _suptitle(fig):
    return " ".join(t.get_text() for t in fig.texts)


def _inside(fig):
    """Every text of the figure (titles, labels, values) is whole on the canvas."""
    box = fig.bbox
    for t in [*fig.texts, *(t for ax in fig.axes for t in (ax.title, *ax.texts))]:
        if t.get_text():
            e = t.get_window_extent()
            assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, t.get_text()


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_window_spread_is_median_and_range_of_per_window_ratios():
    from experiments.paper_report import speedup_spread

    s = speedup_spread([1.0, 2.0, 3.0, 1.0], [1.0, 1.0, 2.0, 2.0])  # ratios 1, 2, 1.5, 0.5
    assert (s["median"], s["min"], s["max"], s["windows"]) == (1.25, 0.5, 2.0, 4)
    assert s["q1"] <= s["median"] <= s["q3"]
    assert speedup_spread([], []) is None


def test_table_carries_the_window_spread_and_explains_na_and_one_stage():
    from experiments.paper_report import table_markdown

    res = _results([_run("resnet18", [1.0, 1.2, 0.9], [1.0, 1.0, 1.0], [8.6], [8.6])], epochs=1, quick=True)
    table = table_markdown(res)
    assert "| 1.03x | 1.00x (0.90-1.20, 3) | n/a |" in table  # overall, then the windows: median (min-max, n)
    assert "Paper speedup n/a: the paper reports no figure for this dataset" in table
    assert "1 stage(s) in Plans: the planner (stages=auto)" in table and "not by pipelining" in table
    two_stages = _run("resnet18", [1.0], [1.0], [50.0], [50.0], "cifar10", stages=2)
    cifar = table_markdown(_results([two_stages], 1, "cifar10"))
    assert "Paper speedup n/a" not in cifar and "1 stage(s) in Plans" not in cifar and "| 1.47x |" in cifar


@pytest.mark.parametrize("speedups, dataset", [([0.8], "cifar10"), ([0.97, 1.0, 1.4], "digits")])
def test_speedup_plot_shows_values_spread_and_the_1_line_with_the_legend_clear(plt, speedups, dataset):
    from experiments.paper_report import speedup_figure

    models = ["resnet18", "resnet34", "resnet50"][:len(speedups)]
    runs = [_run(m, [s * 0.9, s * 1.1], [1.0, 1.0], [9.0], [9.0], dataset) for m, s in zip(models, speedups)]
    fig = speedup_figure(_results(runs, epochs=1, dataset=dataset), plt)
    fig.canvas.draw()
    (ax,) = fig.axes
    _inside(fig)
    title = " ".join(_suptitle(fig).split())
    assert ("CIFAR-10" if dataset == "cifar10" else "digits") in title
    assert "1 epoch" in title and "Test CPU" in title
    texts = _texts(fig)
    for r in runs:
        assert f"{r['speedup']:.2f}x" in texts  # each bar carries its value
    assert ("1.47x" in texts) == (dataset == "cifar10")  # the paper's bar, where it has a figure
    lo, hi = ax.get_ylim()
    one = [line for line in ax.lines if list(line.get_ydata()) == [1.0, 1.0]]
    assert one and lo < 1.0 < hi - 0.1 * (hi - lo)  # the 1.0 line well inside the axes, also for speedups below 1
    assert max(r["speedup_windows"]["max"] for r in runs) < hi  # the whiskers too
    from matplotlib.container import BarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == (2 if dataset == "cifar10" else 1)  # ours, and the paper's where it has a figure
    whisker = bars[0].errorbar.lines[2][0].get_segments()[0]  # the windows' range on our first bar
    spread = runs[0]["speedup_windows"]
    assert [y for _, y in whisker] == pytest.approx([spread["min"], spread["max"]])
    ticks = ax.get_xticks()
    assert [t.get_text() for t in ax.get_xticklabels()] == [{"resnet18": "ResNet-18", "resnet34": "ResNet-34",
                                                           "resnet50": "ResNet-50"}[m] for m in models]
    for k, tick in enumerate(ticks):  # each label under the middle of its model's bars
        group = [c.patches[k] for c in bars]
        assert tick == pytest.approx(sum(p.get_x() + p.get_width() / 2 for p in group) / len(group))
    legend = ax.get_legend().get_window_extent()
    assert not _overlap(legend, ax.get_window_extent())  # outside the axes: it covers no bar


def test_accuracy_plot_of_one_epoch_shows_both_equal_values_apart(plt):
    from experiments.paper_report import accuracy_figure

    fig = accuracy_figure(_results([_run("resnet18", [1.0], [1.0], [8.6], [8.6])], epochs=1, quick=True), plt)
    fig.canvas.draw()
    (ax,) = [a for a in fig.axes if a.lines]
    _inside(fig)
    assert "digits" in _suptitle(fig) and "1 epoch" in _suptitle(fig)
    assert "--quick" in _suptitle(fig) and ax.get_title() == "ResNet-18"
    plain, ours = ax.lines[:2]
    assert plain.get_marker() != ours.get_marker() and plain.get_markerfacecolor() == "none"  # both seen on one spot
    labels = {t.get_text(): t for t in ax.texts}
    assert set(labels) == {"plain 8.6%", "pipedp 8.6%"}
    a, b = (t.get_window_extent() for t in labels.values())
    assert not _overlap(a, b)
    x0, x1 = ax.get_xlim()
    lo, hi = ax.get_ylim()
    assert list(ax.get_xticks()) == [1] and x0 < 1 < x1 and x1 - 1 > 0.4  # not a 0.96-1.04 axis
    assert lo < 8.6 < hi and lo < 10.0 < hi and hi - lo < 30  # the points and chance (10 classes), close up


def test_accuracy_plot_of_many_epochs_and_models(plt):
    from experiments.paper_report import accuracy_figure

    runs = [_run(m, [1.0], [1.0], [10 + 2.8 * e for e in range(30)], [12 + 2.8 * e for e in range(30)], "cifar10")
            for m in ("resnet18", "resnet34", "resnet50")]
    fig = accuracy_figure(_results(runs, epochs=30, dataset="cifar10"), plt)
    fig.canvas.draw()
    _inside(fig)
    axes = [a for a in fig.axes if a.lines]
    assert [a.get_title() for a in axes] == ["ResNet-18", "ResNet-34", "ResNet-50"]
    assert "CIFAR-10" in _suptitle(fig) and "30 epochs" in _suptitle(fig)
    for ax in axes:
        ticks = list(ax.get_xticks())
        assert ticks[0] == 1 and ticks[-1] == 30 and len(ticks) <= 12 and all(float(t).is_integer() for t in ticks)
        assert {"plain 91.2%", "pipedp 93.2%"} == {t.get_text() for t in ax.texts}
        lo, hi = ax.get_ylim()
        assert lo <= 10 and 93.2 < hi <= 105


def test_results_from_before_the_windows_still_render(tmp_path):
    pytest.importorskip("matplotlib")
    from experiments.paper_report import table_markdown, write_outputs

    res = json.load(open(os.path.join(ROOT, "experiments", "results", "paper_quick_cpu_2026-11-23", "results.json")))
    assert "| 0.97x | n/a |" in table_markdown(res) and "recorded before per-window times" in table_markdown(res)
    written = write_outputs(res, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == ["accuracy.png", "speedup.png", "table.md"]
