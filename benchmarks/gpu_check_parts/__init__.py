"""The parts of `benchmarks/gpu_check.py`: the step harness (`step`), the adapter's device work
(`adapter`) and how both are timed (`timing`). Imported by that script, which puts
``benchmarks/`` and the checkout's root on the path."""
