#!/usr/bin/env bash
# Installs what building and testing tokenlog needs beyond cargo, from Debian's packages:
# libclang (bindgen for RocksDB's C API), a C++ compiler, etcd-server (the baseline of
# `tokenlog bench log`), iproute2/iptables (network namespaces for the fault suite), python3-venv
# (the test that drives tokenlog with the `openai` Python package), and from PyPI
# kubernetes-validate (deploy/k8s/check.sh validates the manifests offline with it).
# Idempotent and quiet when everything is present.
set -euo pipefail
need=()
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
command -v g++ >/dev/null || need+=(g++)
command -v etcd >/dev/null || need+=(etcd-server)
command -v ip >/dev/null || need+=(iproute2)
command -v iptables >/dev/null || need+=(iptables)
# The OpenAI-client test makes a Python venv (Debian's python3 needs python3-venv for that).
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v kubernetes-validate >/dev/null || python3 -m pip install -q --root-user-action=ignore kubernetes-validate==1.37.0 >&2
