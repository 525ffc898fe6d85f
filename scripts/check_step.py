"""
The run's first step on the demo beside chat_rl.py's docstring, every number worked out again:

    python -m scripts.check_step                          # 20-60 s on 2 CPU cores
    python -m scripts.check_step --seed=1 --temperature=1.5 --grad-clip=0.05

It runs train() for one step (4 problems x 4 samples of up to 40 new tokens, micro-batches of 5
rows), records what the step sampled, its advantages, L, gradient, lr and update, then recomputes
each from the docstring's formulas in the plain torch below, none of chat_rl's functions in it:
each drawn token from the model over the whole row and the problem's u table, A from the rewards,
N and kept_tokens from the masks, L and its gradient from the model's log-softmax, AdamW's first
step from its formula. It prints them side by side and exits 1 where they disagree.
first_step_of_train, the recorder, is the tests' too (tests/test_plain_step.py, test_fork.py).
"""

import argparse
import json
import math
import os
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as chat_rl sets it, before torch loads
import torch  # noqa: E402

import chat_rl  # noqa: E402
from plumbing import checkpoint  # noqa: E402
from plumbing.data import derive_seed  # noqa: E402

NUM_SAMPLES, MAX_NEW_TOKENS = 4, 40


def first_step_of_train(out_dir, *flags):
    """train()'s step 0 on the demo (4 problems x 4 samples, 40 new tokens, no eval), with flags:
    {"problems", "seed", "out": its rollout's arguments and dict, "advantages": what its backward
    received, "loss": L as its update saw it (summed over ranks), "lr": its lr, "adamw": AdamW's
    settings, "grads": the gradient it stepped with (summed over ranks, clipped), "weights": the
    weights after it, "row": its train row of metrics.jsonl}. A test of an advantage of your own
    runs it with your flag and holds "advantages" to your formula on "out" (tests/test_fork.py
    does), and what it logs to "row". Its recorders are patched in for the run alone."""
    seen = {}
    rollout, optimizer_step = chat_rl.rollout, chat_rl.optimizer_step
    backward = chat_rl.policy_gradient_backward

    def recording_rollout(engine, task, problems, *args, **kwargs):
        out = rollout(engine, task, problems, *args, **kwargs)
        seen.update(problems=problems, seed=args[4], out=out)
        return out

    def recording_backward(model, sequences, masks, advantages, **kwargs):
        seen["advantages"] = advantages.clone()
        return backward(model, sequences, masks, advantages, **kwargs)

    def recording_step(model, optimizer, *args):
        stepped = optimizer_step(model, optimizer, *args)  # clips .grad in place, then steps
        seen["lr"], seen["loss"] = args[0], args[2]  # (lr, grad_clip, loss, kept_tokens)
        seen["adamw"] = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        seen["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return stepped

    argv = ["--preset=demo", f"--out-dir={out_dir}", "--num-steps=1", "--eval-every=-1",
            "--examples-per-step=4", f"--num-samples={NUM_SAMPLES}",
            f"--max-new-tokens={MAX_NEW_TOKENS}", "--device-batch-size=5", *flags]  # fmt: skip
    saved = chat_rl.rollout, chat_rl.optimizer_step, chat_rl.policy_gradient_backward
    chat_rl.rollout, chat_rl.optimizer_step = recording_rollout, recording_step
    chat_rl.policy_gradient_backward = recording_backward
    try:
        assert chat_rl.main(argv) == 0, "the step did not run"
    finally:
        chat_rl.rollout, chat_rl.optimizer_step, chat_rl.policy_gradient_backward = saved
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    (seen["row"],) = [row for row in rows if row.get("split") != "eval"]  # one step, no eval
    return seen


def by_hand(seen, temperature, grad_clip):
    """The docstring's step from the recorded rollout, in plain torch: a dict of the numbers."""
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")  # the weights step 0 starts at
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, K = seen["out"], NUM_SAMPLES
    # 4. A = r - the mean of r over the row's group, exactly 0 for a unanimous group
    r = torch.tensor(out["total"]).view(-1, K)
    A = (r - r.mean(dim=1, keepdim=True)).masked_fill(r.amax(1, True) == r.amin(1, True), 0.0)
    A = A.view(-1)
    # S_i: the positions t + 1 the policy drew (mask 1), predicted from token t; N counts them all
    sizes = [sum(mask[1:]) for mask in out["masks"]]
    kept = [A.view(-1, K)[i // K].abs().sum() > 0 for i in range(len(sizes))]
    total, redrawn, differ = 0.0, 0, 0
    for i, (row, mask) in enumerate(zip(out["sequences"], out["masks"])):
        logits = model(torch.tensor([row]))[0, :, : tokenizer.vocab_size].float()  # (len, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        prompt = len(row) - out["tokens"][i]  # the reply's tokens follow the prompt's
        # 2. the problem's u table, (K, max_new_tokens), from its place in the step
        stream = torch.Generator().manual_seed(derive_seed(seen["seed"], i // K))
        u = torch.rand(K, MAX_NEW_TOKENS, generator=stream)
        for t in range(1, len(row)):
            if not mask[t]:  # the prompt, or a calculator result written in
                continue
            total = total + A[i] * logp[t - 1, row[t]]  # 5. sum over S_i of A_i logp_it
            with torch.no_grad():  # 2. the first v with cumsum(p)[v] > u x cumsum(p)[-1]
                cumsum = torch.softmax(logits[t - 1] / temperature, dim=-1).cumsum(0)
                v = int((cumsum > u[i % K, t - prompt] * cumsum[-1]).nonzero()[0])
            redrawn, differ = redrawn + 1, differ + (v != row[t])
    N = sum(sizes)
    L = -total / N
    L.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0  # torch's clip rule
    # 6. AdamW's first step, after its bias correction: m_hat = g, v_hat = g^2, so each weight
    # moves by lr x g / (|g| + eps), and by lr x weight_decay x w (decoupled) besides
    lr, adamw = seen["lr"], seen["adamw"]
    kept_tokens = sum(size for size, k in zip(sizes, kept) if k)
    updated = {}
    for n, g in grads.items():
        g = g * scale
        grads[n] = g
        w = start[n] * (1 - lr * adamw["weight_decay"])
        # the skip: no group with signal (kept_tokens 0), or a loss or norm not finite
        step = kept_tokens > 0 and math.isfinite(norm) and math.isfinite(float(L.detach()))
        updated[n] = w - lr * g / (g.abs() + adamw["eps"]) if step else start[n]
    return dict(A=A, N=N, kept_tokens=kept_tokens, L=float(L.detach()), norm=norm, grads=grads,
                weights=updated, redrawn=redrawn, differ=differ)  # fmt: skip


def compare(seen, hand, peak_lr):
    """Rows of (what, the docstring's formula, by hand, the run's, agree)."""
    run_row = seen["row"]
    # the gradients' largest difference against their largest entry: rounding, at fp32's 1e-7
    largest = max(float(g.abs().max()) for g in seen["grads"].values())
    grad_diff = max(float((hand["grads"][n] - g).abs().max()) for n, g in seen["grads"].items())
    grads_agree = all(torch.allclose(hand["grads"][n], g, rtol=1e-4, atol=1e-7)
                      for n, g in seen["grads"].items())  # fmt: skip
    # where |g| is far above eps the step is lr x sign(g); near eps the gradient's last bits move
    # it by up to a tenth of lr (tests/test_plain_step.py says why)
    moved = max(float((hand["weights"][n] - w).abs().max()) for n, w in seen["weights"].items())
    adamw = seen["adamw"]
    settings = (adamw["betas"], adamw["eps"], adamw["weight_decay"], adamw["fused"])
    A_diff = float((hand["A"] - seen["advantages"]).abs().max())
    return [
        ("sampling", "first v with cumsum(p)[v] > u x cumsum(p)[-1]",
         f"{hand['redrawn']} tokens redrawn", f"{hand['differ']} differ", hand["differ"] == 0),
        ("A", "r - mean of r over the group", f"{(hand['A'] != 0).sum()} rows nonzero",
         f"largest difference {A_diff:g}", A_diff == 0),
        ("N", "sum_j size(S_j), every row", hand["N"],
         f"sampled_tokens {run_row['sampled_tokens']}", hand["N"] == run_row["sampled_tokens"]),
        ("kept_tokens", "the same, groups with signal", hand["kept_tokens"],
         run_row["kept_tokens"], hand["kept_tokens"] == run_row["kept_tokens"]),
        ("L", "-sum_i sum_{t in S_i} A_i logp_it / N", f"{hand['L']:.10f}", f"{seen['loss']:.10f}",
         math.isclose(hand["L"], seen["loss"], rel_tol=1e-5)),
        ("gradient", "dL/dw, norm clipped", f"norm {hand['norm']:.6f}",
         f"grad_norm {run_row['grad_norm']:.6f}, within {grad_diff / largest:.0e} x the largest",
         grads_agree and math.isclose(hand["norm"], run_row["grad_norm"], rel_tol=1e-4)),
        ("lr", "--lr x (1 - s / num_steps), s = 0", f"{peak_lr:g}", f"{seen['lr']:g}",
         seen["lr"] == peak_lr),
        ("AdamW", "betas, eps, weight decay, fused", "((0.9, 0.95), 1e-08, 0.0, True)",
         str(settings), settings == ((0.9, 0.95), 1e-08, 0.0, True)),
        ("update", "w - lr x g / (|g| + eps)", "the weights after",
         f"largest difference {moved / peak_lr:.3f} x lr", moved <= 0.1 * peak_lr),
    ]  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    args = parser.parse_args(argv)
    flags = [f"--seed={args.seed}", f"--temperature={args.temperature}",
             f"--grad-clip={args.grad_clip}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as out_dir:  # the step's checkpoint and log: not kept
        seen = first_step_of_train(out_dir, *flags)
    hand = by_hand(seen, args.temperature, args.grad_clip)
    rows = compare(seen, hand, chat_rl.PRESETS["demo"]["lr"])
    print(f"\nstep 0 of the demo ({' '.join(flags)}): the docstring's formulas by hand, the run's")
    table = [("what", "the docstring's formula", "by hand", "the run's", "agree")]
    table += [(*map(str, row[:-1]), "yes" if row[-1] else "NO") for row in rows]
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    failed = [row[0] for row in rows if not row[-1]]
    if failed:
        print(f"disagree: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
