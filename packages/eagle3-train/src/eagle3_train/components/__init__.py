"""What the run composes, one object each: the accelerator, the draft's construction with its
optimizer and schedule (build), checkpoints (the only code that knows their layout), metrics,
faults and their exit statuses, the causes other ranks read, preemption, the watchdog."""
