"""eagle3-extract: the target's hidden states, captured and checked, as a sharded dataset.

``run`` plans shards per rank, captures them with the vLLM backend (production: the native
``extract_hidden_states`` path and this package's KV connector, ``backends/connector.py``) or
the transformers backend (reference: forward hooks, ``backends/hf.py``), writes each shard
atomically (``writer.py``) and resumes after a crash (``workdir.py``). ``merge`` joins ranks,
``verify`` recomputes samples with the reference and compares every layer, ``preflight``
checks inputs, layer ids, disk and library behaviour before anything runs.

Layer ids follow vLLM: id k is the residual stream after k decoder layers (0 = embeddings,
N = last layer output before the final norm); ``last_hidden_state`` is id N.
"""
