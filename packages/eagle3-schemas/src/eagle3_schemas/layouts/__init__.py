"""What the files the stages share look like, one module per thing on disk, shared by the stage
that writes it and the stages that read it: conversations (roles, tool calls, ids, seeded
selection), the hidden-state dataset (shard paths, row checksums), the draft checkpoint (its
``config.json`` layouts, whether it stores its vocabulary map, its model card) and the target's
own files (``config.json`` wherever a multimodal wrapper nests it, custom code run only when
trusted).

Imports only ``io``; the schema checks in ``contract`` build on these rules.
"""
