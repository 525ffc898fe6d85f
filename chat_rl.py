"""
Reinforcement learning on verifiable math for a chat model: "GRPO" that is really REINFORCE.

Per step: take a batch of problems, sample num_samples completions of each with the KV-cached
engine, score each with a rule-based verifier (GSM8K's "#### <number>", MATH's \\boxed{}), set each
completion's advantage to its reward minus its group's mean reward, and take one step on

    loss = -(sum over valid completion tokens of logp(token) * advantage) / (valid tokens in the step)

How this departs from GRPO as published (DeepSeek-Math, TRL), and why:
  1. No reference model, no KL penalty: the KL term holds the policy near its start, costs a second
     model in memory and a second forward, and with a verifier as the reward there is no reward
     model to over-optimise against.
  2. No importance ratio, no clipping: every batch is sampled by the very weights being updated and
     used for exactly one step, so the ratio is 1 and the clip never acts; what is left is REINFORCE.
  3. No z-score: advantages are r - mean(r), not divided by the group's std, which would blow up
     near-unanimous groups into full-size updates (`--advantage=zscore` brings it back).
  4. Token-level normalisation (DAPO-style): divide by the valid-token count of the whole step, so
     every token weighs the same whatever the length of its completion
     (`--loss-norm=sequence` averages per completion first, as GRPO does).

Run it:
    python -m chat_rl --preset=demo                                   # offline demo, 1 CPU, minutes
    python -m chat_rl                                                 # GSM8K, Qwen2.5-0.5B-Instruct, 1 GPU
    torchrun --standalone --nproc_per_node=8 -m chat_rl               # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HOST:29500 -m chat_rl
Every hyperparameter below is a flag: --num-samples=8, --lr=1e-6, ...; `--help` lists them.
"""

import math
import os
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist

from flags import ConfigError, RunError, check_config, parse_config as parse_flags

# ---- hyperparameters: name = (default, help). Flags override them: --name=value ---------------
HYPERPARAMETERS = dict(
    preset=("", "'demo' = the offline demo: arith task, tiny model, CPU-sized settings (flags still override)"),
    task=("gsm8k", "gsm8k | math | arith (offline procedural word problems)"),
    model=("Qwen/Qwen2.5-0.5B-Instruct", "hub id or Hugging Face folder (config.json + safetensors)"),
    out_dir=("out", "metrics.jsonl, samples.jsonl and checkpoints go here"),
    device_type=("", "cpu | cuda | mps; empty = autodetect"),
    seed=(0, "seeds data order, sampling and evaluation"),
    resume=(False, "continue from the latest complete checkpoint in out_dir"),
    # rollouts
    examples_per_step=(16, "problems per optimizer step, across all ranks"),
    num_samples=(16, "completions sampled per problem (the group)"),
    max_new_tokens=(768, "completion budget; truncated completions score 0, so keep it generous"),
    temperature=(1.0, "sampling temperature for rollouts"),
    top_k=(0, "top-k sampling for rollouts; 0 = full distribution"),
    generate_batch_rows=(256, "most rows (prompts x samples) one engine call decodes at once"),
    # objective
    advantage=("mean", "mean: r - mean(r) | zscore: (r - mean) / (std + eps)"),
    loss_norm=("token", "token: divide by valid tokens of the step | sequence: mean per completion"),
    format_weight=(0.0, "reward = answer + format_weight * format; 0 = pure answer reward"),
    # optimisation
    num_epochs=(1, "passes over the training problems (sets num_steps when that is -1)"),
    num_steps=(-1, "optimizer steps; -1 = derived from num_epochs"),
    device_batch_size=(8, "rows per forward/backward micro-batch"),
    lr=(3e-6, "AdamW peak learning rate, decayed linearly to 0"),
    weight_decay=(0.0, "AdamW weight decay"),
    grad_clip=(1.0, "clip the global gradient norm; 0 = off"),
    max_nonfinite=(5, "stop after this many consecutive non-finite updates (each one is skipped)"),
    # evaluation and checkpoints
    eval_every=(50, "steps between pass@k evals; -1 = off"),
    eval_examples=(400, "held-out problems per eval"),
    eval_samples=(4, "samples per held-out problem at temperature 1.0 (pass@1 ... pass@k)"),
    save_every=(-1, "steps between checkpoints; -1 = only at the end"),
    keep_checkpoints=(2, "how many recent checkpoints to keep"),
    wandb=("", "wandb project to log to; empty = off"),
)

PRESETS = {
    # Offline demo: tiny byte-level model (tools/make_demo_model.py) on tasks/arith.py; minutes on 1 CPU.
    "demo": dict(task="arith", model="demo_model", out_dir="out/demo", device_type="cpu",
                 examples_per_step=16, num_samples=16, max_new_tokens=48, device_batch_size=64,
                 lr=3e-4, num_steps=300, eval_every=50, eval_examples=200, eval_samples=8),
}

REPO = os.path.dirname(os.path.abspath(__file__))


# ---- setup ------------------------------------------------------------------------------------
def setup_distributed(device_type):
    """(rank, world_size, device). torchrun sets RANK; gloo on CPU, nccl on GPU."""
    if not device_type:
        device_type = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
        # ranks sharing one CPU split its cores instead of fighting over them (unless the user said otherwise)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return rank, world, device


def all_reduce_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def load_policy(cfg, device, rank):
    from gpt import GPT
    from tokenizer import load_tokenizer
    path = cfg.model
    if path == "demo_model":
        path = os.path.join(REPO, "demo_model")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            raise RunError(f"{path} is missing its weights: restore it with `git checkout demo_model` "
                           f"or rebuild it with `python -m tools.make_demo_model` (about 20 minutes)")
    try:  # weights stay fp32 (master copy for AdamW); bf16 happens in autocast on CUDA
        return GPT.from_pretrained(path, device=device), load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise RunError(f"cannot load model {cfg.model!r}: {e}") from None


# ---- rollouts -> rewards -> advantages ---------------------------------------------------------
def rollout(engine, task, rows, cfg, seed):
    """Sample num_samples completions per row and score them. Returns a dict of per-row lists (prompt-major)."""
    from tasks.common import conversation, rewards
    tokenizer = engine.tokenizer
    prompts = [tokenizer.render_for_completion(conversation(task, row)) for row in rows]
    per_call = max(1, cfg.generate_batch_rows // cfg.num_samples)  # prompts per engine call
    out = dict(sequences=[], masks=[], answer=[], format=[], total=[], completions=[], truncated=[])
    for start in range(0, len(prompts), per_call):
        seqs, masks = engine.generate_batch(prompts[start:start + per_call], cfg.num_samples, cfg.max_new_tokens,
                                            cfg.temperature, cfg.top_k, seed=seed + start, include_stop=True)
        out["sequences"] += seqs
        out["masks"] += masks
    for i, (seq, mask) in enumerate(zip(out["sequences"], out["masks"])):
        completion_ids = [t for t, m in zip(seq, mask) if m]
        text = tokenizer.decode(completion_ids)
        terms = rewards(task, text, task.reference(rows[i // cfg.num_samples]), cfg.format_weight)
        for key in ("answer", "format", "total"):
            out[key].append(terms[key])
        out["completions"].append(text)
        # the budget ran out before a stop token (a row that stopped ends with one: include_stop)
        out["truncated"].append(not completion_ids or completion_ids[-1] not in tokenizer.stop_tokens)
    return out


def compute_advantages(rewards, num_samples, kind="mean"):
    """rewards (G * S,) prompt-major -> advantages (G * S,): r - mean(r) within each group of S samples."""
    r = rewards.view(-1, num_samples)
    adv = r - r.mean(dim=1, keepdim=True)
    if kind == "zscore":
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)
    # a group of equal rewards has no signal; its float mean can be off by an ulp (16 x 0.1), so zero it
    # exactly: that is what lets the loss skip the group
    unanimous = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return adv.masked_fill(unanimous, 0.0).view(-1)


# ---- loss -> step --------------------------------------------------------------------------------
def make_batch(sequences, masks, device):
    """Right-padded (inputs, targets): targets are -1 on prompt tokens and padding (no gradient there)."""
    T = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), T, dtype=torch.long)
    targets = torch.full((len(sequences), T), -1, dtype=torch.long)
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        n = len(seq) - 1
        inputs[i, :n] = torch.tensor(seq[:-1])
        # token t+1 is a target only if the policy sampled it (mask 1); prompt tokens are given, not chosen
        targets[i, :n] = torch.tensor([tok if m else -1 for tok, m in zip(seq[1:], mask[1:])])
    return inputs.to(device), targets.to(device)


def policy_gradient_backward(model, sequences, masks, advantages, cfg, device, autocast):
    """
    Accumulate the REINFORCE gradient of this rank's rows into .grad; returns (loss, valid_tokens).
    Rows of groups whose advantages are all zero carry no gradient: they are dropped before any
    forward pass. The normaliser is the valid-token count of the whole step summed over ranks
    (reduced here, one scalar), so micro-batching and rank count do not change the loss; gradients
    are then summed over ranks by sync_gradients. Every rank calls the same collectives, whatever
    number of rows it kept, so a rank with nothing to learn from cannot hang the others.
    """
    num_samples = cfg.num_samples
    group_active = advantages.view(-1, num_samples).abs().sum(dim=1) > 0
    keep = [i for i in range(len(sequences)) if group_active[i // num_samples]]
    keep.sort(key=lambda i: len(sequences[i]))  # similar lengths share a micro-batch: less padding
    tokens = torch.tensor([float(sum(masks[i][1:])) for i in keep] + [0.0]).sum().to(device)
    seq_count = torch.tensor(float(len(keep)), device=device)
    totals = all_reduce_sum(torch.stack([tokens, seq_count]))
    normaliser = totals[0] if cfg.loss_norm == "token" else totals[1]
    loss_sum = torch.zeros((), device=device)
    if normaliser == 0:
        return loss_sum, 0
    for start in range(0, len(keep), cfg.device_batch_size):
        rows = keep[start:start + cfg.device_batch_size]
        inputs, targets = make_batch([sequences[i] for i in rows], [masks[i] for i in rows], device)
        adv = advantages[rows].to(device)
        with autocast:
            logp = -model(inputs, targets, loss_reduction="none")  # (B, T), 0 where target is -1
        per_token = logp * adv[:, None]
        if cfg.loss_norm == "sequence":  # GRPO: mean over each completion's tokens first
            per_token = per_token / (targets >= 0).sum(dim=1, keepdim=True).clamp(min=1)
        loss = -per_token.sum() / normaliser
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum, int(totals[0])


def sync_gradients(model):
    """Sum gradients over ranks (the loss is already divided by the global normaliser)."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


# ---- eval ------------------------------------------------------------------------------------------
def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(engine, task, rows, cfg, rank, world, device, autocast, seed):
    """pass@1..pass@k at temperature 1.0 over the held-out rows, each rank taking every world-th row."""
    mine = rows[rank::world]
    k = cfg.eval_samples
    sums = torch.zeros(k + 1, device=device)  # pass@1..k sums, then the problem count
    samples = []
    eval_cfg = SimpleNamespace(**{**vars(cfg), "num_samples": k, "temperature": 1.0, "top_k": 0, "format_weight": 0.0})
    if mine:
        with autocast:
            out = rollout(engine, task, mine, eval_cfg, seed)
        for g in range(len(mine)):
            c = int(sum(out["answer"][g * k:(g + 1) * k]))
            for j in range(1, k + 1):
                sums[j - 1] += pass_at_k(k, c, j)
        sums[k] = len(mine)
        samples = [dict(question=task.prompt(mine[g]), reference=task.reference(mine[g]),
                        completion=out["completions"][g * k], reward=out["total"][g * k]) for g in range(min(3, len(mine)))]
    sums = all_reduce_sum(sums)
    return {f"pass@{j}": round(float(sums[j - 1] / sums[k]), 4) for j in range(1, k + 1)}, samples


# ---- the run ------------------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_config(argv)
        check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # before any process group, model or data
        rank, world, device = setup_distributed(cfg.device_type)
        return train(cfg, rank, world, device)
    except RunError as e:  # anything else is a bug and keeps its traceback
        print(f"chat_rl: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, rank, world, device):
    import checkpoint
    from engine import Engine
    from tasks.common import get_task
    print0 = print if rank == 0 else (lambda *a, **k: None)
    task = get_task(cfg.task)
    try:  # data before the model: fail fast
        train_rows, eval_rows = task.load("train"), task.load("test", limit=cfg.eval_examples)
    except (RuntimeError, ValueError) as e:
        raise RunError(str(e)) from None
    steps_per_epoch = len(train_rows) // cfg.examples_per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"{cfg.task} has {len(train_rows)} training problems, fewer than --examples-per-step={cfg.examples_per_step}")
    num_steps = cfg.num_steps if cfg.num_steps > 0 else cfg.num_epochs * steps_per_epoch
    start_step, state = 0, None
    if not cfg.resume and checkpoint.has_run(cfg.out_dir):
        raise ConfigError(f"{cfg.out_dir} already holds a run: pass --resume to continue it, or choose another --out-dir")
    if cfg.resume:
        start_step, state = checkpoint.find_resumable(cfg, world)  # refuses corrupt or mismatched ones
        cfg.model = state["model_dir"] if start_step else cfg.model
    if world > 1:  # every rank must have found the same checkpoint, and looked before rank 0 writes anything
        found = torch.tensor([start_step, -start_step], device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found[0] != -found[1]:
            raise ConfigError(f"ranks found different checkpoints in {cfg.out_dir}: it must be one folder all ranks see")
    model, tokenizer = load_policy(cfg, device, rank)
    engine = Engine(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if state:
        checkpoint.restore(state, optimizer, rank)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    os.makedirs(cfg.out_dir, exist_ok=True)
    log = checkpoint.MetricsLog(cfg.out_dir, rank, keep_below_step=start_step, wandb_project=cfg.wandb, config=vars(cfg))
    print0(f"chat_rl: task={cfg.task} model={cfg.model} ({model.num_params() / 1e6:.1f}M params) ranks={world} "
           f"device={device.type} steps={start_step}->{num_steps} out={cfg.out_dir}")
    stop = checkpoint.StopFlag()  # SIGTERM / SIGINT: finish the step, checkpoint, exit 0
    per_rank = cfg.examples_per_step // world
    last_pass1, nonfinite_in_row, t_start = float("nan"), 0, time.time()
    steps_done, last_saved = start_step, start_step if state else -1
    for step in range(start_step, num_steps + 1):
        steps_done = step
        if stop.requested(device):
            break
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == num_steps):
            model.eval()
            metrics, samples = evaluate(engine, task, eval_rows, cfg, rank, world, device, autocast, seed=cfg.seed + 7)
            last_pass1 = metrics["pass@1"]
            log.write({"step": step, "split": "eval", **metrics}, samples)
            print0(f"eval step {step}: " + " ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        if step == num_steps:
            break
        # 1. this rank's problems: a fixed permutation per epoch, step s takes the s-th slice
        t0 = time.time()
        epoch, offset = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        first = offset * cfg.examples_per_step + rank * per_rank
        rows = [train_rows[i] for i in order[first:first + per_rank].tolist()]
        # 2-3. rollouts and rewards
        model.eval()
        with autocast:
            out = rollout(engine, task, rows, cfg, seed=(cfg.seed * 100_003 + step) * 1009 + rank * 101)
        t_rollout = time.time() - t0
        # 4. advantages within each group
        rewards = torch.tensor(out["total"], dtype=torch.float32)
        advantages = compute_advantages(rewards, cfg.num_samples, cfg.advantage)
        # 5-6. loss, gradients summed over ranks, step
        model.train()
        lr = cfg.lr * (1 - step / num_steps)  # linear decay to 0
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss, valid_tokens = policy_gradient_backward(model, out["sequences"], out["masks"], advantages, cfg, device, autocast)
        sync_gradients(model)
        loss = float(all_reduce_sum(loss.detach().clone()))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf")))
        if not math.isfinite(grad_norm) or not math.isfinite(loss):
            nonfinite_in_row += 1  # the same on every rank: loss and norm are of the summed step
            print0(f"step {step}: non-finite loss/gradient, update skipped ({nonfinite_in_row} in a row)")
            if nonfinite_in_row >= cfg.max_nonfinite:
                raise RunError(f"{nonfinite_in_row} non-finite updates in a row at step {step}; "
                               f"lower --lr or check the model's dtype")
        elif valid_tokens > 0:
            nonfinite_in_row = 0
            optimizer.step()
        # metrics, reduced over ranks
        gen_tokens = sum(sum(m) for m in out["masks"])
        sums = all_reduce_sum(torch.tensor([sum(out["total"]), sum(out["answer"]), sum(out["format"]), gen_tokens,
                                            sum(out["truncated"]), len(out["total"]), t_rollout], device=device))
        n = float(sums[5])
        dt = time.time() - t0
        row = dict(step=step, reward=sums[0] / n, reward_answer=sums[1] / n, reward_format=sums[2] / n,
                   loss=loss, lr=lr, seq_len=sums[3] / n, truncated=sums[4] / n,
                   valid_tokens=valid_tokens, grad_norm=grad_norm, rollout_tokens_per_s=sums[3] / (sums[6] / world),
                   step_time_s=dt, skipped_nonfinite=int(nonfinite_in_row > 0))
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        log.write({k: _json_number(v) for k, v in row.items()})
        eta = (time.time() - t_start) / (step + 1 - start_step) * (num_steps - step - 1)
        print0(f"step {step + 1}/{num_steps} | reward {row['reward']:.3f} | pass@1 {last_pass1:.3f} | "
               f"loss {row['loss']:+.4f} | len {row['seq_len']:.0f} | {row['rollout_tokens_per_s']:.0f} tok/s | "
               f"{dt:.1f}s | eta {eta / 60:.1f} min")
        if cfg.save_every > 0 and (step + 1) % cfg.save_every == 0 and step + 1 < num_steps:
            checkpoint.save(cfg, step + 1, model, tokenizer, optimizer, rank, world)
            last_saved = step + 1
    if steps_done != last_saved:  # a stop right after a save (or a resume) has nothing new to write
        checkpoint.save(cfg, steps_done, model, tokenizer, optimizer, rank, world)
    print0(f"{'stopped' if steps_done < num_steps else 'done'} at step {steps_done}/{num_steps} after "
           f"{(time.time() - t_start) / 60:.1f} min; checkpoint in {cfg.out_dir}")
    log.close()
    return 0


def _json_number(v):
    """Round floats for a readable log; non-finite values become null (NaN is not JSON)."""
    if isinstance(v, torch.Tensor):
        v = float(v)
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    return v


def parse_config(argv):
    return parse_flags(argv, HYPERPARAMETERS, PRESETS, __doc__)


if __name__ == "__main__":
    sys.exit(main())
