"""python -m scripts.plot draws a run's metrics.jsonl into a PNG, torn last lines and all."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(folder, steps=4, greedy=True):
    """A short run: integer steps 0..steps-1, no truncation at all, eval rows every 2 steps."""
    rows = [
        {"step": s, "reward": 0.5 + s / 10, "seq_len": 30 - s, "truncated": 0.0}
        for s in range(steps)
    ]
    rows += [
        {
            "step": s,
            "split": "eval",
            "pass@1": 0.4 + s / 10,
            "pass@2": 0.6 + s / 20,
            **({"greedy": 0.7} if greedy else {}),
        }
        for s in range(0, steps + 1, 2)
    ]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 4, "rew')  # a run killed mid-line
    return str(folder)


def plot_command(*args):
    return subprocess.run(
        [sys.executable, "-m", "scripts.plot", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_plot_writes_a_png_of_a_run_and_prints_its_path(tmp_path):
    from matplotlib.image import imread

    result = plot_command(write_run(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{tmp_path / 'metrics.png'}\n"
    image = imread(tmp_path / "metrics.png")
    assert image.shape[:2] == (770, 1210)  # the 11 x 7 inch figure at 110 dpi
    assert (
        len({tuple(p) for p in image.reshape(-1, image.shape[2])[::97]}) > 10
    )  # drawn on: not a blank page


def test_plot_out_names_the_file(tmp_path):
    result = plot_command(write_run(tmp_path / "run"), f"--out={tmp_path / 'elsewhere.png'}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "elsewhere.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (
        tmp_path / "run" / "metrics.png"
    ).exists()


def test_plot_panels(tmp_path):
    from scripts.plot import figure

    fig = figure([write_run(tmp_path / "a"), write_run(tmp_path / "b", greedy=False)])
    reward, passk, _, truncated = fig.axes
    for ax in fig.axes:  # a 4-step run: ticks at whole steps only, not 0.5, 1.5, ...
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks
    # truncation 0 throughout: the axis runs 0 to 1 (a fraction), not matplotlib's +-0.04 around 0
    low, high = truncated.get_ylim()
    assert -0.05 < low < 0 and high == 1.0
    # train reward: each run's raw line (faint) and its running mean (labelled, opaque)
    assert len(reward.lines) == 4 and [
        line.get_label() for line in reward.lines if not line.get_label().startswith("_")
    ] == ["a", "b"]
    assert "running mean of 20 steps" in reward.get_title()
    raw, smooth = reward.lines[:2]
    assert raw.get_alpha() < 0.5 and smooth.get_alpha() is None
    assert list(smooth.get_ydata()) == pytest.approx([0.5, 0.55, 0.6, 0.65])
    # pass@1 solid (the run's one legend entry), pass@2 dashed,
    # greedy dotted where rows carry it (run a only)
    styles = [(line.get_label(), line.get_linestyle()) for line in passk.lines]
    assert [(label, style) for label, style in styles if not label.startswith("_")] == [
        ("a", "-"),
        ("b", "-"),
    ]
    assert sorted(style for _, style in styles) == sorted(["-", "--", ":", "-", "--"])
    assert "greedy (dotted)" in passk.get_title() and "pass@1 (solid)" in passk.get_title()
    # each curve is the run's values at its steps (the torn last line left out)
    a_pass1, a_pass2, a_greedy = (
        (list(line.get_xdata()), list(line.get_ydata())) for line in passk.lines[:3]
    )  # run a's, drawn first
    assert a_pass1 == ([0, 2, 4], pytest.approx([0.4, 0.6, 0.8]))
    assert a_pass2 == ([0, 2, 4], pytest.approx([0.6, 0.7, 0.8]))
    assert a_greedy == ([0, 2, 4], pytest.approx([0.7, 0.7, 0.7]))
    assert list(raw.get_xdata()) == [0, 1, 2, 3] and list(raw.get_ydata()) == pytest.approx(
        [0.5, 0.6, 0.7, 0.8]
    )
    length = fig.axes[2].lines[0]
    assert (
        list(length.get_ydata()) == [30, 29, 28, 27]
        and list(truncated.lines[0].get_ydata()) == [0.0] * 4
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp_path: tmp_path / "nope", "plot: no such folder: {}"),
        (lambda tmp_path: tmp_path, "plot: {} has no metrics.jsonl"),
    ],
)
def test_plot_of_no_run_says_what_is_missing_in_one_line(tmp_path, make, message):
    folder = make(tmp_path)
    result = plot_command(folder)
    err = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(err) == 1 and err[0].startswith(message.format(folder)), (
        result.stderr
    )


def test_plot_without_arguments_prints_its_usage():
    result = plot_command()
    assert result.returncode != 0 and result.stderr.startswith("usage: python -m scripts.plot")


def test_plot_draws_tool_use_beside_truncation_when_rows_carry_it(tmp_path):
    from scripts.plot import figure

    run = write_run(tmp_path / "a")
    with open(
        os.path.join(run, "metrics.jsonl"), "a"
    ) as f:  # after the torn line: a run resumed, now with the tool
        f.write(
            "\n"
            + "\n".join(
                json.dumps(
                    {"step": s, "reward": 0.9, "seq_len": 30, "truncated": 0.0, "tool_use": s / 10}
                )
                for s in range(4, 8)
            )
            + "\n"
        )
    fig = figure([run, write_run(tmp_path / "b")])
    tool_panel = fig.axes[3]
    solid = [line for line in tool_panel.lines if line.get_linestyle() == "-"]
    assert (
        len(solid) == 1 and solid[0].get_label() == "a"
    )  # run b never logged tool use: no tool line, truncation labelled
    assert list(solid[0].get_ydata())[-1] == pytest.approx(
        sum([0.4, 0.5, 0.6, 0.7]) / 8
    )  # running mean
    assert sorted(
        line.get_label() for line in tool_panel.lines if not line.get_label().startswith("_")
    ) == ["a", "b"]
    assert "calculator" in tool_panel.get_title()
