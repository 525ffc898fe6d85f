"""scripts/gpu_check.py on tiny CPU shapes: every check still runs end to end, so that the command meant for a GPU
has run before it first meets one."""

from scripts import gpu_check


def test_quick_cpu_run_passes_every_check(capsys):
    assert gpu_check.main(["--quick", "--device-type=cpu"]) == 0
    table = capsys.readouterr().out.split("| check | result | note |", 1)[1]
    cells = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    rows = {cell[0].strip("| "): cell[1] for cell in cells}
    assert list(rows) == gpu_check.CHECKS
    for check, result in rows.items():
        assert result in ("pass", "ran (CPU)"), (check, result)
