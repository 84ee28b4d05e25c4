"""eagle3-recipe: a recipe planned from the user's own model and node.

``eagle3-recipe plan`` reads a target's config.json, tokenizer and chat template (never its
weights) and prints every setting of a recipe with its reason; ``eagle3-recipe new`` writes the
recipe folder (flags.sh, train.yaml, pipeline.sh) whose pipeline.sh runs it end to end. It
imports no stage: it shares only eagle3-schemas and files on disk with them.
"""
