"""The fast paths: what makes sampling and the loss cheap, each held by a test to a plain
version that a reader reads instead (engine.generate_reference, logprobs.plain_logprobs).
logprobs.py: the loss's log-probs with each prompt run once and the head chunked;
kv_cache.py: the sampler's KV cache; tool_calls.py: calculator calls spotted on the device."""
