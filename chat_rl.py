"""
chat_rl trains a chat model on verifiable math with the plain policy gradient (REINFORCE).

Called "GRPO" in the field: REINFORCE with the group's mean reward as baseline. Completions that
beat their group's average get their log-probability raised, the others lowered.

This docstring is the algorithm. plain_step(), below the hyperparameters, is the same step in under
fifty lines of plain torch; train_step() is the run's step, with the options and the fast paths.
tests/test_plain_step.py holds the run to plain_step, and `python -m scripts.check_step` prints the
run's first steps beside the formulas below, worked by hand. The fast sampler (engine.Engine) and
the fast log-probs (fast/) have tests that hold them to plain versions: you need not read them.

Symbols, on one rank (one torchrun process; a laptop has one):
  K        num_samples: the completions of one problem, its "group"
  B        this rank's rows: its problems x K. A row is a prompt's tokens, then one completion's.
  T        the longest row's length - 1 (each micro-batch of the run has its own B and T)
  mask     per row and token: 1 where the policy drew the token, 0 on the prompt and on the
           calculator's results
  S_i      the tokens row i sampled: the columns where mask[1:] == 1 (in code: targets >= 0)
  r, A     (B,): each row's reward and advantage
  logp     (B, T): column t is the log-prob of the row's token t + 1, predicted from token t, under
           softmax(logits / temperature); 0 outside S_i
  N        one number: sum_j |S_j|, the sampled tokens of every row of the step, on all ranks
           (logged as sampled_tokens at the default flags; the run carries it as N_i, (B,), N in
           every entry)
  kept     the rows of the groups whose A is not all 0, "with signal" (rows_with_gradient);
           kept_tokens is their sampled tokens on all ranks. It is not N.

One optimizer step s at the default flags, as each rank runs it:
  1  problems: this rank's share of the next examples_per_step problems of the epoch's shuffle
  2  for each problem, its rows k = 0 .. K-1, at each reply position j until a stop token or the
     max_new_tokens budget:
         p = softmax(logits[:vocab_size] / temperature)
         token = the first v with cumsum(p)[v] > u[k, j] * cumsum(p)[-1]
  3  r = 1 if the verifier finds the right final answer, else 0
  4  A = r - the mean of r over the row's group            (exactly 0 for a unanimous group)
  5  L = -sum_i sum_{t in S_i} A_i * logp[i, t] / N        (backward through the kept rows only)
  6  gradients: summed over ranks                          (not averaged: N counts every rank's)
     lr = --lr * (1 - s / num_steps)                       (s = 0, 1, ...; no warmup)
         (num_steps: --num-steps, or num_epochs x (training rows // examples_per_step))
     clip: the gradient times min(1, --grad-clip / (its norm + 1e-6)), --grad-clip = 1
     AdamW step (fused, betas (0.9, 0.95), eps 1e-8, no weight decay), skipped when L or the
     norm is not finite or kept_tokens is 0
  7  every eval_every steps: held-out greedy accuracy, and pass@1..k at temperature 1

Details that matter, numbered by step:
  1  The step number alone picks the problems, so a resumed run continues where it stopped.
  2  u is a (K, max_new_tokens) table of uniform numbers in [0, 1), drawn before sampling from the
     problem's own random stream. That stream is seeded by the problem's place in the step, so a
     problem samples the same tokens on 1 rank or 8. A stop token (any of the tokenizer's
     stop_tokens) is sampled and trained like any other token. The calculator writes each call's
     result in (`<<48/2=` gets `24>>`): those tokens have mask 0 and count toward
     max_new_tokens, and their positions' u go unused (u is indexed by reply position).
  3  A completion the budget cut off is graded as it stands (no final answer: 0). A reward
     function that raises gives 0.
  5  A row: prompt p0 p1, sampled a0, the calculator's c0, sampled stop token s.
         row p0 p1 a0 c0 s   mask 0 0 1 0 1   columns 0-3 predict p1 a0 c0 s   S_i = {1, 3}
     N counts unanimous groups' tokens, cut-off completions' and stop tokens; not the prompt, the
     calculator's tokens or padding. tests/test_rl_math.py works N out by hand (N = 7).
  6  The gradients are zeroed before the rollout and before each update's backward; the
     micro-batches' backwards add up. A skipped step still moves the lr on; AdamW's step count
     does not move. --max-nonfinite (5) non-finite steps in a row stop the run (a step with
     kept_tokens 0 neither counts nor resets them: plumbing/metrics.check_nonfinite). With
     --lora-rank, --lora-lr replaces --lr.

Where each step is in the code:
  1    plumbing/data.problems_for_step (plain_step is handed its result)
  2-3  plain_step: engine.generate_reference (the model over each whole row), tasks/common.rewards
       run: rollout() -> engine.Engine, with a KV cache: the same tokens, but where batching's
       rounding of a logit, or the Engine's sums of p in blocks, cross a token's boundary
       (tests/test_reference_sampler.py)
  4    compute_advantages; the run calls it through step_advantages()
  5    plain_step: make_batch, plain_logprobs, one loss line
       run: policy_gradient_backward() -> normaliser() (N) -> plumbing/passes.py (micro-batches
       of kept rows) -> objective() (the loss)
  6    plumbing/distributed.sync_gradients, then optimizer_step() (AdamW: plumbing/start.adamw)
  7    the run: plumbing/evaluation.py
To change the step: the loss is objective()'s first branch; the advantage compute_advantages()
(step_advantages() where it reads more of the rollout); the reward rollout()'s total; N
normaliser(); the rows that train rows_with_gradient(). docs/objective.md has a recipe for each.
Put a change behind a flag that is off by default: a change of the default also moves plain_step's
loss line and its compute_advantages call, and scripts/check_step.py's hand formulas.
Every option that switches something on is off by default and changes one step:
plumbing/flags.py's docstring lists them by step. Under --dtype=bf16 (a GPU's default) the numbers
round differently from plain_step's fp32, and the sampler's log-probs from the loss's
(--rollout-correction weighs that).

How this departs from GRPO as published (DeepSeek-Math, TRL), and why:
  1. No reference model, no KL penalty. The KL term holds the policy near its start, at the cost
     of a second model in memory and a second forward pass; with a verifier as the reward there
     is no reward model to over-optimise. (--kl-beta brings it back: k3 to the frozen start.)
  2. No importance ratio, no clipping. Every batch is sampled by the weights being updated and
     used for one step, so the ratio is 1 and the clip never acts: REINFORCE. (--ppo-epochs=2
     brings them back: two updates a rollout, the second clipped.)
  3. No z-score. Advantages are r - mean(r), not divided by the group's std, which would blow up
     near-unanimous groups into full-size updates (--advantage=zscore brings it back).
  4. Token-level normalisation (TRL's loss_type="dapo"): every token weighs the same whatever its
     completion's length, and steps shrink as groups turn unanimous (less left to learn).
     N counts unanimous groups' tokens too; the DAPO paper's batches hold only groups with
     signal, which --loss-norm=kept_tokens matches. (--loss-norm=sequence is GRPO's mean per
     completion.)

Run it:
    python -m chat_rl --preset=demo                      # offline demo, 1 CPU, minutes
    python -m chat_rl                                    # GSM8K, Qwen2.5-0.5B-Instruct, 1 GPU
    torchrun --standalone --nproc_per_node=8 -m chat_rl  # 8 GPUs (nodes: README; 7B: docs/gpu.md)
"""

import math
import os
import sys
import time
from functools import partial
from inspect import signature

# torch's OpenMP threads busy-wait by default, which beside any other work slows a CPU run several
# times over (docs/benchmarks.md); OpenMP reads the policy once, as torch loads: set it before
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from tqdm import tqdm

from engine import generate_reference
from fast.logprobs import LOGPROBS, RolloutLogprobs, make_batch, plain_logprobs, sampled_tokens
from plumbing import fsdp, loop, metrics, refill
from plumbing.data import derive_seed, problems_for_step
from plumbing.distributed import all_reduce_sum, sync_gradients
from plumbing.flags import run
from plumbing.passes import backward_passes
from tasks.common import conversation, rewards as reward_terms

# ---- hyperparameters -----------------------------------------------------------------------------
# What a fork edits: name=(default, meaning) of the default run (GSM8K, a real model, GPUs), then
# the presets' changes. Each is a flag too (--num-samples=8), which wins over both; see --help.
HYPERPARAMETERS = dict(
    task=(
        "gsm8k",
        "gsm8k | math | arith, mental (offline) | data (--data) | rg:<dataset> | "
        "pkg.module | task.py",
    ),
    model=("Qwen/Qwen2.5-0.5B-Instruct", "hub id | Hugging Face folder | PEFT LoRA folder"),
    out_dir=("out", "metrics.jsonl, samples.jsonl and checkpoints go here"),
    device_type=("", "cpu | cuda | mps; empty = autodetect"),
    dtype=(
        "auto",
        "fp32 | bf16 (autocast, fp32 weights) | auto: bf16 on CUDA, and on a CPU with bf16 units "
        "for a model whose matmuls gain from it (plumbing/distributed.bf16_pays)",
    ),
    seed=(0, "seeds data order, sampling and evaluation"),
    resume=(False, "continue from the latest complete checkpoint in out_dir"),
    # rollouts
    examples_per_step=(16, "problems per optimizer step, across all ranks (a multiple of them)"),
    num_samples=(16, "completions sampled per problem (the group)"),
    max_new_tokens=(768, "completion budget; a reply cut off before its answer scores 0"),
    temperature=(1.0, "sampling temperature for rollouts, > 0 (the loss's log-probs use it too)"),
    top_k=(0, "top-k for rollouts; 0 = full distribution (the loss ignores the cut: keep 0)"),
    generate_batch_rows=(256, "most rows (prompts x samples) per engine call, >= one prompt's"),
    tool=("calculator", "calculator | none: answer <<expr= calls mid-rollout (eval too)"),
    # objective
    advantage=("mean", "mean: r - mean(r) | zscore: (r - mean(r)) / (std(r) + 1e-4)"),
    loss_norm=("all_tokens", "the loss's N (normaliser()): all_tokens | kept_tokens | sequence"),
    mask_truncated=(False, "cut-off completions (no stop token) train no token"),
    refill=(0, "dynamic sampling: up to this many more rollouts a step for groups with signal"),
    kl_beta=(0.0, "weight of a k3 KL to the frozen starting policy; 0 = off"),
    ppo_epochs=(1, "updates on each rollout; > 1: PPO's clipped ratio in the loss"),
    clip_eps=(0.2, "--ppo-epochs > 1: the ratio clipped to [1 - clip_eps, 1 + clip_eps_high]"),
    clip_eps_high=(-1.0, "-1 = --clip-eps; above it: DAPO's clip-higher (its 0.28)"),
    rollout_correction=("none", "none | tis | mis: the sampler's rounding corrected (README)"),
    rollout_cap=(2.0, "--rollout-correction's bound on p_trainer / p_sampler (TRL's 2)"),
    logprobs=("fast", "the loss's log-probs: fast | plain (all logits at once)"),
    # rewards: terms added in rollout(), before the advantages (the objective never sees them)
    format_weight=(0.0, "reward = answer + format_weight * format; 0 = answer only"),
    overlong_buffer=(0, "DAPO's soft overlong reward: the last N of max_new_tokens cost 0 -> 1"),
    # optimisation
    num_epochs=(1, "passes over the training problems (when num_steps is -1)"),
    num_steps=(-1, "optimizer steps; -1 = derived from num_epochs"),
    device_batch_size=(8, "most rows per forward/backward micro-batch"),
    device_batch_tokens=(16384, "most tokens (rows x padded length) per micro-batch"),
    lr=(3e-6, "AdamW peak learning rate; step s uses lr x (1 - s / num_steps)"),
    lora_rank=(0, "rank of the LoRA adapters; 0 = full fine-tuning"),
    lora_alpha=(32.0, "LoRA's scale is lora_alpha / lora_rank"),
    lora_targets=("all-linear", "all-linear | q_proj,v_proj,... (,lm_head: trained whole)"),
    lora_lr=(3e-5, "peak learning rate with --lora-rank > 0, instead of --lr"),
    weight_decay=(0.0, "AdamW weight decay"),
    adam_beta1=(0.9, "AdamW's decay of its gradient mean"),
    adam_beta2=(0.95, "AdamW's decay of its squared-gradient mean (0.95 as LLMs use)"),
    grad_clip=(1.0, "clip the global gradient norm; 0 = off"),
    max_nonfinite=(5, "stop after this many non-finite updates in a row"),
    # memory (docs/gpu.md: "Past one GPU's memory")
    fsdp=(False, "FSDP2: shard weights, grads, AdamW (16 B/param won't fit)"),
    activation_checkpointing=(False, "recompute layers in backward: less memory, 1/3 more compute"),
    # evaluation and checkpoints
    eval_every=(50, "steps between pass@k evals; -1 = off"),
    eval_only=(False, "evaluate --model once (no training, no checkpoint) and stop"),
    eval_examples=(400, "held-out problems per eval"),
    eval_samples=(4, "samples per held-out problem at temperature 1.0"),
    save_every=(-1, "steps between checkpoints; -1 = only at the end"),
    keep_checkpoints=(2, "how many recent checkpoints to keep"),
    wandb=("", "wandb project to log to; empty = off"),
    # your own rows and reward (README "Your own task"): --data alone selects --task=data
    data=("", "rows: a .jsonl/.parquet/.csv file, a folder of them or a hub id"),
    data_config=("", "the hub data set's configuration, e.g. main"),
    train_split=("train", "--data's split to train on (a folder's or a hub data set's)"),
    eval_split=("test", "--data's split of held-out rows, unless --eval-data"),
    eval_data=("", "held-out rows: a file, a folder (its --eval-split) or a hub id"),
    prompt_column=("question", "--task=data: the column holding the prompt"),
    answer_column=("answer", "--task=data: the column holding the answer"),
    instruction=("", "--task=data: text appended to every prompt after a blank line"),
    verifier=("gsm8k", "--task=data: gsm8k (#### n) | math (\\boxed{}) | exact (stripped text)"),
    reward=("", "--task=data: file.py:function(completion, row) -> float, not the verifier"),
    system_prompt=("", "a system turn before every prompt (chat template)"),
    # the built-in tasks' own options
    gsm8k_answer=("hash", "--task=gsm8k's rule: hash (the first '#### n') | last-number"),
    mental_digits=(1, "--task=mental's operands: 1 (1 to 10), 2 (10 to 99) or 3 (100 to 999)"),
    mental_ops=("+-x", "--task=mental's operations: some of + - x (x alone: products only)"),
    rg_config=("", "--task=rg:<dataset>: reasoning-gym's options, JSON or a .json file"),
    rg_train_size=(1000, "--task=rg:<dataset>: training rows generated (held-out ones dropped)"),
)

# fmt: off
PRESETS = dict(
    # the offline demo on one CPU: demo_model/, the 0.8M-parameter model of make_demo_model.py
    demo=dict(task="arith", model="demo_model", out_dir="out/demo", device_type="cpu",
              examples_per_step=12, max_new_tokens=64, num_steps=150, device_batch_size=64,
              lr=3e-4, lora_lr=1e-3, eval_examples=200, eval_samples=8),
    # docs/smollm2.md: SmolLM2-135M-Instruct (scripts/convert_gguf.py makes it
    # offline) on a CPU; 8 x 8 samples of 64 tokens a step, lr 3e-5 (1e-5 learned 2x slower);
    # fp32: bf16 (with --rollout-correction=tis) ran the whole preset 0.78-1.88x as fast on a 2-core
    # CPU with bf16 units, as uneven as its replies' length; one seed learned less (benchmarks.md)
    smollm2=dict(task="mental", model="models/smollm2-135m", out_dir="out/smollm2",
                 device_type="cpu", dtype="fp32", examples_per_step=8, num_samples=8,
                 max_new_tokens=64, tool="none", num_steps=20, device_batch_size=16, lr=3e-5,
                 lora_lr=3e-4, eval_every=10, eval_examples=64, eval_samples=16),
)
# fmt: on
# objective()'s flags: train_step() hands each one's value to it as batch.<name>. Their defaults in
# HYPERPARAMETERS are their "off" values, written nowhere else. A flag of your own for objective():
# its line in HYPERPARAMETERS, its name here, its bad values refused in
# plumbing/flags.check_objective (a flag for a kind of advantage is not one: docs/objective.md).
OBJECTIVE_FLAGS = (
    "kl_beta",
    "ppo_epochs",
    "clip_eps",
    "clip_eps_high",
    "rollout_correction",
    "rollout_cap",
)  # fmt: skip
OFF = {name: HYPERPARAMETERS[name][0] for name in OBJECTIVE_FLAGS}


# ---- the step, plainly ---------------------------------------------------------------------------
def plain_step(model, optimizer, tokenizer, task, problems, num_samples, max_new_tokens,
               temperature, seed, step, num_steps, peak_lr, tool, grad_clip=1.0,
               first_id=0):  # fmt: skip
    """Steps 2-6 at the default flags in plain torch, fp32, on one rank: sample, score, advantage,
    loss, backward, update. Returns (L, this rank's rewards).
    problems: this rank's share of the step's problems; first_id: the place of the first of them
    in the step (rank x len(problems)); seed: the step's seed (the run's is derive_seed(--seed,
    "rollout", step)); optimizer: plumbing/start.adamw's; tool: calculator.calculate or None;
    grad_clip 0 is off. tests/test_rl_math.py holds the pieces it shares with the run
    (compute_advantages, make_batch, rows_with_gradient, optimizer_step) to formulas written out."""
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    prompts = [tokenizer.render_for_completion(conversation(task, p)) for p in problems]
    # 2. sample num_samples completions of each prompt, a token at a time, running the model over
    # each whole row (no cache). Each problem's random stream is seeded by its place in the step.
    seeds = [derive_seed(seed, first_id + i) for i in range(len(problems))]
    samples = generate_reference(model, tokenizer, prompts, num_samples, max_new_tokens,
                                 temperature, seed=seeds, tool=tool, include_stop=True)  # fmt: skip
    # 3. score each completion's text with the task's verifier
    rewards = []
    for i, sequence in enumerate(samples.sequences):
        problem, prompt = problems[i // num_samples], prompts[i // num_samples]
        text = tokenizer.decode(sequence[len(prompt) :])
        rewards.append(reward_terms(task, text, task.reference(problem), row=problem)["total"])
    # 4. A_i = r_i - the mean reward of row i's group, (rows,)
    advantages = compute_advantages(torch.tensor(rewards), num_samples).to(device)
    # 5. this rank's share of L. inputs and targets (rows, T) are a row shifted by one: prompt
    # p0 p1, sampled a0 a1 -> inputs p0 p1 a0, targets -1 a0 a1 (-1: not sampled, or padding)
    inputs, targets = make_batch(samples.sequences, samples.masks, device)
    # logp (rows, T): each target's log-prob under softmax(logits / temperature), 0 where the
    # target is -1, so the sum below runs over S_i alone
    logp = plain_logprobs(model, inputs, targets, temperature, vocab_size=tokenizer.vocab_size)
    N = all_reduce_sum((targets >= 0).sum())  # a number: the step's sampled tokens, all ranks
    loss = -(advantages[:, None] * logp).sum() / N
    loss.backward()
    # 6. sum the gradients over ranks (N already counts every rank's tokens), set the lr, then
    # the run's optimizer_step(): clip, AdamW, or skip when kept_tokens is 0 or not finite
    sync_gradients(model)
    lr = peak_lr * (1 - step / num_steps)
    kept = rows_with_gradient(advantages, num_samples)
    kept_tokens = int(all_reduce_sum((targets[kept] >= 0).sum()))
    loss = float(all_reduce_sum(loss.detach()))  # L: the ranks' shares summed
    optimizer_step(model, optimizer, lr, grad_clip, loss, kept_tokens)
    return loss, rewards


# ---- the run -------------------------------------------------------------------------------------
# train_step() is plain_step() with the options and the fast paths; train() runs it with evals and
# checkpoints (plumbing/loop.py). Editing objective() needs nothing of fast/: the fast log-probs
# check the gradient they send against objective()'s own (fast/logprobs.Guess).


# ---- 2-3. rollouts and rewards -------------------------------------------------------------------
def rollout(engine, task, problems, num_samples, max_new_tokens, temperature, top_k, seed,
            format_weight=0.0, generate_batch_rows=256, progress="", problem_ids=None,
            system_prompt="", overlong_buffer=0):  # fmt: skip
    """Steps 2-3: sample num_samples completions of each problem and score them. Returns a dict of
    lists with one entry per completion, in problem order (problems[0]'s samples first).
    A problem's samples come from a random stream seeded by seed and the problem's id (its place
    in the step or the eval set), so neither the ranks nor the batching change them. Each engine
    call takes generate_batch_rows // num_samples problems (at least one). Callers: train_step(),
    plumbing/refill.py and plumbing/evaluation.py.
      sequences, masks   prompt + reply token ids; mask 1 where the policy sampled the token
      sampler_logp       per token: the log-prob the engine drew it with (0 where not sampled);
                         None for a stand-in engine without them
      total              the reward the advantages read: answer, plus format_weight * format,
                         plus the overlong penalty (training only; the evals grade the answer)
      answer, format, overlong, tokens, truncated, completions, tool_calls, tool_errors,
      tool_use, reward_errors   the reward's terms and what the train row logs"""
    tokenizer = engine.tokenizer
    chats = [conversation(task, problem, system_prompt=system_prompt) for problem in problems]
    prompts = [tokenizer.render_for_completion(chat) for chat in chats]
    per_call = max(1, generate_batch_rows // num_samples)  # prompts per engine call
    problem_ids = list(range(len(problems)) if problem_ids is None else problem_ids)
    keys = "sequences masks sampler_logp answer format overlong total tokens completions truncated"
    out = {key: [] for key in (keys + " tool_calls tool_errors tool_use reward_errors").split()}
    calls, quiet = range(0, len(prompts), per_call), None if progress else True
    for first in tqdm(calls, desc=progress, unit="call", leave=False, disable=quiet):
        # include_stop keeps the stop token in the row, so ending the answer is trained too
        seeds = [derive_seed(seed, i) for i in problem_ids[first : first + per_call]]
        samples = engine.generate(prompts[first : first + per_call], num_samples, max_new_tokens,
                                  temperature, top_k, include_stop=True, seed=seeds)  # fmt: skip
        for key in ("sequences", "masks", "tool_calls", "tool_errors"):  # tool_calls: per sample
            out[key] += getattr(samples, key)
        # None: a stand-in engine without them (both of engine.py's samplers keep them)
        out["sampler_logp"] += samples.logprobs or [None] * len(samples.sequences)
    for i, seq in enumerate(out["sequences"]):
        # the reply: the policy's tokens (mask 1) with the calculator's results among them (mask 0)
        completion_ids = seq[len(prompts[i // num_samples]) :]
        text = tokenizer.decode(completion_ids)  # special tokens (the stop token) dropped
        row = problems[i // num_samples]
        terms = reward_terms(task, text, task.reference(row), format_weight, row=row)
        # --overlong-buffer counts the reply's length as max_new_tokens does (tool results and
        # the stop token in it), so a cut-off reply pays the full -1
        overlong = overlong_penalty(len(completion_ids), max_new_tokens, overlong_buffer)
        terms = {**terms, "total": terms["total"] + overlong}  # off: + 0.0, the same number
        for key in ("answer", "format", "total"):
            out[key].append(terms[key])
        out["overlong"].append(overlong)
        out["reward_errors"].append(terms.get("error"))  # a user's reward that raised, or None
        out["tokens"].append(len(completion_ids))  # tool results in it (the loss's N: not)
        out["tool_use"].append(float(out["tool_calls"][i] > 0))
        out["completions"].append(text)
        # the budget ran out before a stop token (a completion that stopped ends with one)
        out["truncated"].append(
            not completion_ids or completion_ids[-1] not in tokenizer.stop_tokens
        )
    return out


def training_rewards(cfg):
    """rollout()'s reward terms past the answer, which training samples with (train_step() and
    each --refill round, through one partial of rollout) and the evals do not (they grade the
    answer alone). A term of your own: its flag here, once, and its argument in rollout()."""
    return dict(format_weight=cfg.format_weight, overlong_buffer=cfg.overlong_buffer)


def overlong_penalty(length, max_new_tokens, buffer):
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), a reward term of a completion
    of `length` tokens: 0 up to max_new_tokens - buffer, then falling linearly to -1 at
    max_new_tokens: ((max_new_tokens - buffer) - length) / buffer. buffer 0: off, always 0."""
    if buffer <= 0 or length <= max_new_tokens - buffer:
        return 0.0
    return ((max_new_tokens - buffer) - length) / buffer


# ---- 4. advantages -------------------------------------------------------------------------------
def compute_advantages(rewards, num_samples, kind="mean"):
    """Step 4. rewards (groups * num_samples,), a problem's samples together -> advantages of the
    same shape: r - mean(r) within each group ("mean"), also divided by the group's std
    ("zscore"). A kind of your own: its branch here and its name in plumbing/flags.ADVANTAGES;
    docs/objective.md says where one that reads more than the rewards goes. A kind meant to train
    unanimous groups too (no baseline) returns before their zeroing below. num_samples is at
    least 2, so a kind may divide by num_samples - 1."""
    r = rewards.view(-1, num_samples)
    adv = r - r.mean(dim=1, keepdim=True)
    if kind == "zscore":
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)  # torch's std: n - 1, as TRL's GRPO
    elif kind != "mean":  # a kind the flag accepts but no branch computes: refused, not "mean"
        raise ValueError(f"unknown advantage {kind!r}")
    # a group of equal rewards has no signal; its float mean can be off by a rounding error (the
    # mean of 16 x 0.1 is not exactly 0.1), so zero it exactly: that lets the loss skip the group
    unanimous = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return adv.masked_fill(unanimous, 0.0).view(-1)


def step_advantages(out, cfg):
    """Step 4 for a rollout's groups (rollout()'s dict), the step's and each --refill round's: the
    run's one call of compute_advantages, so what an advantage of your own reads besides the
    rewards (out's other lists, rollout()'s docstring; a flag of yours in cfg) goes in here once."""
    return compute_advantages(torch.tensor(out["total"]), cfg.num_samples, cfg.advantage)


# ---- 5. loss -------------------------------------------------------------------------------------
def objective(logp, batch):
    """One micro-batch's share of the loss L, and its stats. What a fork edits (docs/objective.md).
    At the default flags it is the first branch, step 5 for this micro-batch's rows:
        loss = sum over sampled tokens of -(A_i / N_i) * logp
    Its callers: policy_gradient_backward (rows_with_gradient: which rows; normaliser: N_i) ->
    plumbing/passes.backward_passes, which builds `batch` for each micro-batch (make_batch, the
    log-probs), calls this and runs .backward().
      logp                (B, T) the policy's log-probs of the rows' tokens, 0 where not sampled
      batch.advantages    (B,) one per row, or (B, T) one per token
      batch.normaliser    (B,) each row's N_i: step 5's N in every entry at the default
      batch.sampled       (B, T) bool, the tokens S_i
      batch.<flag>        each flag in OBJECTIVE_FLAGS, as given on the command line
      batch.ref_logp, batch.old_logp, batch.sampler_logp   (B, T) or None, for the options
    (B, T) is make_batch's layout: column t holds the row's token t + 1. B and T are this
    micro-batch's (plumbing/passes.py), so a mean over the batch is not the step's mean. Only kept
    rows arrive (rows_with_gradient): a unanimous group's never do, though N counts their tokens.
    Keep it a pure function: the fast log-probs call it again to check their gradient
    (fast/logprobs.Guess); --logprobs=plain uses autograd alone.
    Returns (loss, stats). Each stat is a sum over sampled tokens, logged per token of the kept
    rows; a value that is once a step goes in train_step()'s step_values instead."""
    A = batch.advantages[:, None] if batch.advantages.dim() == 1 else batch.advantages  # (B, 1|T)
    N, sampled = batch.normaliser[:, None], batch.sampled
    # p of the weights that drew the rows: these (the first epoch), or PPO's saved ones (not q)
    old_logp = logp.detach() if batch.old_logp is None else batch.old_logp
    no_correction = batch.rollout_correction == "none"  # the default: the sampler's q ignored
    correction = 1.0 if no_correction else rollout_weight(old_logp, batch)
    stats = {}
    if batch.ppo_epochs == 1:  # REINFORCE, linear in logp: a sampled token's weight is -A_i / N_i
        weight = -(A / N) * correction * sampled  # (B, T), 0 where not sampled
        loss = (weight * logp).sum()
        stats["clip_frac"] = logp.new_zeros(())  # one update a rollout: the ratio is 1, none clips
    else:  # PPO's clipped surrogate token by token, each over its N_i; ratio 1 until the 1st update
        # (there the loss's value is -sum A / N, with no logp in it; its gradient is REINFORCE's)
        ratio = torch.exp(logp - old_logp)
        eps_high = (
            batch.clip_eps if batch.clip_eps_high < 0 else batch.clip_eps_high
        )  # -1: the same
        clipped = ratio.clamp(1 - batch.clip_eps, 1 + eps_high)
        loss = -(torch.minimum(ratio * A, clipped * A) * correction * sampled / N).sum()
        stats["clip_frac"] = (clipped * A < ratio * A)[sampled].sum()  # the clip holds the ratio
    if batch.kl_beta > 0:  # k3, an estimate of KL(policy || reference) per sampled token, >= 0
        log_ratio = batch.ref_logp - logp
        k3 = torch.exp(log_ratio) - log_ratio - 1
        loss = loss + batch.kl_beta * (k3 * sampled / N).sum()
        stats["kl"] = k3.detach()[sampled].sum()
    return loss, stats


def rollout_weight(old_logp, batch):
    """--rollout-correction's weight of each token (B, T), no gradient through it; 1 without it.
    The engine samples from q, its own rounding of the policy (bf16, a KV cache), while the loss
    differentiates the trainer's p: the same weights, other numbers. REINFORCE assumes the tokens
    came from p; an importance weight p / q makes that so, and a token q drew far likelier than p
    (a rounding artefact, not the policy) is where training goes astray. tis (truncated, TRL's
    vllm_importance_sampling_correction): min(p / q, cap). mis (masked): p / q, and 0 where it
    leaves [1 / cap, cap]. p: the sampling weights' log-probs (old_logp); q: batch.sampler_logp
    (None, a caller's batch without it: no correction)."""
    if batch.rollout_correction == "none" or batch.sampler_logp is None:
        return 1.0
    ratio = torch.exp(old_logp - batch.sampler_logp)
    if batch.rollout_correction == "tis":
        return ratio.clamp(max=batch.rollout_cap)
    return ratio * ((ratio >= 1 / batch.rollout_cap) & (ratio <= batch.rollout_cap))


def rows_with_gradient(advantages, num_samples, kl_beta=0.0):
    """(rows,) bool: the kept rows, those whose tokens carry gradient. The passes, kept_tokens and
    the update's skip follow it. A row is kept when its group has a nonzero advantage anywhere
    (advantages per row (rows,) or per token (rows, T)); compute_advantages zeroes a unanimous
    group exactly. Under --kl-beta every row is kept, since the KL term pulls on each."""
    if kl_beta > 0 or len(advantages) == 0:  # (a rank --refill left no row: none)
        return torch.full((len(advantages),), kl_beta > 0)
    groups = advantages.abs().reshape(len(advantages) // num_samples, -1)  # a group's every entry
    return (groups.sum(dim=1) > 0).repeat_interleave(num_samples)


def normaliser(tokens, kept, loss_norm, device):
    """Returns (N_i for each of this rank's rows, kept_tokens). tokens: each row's |S_i|; kept:
    (rows,) bool from rows_with_gradient. Sums run over the step's C completions on all ranks:
        all_tokens (default)   N_i = sum_j |S_j|                   every sampled token of the step
        kept_tokens            N_i = sum_{j in kept groups} |S_j|  the groups with signal only
        sequence               N_i = C * max(1, |S_i|)             a mean per completion, then of C
    Two groups of two that sampled 3, 2 and 1, 1 tokens, the second group unanimous
    (tests/test_rl_math.py): all_tokens N = 7, kept_tokens N = 5, sequence N_i = 4 * |S_i|.
    kept_tokens, the second value, is the kept rows' tokens under every --loss-norm: the train
    row's per-token stats divide by it, and 0 skips the update."""
    counts = [tokens[kept].sum(), tokens.sum(), torch.tensor(float(len(tokens)))]
    kept_tokens, all_tokens, completions = all_reduce_sum(torch.stack(counts).to(device)).tolist()
    N = {
        "all_tokens": torch.full_like(tokens, all_tokens),
        "kept_tokens": torch.full_like(tokens, kept_tokens),
        "sequence": completions * tokens.clamp(min=1),
    }[loss_norm]
    return N, kept_tokens


def policy_gradient_backward(model, sequences, masks, advantages, *, num_samples, loss_norm,
                             temperature=1.0, options=OFF, device="cpu", **how):  # fmt: skip
    """Step 5 on this rank's rows: add the gradient of this rank's share of L to .grad, and return
    (that share, kept_tokens). N_i counts all ranks, so the shares sum to L however the rows are
    split. The kept rows go through objective() a micro-batch at a time (plumbing/passes.py); the
    others carry no gradient and are left out.
    advantages: (rows,), or (rows, T) per token in make_batch's layout, used as they are; options:
    the values of OBJECTIVE_FLAGS; `how`: backward_passes' keywords (what the options read, how
    the passes run, what --ppo-epochs keeps between epochs)."""
    signature(backward_passes).bind_partial(**how)  # a misspelt keyword fails at every step
    tokens = torch.tensor([float(sampled_tokens(mask)) for mask in masks])  # |S_i|
    kept = rows_with_gradient(advantages, num_samples, options["kl_beta"])
    N, kept_tokens = normaliser(tokens, kept, loss_norm, device)
    if kept_tokens == 0:  # no kept row on any rank: nothing carries gradient
        return torch.zeros((), device=device), 0
    loss = backward_passes(objective, model, sequences, masks, advantages, kept, N,
                           num_samples=num_samples, temperature=temperature, options=options,
                           device=device, **how)  # fmt: skip
    return loss, int(kept_tokens)


def without_truncated(masks, truncated):
    """--mask-truncated (TRL's mask_truncated_completions, DAPO's overlong filtering): a completion
    cut off trains none of its tokens, so a reward that scores unfinished text (yours may) cannot
    teach rambling. As in TRL it keeps its place elsewhere: its reward is in its group's mean and
    it counts in sequence's C; sampling no token now, it adds nothing to the tokens' N."""
    return [[0] * len(mask) if cut else mask for mask, cut in zip(masks, truncated)]


def training_rows(out, advantages, trains, mask_truncated):
    """The rows step 5 trains on, from the rollout's: (sequences, masks, sampler_logp, advantages).
    All of them, unless --refill chose groups (trains, (rows,) bool, a chosen group's every row
    True; None: all); --mask-truncated zeroes cut-off rows' masks here, after the advantages, so
    their rewards stay in their groups' means."""
    sequences, masks, sampler_logp = out["sequences"], out["masks"], out["sampler_logp"]
    if mask_truncated:
        masks = without_truncated(masks, out["truncated"])
    if trains is not None:  # --refill: the chosen groups alone train
        keep = trains.nonzero()[:, 0].tolist()
        sequences, masks = [sequences[i] for i in keep], [masks[i] for i in keep]
        sampler_logp, advantages = [sampler_logp[i] for i in keep], advantages[trains]
    return sequences, masks, sampler_logp, advantages


# ---- 6. step -------------------------------------------------------------------------------------
def optimizer_step(model, optimizer, lr, grad_clip, loss, kept_tokens):
    """Clip the global gradient norm, then take one AdamW step at lr. Returns (the norm before
    clipping, finite). The step is skipped if the loss or the gradient is not finite, or if
    kept_tokens is 0 (the gradient is zero, but AdamW's momentum would still move the weights).
    The caller's lr schedule moves on through a skip; AdamW's step count does not.
    Step 6 in order, as train_step runs it: sync_gradients (a sum over ranks), lr = peak x (1 - s /
    num_steps), then this; AdamW is plumbing/start.adamw's (fused, betas (0.9, 0.95), eps 1e-8, no
    weight decay), and plumbing/metrics.check_nonfinite stops a run of non-finite steps."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    max_norm = grad_clip or float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True))
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    if finite and kept_tokens > 0:
        optimizer.step()
    return grad_norm, finite


# ---- the loop ------------------------------------------------------------------------------------
def train(cfg, rank, world, device):
    """Steps 1-7 on every rank in lockstep: train_step() once a step, with held-out evals,
    checkpoints, stop signals and the log around it (plumbing/loop.py)."""
    return loop.run(train_step, rollout, cfg, rank, world, device)


def train_step(setup, cfg, step, rank, world, device, stop):
    """Steps 1-6 once on this rank. Returns (the step's train row, None) after the update;
    (None, None) if a stop came first; (None, the first error) if the reward failed on every
    completion. Without the options, stops and the train row, it is these lines:
        problems = problems_for_step(rows, step, rank, world, examples_per_step, seed)      # 1
        out = rollout(engine, task, problems, ..., **training_rewards(cfg))                  # 2-3
        advantages = step_advantages(out, cfg)                                              # 4
        policy_gradient_backward(model, out["sequences"], out["masks"], advantages, ...)    # 5
        sync_gradients(model); optimizer_step(model, optimizer, lr, grad_clip, ...)         # 6"""
    model, optimizer, autocast = setup.model, setup.optimizer, setup.autocast
    options = {name: getattr(cfg, name) for name in OBJECTIVE_FLAGS}  # objective()'s, as given
    t0 = time.time()
    # 1. this rank's share of the step's problems
    problems = problems_for_step(setup.train_rows, step, rank, world, cfg.examples_per_step,
                                 cfg.seed)  # fmt: skip
    model.eval()  # these models have no dropout: eval() and train() mark the phases for a fork
    optimizer.zero_grad(set_to_none=True)  # frees the last step's gradients for the KV cache
    # 2-3. a problem's id is its place in the step, and seeds its samples: the same on 1 rank or 8
    problem_ids = range(rank * len(problems), (rank + 1) * len(problems))
    # training's rollout adds the reward's terms past the answer (training_rewards); the evals' not
    sample = partial(rollout, **training_rewards(cfg))
    # autocast is --dtype's (bf16, or nothing in fp32); gathered() gives --fsdp the whole weights
    # for the rollout; abandonable() leaves the rollout at a stop signal. At the defaults none of
    # them changes a number
    with autocast, fsdp.gathered(model), stop.abandonable(model):
        out = sample(setup.engine, setup.task, problems, cfg.num_samples, cfg.max_new_tokens,
                     cfg.temperature, cfg.top_k, derive_seed(cfg.seed, "rollout", step),
                     generate_batch_rows=cfg.generate_batch_rows, problem_ids=problem_ids,
                     system_prompt=cfg.system_prompt)  # fmt: skip
    t_rollout = time.time() - t0
    if stop.requested(device):  # a stop on any rank leaves the step on every rank
        return None, None
    if failure := metrics.all_rewards_failed(out["reward_errors"], device):  # a bug: stop
        return None, failure
    # 4. the advantages; --refill samples more groups while too few have signal
    advantages = step_advantages(out, cfg)
    trains, refilled = None, {}  # --refill: which completions train, the rounds' counts
    if cfg.refill:
        refills = refill.refill_step(sample, step_advantages, setup, cfg, step, out, advantages,
                                     rank, world, device, stop)  # fmt: skip
        if refills is None:  # a stop came during a round, on some rank
            return None, None
        out, advantages, trains, refilled = refills
        t_rollout = time.time() - t0
    # once-a-step values (a fork's KL folded into the reward, an advantage's spread): their mean
    # over ranks goes in the train row as it is, not per token like objective()'s stats
    step_values = {}
    if cfg.overlong_buffer > 0:  # its share of `reward`, every completion the step sampled
        step_values["reward_overlong"] = sum(out["overlong"]) / len(out["overlong"])
    sequences, masks, sampler_logp, advantages = training_rows(
        out, advantages, trains, cfg.mask_truncated
    )
    model.train()
    # linear decay from the peak at step 0; the last step's lr is peak_lr / num_steps
    lr = setup.peak_lr * (1 - step / setup.num_steps)
    saved, stats, updates = RolloutLogprobs(), {}, []  # updates: each epoch's (loss, grad_norm)
    gaps = []  # the sampler's log-probs against the trainer's, pass by pass
    for epoch in range(cfg.ppo_epochs):  # 5-6. one update on this rollout, or --ppo-epochs
        optimizer.zero_grad(set_to_none=True)  # each epoch its own gradient
        # a stop does not cut an --fsdp pass (it gathers from every rank), nor a later epoch
        with stop.abandonable(model, unless=cfg.fsdp or epoch > 0):
            loss, kept_tokens = policy_gradient_backward(
                model, sequences, masks, advantages,
                num_samples=cfg.num_samples, loss_norm=cfg.loss_norm,
                temperature=cfg.temperature, options=options, reference=setup.reference,
                sampler_logp=sampler_logp,
                device=device, autocast=autocast, device_batch_size=cfg.device_batch_size,
                device_batch_tokens=cfg.device_batch_tokens, logprobs=LOGPROBS[cfg.logprobs],
                vocab_size=setup.tokenizer.vocab_size,
                saved=saved, stats=stats, gaps=gaps)  # fmt: skip
        if epoch == 0 and stop.requested(device):
            return None, None
        # 6. summed, not averaged: N_i counts every rank. A rank with no gradient sends zeros;
        # under --fsdp the backward's reduce-scatter sums instead (fsdp.prepare's divide factor 1)
        sync_gradients(model)
        loss = float(all_reduce_sum(loss.detach()))  # each rank's share of L, summed
        norm, finite = optimizer_step(model, optimizer, lr, cfg.grad_clip, loss, kept_tokens)
        updates.append((loss, norm))
        if not finite:  # the next epoch would meet the same weights and rollout
            break
    losses, norms = zip(*updates)  # each epoch's; the step reports their means
    loss, grad_norm = sum(losses) / len(losses), sum(norms) / len(norms)
    row = metrics.step_metrics(
        step, out, t_rollout, device, world, loss=loss, lr=lr, kept_tokens=kept_tokens,
        sampled_tokens=sum(map(sampled_tokens, masks)),  # this rank's: step_metrics sums them
        grad_norm=grad_norm, step_time_s=time.time() - t0, skipped_nonfinite=int(not finite),
        state_mib=fsdp.state_bytes(model, optimizer) / 2**20,
        **metrics.per_token(stats, kept_tokens * len(updates), device),
        **metrics.gap_row(gaps, kept_tokens, device),
        **metrics.rank_means(step_values, device), **refilled)  # fmt: skip
    return row, None


# ==== the command line ===========================================================================
def main(argv=None):
    """python -m chat_rl [--name=value ...]: plumbing/flags.run checks them, then runs train()."""
    return run(train, HYPERPARAMETERS, PRESETS, __doc__, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
