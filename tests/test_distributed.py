"""Two CPU ranks (gloo): gradients equal one process's over the union of their groups; ranks stay in sync."""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
from distributed import sync_gradients
from gpt import GPT, GPTConfig
from tokenizer import ByteTokenizer

NUM_SAMPLES, DEVICE_BATCH_SIZE = 2, 3
CONFIG = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def groups_for(rank, step):
    """Each rank's rollouts at a step: rank 0 two groups, rank 1 one live group plus one all-equal group."""
    g = torch.Generator().manual_seed(100 * step + rank)
    n_groups = 2
    seqs, masks = [], []
    for _ in range(n_groups * NUM_SAMPLES):
        prompt_len = int(torch.randint(2, 5, (1,), generator=g))
        completion_len = int(torch.randint(1, 7, (1,), generator=g))
        seqs.append(torch.randint(0, 256, (prompt_len + completion_len,), generator=g).tolist())
        masks.append([0] * prompt_len + [1] * completion_len)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0]) if rank == 0 else torch.tensor([1.0, 0.0, 1.0, 1.0])
    return seqs, masks, chat_rl.compute_advantages(rewards, NUM_SAMPLES)


def model_for_test():
    return GPT(GPTConfig(**CONFIG)).init_weights(0)


def _worker(rank, world, init_file, out_dir, dead_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = model_for_test()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        seqs, masks, adv = groups_for(rank, step)
        if rank == dead_rank:
            adv = torch.zeros_like(adv)  # nothing to learn on this rank: it still joins every collective
        opt.zero_grad(set_to_none=True)
        chat_rl.policy_gradient_backward(model, seqs, masks, adv, NUM_SAMPLES, DEVICE_BATCH_SIZE, "kept_tokens", "cpu")
        sync_gradients(model)
        if step == 0:
            torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, os.path.join(out_dir, f"grad{rank}.pt"))
        opt.step()
    torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), os.path.join(out_dir, f"params{rank}.pt"))
    dist.destroy_process_group()


def run_two_ranks(tmp_path, dead_rank=-1):
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), dead_rank), nprocs=2, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"grad{r}.pt") for r in range(2)], [torch.load(tmp_path / f"params{r}.pt") for r in range(2)]


def test_two_rank_gradient_equals_one_process_over_the_union(tmp_path):
    grads, _ = run_two_ranks(tmp_path)
    model = model_for_test()
    union = [groups_for(r, 0) for r in range(2)]
    seqs = union[0][0] + union[1][0]
    masks = union[0][1] + union[1][1]
    adv = torch.cat([union[0][2], union[1][2]])
    chat_rl.policy_gradient_backward(model, seqs, masks, adv, NUM_SAMPLES, DEVICE_BATCH_SIZE, "kept_tokens", "cpu")
    for name, p in model.named_parameters():
        for r in range(2):
            assert torch.allclose(grads[r][name], p.grad, atol=1e-6, rtol=0), name


def test_parameters_stay_identical_on_both_ranks(tmp_path):
    _, params = run_two_ranks(tmp_path)
    assert torch.equal(params[0], params[1])


def test_a_rank_with_no_live_groups_does_not_hang_and_stays_in_sync(tmp_path):
    _, params = run_two_ranks(tmp_path, dead_rank=1)
    assert torch.equal(params[0], params[1])
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in model_for_test().parameters()]))


def test_torchrun_two_ranks_runs_the_demo(tmp_path):
    model_dir = tmp_path / "model"
    model_for_test().save_pretrained(str(model_dir))
    ByteTokenizer().save_pretrained(str(model_dir))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "chat_rl",
           "--preset=demo", f"--model={model_dir}", f"--out-dir={out}", "--device-type=cpu", "--num-steps=2",
           "--examples-per-step=4", "--num-samples=4", "--max-new-tokens=8", "--eval-every=1",
           "--eval-examples=6", "--eval-samples=2"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
    result = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "split" not in r] == [0, 1]
    assert [r["step"] for r in rows if r.get("split") == "eval"] == [0, 1, 2]
    assert (out / "step_000002" / "model.safetensors").exists()
