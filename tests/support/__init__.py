"""What the tests share: valid fixture artifacts of every kind and their corruptions, stage
entry points run in-process, the trainer's synthetic inputs, the embedded tiny targets' corpus
and scoring, stand-ins of real targets, synthetic streams, the eval tests' tiny draft.

Importable as ``support`` from every test (pyproject's pytest ``pythonpath``); scripts that run
in another interpreter (vLLM's) run as ``python -m support.NAME`` with ``tests`` on PYTHONPATH.
"""
