"""What runs beside the library, never imported by it: benchmarks, the plot, the demo-model builder.
Run each from the repository root as a module, e.g. `python -m scripts.plot out/demo`; a few
(bench_smollm2, bench_mixed_lengths, gpu_check_*, op_count, rollout_rates) are pieces that
bench_rollout and gpu_check import, not commands."""
