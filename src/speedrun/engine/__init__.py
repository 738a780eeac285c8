"""What every family's loop shares and knows no family: system.py (device, precision, seeds), loop.py (timer,
guard, stop at step end, step bookkeeping, the run's result, evaluation), checkpoint.py (the checkpoint format)."""
