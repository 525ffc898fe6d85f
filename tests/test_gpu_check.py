"""scripts/gpu_check.py on tiny CPU shapes, in CUDA's precision (bf16 autocast, bf16 gathers, a bf16
LoRA base; two gloo ranks where a GPU machine has two NCCL ones): every check still runs end to end,
so that the command meant for a GPU has run before it first meets one, and each result comes with
the line that says what it means."""

from scripts import gpu_check


def test_quick_cpu_run_passes_every_check(capsys):
    assert gpu_check.main(["--quick", "--device-type=cpu"]) == 0
    table = capsys.readouterr().out.split("| check | result | note |", 1)[1]
    cells = [
        line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    rows = {cell[0].strip("| "): cell[1] for cell in cells}
    assert list(rows) == gpu_check.CHECKS
    for check, result in rows.items():
        assert result in ("pass", "ran (CPU)"), (check, result)
    # then one line a check: what its result means for a run
    meanings = table.split("what this means for a run here:\n", 1)[1].splitlines()
    for line, (check, result) in zip(meanings, rows.items(), strict=True):
        assert line == f"  {check}: {result}: {gpu_check.meaning(check, result)}"
