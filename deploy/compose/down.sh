#!/usr/bin/env bash
# Stops what up.sh started and removes its containers, networks and volumes (the log's data).
# The certificates in ./certs (or $TOKENLOG_CERTS) stay unless --purge is given.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-tokenlog}"
export TOKENLOG_CERTS="${TOKENLOG_CERTS:-$here/certs}"
docker-compose -f "$here/docker-compose.yml" down --volumes --remove-orphans --timeout 5
if [ "${1:-}" = --purge ]; then rm -rf "$TOKENLOG_CERTS"; echo "removed $TOKENLOG_CERTS"; fi
