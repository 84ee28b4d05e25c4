#!/usr/bin/env bash
# Wheels a bare CUDA image may lack (measured on one with Python 3.12, torch 2.11, transformers
# 5.17 and no network): speculators 0.9.0 and what importing it needs — its eagle3 modules import openai,
# which imports httpx2 → httpcore2, truststore, anyio, h11, idna, sniffio —, jsonschema for
# eagle3-schemas. Downloaded once, on a machine with network, into .whl/ (ignored by git); copy
# it to the GPU node beside the repository. gpu_check.sh installs only those whose distribution
# the image does not have: the image's own (typing-extensions, idna, … that torch and transformers were
# installed with) are never overridden.
#
#   bash tools/gpu/gpu_wheels.sh     # with network
#   bash tools/gpu/gpu_check.sh      # on the GPU node
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
loguru==0.7.3 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0
h11==0.16.0 idna==3.20 sniffio==1.3.1 jiter==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
typing-extensions==4.16.0 jsonschema==4.26.0 referencing==0.37.0
jsonschema-specifications==2025.9.1 rpds-py==2026.9.1"
mkdir -p .whl
for wheel in $WHEELS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$wheel"
done
du -sh .whl
