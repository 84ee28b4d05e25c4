"""The training run: trainer (set up, run, close), its set-up (setup), the loop, validation,
the non-finite watch, and what a run delivers (exports and the published draft)."""
