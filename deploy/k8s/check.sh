#!/usr/bin/env bash
# Checks the Kubernetes manifests offline, for every overlay: certificates made by
# `tokenlog certs` (into a scratch copy), `kubectl kustomize`, schema validation with the PyPI
# package kubernetes-validate (--strict), then what a schema cannot see (check.py): every
# container's flags exist in `tokenlog <command> --help`, the peers list matches the StatefulSet's
# size and names, each node pod's certificate is in its Secret, probes name declared ports.
# Usage: deploy/k8s/check.sh [path/to/tokenlog]   (default: tokenlog on PATH)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(realpath "${1:-$(command -v tokenlog)}")"
command -v kubectl >/dev/null || { echo "check.sh: kubectl is needed (kubectl kustomize)" >&2; exit 1; }
command -v kubernetes-validate >/dev/null || { echo "check.sh: kubernetes-validate is needed (deploy/install-deps.sh installs it from PyPI)" >&2; exit 1; }
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp -r "$here" "$scratch/k8s"
for overlay in "$here"/overlays/*/; do
  name="$(basename "$overlay")"
  n="$(grep -oE '^    count: [0-9]+' "$overlay/kustomization.yaml" | grep -oE '[0-9]+' || echo 3)"
  nodes="$(seq -s, -f 'tokenlog-node-%g' 0 $((n - 1)))"
  "$bin" certs --out "$scratch/k8s/overlays/$name/certs" --node "$nodes" --decoder-pool tokenlog-decoder \
    --gateway gateway --admin admin >/dev/null 2>"$scratch/certs.err" || { cat "$scratch/certs.err" >&2; exit 1; }
  kubectl kustomize "$scratch/k8s/overlays/$name" > "$scratch/$name.yaml"
  kubernetes-validate --strict --quiet "$scratch/$name.yaml"
  python3 "$here/check.py" "$bin" "$scratch/$name.yaml" "$n"
  echo "deploy/k8s/overlays/$name: $n nodes, valid"
done
