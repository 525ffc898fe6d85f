"""What a run needs that is not RL: flags.py (the command line and its checks), distributed.py
and fsdp.py (the ranks, their collectives, sharding), checkpoint.py (saving, loading, resuming),
metrics.py (what a run reports)."""
