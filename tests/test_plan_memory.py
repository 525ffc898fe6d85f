"""
The memory plan (plumbing/memory.py, scripts/plan_memory.py) held to what the CPU allocates: on a
small model of the Qwen2 family (qkv bias, GQA, tied head) with random weights, each part the
plan counts from the code's shapes is the bytes the code's own tensors take, in CUDA's precision
(bf16 autocast over fp32 weights; --fsdp's bf16 weights; LoRA's bf16 base): the weights,
gradients and AdamW moments after a step, the Engine's KV cache and its last decode step, a
training micro-batch's activations with and without --activation-checkpointing, and autocast's
copies. And the check at start: a run whose state cannot fit the GPU stops in one line, before
any weight is read.
"""

from types import SimpleNamespace

import pytest
import torch

import chat_rl
from engine import Engine, next_logits
from fast import attention
from fast.logprobs import fast_logprobs, make_batch
from fast.sampling import sample_next_token
from plumbing import checkpoint, flags, memory, start
from plumbing.flags import ConfigError
from policy import hf_folder, lora
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from scripts import plan_memory
from scripts.bench_memory import LiveBytes

BF16 = torch.bfloat16
QWEN2_LIKE = dict(  # Qwen2.5's switches at a small size: qkv bias, 2 query heads per KV head
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    tie_word_embeddings=True,
)
DEFAULTS = flags.parse_config([], chat_rl.HYPERPARAMETERS)  # every flag at its default
LORA_RANK = 4
# the parts whose sizes are counted exactly from the shapes: the bytes must agree to the byte,
# up to this (fused AdamW's one-element step counters, 4 bytes a tensor, are left out)
EXACT = 1e-3
# the engine's temporaries are planned by their largest (the prefill's MLP, one decode step's keys
# upcast to fp32 and its scores), not every small one: on this small model the rest is a few
# percent
TEMPORARIES = 0.05


def tiny(lora_targets="", **changes):
    """The test model in the dtypes a CUDA run holds: fp32 (AdamW's master copy), or with
    lora_targets a bf16 base and fp32 adapters of rank LORA_RANK."""
    model = GPT(GPTConfig(**{**QWEN2_LIKE, **changes})).init_weights(0)
    if lora_targets:
        targets = lora.parse_targets(lora_targets)
        lora.add_adapters(model, LORA_RANK, 8.0, targets, base_dtype=BF16)
    return model


def storage_bytes(tensors):
    """Bytes of the distinct storages among tensors (a tied head once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def close(measured, planned, tolerance):
    return abs(planned - measured) <= tolerance * measured


# ---- weights, gradients, AdamW ---------------------------------------------------------------
@pytest.mark.parametrize("lora_targets", ["", "all-linear", "all-linear,lm_head"])
def test_the_state_planned_is_what_a_step_of_adamw_allocates(lora_targets):
    model = tiny(lora_targets)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = start.adamw(trained, 1e-3, DEFAULTS)
    ids = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=BF16):
        loss = model(ids, ids)
    loss.backward()
    optimizer.step()
    measured = {
        "weights": storage_bytes(model.parameters()),
        "gradients": storage_bytes(p.grad for p in trained),
        "AdamW moments": storage_bytes(v for s in optimizer.state.values() for v in s.values()),
    }
    c = memory.counts(model.config, LORA_RANK if lora_targets else 0, lora_targets or "all-linear")
    planned = memory.state(c)
    for part, size in measured.items():
        assert close(size, planned[part], EXACT), (part, size, planned[part])


# ---- the KV cache and a decode step ----------------------------------------------------------
def test_the_kv_cache_planned_is_the_engines_prompt_part_and_own_part():
    # 3 prompts of 40, 39 and 38 tokens (left-padded to 40), 4 samples each, 200 new tokens; keys
    # and values in bf16 as autocast computes them on CUDA
    model, P, S, T, new = tiny(), 3, 4, 40, 200
    engine = Engine(model, ByteTokenizer())
    prompts = [list(range(1, T + 1 - i)) for i in range(P)]
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        _, cache = engine.prefill(prompts, S, new)
        prompt_part = storage_bytes([*cache.prompt_k, *cache.prompt_v])
        own_part = storage_bytes([*cache.k, *cache.v])
        assert memory.kv_cache(model.config, P, S, T, new) == (prompt_part, own_part)
        # the last decode step: every own slot written and read
        cache.pos = T + new - 1
        with LiveBytes() as live:
            logits = next_logits(model, torch.zeros(P * S, dtype=torch.long), cache)
            sample_next_token(logits[:, :256], torch.rand(P * S))
    planned = memory.decode_temporaries(model.config, P, S, T, new, model.config.vocab_size)
    assert close(live.peak, planned, TEMPORARIES), (live.peak, planned)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32 weights", "bf16 weights"])
def test_the_prefills_temporaries_planned_are_its_mlps_moment(dtype):
    # every prompt of a call in one forward pass: at Qwen2.5's MLP/width ratio (5.4) the SwiGLU
    # of the last layer is the peak, beside the prompt part of the cache (the own part comes after)
    model, P, S, T, new = tiny(intermediate_size=704).to(dtype), 6, 2, 64, 4
    engine = Engine(model, ByteTokenizer())
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        model(torch.zeros(1, 1, dtype=torch.long))  # autocast's copies: made, and not counted
        with LiveBytes() as live:
            engine.prefill([list(range(1, T + 1))] * P, S, new)
    prompt_part, _ = memory.kv_cache(model.config, P, S, T, new)
    residual = 4 if dtype == torch.float32 else 2
    planned = memory.prefill_temporaries(model.config, P, T, residual)
    assert close(live.peak - prompt_part, planned, TEMPORARIES), (live.peak - prompt_part, planned)


# ---- a training micro-batch ------------------------------------------------------------------
def micro_batch_rows(G, S, prompt_tokens, new_tokens, seed=0):
    """G prompts x S samples, every completion new_tokens long and sampled throughout: the
    micro-batch the plan assumes (memory.micro_batch)."""
    gen = torch.Generator().manual_seed(seed)
    sequences, masks = [], []
    for _ in range(G):
        prompt = torch.randint(0, 500, (prompt_tokens,), generator=gen).tolist()
        for _ in range(S):
            completion = torch.randint(0, 500, (new_tokens,), generator=gen).tolist()
            sequences.append(prompt + completion)
            masks.append([0] * prompt_tokens + [1] * new_tokens)
    return make_batch(sequences, masks, "cpu")


RUNS = {  # how a CUDA run holds the model, on the CPU: (its dtype, LoRA's targets)
    "replicated: fp32 weights, bf16 autocast": ("fp32", ""),
    "--fsdp: the gathered bf16 weights": ("bf16", ""),
    "LoRA: bf16 base, every projection": ("fp32", "all-linear"),
    "LoRA: q and v, the head trained whole": ("fp32", "q_proj,v_proj,lm_head"),
    "LoRA: the embeddings trained whole (fp32 residual)": ("fp32", "all-linear,embed_tokens"),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("shape", [(2, 4, 24, 40), (3, 3, 17, 29)], ids=["2x4", "3x3"])
def test_a_micro_batchs_activations_planned_are_what_its_forward_pass_leaves(
    run, checkpointing, shape, monkeypatch
):
    monkeypatch.setattr(attention, "FP32_ON_CPU", False)  # CUDA's bf16 attention kernels
    # what the forward pass of the loss's log-probs (fast_logprobs, as train() calls it) leaves
    # allocated for its backward pass: every tensor autograd saved, SampledLogprobs' gradient
    # buffers, and what checkpointing keeps of each layer; the layer the backward pass recomputes
    # comes later, and the plan adds it on its own
    dtype, lora_targets = RUNS[run]
    G, S, prompt_tokens, new_tokens = shape
    model = tiny(lora_targets)
    if dtype == "bf16":
        model = model.to(BF16)
    model.checkpoint_layers = checkpointing
    inputs, targets = micro_batch_rows(G, S, prompt_tokens, new_tokens)
    loss_grad = torch.where(targets >= 0, -0.01, 0.0)
    with LiveBytes() as live:
        with torch.autocast("cpu", dtype=BF16):
            logp = fast_logprobs(model, inputs, targets, 1.0, loss_grad=loss_grad)
        left = live.now  # logp holds the graph, and the graph what it saved
    assert logp.requires_grad
    c = memory.counts(model.config, LORA_RANK if lora_targets else 0, lora_targets or "all-linear")
    mb = SimpleNamespace(B=G * S, G=G, P=prompt_tokens - 1, T=new_tokens)
    residual = 4 if c.embeddings_trained and dtype == "fp32" else 2
    targets_flag = lora_targets or "all-linear"
    rank = LORA_RANK if lora_targets else 0
    planned = memory.activations(model.config, c, mb, residual, checkpointing, rank, targets_flag)
    if checkpointing:
        planned -= memory.layer_saved(model.config, mb, residual, rank, targets_flag)
    planned += memory.head_buffers(model.config, c, mb)
    if dtype == "fp32" and not lora_targets and not checkpointing:
        # autocast's bf16 copies of the layers' matrices, kept for the backward pass (the plan
        # counts them, all of them, on their own line)
        planned += 2 * sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    assert close(left, planned, EXACT), (left, planned)


def test_autocasts_copies_planned_are_what_autocast_caches():
    # under autocast every fp32 matrix a matmul reads is cast to bf16 once and kept until the
    # autocast block ends: for the Engine, the whole rollout
    model = tiny()
    with LiveBytes() as live, torch.autocast("cpu", dtype=BF16), torch.no_grad():
        logits = model(torch.zeros(1, 1, dtype=torch.long))
        cached = live.now - logits.untyped_storage().nbytes()
    planned = memory.counts(model.config).cast * 2
    assert close(cached, planned, EXACT), (cached, planned)


# ---- the whole plan --------------------------------------------------------------------------
def test_the_plan_of_chat_rls_defaults_adds_its_parts_per_phase():
    cfg = flags.parse_config([], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    config = GPTConfig(**QWEN2_LIKE)
    plan = memory.plan(config, cfg, world=1)
    parts = plan.parts
    # the defaults: 8 rows of one prompt a micro-batch; the greedy eval's 256 prompts the largest
    # engine call on one rank
    assert vars(plan.micro_batch) == dict(B=8, G=1, P=255, T=768)
    assert plan.call == (256, 1)
    held = parts["weights"] + parts["AdamW moments"] + parts["autocast's bf16 copies"]
    prefill = parts["KV cache, prompt part"] + parts["prefill's temporaries"]
    decode = parts["KV cache, prompt part"] + parts["KV cache, own part"]
    decode += parts["decode step's temporaries"]
    assert plan.peaks["rollout"] == held + max(prefill, decode)
    loss = parts["loss head's buffers"] + parts["loss head's chunk"]
    training = held + parts["gradients"] + loss
    assert plan.peaks["training"] == training + parts["activations"]
    sharded = memory.plan(config, SimpleNamespace(**{**vars(cfg), "fsdp": True}), world=8)
    # 8 ranks: 2 problems each; the shards of 16 bytes a parameter, the model gathered to sample
    c = plan.counts
    assert sharded.parts["weights"] + sharded.parts["AdamW moments"] == 12 * c.total / 8
    assert sharded.parts["--fsdp gathered, rollout"] == 2 * c.total
    assert sharded.parts["autocast's bf16 copies"] == 0


def test_the_script_plans_a_folders_config_and_says_what_fits(tmp_path, capsys):
    # the config alone: a folder holding nothing else is enough
    (tmp_path / "model").mkdir()
    hf_folder.write_config(str(tmp_path / "model"), GPTConfig(**QWEN2_LIKE), torch.float32)
    models = f"--model={tmp_path / 'model'},{tmp_path / 'model' / 'config.json'}"
    assert plan_memory.main([models, "--ranks=1,4", "--gpu-gb=0.05", "--lora-rank=8"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| part |"))
    assert header.split(" | ")[1:] == [
        "1 GPU: full",
        "1 GPU: LoRA r8 (as given)",
        "4 GPUs: full",
        "4 GPUs: --fsdp",
        "4 GPUs: LoRA r8 (as given) |",
    ]
    for part in ("weights", "AdamW moments", "KV cache, prompt part", "activations"):
        assert f"\n| {part} | " in out
    # 50 MB: the defaults' KV cache and activations do not fit, whatever the state
    assert "| fits 0.05 GB: plain / checkpointed | no / no |" in out
    assert out.count("\n| " + str(tmp_path / "model")) == 2  # the summary, a model a line
    assert plan_memory.main(["--model=no/such-model"]) == 2
    assert "no config.json to read" in capsys.readouterr().err


# ---- the check at start ----------------------------------------------------------------------
def tiny_folder(tmp_path):
    path = tmp_path / "model"
    tiny().save_pretrained(str(path))
    ByteTokenizer().save_pretrained(str(path))
    return str(path)


def run_config(*argv):
    cfg = flags.parse_config(
        ["--preset=demo", *argv], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )  # fmt: skip
    cfg.rows_fingerprint = ""
    return cfg


def test_a_state_too_large_for_the_gpu_is_refused_in_one_line_naming_what_fits(tmp_path):
    path = tiny_folder(tmp_path)
    cfg = run_config(f"--model={path}")
    gpu = torch.device("cuda", 0)
    need = sum(memory.state(memory.counts(GPTConfig(**QWEN2_LIKE))).values())  # 16 B/param
    memory.check_state_fits(cfg, 1, gpu, total=need)  # it fits: nothing said
    with pytest.raises(ConfigError) as refused:
        memory.check_state_fits(cfg, 1, gpu, total=need / 3)
    message = str(refused.value)
    assert "\n" not in message and "more than the GPU's" in message
    # the GPUs it names are the fewest (a power of 2) on which the plan's peaks fit, not those the
    # state alone would (2, for 16 bytes a parameter over two thirds of it), with the peak; a run
    # small enough for the state to weigh (64 rows of 8 tokens, no eval)
    small = [f"--model={path}", "--max-new-tokens=8", "--eval-every=-1", "--examples-per-step=64"]
    small += ["--num-samples=1", "--device-batch-size=1", "--generate-batch-rows=1"]
    config, sharded, total = GPTConfig(**QWEN2_LIKE), run_config(*small, "--fsdp"), need / 1.5
    with pytest.raises(ConfigError) as refused:
        memory.check_state_fits(run_config(*small), 1, gpu, total=total)
    message = str(refused.value)

    def planned(gpus):
        peaks = memory.plan(config, sharded, gpus).peaks
        return max(peaks["rollout"], peaks["training, --activation-checkpointing"])

    room = memory.PLANNED_SHARE * total
    gpus = next(n for n in (2, 4, 8, 16, 32, 64) if planned(n) <= room)
    assert gpus > 2 and planned(gpus // 2) > room
    peak = f"a {memory.gb(planned(gpus))} peak with --activation-checkpointing"
    assert f"--fsdp on {gpus} GPUs ({peak})" in message and "--lora-rank=16 (a " in message
    # --fsdp on one GPU shards nothing: refused too, with the same way out
    with pytest.raises(ConfigError, match=f"--fsdp on {gpus} GPUs"):
        memory.check_state_fits(run_config(*small, "--fsdp"), 1, gpu, total=total)
    memory.check_state_fits(run_config(f"--model={path}", "--fsdp"), 3, gpu, total=need / 3)
    memory.check_state_fits(run_config(f"--model={path}", "--lora-rank=16"), 1, gpu, need / 3)
    memory.check_state_fits(cfg, 1, torch.device("cpu"))  # off CUDA: no check


def test_start_refuses_a_state_too_large_before_reading_a_weight(tmp_path, monkeypatch):
    # the check stands before the model is built (the weights would go straight to the GPU);
    # here a stand-in GPU of 1 MB, on the CPU
    path = tiny_folder(tmp_path)
    monkeypatch.setattr(memory, "device_memory", lambda device: 10**6)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was read before its size was checked")

    monkeypatch.setattr(checkpoint, "load_policy", refuse)
    cfg = run_config(f"--model={path}", f"--out-dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match="more than the GPU's 0.001 GB"):
        start.start(cfg, 0, 1, torch.device("cpu"))
