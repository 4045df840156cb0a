"""Training and evaluation: the loop (loop.py), its jitted steps (step.py), the one evaluation
loop, checkpoints and the rules for resuming them, optimizer, metrics, preemption, the workdir."""
