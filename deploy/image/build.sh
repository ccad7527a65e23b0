#!/usr/bin/env bash
# Builds the image `tokenlog:dev` from local files only (no registry is reachable, nothing is
# pulled): FROM scratch, with the tokenlog binary, exactly the shared libraries it links (read off
# `ldd`), a non-root user (uid 10001) and its state directory.
#
#   deploy/image/build.sh [--binary PATH] [--tag NAME:TAG]
#
# Without --binary it uses $CARGO_TARGET_DIR/release/tokenlog, building it first if missing. The
# tests pass the binary they already built (no second build in CI).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=""
TAG="tokenlog:dev"
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) BIN="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$BIN" ]; then
  BIN="${CARGO_TARGET_DIR:-target}/release/tokenlog"
  [ -x "$BIN" ] || cargo build --release --bin tokenlog
fi
[ -x "$BIN" ] || { echo "build.sh: $BIN is not an executable" >&2; exit 1; }
command -v docker >/dev/null || { echo "build.sh: docker is not installed" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root/usr/local/bin" "$root/etc" "$root/tmp" "$work/state/data" "$root/models" "$root/certs"
cp "$BIN" "$root/usr/local/bin/tokenlog"
# Debug info stays out of the image (symbols stay: panics still name their functions).
if command -v strip >/dev/null; then strip --strip-debug "$root/usr/local/bin/tokenlog"; fi
# Every library the binary loads, and the loader itself, at the paths it looks for them.
libs=$(ldd "$BIN" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
[ -n "$libs" ] || { echo "build.sh: ldd found no libraries for $BIN (a static binary needs none; is it for this machine?)" >&2; exit 1; }
for lib in $libs; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cat > "$root/etc/passwd" <<PASSWD
root:x:0:0:root:/:/nonexistent
tokenlog:x:10001:10001:tokenlog:/var/lib/tokenlog:/nonexistent
PASSWD
cat > "$root/etc/group" <<GROUP
root:x:0:
tokenlog:x:10001:
GROUP
echo "hosts: files dns" > "$root/etc/nsswitch.conf"
chmod 1777 "$root/tmp"
sha=$(sha256sum "$BIN" | cut -c1-64)
cat > "$work/Dockerfile" <<DOCKERFILE
FROM scratch
COPY root/ /
COPY --chown=10001:10001 state/ /var/lib/tokenlog/
LABEL org.opencontainers.image.title="tokenlog" tokenlog.binary.sha256="$sha"
USER 10001:10001
WORKDIR /var/lib/tokenlog
ENTRYPOINT ["/usr/local/bin/tokenlog"]
CMD ["--help"]
DOCKERFILE
# (The legacy builder's deprecation notice is noise here: shown only when the build fails.)
if ! docker build --quiet --tag "$TAG" "$work" >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  exit 1
fi
size=$(docker image inspect "$TAG" --format '{{.Size}}')
echo "built $TAG ($((size / 1048576)) MiB) from $BIN (sha256 ${sha:0:12})"
