"""
The run's first steps on the demo beside chat_rl.py's docstring, every number worked out again:

    python -m scripts.check_step                          # 5-60 s on 2 CPU cores
    python -m scripts.check_step --ranks=2                # two ranks, as torchrun starts them
    python -m scripts.check_step --seed=1 --temperature=1.5 --grad-clip=0.05 --num-steps=2

It runs train() for --num-steps steps (4; 4 problems x 4 samples of up to 40 new tokens,
micro-batches of 5 rows), records what each step sampled, its advantages, L, gradient, lr and
update, then recomputes each from the docstring's formulas in the plain torch below, none of
chat_rl's functions in it: each drawn token from the model over the whole row and the problem's u
table, each row's end and calculator call, A from the rewards, N (beside the divisor the loss
used) and kept_tokens from the masks, L and its gradient from the model's log-softmax, the lr from
the schedule, and AdamW's step on the run's gradient (its moments and count kept by hand) or the
skip. Each step starts from the weights the run's last one ended at. It prints a table a step and
exits 1 where they disagree, 2 if the run itself stops; at the default seed step 2 has no group
with signal, so the skip and the AdamW step after it are both checked. With --ranks=2 each rank
samples its share of the step's problems, and the formulas run over all their rows: N, L and the
gradient are the step's on both, and both ranks' weights must be one. steps_of_train and
first_step_of_train, the recorders, are the tests' too (tests/test_plain_step.py, test_fork.py).
"""

import argparse
import json
import math
import os
import socket
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as chat_rl sets it, before torch loads
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import chat_rl  # noqa: E402
from calculator import calculate  # noqa: E402
from engine import CALL  # noqa: E402
from plumbing import checkpoint  # noqa: E402
from plumbing.data import derive_seed  # noqa: E402

NUM_SAMPLES, MAX_NEW_TOKENS = 4, 40


def steps_of_train(out_dir, *flags, num_steps=1):
    """train() on the demo for num_steps steps (4 problems x 4 samples, 40 new tokens, micro-batches
    of 5 rows, no eval), with flags: a list of each step's {"problems", "seed", "out": its rollout's
    arguments and dict, "advantages": what its backward received, "N": the normaliser the loss
    divided by (its first row's N_i), "loss": L as its update saw it (summed over ranks), "lr",
    "adamw": AdamW's settings, "grads": the gradient it stepped with
    (summed over ranks, clipped), "weights": the weights after it, "row": its train row of
    metrics.jsonl}. Its recorders are patched in for the run alone."""
    if any(flag.startswith("--refill") for flag in flags):  # its rounds: several rollouts a step
        raise ValueError("steps_of_train records one rollout a step, not --refill's rounds")
    steps = []
    rollout, optimizer_step = chat_rl.rollout, chat_rl.optimizer_step
    backward, normaliser = chat_rl.policy_gradient_backward, chat_rl.normaliser

    def recording_rollout(engine, task, problems, *args, **kwargs):
        out = rollout(engine, task, problems, *args, **kwargs)
        if not steps or "grads" in steps[-1]:  # a new step (a --refill round: the same step)
            steps.append({})
        steps[-1].update(problems=problems, seed=args[4], out=out)
        return out

    def recording_backward(model, sequences, masks, advantages, **kwargs):
        steps[-1]["advantages"] = advantages.clone()
        return backward(model, sequences, masks, advantages, **kwargs)

    def recording_normaliser(*args):
        N, kept_tokens = normaliser(*args)
        steps[-1]["N"] = float(N[0]) if len(N) else None
        return N, kept_tokens

    def recording_step(model, optimizer, *args):
        stepped = optimizer_step(model, optimizer, *args)  # clips .grad in place, then steps
        adamw = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in model.named_parameters()}  # fmt: skip
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps[-1].update(lr=args[0], loss=args[2], adamw=adamw, grads=grads, weights=weights)
        return stepped

    argv = ["--preset=demo", f"--out-dir={out_dir}", f"--num-steps={num_steps}",
            "--eval-every=-1", "--examples-per-step=4", f"--num-samples={NUM_SAMPLES}",
            f"--max-new-tokens={MAX_NEW_TOKENS}", "--device-batch-size=5", *flags]  # fmt: skip
    names = "rollout", "optimizer_step", "policy_gradient_backward", "normaliser"
    saved = [getattr(chat_rl, name) for name in names]
    recorders = recording_rollout, recording_step, recording_backward, recording_normaliser
    for name, recorder in zip(names, recorders):
        setattr(chat_rl, name, recorder)
    try:
        code = chat_rl.main(argv)
    finally:
        for name, function in zip(names, saved):
            setattr(chat_rl, name, function)
    if code != 0:
        raise RuntimeError(f"chat_rl exited {code}")
    if os.environ.get("RANK", "0") != "0":  # rank 0 writes the log
        return steps
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [row for row in rows if row.get("split") != "eval"]  # a row a step, no eval
    for step, row in zip(steps, rows, strict=True):
        step["row"] = row
    return steps


def steps_on_ranks(ranks, out_dir, *flags, num_steps=1):
    """steps_of_train on `ranks` processes of one machine, as torchrun would start them (gloo):
    each step's rollout and advantages of every rank, in rank order (the step's problems in
    order), with rank 0's L, gradient, weights and row, and "rank_weights", every rank's weights
    after the step."""
    port = free_port()
    mp.start_processes(on_a_rank, args=(ranks, port, out_dir, flags, num_steps), nprocs=ranks,
                       join=True, start_method="spawn")  # fmt: skip
    each = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(ranks)]
    steps = each[0]
    for s, step in enumerate(steps):
        outs = [rank[s]["out"] for rank in each]
        step["out"] = {key: sum((out[key] for out in outs), []) for key in step["out"]}
        step["advantages"] = torch.cat([rank[s]["advantages"] for rank in each])
        step["rank_weights"] = [rank[s]["weights"] for rank in each]
    return steps


def on_a_rank(rank, ranks, port, out_dir, flags, num_steps):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    if rank:  # one console: rank 0's
        sys.stdout = open(os.devnull, "w")
    steps = steps_of_train(out_dir, *flags, num_steps=num_steps)
    torch.save(steps, os.path.join(out_dir, f"rank{rank}.pt"))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_step_of_train(out_dir, *flags):
    """steps_of_train's step 0 alone. A test of an advantage of your own runs it with your flag and
    holds "advantages" to your formula on "out" (tests/test_fork.py does), and what it logs to
    "row"; a test's own patches of chat_rl stay as they were."""
    return steps_of_train(out_dir, *flags)[0]


def by_hand(step, model, tokenizer, weights, adam, s, num_steps, peak_lr, temperature, grad_clip):
    """Step s of the docstring from the run's recorded rollout, in plain torch, from the weights
    the step started at (loaded into model) and AdamW's moments by hand (adam, updated in place):
    a dict of numbers."""
    model.load_state_dict(weights, strict=False)  # the step's starting weights (tied head: one)
    model.zero_grad(set_to_none=True)
    out, K = step["out"], NUM_SAMPLES
    # 2. each problem's u table, (K, max_new_tokens), from its place in the step
    streams = [derive_seed(step["seed"], g) for g in range(len(out["sequences"]) // K)]
    u_of = [torch.rand(K, MAX_NEW_TOKENS, generator=torch.Generator().manual_seed(seed))
            for seed in streams]  # fmt: skip
    # 4. A = r - the mean of r over the row's group, exactly 0 for a unanimous group
    r = torch.tensor(out["total"]).view(-1, K)
    A = (r - r.mean(dim=1, keepdim=True)).masked_fill(r.amax(1, True) == r.amin(1, True), 0.0)
    A = A.view(-1)
    # S_i: the positions t + 1 the policy drew (mask 1), predicted from token t; N counts them all
    sizes = [sum(mask[1:]) for mask in out["masks"]]
    kept = [A.view(-1, K)[i // K].abs().sum() > 0 for i in range(len(sizes))]
    total, redrawn, differ = torch.zeros(()), 0, 0
    for i, (row, mask) in enumerate(zip(out["sequences"], out["masks"])):
        logits = model(torch.tensor([row]))[0, :, : tokenizer.vocab_size].float()  # (len, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        prompt = len(row) - out["tokens"][i]  # the reply's tokens follow the prompt's
        u = u_of[i // K]
        for t in range(1, len(row)):
            if not mask[t]:  # the prompt, or a calculator result written in
                continue
            total = total + A[i] * logp[t - 1, row[t]]  # 5. sum over S_i of A_i logp_it
            with torch.no_grad():  # 2. the first v with cumsum(p)[v] > u x cumsum(p)[-1]
                cumsum = torch.softmax(logits[t - 1] / temperature, dim=-1).cumsum(0)
                j = t - prompt  # the reply position, u's column
                v = int((cumsum > u[i % K, j] * cumsum[-1]).nonzero()[0])
            redrawn, differ = redrawn + 1, differ + (v != row[t])
    ends, calls = rows_as_step_2_says(out, tokenizer)
    N, kept_tokens = sum(sizes), sum(size for size, k in zip(sizes, kept) if k)
    L = -total / N
    if L.requires_grad:  # no row with signal: no term, no gradient
        L.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}  # fmt: skip
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0  # torch's clip rule
    clip = "acts" if scale < 1 else "idle"  # the demo's norms: 0.1-0.2, below the default 1
    # 6. lr falls linearly; AdamW steps unless no group has signal or a number is not finite. Its
    # step is worked from the run's own clipped gradient (the gradient row above checks that one):
    # near AdamW's eps a gradient's last bits move a weight by a tenth of lr, and this row checks
    # the update itself (its moments, bias corrections, count across skips) to rounding
    lr = peak_lr * (1 - s / num_steps)
    beta1, beta2 = step["adamw"]["betas"]
    eps, decay = step["adamw"]["eps"], step["adamw"]["weight_decay"]
    takes = kept_tokens > 0 and math.isfinite(norm) and math.isfinite(float(L.detach()))
    adam["count"] += takes  # a skipped step leaves AdamW's count
    updated = {}
    for n, p in model.named_parameters():
        grads[n] = grads[n] * scale
        g = step["grads"][n]
        if not takes:
            updated[n] = p.detach().clone()
            continue
        m = adam.setdefault(("m", n), torch.zeros_like(g)).mul_(beta1).add_((1 - beta1) * g)
        v = adam.setdefault(("v", n), torch.zeros_like(g)).mul_(beta2).add_((1 - beta2) * g * g)
        # m_hat / (sqrt(v_hat) + eps), m_hat and v_hat the moments over their bias corrections
        m_hat, v_hat = m / (1 - beta1 ** adam["count"]), v / (1 - beta2 ** adam["count"])
        updated[n] = p.detach() * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return dict(A=A, N=N, kept_tokens=kept_tokens, L=float(L.detach()), norm=norm, grads=grads,
                weights=updated, lr=lr, takes=takes, redrawn=redrawn, differ=differ, ends=ends,
                calls=calls, clip=clip)  # fmt: skip


def rows_as_step_2_says(out, tokenizer):
    """(rows ending as step 2 says, calculator calls answered as it says), each a list of (row,
    good). A row ends at its one sampled stop token, its last, or has no stop token and
    max_new_tokens reply tokens. A call is sampled text ending in '<<expression=' (engine.CALL):
    calculate(expression) + '>>' follows it, forced (mask 0), cut only by the budget; nothing is
    forced after a refused expression, and nowhere else."""
    ends, calls = [], []
    for i, (row, mask) in enumerate(zip(out["sequences"], out["masks"])):
        n = out["tokens"][i]
        reply, drawn = row[len(row) - n :], mask[len(row) - n :]
        stops = [j for j, token in enumerate(reply) if token in tokenizer.stop_tokens and drawn[j]]
        ends.append((i, stops == [n - 1] or (not stops and n == MAX_NEW_TOKENS)))
        text, j = "", 0
        while j < n:
            if not drawn[j]:  # a forced token with no call before it
                calls.append((i, False))
                break
            text += tokenizer.decode(reply[j : j + 1])  # a token at a time, as the Engine reads
            j += 1
            if not (text.endswith("=") and CALL.search(text)):
                continue
            k = next((k for k in range(j, n) if drawn[k]), n)  # the forced run after the call
            result = calculate(text[text.rfind("<<") + 2 : -1])
            wanted = "" if result is None else f"{result}>>"
            got = tokenizer.decode(reply[j:k])
            cut = k == n == MAX_NEW_TOKENS  # the budget ran out mid-result, or before it
            calls.append((i, got == wanted or (cut and wanted.startswith(got))))
            text, j = text + got, k
    return ends, calls


def compare(step, hand):
    """Rows of (what, the docstring's formula, by hand, the run's, agree) for one step."""
    run_row, lr = step["row"], hand["lr"]
    # the gradients' largest difference against their largest entry: rounding, at fp32's 1e-7
    largest = max(float(g.abs().max()) for g in step["grads"].values()) or 1.0
    grad_diff = max(float((hand["grads"][n] - g).abs().max()) for n, g in step["grads"].items())
    grads_agree = all(torch.allclose(hand["grads"][n], g, rtol=1e-4, atol=1e-7)
                      for n, g in step["grads"].items())  # fmt: skip
    moved = max(float((hand["weights"][n] - w).abs().max()) for n, w in step["weights"].items())
    A_diff = float((hand["A"] - step["advantages"]).abs().max())
    return [
        ("sampling", "first v with cumsum(p)[v] > u x cumsum(p)[-1]",
         f"{hand['redrawn']} tokens redrawn", f"{hand['differ']} differ", hand["differ"] == 0),
        ("A", "r - mean of r over the group", f"{int((hand['A'] != 0).sum())} rows nonzero",
         f"largest difference {A_diff:g}", A_diff == 0),
        ("rows end", "at a sampled stop token, or the budget",
         f"{sum(good for _, good in hand['ends'])} of {len(hand['ends'])} rows", "the run's rows",
         all(good for _, good in hand["ends"])),
        ("calculator", "'<<48/2=' gets '24>>', mask 0",
         f"{sum(good for _, good in hand['calls'])} of {len(hand['calls'])} calls",
         "the run's rows",
         all(good for _, good in hand["calls"])),
        ("N", "sum_j size(S_j), every row", hand["N"],
         f"divided by {step.get('N')}, sampled_tokens {run_row['sampled_tokens']}",
         hand["N"] == step.get("N") == run_row["sampled_tokens"]),
        ("kept_tokens", "the same, groups with signal", hand["kept_tokens"],
         run_row["kept_tokens"], hand["kept_tokens"] == run_row["kept_tokens"]),
        ("L", "-sum_i sum_{t in S_i} A_i logp_it / N", f"{hand['L'] + 0.0:.10f}",
         f"{step['loss'] + 0.0:.10f}",
         math.isclose(hand["L"], step["loss"], rel_tol=1e-5, abs_tol=1e-12)),
        ("gradient", "dL/dw, norm clipped", f"norm {hand['norm']:.6f}, clip {hand['clip']}",
         f"grad_norm {run_row['grad_norm']:.6f}, within {grad_diff / largest:.0e} x the largest",
         grads_agree and math.isclose(hand["norm"], run_row["grad_norm"], rel_tol=1e-4)),
        ("lr", "--lr x (1 - s / num_steps)", f"{lr:g}", f"{step['lr']:g}",
         math.isclose(step["lr"], lr, rel_tol=1e-12)),
        ("update", "AdamW on the run's gradient, or none", "steps" if hand["takes"] else "skips",
         f"largest difference {moved / lr:.0e} x lr (rounding: up to 1e-3)", moved <= 1e-3 * lr),
    ]  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--num-steps", type=int, default=4, help="steps, 1 at least")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="processes")
    args = parser.parse_args(argv)
    if args.num_steps < 1 or not args.temperature > 0:
        parser.error("--num-steps is 1 at least and --temperature above 0")
    flags = [f"--seed={args.seed}", f"--temperature={args.temperature}",
             f"--grad-clip={args.grad_clip}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as out_dir:  # the run's checkpoint and log: not kept
        try:
            if args.ranks == 1:
                steps = steps_of_train(out_dir, *flags, num_steps=args.num_steps)
            else:
                steps = steps_on_ranks(args.ranks, out_dir, *flags, num_steps=args.num_steps)
        except (RuntimeError, mp.ProcessRaisedException) as e:  # the run's own error is above
            print(f"check_step: the run did not finish, nothing to compare ({e})", file=sys.stderr)
            return 2
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")  # by_hand's, loaded once
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}  # step 0 starts here
    adam, peak_lr = {"count": 0}, chat_rl.PRESETS["demo"]["lr"]
    adamw = steps[0]["adamw"]
    settings = (adamw["betas"], adamw["eps"], adamw["weight_decay"], adamw["fused"])
    expected = ((0.9, 0.95), 1e-08, 0.0, True)
    failed = [] if settings == expected else ["AdamW's settings"]
    ranks = "1 rank" if args.ranks == 1 else f"{args.ranks} ranks"
    print(f"\nthe demo, {args.num_steps} steps on {ranks} ({' '.join(flags)}): the "
          f"docstring's formulas by hand beside the run's; AdamW's betas, eps, weight decay, "
          f"fused: {settings} "
          f"({'yes' if settings == expected else 'NO, not ' + str(expected)})")  # fmt: skip
    for s, step in enumerate(steps):
        hand = by_hand(step, model, tokenizer, weights, adam, s, args.num_steps, peak_lr,
                       args.temperature, args.grad_clip)  # fmt: skip
        weights = step["weights"]  # the next step starts where the run's ended
        rows = compare(step, hand)
        if "rank_weights" in step:  # the gradients summed over ranks: every rank the same update
            same = all(torch.equal(w[n], step["weights"][n])
                       for w in step["rank_weights"] for n in w)  # fmt: skip
            rows.append(("ranks", "one update on every rank", "the same weights",
                         "the same" if same else "they differ", same))  # fmt: skip
        table = [(f"step {s}", "the docstring's formula", "by hand", "the run's", "agree")]
        table += [(*map(str, row[:-1]), "yes" if row[-1] else "NO") for row in rows]
        widths = [max(len(row[c]) for row in table) for c in range(5)]
        print()
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        failed += [f"step {s} {row[0]}" for row in rows if not row[-1]]
    print(
        "\nNot checked here: the verifier's grading (the run's rewards are taken as given), bf16 "
        "and GPUs (fp32 on the CPU), the preset's sizes (4 problems x 4 samples of 40 tokens)."
    )
    if failed:
        print(f"disagree: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
