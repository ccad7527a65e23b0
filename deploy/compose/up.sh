#!/usr/bin/env bash
# Starts tokenlog on Docker (docker-compose.yml beside this script): builds the image if it is
# missing (deploy/image/build.sh), makes certificates if ./certs (or $TOKENLOG_CERTS) has none,
# starts 3 nodes, 2 decoders and 2 gateways, and waits until the log has a leader and both
# gateways answer. TOKENLOG_MODEL=smollm2 runs the bundled SmolLM2 (fetched into ../../models by
# deploy/fetch-model.sh) instead of the fake model. The project name is $COMPOSE_PROJECT_NAME
# (default tokenlog); ./down.sh removes what this started.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-tokenlog}"
export TOKENLOG_IMAGE="${TOKENLOG_IMAGE:-tokenlog:dev}"
export TOKENLOG_CERTS="${TOKENLOG_CERTS:-$here/certs}"
export TOKENLOG_MODELS="${TOKENLOG_MODELS:-$(cd "$here/../.." && pwd)/models}"
command -v docker >/dev/null || { echo "up.sh: docker is not installed" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "up.sh: the Docker daemon does not answer (is it running?)" >&2; exit 1; }
docker image inspect "$TOKENLOG_IMAGE" >/dev/null 2>&1 || "$here/../image/build.sh" --tag "$TOKENLOG_IMAGE"

if [ "${TOKENLOG_MODEL:-fake}" = smollm2 ]; then
  "$here/../fetch-model.sh" "$TOKENLOG_MODELS" >&2
  export TOKENLOG_DECODER_MODEL="--model=/models/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
mkdir -p "$TOKENLOG_MODELS"

# Certificates, made inside the image (no tokenlog needed on the host) as the image's user, so
# that the containers can read their keys (0600).
if [ ! -f "$TOKENLOG_CERTS/ca.pem" ]; then
  mkdir -p "$TOKENLOG_CERTS"
  if [ "$(id -u)" = 0 ]; then chown 10001:10001 "$TOKENLOG_CERTS"; else chmod 0777 "$TOKENLOG_CERTS"; fi
  docker run --rm --network none -v "$TOKENLOG_CERTS:/out" "$TOKENLOG_IMAGE" certs --out /out >/dev/null
  echo "made certificates in $TOKENLOG_CERTS"
fi

docker-compose -f "$here/docker-compose.yml" up -d --remove-orphans

# Ready: a leader, as the admin sees it from inside the clients network, and both gateways.
status() {
  docker run --rm --network "${COMPOSE_PROJECT_NAME}_clients" -v "$TOKENLOG_CERTS:/certs:ro" "$TOKENLOG_IMAGE" \
    status --cluster node-1:7001,node-2:7001,node-3:7001 \
    --tls-ca /certs/ca.pem --tls-cert /certs/admin.pem --tls-key /certs/admin.key "$@"
}
deadline=$((SECONDS + ${TOKENLOG_UP_TIMEOUT_S:-120}))
# Fails with the containers' last words once the deadline has passed.
give_up_after_deadline() {
  [ $SECONDS -lt $deadline ] && return 0
  echo "up.sh: $1; logs:" >&2
  docker-compose -f "$here/docker-compose.yml" logs --tail 20 >&2
  exit 1
}
until status >/dev/null 2>&1; do
  give_up_after_deadline "no leader after ${TOKENLOG_UP_TIMEOUT_S:-120} s"
  sleep 1
done
for port in "${TOKENLOG_HTTP_PORT:-8000}" "${TOKENLOG_HTTP_PORT_2:-8001}"; do
  until curl -fsS "http://127.0.0.1:$port/v1/models" 2>/dev/null | grep -q '"id"'; do
    give_up_after_deadline "the gateway on 127.0.0.1:$port serves no model"
    sleep 1
  done
done
status
echo "tokenlog is up: gRPC 127.0.0.1:${TOKENLOG_GRPC_PORT:-7100},127.0.0.1:${TOKENLOG_GRPC_PORT_2:-7101}; HTTP http://127.0.0.1:${TOKENLOG_HTTP_PORT:-8000}/v1"
