"""A reward for --task=data (README, "Your own task"): 1 if the number after the completion's last
'####' is the row's target, else 0. chat_rl calls it once per completion, with the completion's
text and its row."""

import re


def reward(completion, row):  # row: every column of the completion's row
    numbers = re.findall(r"####\s*(-?\d+)", completion)
    return float(bool(numbers) and int(numbers[-1]) == row["target"])
