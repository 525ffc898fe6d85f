"""The fast paths: what makes sampling and the loss cheap, each held by a test to a plain
version that a reader reads instead (engine.generate_reference, logprobs.plain_logprobs).
logprobs.py: the loss's log-probs with the head chunked; shared_prefix.py: its forward pass with
each prompt run once; kv_cache.py: the sampler's KV cache; tool_calls.py: calculator calls
spotted on the device; packed_linear.py: the engine's weights packed for oneDNN."""
