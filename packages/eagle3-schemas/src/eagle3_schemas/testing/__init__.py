"""Test support for every stage: valid fixture artifacts and helpers that damage them."""
