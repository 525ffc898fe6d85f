"""LoRA (policy/lora.py) on tiny random Qwen2 / Qwen3 / Llama models that transformers makes: the
start is the base bit for bit, only the adapters train, the merged checkpoint and the PEFT folder
load elsewhere with the same logits, --model takes a PEFT folder, and runs resume bit for bit and
agree on 2 ranks."""

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import chat_rl
import test_hf_checkpoints as hf_ckpt  # a module object, so pytest does not collect its tests twice
import test_resume
from engine import Engine, generate_reference
from fast.logprobs import fast_logprobs, plain_logprobs
from plumbing import checkpoint, flags, start
from plumbing.flags import ConfigError
from policy import lora
from policy.gpt import GPT
from policy.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["qwen2", "qwen3", "llama"]
DEFAULTS = flags.parse_config([], chat_rl.HYPERPARAMETERS)  # every flag at its default


def base_folder(tmp_path, family):
    """A random model of the family saved by transformers, with a tokenizer's files beside it
    (chat_rl loads both)."""
    path, hf = hf_ckpt.save_hf_model(tmp_path, family)
    ByteTokenizer().save_pretrained(path)
    return path, hf


def with_trained_adapters(model, rank=4, seed=1, **kwargs):
    """Adapters as training might leave them: B nonzero, so every adapter changes the model."""
    lora.add_adapters(model, rank, 8.0, seed=seed, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def idx():
    return torch.randint(0, hf_ckpt.VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_with_b_zero_the_model_is_the_base_bit_for_bit(tmp_path, family):
    path, _ = base_folder(tmp_path, family)
    base, adapted = (
        GPT.from_pretrained(path).eval(),
        lora.add_adapters(GPT.from_pretrained(path).eval(), 4, 8.0),
    )
    with torch.no_grad():
        assert torch.equal(base(idx()), adapted(idx()))
    prompts = [[1, 5, 9], [3, 3, 7, 2]]
    greedy = [
        Engine(m, hf_ckpt.NoStopTokenizer()).generate_batch(prompts, 2, 12, temperature=0.0)[0]
        for m in (base, adapted)
    ]
    assert greedy[0] == greedy[1]
    # and the adapters are there: with B moved, the logits move
    with torch.no_grad():
        assert not torch.equal(
            base(idx()), with_trained_adapters(GPT.from_pretrained(path).eval())(idx())
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_adapters_get_gradients_the_same_on_the_fast_and_the_plain_path(tmp_path, family):
    path, _ = base_folder(tmp_path, family)
    grads = []
    for logprobs in (fast_logprobs, plain_logprobs):
        model = with_trained_adapters(GPT.from_pretrained(path))
        seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 9, 4, 4, 4, 4, 4], [9, 9, 5]]
        masks = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1], [0, 0, 1]]
        adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
        chat_rl.policy_gradient_backward(
            model,
            seqs,
            masks,
            adv,
            num_samples=2,
            device_batch_size=8,
            loss_norm="all_tokens",
            device=torch.device("cpu"),
            logprobs=logprobs,
        )
        names = {name for name, p in model.named_parameters() if p.grad is not None}
        assert names == {name for name, p in model.named_parameters() if ".lora." in name}, names
        assert all(
            not p.requires_grad for name, p in model.named_parameters() if ".lora." not in name
        )
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for name, g in grads[0].items() if "lora_A" in name)


def save_checkpoint(model, out_dir, base):
    cfg = SimpleNamespace(out_dir=str(out_dir), model=base, keep_checkpoints=2)
    optimizer = start.adamw([p for p in model.parameters() if p.requires_grad], 1e-3, DEFAULTS)
    checkpoint.save(cfg, 1, model, ByteTokenizer(), optimizer, rank=0, world=1)
    return out_dir / "step_000001"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_checkpoint_and_the_peft_folder_give_the_models_logits(tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _ = base_folder(tmp_path, family)
    model = with_trained_adapters(GPT.from_pretrained(path).eval())
    folder = save_checkpoint(model, tmp_path / "run", path)
    with torch.no_grad():
        ours = model(idx())
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()(idx()).logits
        peft = (
            PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(path), folder / "adapter"
            )
            .eval()(idx())
            .logits
        )
    torch.testing.assert_close(merged, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(peft, ours, rtol=1e-5, atol=1e-5)
    config = json.load(open(folder / "adapter" / "adapter_config.json"))
    assert (
        config["base_model_name_or_path"] == path
        and config["r"] == 4
        and len(config["target_modules"]) == 7
    )
    assert not any(
        ".lora" in name for name in load_file(folder / "model.safetensors")
    )  # a plain folder


def test_some_projections_only_and_the_adapters_keys_are_peft_s(tmp_path):
    path, _ = base_folder(tmp_path, "qwen2")
    model = with_trained_adapters(
        GPT.from_pretrained(path).eval(), targets=["q_proj", "v_proj", "down_proj"]
    )
    keys = set(lora.adapter_state_dict(model))
    assert keys == {
        f"base_model.model.model.layers.{i}.{part}.lora_{ab}.weight"
        for i in range(2)
        for ab in "AB"
        for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    folder = save_checkpoint(model, tmp_path / "run", path)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(folder)(idx()).logits,
            model(idx()),
            rtol=1e-5,
            atol=1e-5,
        )


def build(model, lora_rank, **kwargs):
    cfg = SimpleNamespace(
        model=model,
        lora_rank=lora_rank,
        lora_alpha=32.0,
        lora_targets="all-linear",
        seed=0,
        **kwargs,
    )
    return checkpoint.build_policy(cfg, None, "cpu")[0].eval()


def test_model_may_be_a_peft_folder_trained_on_or_merged_for_full_fine_tuning(tmp_path):
    path, _ = base_folder(tmp_path, "llama")
    model = with_trained_adapters(GPT.from_pretrained(path).eval())
    adapter = str(save_checkpoint(model, tmp_path / "run", path) / "adapter")
    with torch.no_grad():
        expected = model(idx())
        on = build(adapter, lora_rank=4)  # trained on: the same adapters, trainable
        torch.testing.assert_close(on(idx()), expected, rtol=0, atol=0)
        assert {n for n, p in on.named_parameters() if p.requires_grad} == {
            n for n, p in model.named_parameters() if p.requires_grad
        }
        full = build(adapter, lora_rank=0)  # merged: a plain model, every weight trainable
        torch.testing.assert_close(full(idx()), expected, rtol=1e-5, atol=1e-5)
        assert not lora.has_adapters(full) and all(p.requires_grad for p in full.parameters())
    with pytest.raises(ConfigError, match="is a rank-4 adapter: to train it on, --lora-rank=4"):
        build(adapter, lora_rank=8)


def test_a_peft_folder_merged_on_the_meta_device_has_the_cpu_builds_parameters(tmp_path):
    """Under --fsdp every rank but the first builds --model on the meta device and takes rank 0's
    values (plumbing/start.py): a PEFT folder merged for full fine-tuning there must come out with
    the same parameters as on the CPU, adapters merged away, nothing allocated."""
    path, _ = base_folder(tmp_path, "llama")
    model = with_trained_adapters(GPT.from_pretrained(path).eval())
    adapter = str(save_checkpoint(model, tmp_path / "run", path) / "adapter")
    cfg = SimpleNamespace(model=adapter, lora_rank=0, lora_alpha=32.0, lora_targets="all-linear")
    built = {
        where: checkpoint.build_policy(cfg, None, torch.device(where), torch.float32)[0]
        for where in ("cpu", "meta")
    }
    cpu, meta = ([(n, p.shape, p.dtype) for n, p in built[w].named_parameters()] for w in built)
    assert meta == cpu and not lora.has_adapters(built["meta"])
    assert all(p.is_meta for p in built["meta"].parameters())


def test_a_lora_run_trains_only_the_adapters_and_the_optimizer_holds_only_them(tmp_path):
    out = tmp_path / "run"
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                "--lora-rank=2",
                f"--out-dir={out}",
                "--num-steps=2",
                "--examples-per-step=2",
                "--num-samples=4",
                "--max-new-tokens=40",
                "--eval-every=-1",
            ]
        )
        == 0
    )
    state = torch.load(out / "step_000002" / "trainer_state.pt", weights_only=True)
    adapters = load_file(out / "step_000002" / "adapter" / "adapter_model.safetensors")
    held = [len(group["params"]) for group in state["optimizer"]["param_groups"]]
    assert (
        held == [len(adapters)] and len(state["optimizer"]["state"]) == len(adapters) == 4 * 7 * 2
    )  # A, B: 7 x 4 layers
    assert any(
        t.abs().sum() > 0 for name, t in adapters.items() if "lora_B" in name
    )  # trained: B moved from 0
    base, merged = (
        load_file(os.path.join(folder, "model.safetensors"))
        for folder in (os.path.join(REPO, "demo_model"), out / "step_000002")
    )
    assert all(
        torch.equal(base[k], merged[k]) for k in base if "norm" in k or "embed" in k
    )  # frozen: norms, embeddings
    assert any(not torch.equal(base[k], merged[k]) for k in base)  # the adapters folded in


def test_lora_with_fsdp_is_refused_in_one_line(tmp_path, capsys):
    assert (
        chat_rl.main(["--preset=demo", "--lora-rank=4", "--fsdp", f"--out-dir={tmp_path / 'run'}"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "chat_rl: error: --lora-rank with --fsdp is not built"
    ), err


def test_a_lora_run_killed_and_resumed_matches_the_uninterrupted_run_bit_for_bit(tmp_path):
    def argv(out):
        return [
            *test_resume.args(os.path.join(REPO, "demo_model"), out),
            "--lora-rank=2",
            "--lora-lr=1e-2",
        ]

    whole = test_resume.launch(argv(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = test_resume.launch(argv(tmp_path / "killed"), "metrics", 2)
    assert killed.returncode != 0
    resumed = test_resume.launch([*argv(tmp_path / "killed"), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [
        [
            {k: v for k, v in json.loads(line).items() if k not in test_resume.TIMING_KEYS}
            for line in open(out / "metrics.jsonl")
        ]
        for out in (tmp_path / "whole", tmp_path / "killed")
    ]
    assert rows[0] == rows[1]
    final = [
        load_file(out / "step_000005" / "adapter" / "adapter_model.safetensors")
        for out in (tmp_path / "whole", tmp_path / "killed")
    ]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert any(t.abs().sum() > 0 for name, t in final[0].items() if "lora_B" in name)


def test_two_ranks_train_the_adapters_one_process_trains(tmp_path):
    flags = [
        "--preset=demo",
        "--lora-rank=2",
        "--num-steps=2",
        "--examples-per-step=4",
        "--num-samples=4",
        "--max-new-tokens=40",
        "--eval-every=2",
        "--eval-examples=4",
        "--eval-samples=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "chat_rl",
            *flags,
            f"--out-dir={tmp_path / 'two'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert chat_rl.main([*flags, f"--out-dir={tmp_path / 'one'}"]) == 0
    rows = [
        [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        for run in ("one", "two")
    ]
    for one, two in zip(*rows):
        for key in {"reward", "seq_len", "pass@1", "greedy", "kept_tokens"} & set(one):
            assert one[key] == pytest.approx(two[key], rel=1e-5), key
    adapters = [
        load_file(tmp_path / run / "step_000002" / "adapter" / "adapter_model.safetensors")
        for run in ("one", "two")
    ]
    for k in adapters[0]:  # summed in another order: a share of one AdamW step apart at most
        apart, moved = (adapters[0][k] - adapters[1][k]).abs().max(), adapters[0][k].abs().max()
        assert apart <= 0.05 * moved + 1e-7, k
    assert any(t.abs().sum() > 0 for name, t in adapters[0].items() if "lora_B" in name)


@pytest.mark.parametrize(
    "family, whole", [("llama", "lm_head"), ("qwen2", "embed_tokens")]
)  # untied; tied
def test_the_head_or_the_embeddings_train_whole_when_named_and_peft_loads_them(
    tmp_path, family, whole
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _ = base_folder(tmp_path, family)
    targets = lora.parse_targets(f"all-linear,{whole}")
    model = with_trained_adapters(
        GPT.from_pretrained(path).eval(), targets=targets
    )  # the head/embeddings moved too
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    named = {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}[whole]
    assert named in trained and {n for n in trained if ".lora." not in n} == {
        named
    }  # a tied head: one matrix
    folder = save_checkpoint(model, tmp_path / "run", path)
    config = json.load(open(folder / "adapter" / "adapter_config.json"))
    assert config["modules_to_save"] == (
        [whole] if family == "llama" else ["embed_tokens", "lm_head"]
    )
    assert len(config["target_modules"]) == 7
    with torch.no_grad():
        ours = model(idx())
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()(idx()).logits
        peft = (
            PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(path), folder / "adapter"
            )
            .eval()(idx())
            .logits
        )
        again = build(
            str(folder / "adapter"), lora_rank=4
        )  # --model=<this PEFT folder>, trained on
        torch.testing.assert_close(merged, ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(peft, ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again(idx()), ours, rtol=0, atol=0)
    assert {n for n, p in again.named_parameters() if p.requires_grad} == trained


def peft_snippet():
    """docs/checkpoints.md's PEFT lines, as printed."""
    with open(os.path.join(REPO, "docs", "checkpoints.md")) as f:
        text = f.read().split("## A LoRA run's adapter", 1)[1]
    return text.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_an_adapter_and_its_base_moved_together_load_with_the_peft_lines(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    project = tmp_path / "project"  # a base beside the run: recorded from the adapter's folder
    shutil.copytree(os.path.join(REPO, "demo_model"), project / "models" / "demo")
    monkeypatch.chdir(project)
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                "--model=models/demo",
                "--lora-rank=2",
                "--out-dir=out",
                "--num-steps=2",
                "--examples-per-step=2",
                "--num-samples=4",
                "--max-new-tokens=40",
                "--eval-every=-1",
            ]
        )
        == 0
    )
    with open(project / "out" / "step_000002" / "adapter" / "adapter_config.json") as f:
        recorded = json.load(f)["base_model_name_or_path"]
    assert recorded == "../../../models/demo"
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path)  # and run from another folder
    merged = tmp_path / "moved" / "out" / "step_000002"
    adapter = merged / "adapter"
    code, n = re.subn(
        r'^adapter = "[^"]*"', f"adapter = {str(adapter)!r}", peft_snippet(), flags=re.MULTILINE
    )
    # the base line as the docs say to write it for a base recorded relative to the adapter
    code, m = re.subn(
        r'from_pretrained\("Qwen/[^"]*"\)',
        f"from_pretrained(os.path.join(adapter, {recorded!r}))",
        code,
    )
    assert n == m == 1, code
    namespace = {}
    exec(compile("import os\n" + code, "docs/checkpoints.md (PEFT lines)", "exec"), namespace)
    text = "Ava has 23 pens. #### 34"
    ids = torch.tensor([namespace["tokenizer"].encode(text)])
    assert ids.tolist()[0] == ByteTokenizer().encode(text)  # the run's tokenizer, from the adapter
    with torch.no_grad():
        peft = namespace["model"].eval()(ids).logits
        whole = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
        ours = build(str(adapter), lora_rank=2)(ids)  # --model=<the moved adapter>: its base found
    torch.testing.assert_close(peft, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, peft, rtol=1e-5, atol=1e-5)
    trained = load_file(adapter / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)  # it moved the model


def test_the_base_is_recorded_as_a_hub_id_or_a_folder_loading_from_elsewhere(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "a1b2"
    beside = tmp_path / "models" / "base"
    for folder in (snapshot, beside, tmp_path / "elsewhere"):
        folder.mkdir(parents=True)
    adapter = tmp_path / "out" / "step_000001" / "adapter"

    def recorded(model, run_in=tmp_path):
        monkeypatch.chdir(run_in)
        return checkpoint.lora_base(SimpleNamespace(model=str(model)), str(adapter))

    assert recorded("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # as given
    assert recorded(snapshot) == "Qwen/Qwen2.5-0.5B-Instruct"  # a folder of the hub's cache: its id
    assert recorded(beside) == "../../../models/base"  # beside the run: from the adapter
    assert recorded(beside, run_in=tmp_path / "elsewhere") == str(beside)  # elsewhere: absolute


def test_the_engine_stacks_each_adapter_once_a_call_not_once_a_token(tmp_path, monkeypatch):
    path, _ = base_folder(tmp_path, "qwen2")
    model = with_trained_adapters(GPT.from_pretrained(path).eval())  # B moved: the terms count
    adapters = [m for m in model.modules() if isinstance(m, lora.Adapter)]
    built, stacked = [], lora.Adapter.stacked

    def counted(self):
        built.append(self)
        return stacked(self)

    monkeypatch.setattr(lora.Adapter, "stacked", counted)
    tokenizer = ByteTokenizer()  # the reference sampler decodes what it draws
    tokenizer.stop_tokens, tokenizer.vocab_size = set(), hf_ckpt.VOCAB  # every row to the end
    prompts = [[1, 5, 9], [3, 3, 7, 2]]
    kw = dict(num_samples=2, max_new_tokens=12, temperature=1.0, seed=1)
    samples = Engine(model, tokenizer).generate(prompts, **kw)
    assert len(built) == len(adapters)  # once each, for the whole call
    assert all(adapter.built is None for adapter in adapters)  # and made afresh after it
    built.clear()
    reference = generate_reference(model, tokenizer, prompts, **kw)
    assert len(built) > 10 * len(adapters)  # the plain sampler: each pass stacks them again
    assert samples[:4] == reference[:4]
