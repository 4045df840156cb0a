"""Training and evaluation: the loop (loop.py) and its rooms (experiment, restore, progress,
saved_run, run_files), its jitted steps (step.py), the one evaluation loop, checkpoints and the
rules for resuming them, optimizer, metrics, preemption, the workdir and its lock."""
