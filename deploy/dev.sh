#!/usr/bin/env bash
# The README's run command: installs build dependencies if missing, builds tokenlog (release)
# and runs `tokenlog dev`, the embedded single-machine default. Extra arguments go to `dev`.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cargo build --release --workspace --bins
exec "${CARGO_TARGET_DIR:-target}/release/tokenlog" dev "$@"
