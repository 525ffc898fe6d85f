"""Bad input stops the run with one line that says why, a nonzero exit, and no model loaded."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from huggingface_hub import constants as hub_constants

import chat_rl
from plumbing import checkpoint, flags
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer

TINY = dict(
    vocab_size=264,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    GPT(GPTConfig(**TINY)).init_weights(0).save_pretrained(str(path))
    ByteTokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(checkpoint, "load_policy", refuse)


def run(argv, capsys):
    code = chat_rl.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


CASES = [
    (["--bogus=1"], "unknown flag --bogus (see --help)"),
    (["--num-step=20"], "unknown flag --num-step (did you mean --num-steps?)"),
    (["--lr", "--seed=1"], "--lr needs a value"),
    (["--num-samples=abc"], "expected int"),
    (["--lr=fast"], "expected float"),
    (["--resume=maybe"], "expected bool"),
    (["--num-samples"], "needs a value"),
    (["demo"], "unexpected argument"),
    (["--preset=huge"], "unknown preset"),
    (["--num-samples=0"], "must be positive"),
    (["--adam-beta2=1"], "--adam-beta2 must be in [0, 1), got 1.0"),
    (["--examples-per-step=-4"], "must be positive"),
    (["--device-batch-size=0"], "must be positive"),
    (["--max-new-tokens=0"], "must be positive"),
    (["--eval-examples=0"], "must be positive"),
    (["--temperature=-0.5"], "must be >= 0"),
    (["--lr=0"], "--lr must be above 0, got 0.0"),
    (["--grad-clip=-1"], "--grad-clip must be >= 0, got -1.0"),
    (["--lr=nan"], "must be a finite number"),
    (["--temperature=inf"], "must be a finite number"),
    (["--num-samples=1"], "--num-samples >= 2"),
    (["--temperature=0"], "--temperature > 0"),
    (["--eval-every=0"], "positive or -1"),
    (["--save-every=0"], "positive or -1"),
    (["--save-every=-5"], "positive or -1"),
    (["--num-steps=0"], "positive or -1"),
    (["--task=chess"], "unknown task 'chess'"),
    (["--advantage=rank"], f"--advantage is {' | '.join(flags.ADVANTAGES)}, not 'rank'"),
    (["--loss-norm=tokens"], "--loss-norm is kept_tokens | all_tokens | sequence, not 'tokens'"),
    (["--device-type=tpu"], "unknown --device-type 'tpu'"),
    (["--device-batch-tokens=10"], "--device-batch-tokens=10 is below --max-new-tokens=768"),
    (["--overlong-buffer=-1"], "--overlong-buffer must be in [0, --max-new-tokens=768]"),
    (["--overlong-buffer=769"], "--overlong-buffer must be in [0, --max-new-tokens=768]"),
    (["--model=/no/such/folder"], "no such folder"),
    (["--model=./relative/missing"], "no such folder"),
]


@pytest.mark.parametrize("argv,reason", CASES, ids=[c[0][0] for c in CASES])
def test_bad_flag_is_refused_in_one_line(argv, reason, capsys, no_model_loading, tmp_path):
    code, err = run(argv + [f"--out-dir={tmp_path / 'run'}"], capsys)
    assert code != 0
    assert len(err) == 1 and err[0].startswith("chat_rl: error:") and reason in err[0], err


def test_a_model_path_that_is_no_model_folder_says_what_to_give_instead(tmp_path):
    # a file, a run's out-dir (its checkpoints are inside), a folder without config.json: each
    # refused before any load
    run_dir, plain_dir, file = (
        tmp_path / "out" / "demo",
        tmp_path / "empty",
        tmp_path / "model.safetensors",
    )
    for step in ("step_000050", "step_000150"):
        (run_dir / step).mkdir(parents=True)
    plain_dir.mkdir()
    file.write_bytes(b"")
    latest = run_dir / "step_000150"
    expected = {
        str(file): "is a file: give the folder that holds its config.json",
        str(run_dir): (
            f"is a run's folder: its checkpoints are its step_* folders, the latest {latest}"
        ),
        str(plain_dir): "holds no config.json: not a Hugging Face model folder",
    }
    for model, reason in expected.items():
        cfg = flags.parse_config(
            ["--preset=demo", f"--model={model}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
        )
        with pytest.raises(flags.ConfigError, match=re.escape(reason)):
            flags.check_config(cfg, world_size=1)


def test_examples_per_step_must_divide_among_ranks():
    cfg = flags.parse_config(
        ["--preset=demo", "--examples-per-step=3"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    with pytest.raises(
        flags.ConfigError, match="not divisible by the 2 ranks: use a multiple of 2, e.g. 2, 4$"
    ):
        flags.check_config(cfg, world_size=2)
    cfg = flags.parse_config(
        ["--preset=demo", "--examples-per-step=1"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    with pytest.raises(flags.ConfigError, match="e.g. 2$"):  # no 0 among the values it suggests
        flags.check_config(cfg, world_size=2)


@pytest.mark.parametrize(
    "argv,reason",
    [
        (["--examples-per-step=30000"], "fewer than --examples-per-step=30000"),
        (["--eval-examples=5000"], "distinct test problems; ask for fewer"),
    ],
)
def test_impossible_data_arithmetic_is_refused(argv, reason, capsys, no_model_loading, tmp_path):
    code, err = run(["--preset=demo", f"--out-dir={tmp_path / 'run'}"] + argv, capsys)
    assert code != 0 and len(err) == 1 and reason in err[0], err


def test_gsm8k_offline_says_how_to_run_the_demo(
    capsys, no_model_loading, tmp_path, monkeypatch, model_dir
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # no cached copy either
    code, err = run(
        ["--task=gsm8k", f"--model={model_dir}", f"--out-dir={tmp_path / 'run'}"], capsys
    )
    assert code != 0 and len(err) >= 1
    assert "could not load openai/gsm8k" in err[-1] and "--preset=demo" in err[-1]


def demo_args(model_dir, out_dir):
    return [
        "--preset=demo",
        f"--model={model_dir}",
        f"--out-dir={out_dir}",
        "--num-steps=2",
        "--examples-per-step=2",
        "--num-samples=2",
        "--max-new-tokens=4",
        "--eval-every=-1",
    ]


def write_checkpoint(argv, model_dir):
    cfg = flags.parse_config(argv, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    model = GPT.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(cfg, 1, model, ByteTokenizer(), opt, rank=0, world=1)
    return cfg.out_dir


def test_corrupt_checkpoint_is_refused_on_resume(capsys, no_model_loading, tmp_path, model_dir):
    argv = demo_args(model_dir, tmp_path / "run")
    out_dir = write_checkpoint(argv, model_dir)
    with open(f"{out_dir}/step_000001/trainer_state.pt", "wb") as f:
        f.write(b"not a checkpoint")
    code, err = run(argv + ["--resume"], capsys)
    assert code != 0 and len(err) == 1 and "step_000001 is unreadable" in err[0]


def test_checkpoint_with_other_settings_is_refused_on_resume(
    capsys, no_model_loading, tmp_path, model_dir
):
    argv = demo_args(model_dir, tmp_path / "run")
    write_checkpoint(argv, model_dir)
    code, err = run(argv + ["--resume", "--lr=0.1"], capsys)
    assert code != 0 and len(err) == 1 and "different settings: lr (0.0003 -> 0.1)" in err[0]


def test_an_existing_run_is_not_overwritten_without_resume(
    capsys, no_model_loading, tmp_path, model_dir
):
    argv = demo_args(model_dir, tmp_path / "run")
    write_checkpoint(argv, model_dir)
    code, err = run(argv, capsys)
    assert code != 0 and len(err) == 1 and "already holds a run" in err[0]


def test_flags_take_their_value_after_an_equals_sign_or_a_space():
    cfg = flags.parse_config(
        ["--lr", "1e-3", "--eval-every", "-1", "--resume", "--num-samples=8", "--wandb", "proj"],
        chat_rl.HYPERPARAMETERS,
        chat_rl.PRESETS,
    )
    assert (cfg.lr, cfg.eval_every, cfg.resume, cfg.num_samples, cfg.wandb) == (
        1e-3,
        -1,
        True,
        8,
        "proj",
    )
    assert (
        flags.parse_config(["--resume", "false"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS).resume
        is False
    )


def test_a_preset_changes_the_defaults_and_flags_still_win():
    cfg = flags.parse_config(
        ["--preset", "demo", "--lr=1e-3"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    defaults = {name: default for name, (default, _) in chat_rl.HYPERPARAMETERS.items()}
    expected = {**defaults, **chat_rl.PRESETS["demo"], "lr": 1e-3, "preset": "demo"}
    assert (
        cfg.lr == 1e-3 and cfg.task == "arith" and cfg.num_samples == 16 and vars(cfg) == expected
    )


def test_every_preset_names_only_real_flags_with_values_of_their_type():
    for preset, values in chat_rl.PRESETS.items():
        for name, value in values.items():
            assert name in chat_rl.HYPERPARAMETERS, f"--preset={preset} sets unknown {name}"
            assert type(value) is type(chat_rl.HYPERPARAMETERS[name][0]), (
                f"--preset={preset}: {name}={value!r}"
            )


def test_a_preset_given_another_model_says_so_in_one_line(capsys, tmp_path):
    cfg = flags.parse_config(
        ["--preset=demo", "--model=some/model"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    note = flags.preset_note(cfg, chat_rl.PRESETS)
    assert "--preset=demo was chosen for --model=demo_model" in note and "--lr=0.0003" in note
    assert "\n" not in note
    own = flags.parse_config(
        [
            "--preset=demo",
            "--model=m/m",
            "--lr=1e-5",
            "--max-new-tokens=96",
            "--eval-examples=9",
            "--eval-samples=2",
            "--lora-lr=1e-4",
        ],
        chat_rl.HYPERPARAMETERS,
        chat_rl.PRESETS,
    )
    assert (
        flags.preset_note(own, chat_rl.PRESETS) == ""
    )  # every tuned value given: nothing to warn about
    plain = flags.parse_config(["--preset=demo"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    assert flags.preset_note(plain, chat_rl.PRESETS) == ""


def note_for(model, preset="smollm2"):
    cfg = flags.parse_config(
        [f"--preset={preset}", f"--model={model}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    return flags.preset_note(cfg, chat_rl.PRESETS)


def smollm2_config():
    """SmolLM2-135M-Instruct's shape, as the hub's config.json and the converted folder's say."""
    return dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                tie_word_embeddings=True)  # fmt: skip


def test_a_preset_given_its_own_model_from_another_folder_says_nothing(tmp_path, monkeypatch):
    # the model is judged by its config.json, not by the path that names it: a copy elsewhere
    # (the config alone is read, never the weights), the hub id of the converted folder, and
    # --preset=demo's own model by another path are the models the presets were made for
    monkeypatch.chdir(tmp_path)  # --preset=smollm2's models/smollm2-135m, relative to here
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m" / "config.json").write_text(json.dumps(smollm2_config()))
    copy = tmp_path / "elsewhere" / "smollm2"
    copy.mkdir(parents=True)
    # another way of writing the same shape: no torch_dtype, the rope written otherwise
    (copy / "config.json").write_text(json.dumps({**smollm2_config(), "rope_theta": 1e5}))
    assert note_for(str(copy)) == ""
    hub = tmp_path / "hub"  # the hub id's config.json in a local Hugging Face cache, offline
    snapshot = hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(smollm2_config()))
    (hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs").mkdir()
    (hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    assert note_for("HuggingFaceTB/SmolLM2-135M-Instruct") == ""
    demo = os.path.join(os.path.dirname(chat_rl.__file__), "demo_model")
    assert note_for(os.path.abspath(demo), preset="demo") == ""


def test_a_preset_given_another_model_by_config_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m" / "config.json").write_text(json.dumps(smollm2_config()))
    for change in (dict(num_hidden_layers=24), dict(vocab_size=151936), dict(model_type="qwen2")):
        other = tmp_path / "other" / "_".join(change)
        other.mkdir(parents=True)
        (other / "config.json").write_text(json.dumps({**smollm2_config(), **change}))
        note = note_for(str(other))
        assert (
            note.startswith("chat_rl: note: --preset=smollm2 was chosen for ")
            and "--lr=3e-05" in note
        )
    # a hub id not in the cache (offline): judged by its name, as before
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert "was chosen for --model=models/smollm2-135m" in note_for("Qwen/Qwen2.5-0.5B-Instruct")


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        chat_rl.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(f"--{name.replace('_', '-')}" in out for name in chat_rl.HYPERPARAMETERS)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("--lr "))
    assert "3e-06" in lines[at]  # the default, then each preset's value on the lines below
    assert "0.0003" in lines[at + 1] and "--preset=demo" in lines[at + 1]


def test_help_opens_with_one_whole_sentence(capsys):
    with pytest.raises(SystemExit):
        chat_rl.main(["--help"])
    first = capsys.readouterr().out.splitlines()[0]
    # the docstring's first line is its whole first paragraph: none of the sentence left for line 2
    assert (
        first.endswith(".")
        and first.count(". ") == 0
        and chat_rl.__doc__.strip().split("\n")[1] == ""
    ), first


def test_a_missing_folder_under_a_folder_here_is_not_taken_for_a_hub_id(
    capsys, no_model_loading, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (
        tmp_path / "my_models"
    ).mkdir()  # so my_models/qwen is a path with a typo, not a hub id to download
    code, err = run(["--model=my_models/qwen", f"--out-dir={tmp_path / 'run'}"], capsys)
    assert (
        code == 2
        and len(err) == 1
        and "--model='my_models/qwen': no such folder" in err[0]
        and "Org/Name" in err[0]
    ), err


def test_the_model_is_checked_before_the_out_dir(
    capsys, no_model_loading, tmp_path, monkeypatch, model_dir
):
    out_dir = write_checkpoint(
        demo_args(model_dir, tmp_path / "run"), model_dir
    )  # a run a new one would overwrite
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_models").mkdir()
    code, err = run(["--model=my_models/qwen", f"--out-dir={out_dir}"], capsys)
    assert code == 2 and len(err) == 1 and "no such folder" in err[0], err


def test_an_org_slash_name_with_no_folder_org_here_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = flags.parse_config(
        ["--model=Qwen/Qwen2.5-0.5B-Instruct", "--device-type=cpu"],
        chat_rl.HYPERPARAMETERS,
        chat_rl.PRESETS,
    )
    flags.check_config(cfg, world_size=1)  # not refused: it is downloaded when the model loads


def test_the_refusal_to_overwrite_names_both_ways_on(capsys, no_model_loading, tmp_path, model_dir):
    argv = demo_args(model_dir, tmp_path / "run")
    write_checkpoint(argv, model_dir)
    (tmp_path / "run-2").mkdir()  # taken: the folder offered must be one no run has
    code, err = run(argv, capsys)
    assert code == 2 and len(err) == 1 and "the same command plus --resume" in err[0], err
    assert err[0].endswith(f"pass --out-dir={tmp_path / 'run-3'}"), err


def test_a_run_cannot_be_lengthened_and_the_refusal_says_how_to_train_on(
    capsys, no_model_loading, tmp_path, model_dir
):
    argv = demo_args(model_dir, tmp_path / "run")  # --num-steps=2
    out_dir = write_checkpoint(argv, model_dir)
    code, err = run(argv + ["--resume", "--num-steps=4"], capsys)
    assert code == 2 and len(err) == 1 and "num_steps (2 -> 4)" in err[0], err
    assert err[0].endswith(
        f"start a new run with --model={out_dir}/step_000001 and a new --out-dir"
    ), err


def test_mps_on_a_machine_without_it_is_refused_in_one_line(
    capsys, no_model_loading, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        torch.backends.mps, "is_available", lambda: False
    )  # so a Mac with MPS sees the same
    code, err = run(["--device-type=mps", f"--out-dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and err == [
        "chat_rl: error: --device-type=mps but MPS is not available on this machine"
    ], err


def test_under_torchrun_a_bad_flag_is_said_once_not_once_per_rank(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "chat_rl",
            "--preset=demo",
            "--device-type=cpu",
            "--lr=0",
            f"--out-dir={tmp_path / 'run'}",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in result.stderr.splitlines() if "chat_rl: error:" in line]
    assert result.returncode != 0 and said == ["chat_rl: error: --lr must be above 0, got 0.0"], (
        result.stderr[-2000:]
    )


def test_an_older_torch_stops_python_m_chat_rl_in_one_line(tmp_path):
    # torch 2.5 lacks what plumbing/fsdp.py imports at its top (fully_shard public from 2.6) and
    # what fsdp.prepare calls (2.8): without the check every run, --fsdp or not, ends in an
    # ImportError's traceback. Here torch says it is 2.5.1 and, as 2.5 does, has no public
    # fully_shard; the run must name the floor before it gets there
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    older = (
        "import runpy, sys, torch, torch.distributed.fsdp as fsdp; "
        "torch.__version__ = '2.5.1'; del fsdp.fully_shard; "
        "sys.argv = ['chat_rl', '--preset=demo', f'--out-dir={sys.argv[1]}']; "
        "runpy.run_module('chat_rl', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", older, str(tmp_path / "run")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "chat_rl needs torch>=2.8 (found 2.5.1): pip install --upgrade 'torch>=2.8'"
    ], result.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_the_torch_floor_is_what_fsdp_calls_and_requirements_say():
    import plumbing

    assert plumbing.torch_floor_message(torch.__version__) == ""  # this torch runs
    for version in ("2.7.1", "2.7.1+cu126", "1.13.0"):
        assert plumbing.torch_floor_message(version).startswith("chat_rl needs torch>=2.8 (found")
    for version in ("2.8.0", "2.10.0+cpu", "3.0.0a0"):  # 2.10 is not below 2.8
        assert plumbing.torch_floor_message(version) == ""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "requirements.txt")) as f:
        assert "torch>=2.8\n" in f.read()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_text(name):
    with open(os.path.join(REPO, "scripts", name)) as f:
        return f.read()


# the scripts that run as commands (the rest are pieces they import)
COMMANDS = sorted(
    name[:-3]
    for name in os.listdir(os.path.join(REPO, "scripts"))
    if name.endswith(".py") and '__name__ == "__main__"' in script_text(name)
)


@pytest.mark.parametrize("script", COMMANDS)
def test_every_script_answers_help_and_runs_nothing(script):
    command = [sys.executable, "-m", f"scripts.{script}", "--help"]
    shown = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    first_line = re.search(r'"""\s*(.+)', script_text(f"{script}.py")).group(1).strip()
    assert shown.returncode == 0, shown.stderr[-300:]
    assert "usage:" in shown.stdout or first_line in shown.stdout, shown.stdout[:300]
