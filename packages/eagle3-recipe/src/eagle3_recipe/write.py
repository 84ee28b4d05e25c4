from __future__ import annotations


def write_recipe(*a):
    raise NotImplementedError
