"""
Builds the offline demo's starting policy: a ~0.8M-parameter model of gpt.py's class, supervised on
the procedural arithmetic task (tasks/arith.py) until it is competent but unreliable.

Why unreliable on purpose: RL from a verifier only learns from groups whose samples disagree.
A merely weak model gets every sample of most problems wrong (no signal); a perfect one gets them
all right (nothing to learn). So the demonstrations mix clean worked solutions with a share
(SLIP_RATE) whose one arithmetic step is off by 1-3, the slip carried to a wrong final answer.
The supervised model then knows the procedure but slips now and then when sampled.
And a minority of the demonstrations (TOOL_RATE) compute every step with the calculator
(`<<4*5=20>>`, tasks/arith.solution_with_tool), whose results cannot slip: a strategy present in
the sampled distribution but not at its mode (greedy decoding does not call the tool). RL's job is
to find that strategy and make it the policy's first choice: RL with a verifier ends up better than
its teacher, and better at its best answer, not only at sampling it. The results are masked out of
the loss, as RL's forced tokens are: the model learns to call the tool, not to be it.

    # writes demo_model/ (HF folder), ~20 min on one CPU thread
    python -m scripts.make_demo_model
    python -m scripts.make_demo_model --seed=1 --out=/tmp/m

demo_model/ ships with the repository; this rebuilds it (chat_rl stops with this command if it
is missing).
"""

import argparse
import random
import re
import time

import torch
from tqdm import tqdm

from calculator import calculate
from chat_rl import make_batch
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from tasks import arith
from tasks.common import conversation

# ---- hyperparameters -----------------------------------------------------------------------
CONFIG = dict(
    vocab_size=264,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TOOL_RATE = 0.15  # share of demonstrations that compute every step with the calculator
SLIP_RATE = 0.4  # share of the others with one arithmetic slip
NUM_STEPS = 2400
BATCH_SIZE = 32
LR = 3e-3
WARMUP = 50
SEED = 0
OUT = "demo_model"


def batch_of(rows, tokenizer, rng, slip_rate=SLIP_RATE, tool_rate=TOOL_RATE):
    """Render rows (a tool_rate share calling the calculator, a slip_rate share of the rest with a
    slipped solution) into (inputs, targets), -1 outside the answers and on the calculator's
    results."""
    seqs, masks = [], []
    for row in rows:
        conv = conversation(arith, row, with_solution=True)
        if rng.random() < tool_rate:
            conv["messages"][-1]["content"] = arith.solution_with_tool(row)
        elif rng.random() < slip_rate:
            conv["messages"][-1]["content"] = arith.solution_with_slip(row, rng)
        ids, mask = tokenizer.render_conversation(conv)
        seqs.append(ids)
        masks.append(mask_tool_results(ids, mask))
    return make_batch(seqs, masks, "cpu")  # the targets RL's loss takes too: only where mask is 1


# what the engine forces after `<<expr=`: the result and `>>`
RESULT = re.compile(r"<<[^=\n>]*=([^>\n]*>>)")


def mask_tool_results(ids, mask):
    """mask with 0 on the tool's results, as generate_batch marks the tokens it forces (byte
    tokenizer: a byte per character; special tokens, ids >= 256, stand in as one character that is
    never part of a call)."""
    text = "".join(chr(i) if i < 256 else "\0" for i in ids)
    mask = list(mask)
    for m in RESULT.finditer(text):
        mask[m.start(1) : m.end(1)] = [0] * (m.end(1) - m.start(1))
    return mask


def build(
    out=OUT,
    seed=SEED,
    num_steps=NUM_STEPS,
    slip_rate=SLIP_RATE,
    tool_rate=TOOL_RATE,
    log=tqdm.write,
):
    """
    Progress: a bar with counts on a terminal (tqdm, on stderr; off when stderr is not a terminal,
    e.g. a log file), and a plain line every 100 steps either way. log=tqdm.write prints lines
    without breaking the bar.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = ByteTokenizer()
    model = GPT(GPTConfig(**CONFIG)).init_weights(seed)
    log(
        f"demo model: {model.num_params() / 1e6:.2f}M parameters, {num_steps} supervised steps, "
        f"tool rate {tool_rate}, slip rate {slip_rate}"
    )
    rows = arith.load("train", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    t0 = time.time()
    bar = tqdm(total=num_steps, desc="sft", unit="step", disable=None)  # None: only on a terminal
    for step in range(num_steps):
        # warmup, then linear decay to 0
        lr = LR * min(1.0, (step + 1) / WARMUP) * (1 - step / num_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = batch_of(
            rng.sample(rows, BATCH_SIZE), tokenizer, rng, slip_rate, tool_rate
        )
        loss = model(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)  # drawn by the update
        bar.update()
        if step % 100 == 0 or step == num_steps - 1:
            log(
                f"sft step {step:5d}/{num_steps} | loss {loss.item():.4f} | lr {lr:.2e} | "
                f"{time.time() - t0:.0f}s"
            )
    bar.close()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"saved {out}; measuring held-out accuracy, greedy and sampled")
    for temperature, (accuracy, tool_use) in measure(model, tokenizer).items():
        log(
            f"{out}: temperature {temperature}: held-out accuracy {accuracy:.1%}, "
            f"calculator used by {tool_use:.1%} (200 problems)"
        )
    return model


def measure(model, tokenizer, num_problems=200, samples=4, max_new_tokens=64):
    """Held-out accuracy and tool use, greedy and sampled at T = 1: the gaps between them are what
    RL can close."""
    from engine import Engine

    rows = arith.load("test", limit=num_problems)
    prompts = [tokenizer.render_for_completion(conversation(arith, row)) for row in rows]
    engine, model = Engine(model, tokenizer, tool=calculate), model.eval()
    scores = {}
    # one batch per temperature (the seeded samples, and so the numbers, depend on the batch);
    # the bar counts completions
    bar = tqdm(total=len(rows) * (1 + samples), desc="measure", unit="completion", disable=None)
    for temperature, n in ((0.0, 1), (1.0, samples)):
        out = engine.generate(
            prompts, n, max_new_tokens=max_new_tokens, temperature=temperature, seed=1
        )
        seqs, calls = out.sequences, out.tool_calls
        texts = [tokenizer.decode(s[len(prompts[i // n]) :]) for i, s in enumerate(seqs)]
        accuracy = sum(
            arith.grade(t, arith.reference(rows[i // n])) for i, t in enumerate(texts)
        ) / len(texts)
        scores[temperature] = (accuracy, sum(c > 0 for c in calls) / len(texts))
        bar.update(len(texts))
    bar.close()
    return scores


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--num-steps", type=int, default=NUM_STEPS)
    p.add_argument("--slip-rate", type=float, default=SLIP_RATE)
    p.add_argument("--tool-rate", type=float, default=TOOL_RATE)
    args = p.parse_args()
    build(args.out, args.seed, args.num_steps, args.slip_rate, args.tool_rate)
