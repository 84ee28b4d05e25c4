"""The NVIDIA-driver check every stage's preflight and `eagle3-extract plan` run on GPU hosts:
the comparison is a function of both versions, exercised here with the driver's version as a
parameter (this machine has no driver); what this machine itself reports is checked too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eagle3_schemas.runtime.cuda_driver import (
    check_this_host,
    driver_cuda_version,
    driver_verdict,
    parse_cuda_version,
    torch_cuda_version,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("13.0", (13, 0)), ("12.8", (12, 8)), ("13.0.1", (13, 0)), (12040, (12, 4)), (13000, (13, 0))],
)
def test_versions_parse_from_torch_strings_and_driver_integers(value, expected):
    assert parse_cuda_version(value) == expected


def test_a_version_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match=r"CUDA version 'cu130': expected MAJOR.MINOR"):
        parse_cuda_version("cu130")


@pytest.mark.parametrize(
    ("driver", "runtime", "level"),
    [
        ((12, 4), "13.0", "error"),  # torch 2.14+cu130 / vLLM 0.33 on an R550 driver
        ((12, 9), "13.0", "error"),
        ((13, 0), "13.0", "ok"),
        ((13, 0), "13.2", "warning"),  # minor-version compatibility
        ((13, 1), "13.0", "ok"),
        ((12, 8), "12.8", "ok"),
        ((12, 2), "12.8", "warning"),
        ((11, 8), "12.8", "error"),
    ],
)
def test_driver_against_runtime(driver, runtime, level):
    verdict = driver_verdict(driver, runtime)
    assert verdict is not None and verdict[0] == level, verdict


def test_too_old_says_both_versions_and_what_to_install():
    level, message = driver_verdict((12, 4), "13.0", who="torch 2.14.0+cu130")
    assert level == "error"
    assert "supports CUDA 12.4 but torch 2.14.0+cu130 is built for CUDA 13.0" in message
    assert "driver that supports CUDA 13 (R580 or newer)" in message


def test_nothing_to_compare_without_a_driver_or_with_a_cpu_torch():
    assert driver_verdict(None, "13.0") is None
    assert driver_verdict((13, 0), None) is None


@pytest.mark.process
def test_this_machine_is_read_without_importing_torch():
    """What the stages see here: the installed torch's CUDA release read from its files (equal
    to what torch says once imported), the driver from libcuda (None on a machine without)."""
    code = (
        "import sys; from eagle3_schemas.runtime.cuda_driver import torch_cuda_version as v; "
        "read = v(); assert 'torch' not in sys.modules; import torch; "
        "print(repr(read), repr(torch.version.cuda))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    read, actual = out.stdout.split()
    assert read == actual
    assert check_this_host() == driver_verdict(driver_cuda_version(), torch_cuda_version())
