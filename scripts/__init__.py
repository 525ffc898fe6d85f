"""What runs beside the library, never imported by it: benchmarks, the plot, the demo-model builder.
Run each from the repository root as a module, e.g. `python -m scripts.plot out/demo`."""
