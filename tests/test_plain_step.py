"""chat_rl.plain_step, the step in plain torch, against train()'s first step on the demo: the same
completions, rewards and gradient, so a reader can learn the algorithm from the plain one."""

import pytest
import torch

import chat_rl
from calculator import calculate
from plumbing import checkpoint
from tasks import arith

NUM_SAMPLES, MAX_NEW_TOKENS = 4, 40


def first_step_of_train(tmp_path, monkeypatch, *flags):
    """train()'s step 0 on the demo: its rollout's arguments and output, and the gradient the update
    was given (after the sum over ranks, before clipping)."""
    seen = {}
    rollout, optimizer_step = chat_rl.rollout, chat_rl.optimizer_step

    def recording_rollout(engine, task, problems, *args, **kwargs):
        out = rollout(engine, task, problems, *args, **kwargs)
        seen.update(problems=problems, seed=args[4], out=out)
        return out

    def recording_step(model, optimizer, *args):
        seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        return optimizer_step(model, optimizer, *args)

    monkeypatch.setattr(chat_rl, "rollout", recording_rollout)
    monkeypatch.setattr(chat_rl, "optimizer_step", recording_step)
    argv = ["--preset=demo", f"--out-dir={tmp_path}", "--num-steps=1", "--eval-every=-1",
            "--examples-per-step=4", f"--num-samples={NUM_SAMPLES}",
            f"--max-new-tokens={MAX_NEW_TOKENS}", "--device-batch-size=5", *flags]  # fmt: skip
    assert chat_rl.main(argv) == 0
    return seen


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_train_takes_the_plain_steps_gradient(tmp_path, monkeypatch, temperature):
    train = first_step_of_train(tmp_path, monkeypatch, f"--temperature={temperature}")
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")  # the weights step 0 starts at
    loss, rewards = chat_rl.plain_step(model, tokenizer, arith, train["problems"], NUM_SAMPLES,
                                       MAX_NEW_TOKENS, temperature, train["seed"],
                                       tool=calculate)  # fmt: skip
    assert rewards == train["out"]["total"]  # the same completions, scored the same
    groups = torch.tensor(rewards).view(-1, NUM_SAMPLES)
    assert (groups.amax(1) > groups.amin(1)).any(), "no group with signal: no gradient to compare"
    assert loss != 0
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, train["grads"][name], rtol=1e-4, atol=1e-7), name
