"""The contract itself: the schema files and checking an artifact against them.

``registry`` loads the schema files (the package data ``schema_files``), ``header`` reads and
writes an artifact's header, ``validate`` checks structure and runs the schema's named checks
(``checks``, one module per artifact kind), ``meta_check`` checks the schema files themselves and
freezes released versions. Beside them, what the stages run against the contract: ``lineage``
(the fingerprints every header records), ``paths`` (a path argument is the artifact it should
be), ``stream`` (a hidden-state dataset validated while it is written).

Imports ``layouts`` and ``io`` below it, never ``runtime`` or the command line above it.
"""
