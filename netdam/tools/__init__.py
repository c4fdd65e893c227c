"""Commands that exercise the emulator: demo, all-reduce run, benchmarks, fuzz, soak, flood."""
