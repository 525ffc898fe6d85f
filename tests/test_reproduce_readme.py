"""scripts/reproduce_readme.py prints the README's demo table from the runs' eval rows: step 0 ->
the last eval, points of change computed before rounding, the tool columns only for runs that had
the tool."""

import json

from scripts import reproduce_readme


def write_run(folder, evals):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, values in evals:
            # a train row, which the table ignores
            f.write(json.dumps({"step": step, "loss": 0.0}) + "\n")
            f.write(json.dumps({"step": step, "split": "eval", **values}) + "\n")


def test_the_table_reads_step_0_and_the_last_eval_of_each_finished_run(tmp_path, capsys):
    start = {
        "greedy": 0.775,
        "pass@1": 0.4925,
        "pass@8": 0.915,
        "tool_use": 0.1469,
        "greedy_tool_use": 0.0,
    }
    end = {
        "greedy": 0.92,
        "pass@1": 0.90125,
        "pass@8": 0.97,
        "tool_use": 0.9919,
        "greedy_tool_use": 1.0,
    }
    write_run(tmp_path / "seed0", [(0, start), (50, {**end, "pass@1": 0.5}), (150, end)])
    write_run(tmp_path / "seed0-none", [(0, start), (150, end)])
    assert reproduce_readme.main([f"--out={tmp_path}", "--print"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "| seed 0 | 49.2% -> 90.1% (+40.9) | 77.5% -> 92.0% (+14.5) "
        "| 91.5% -> 97.0% | 14.7% -> 99.2% | 0% -> 100% |"
    ) in lines
    assert (
        "| seed 0, `--tool=none` | 49.2% -> 90.1% (+40.9) | 77.5% -> 92.0% (+14.5) "
        "| 91.5% -> 97.0% | (off) | (off) |"
    ) in lines
    assert not any(line.startswith("| seed 1 ") for line in lines)  # no run there: no row


def test_the_lora_table_reads_each_run_with_its_trained_parameters_and_step_time(tmp_path, capsys):
    start = {
        "greedy": 0.775,
        "pass@1": 0.5,
        "pass@8": 0.95,
        "tool_use": 0.13,
        "greedy_tool_use": 0.0,
    }
    end = {"greedy": 0.93, "pass@1": 0.9, "pass@8": 0.97, "tool_use": 0.99, "greedy_tool_use": 1.0}
    for name in ("seed0", "seed1-r16"):
        write_run(tmp_path / name, [(0, start), (150, end)])
        with open(tmp_path / name / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": s, "step_time_s": 1.5}) + "\n" for s in range(4))
    assert reproduce_readme.main([f"--out={tmp_path}", "--print", "--lora"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "| seed 0, full | 821,376 | 50.0% -> 90.0% | 77.5% -> 93.0% "
        "| 95.0% -> 97.0% | 13.0% -> 99.0% | 0.1 min |"
    ) in lines
    assert (
        "| seed 1, `--lora-rank=16` | 155,648 | 50.0% -> 90.0% | 77.5% -> 93.0% "
        "| 95.0% -> 97.0% | 13.0% -> 99.0% | 0.1 min |"
    ) in lines
    assert not any(line.startswith("| seed 2") for line in lines)


def test_the_real_model_table_reads_pass_at_k_length_and_the_time_of_steps_and_evals(
    tmp_path, capsys
):
    def metrics(p1, greedy, length):
        return {
            "greedy": greedy,
            "seq_len": length,
            "eval_time_s": 60.0,
            **{f"pass@{k}": min(1.0, p1 * k) for k in range(1, 17)},
        }

    write_run(
        tmp_path / "smollm2-seed1",
        [(0, metrics(0.125, 0.25, 50.4)), (40, metrics(0.5, 0.625, 21.6))],
    )
    with open(tmp_path / "smollm2-seed1" / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"step": s, "step_time_s": 30.0}) + "\n" for s in range(40))
    assert reproduce_readme.main([f"--out={tmp_path}", "--print", "--smollm2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "| seed 1 | 12.5% -> 50.0% (+37.5) | 25.0% -> 62.5% (+37.5) "
        "| 100.0% -> 100.0% | 50 -> 22 | 22 min |"
    ) in lines
    assert (
        "| seed 1 | 12.5 -> 50.0 | 25.0 -> 100.0 | 50.0 -> 100.0 "
        "| 100.0 -> 100.0 | 100.0 -> 100.0 |"
    ) in lines
    assert not any(line.startswith("| seed 0 ") for line in lines)
