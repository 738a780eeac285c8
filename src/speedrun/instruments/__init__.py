"""The instruments: measurements made of many runs. bench (settings side by side), ablate (each trick off in turn),
to_target (the least budget that reaches the target), compare (two stored results), bench_loader (the input
path's images/s); variants.py holds what ablate and to_target share."""
