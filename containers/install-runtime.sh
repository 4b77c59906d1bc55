#!/bin/sh
# Installs the runtime lock into the environment of PYTHON (a venv in both images that hold it:
# Dockerfile.runtime and Dockerfile.airflow's local stage), as the Makefile does for the dev
# venv: torch alone from TORCH_INDEX_URL (the CPU or a CUDA build of the lock's version), the
# rest of the lock exactly as locked from PyPI, then deepspeed built against that torch.
#   usage: install-runtime.sh PYTHON requirements/runtime.txt
set -eu
python="$1"
lock="$2"
: "${TORCH_INDEX_URL:?set TORCH_INDEX_URL}"
grep '^torch==' "$lock" > /tmp/torch.txt
grep -v '^torch==' "$lock" > /tmp/runtime-no-torch.txt
"$python" -m pip install --no-deps --index-url "${TORCH_INDEX_URL}" -r /tmp/torch.txt
"$python" -m pip install -r /tmp/runtime-no-torch.txt
DS_BUILD_OPS=0 "$python" -m pip install --no-build-isolation --no-deps deepspeed==0.19.8
"$python" -m pip check
rm /tmp/torch.txt /tmp/runtime-no-torch.txt
