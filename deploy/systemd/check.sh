#!/usr/bin/env bash
# Checks the systemd units offline: `systemd-analyze verify` (the only warnings allowed are
# about RestartSteps/RestartMaxDelaySec, which systemd < 254 does not know), an exposure level
# of at most 2.0 in `systemd-analyze security --offline`, and every flag of every ExecStart in
# `tokenlog <command> --help`.
# Usage: deploy/systemd/check.sh [path/to/tokenlog]   (default: tokenlog on PATH)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(realpath "${1:-$(command -v tokenlog)}")"
command -v systemd-analyze >/dev/null || { echo "check.sh: systemd-analyze is needed" >&2; exit 1; }
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
status=0
for unit in "$here"/*.service; do
  name="$(basename "$unit")"
  # The binary the tests built stands in for /usr/local/bin/tokenlog (verify checks it runs).
  sed "s|/usr/local/bin/tokenlog|$bin|" "$unit" > "$scratch/$name"
  out="$(cd "$scratch" && systemd-analyze verify --man=no "./$name" 2>&1 || echo "verify failed")"
  unexpected="$(grep -vE "Unknown key '(RestartSteps|RestartMaxDelaySec)'" <<<"$out" | grep -v '^$' || true)"
  if [ -n "$unexpected" ]; then
    echo "$name: systemd-analyze verify: $unexpected" >&2
    status=1
  fi
  if ! (cd "$scratch" && systemd-analyze security --offline=true --threshold=20 "./$name" >/dev/null 2>&1); then
    echo "$name: exposure above 2.0:" >&2
    (cd "$scratch" && systemd-analyze security --offline=true "./$name" 2>&1 | tail -3) >&2
    status=1
  fi
  # ExecStart's continuation lines joined; then its command and flags.
  exec_start="$(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | tr -d '\\\n')"
  command="$(awk '{print $2}' <<<"${exec_start#ExecStart=}")"
  help="$("$bin" "$command" --help)"
  for flag in $(grep -oE -- '--[a-z0-9-]+' <<<"$exec_start"); do
    grep -qE -- "$flag[ =,]" <<<"$help" || { echo "$name: \`tokenlog $command\` has no flag $flag" >&2; status=1; }
  done
  # Every variable ExecStart uses is set in the example environment file.
  env_file="$here/${name#tokenlog-}"; env_file="${env_file%.service}.env.example"
  for var in $(grep -oE '\$\{?[A-Z_]+' <<<"$exec_start" | tr -d '${' | sort -u); do
    grep -q "^$var=" "$env_file" || { echo "$name: $var is not in $(basename "$env_file")" >&2; status=1; }
  done
  [ $status = 0 ] && echo "deploy/systemd/$name: valid"
done
exit $status
