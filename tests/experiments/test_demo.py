from experiments.demo import demo, main, pattern_data


def test_demo_runs_and_learns_on_cpu(capsys):
    out = demo(["--steps", "8", "--batch", "16", "--width", "8", "--windows", "1", "--stages", "2"])
    text = capsys.readouterr().out
    assert "2 stage(s) x 4 microbatch(es)" in text
    assert "step 7: loss" in text and "images/s: plain" in text and "x of plain" in text
    losses = out["losses"]
    assert sum(losses[-2:]) < sum(losses[:2])  # the offline data is learnable
    assert out["plain_images_per_s"] > 0 and out["pipedp_images_per_s"] > 0


def test_pattern_data_is_deterministic():
    a, b = pattern_data(2, 4), pattern_data(2, 4)
    assert all((x1 == x2).all() and (y1 == y2).all() for (x1, y1), (x2, y2) in zip(a, b, strict=True))


def test_main_returns_an_exit_status(capsys):
    assert main(["--steps", "2", "--batch", "8", "--width", "4", "--windows", "1", "--microbatches", "2"]) == 0
    assert "images/s: plain" in capsys.readouterr().out
    assert main(["--steps", "1", "--batch", "4", "--width", "4", "--stages", "two"]) == 1  # one line, no traceback
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m experiments.demo: error:") and "two" in line
