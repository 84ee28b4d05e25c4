"""What every stage's process shares beyond artifacts: preemption signals (``signals``), whether
the host's NVIDIA driver runs the installed CUDA build (``cuda_driver``), the root cause of a
failed child process (``failures``), and config fields set from parsed command lines
(``options``).

Leaves: imports nothing else of this library.
"""
