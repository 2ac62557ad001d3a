// @ts-check
// Follow a room and keep your place: each event is printed once, and the cursor of the last one is
// written to a file, so a restart of this program carries on after it, missing and repeating nothing.
//
// QUAYUTEC_ROOM_ID names the room, QUAYUTEC_CURSOR_FILE the file (default room-<id>.cursor), and
// QUAYUTEC_MAX_EVENTS stops after that many events (unset: follow until interrupted). The Gateway and
// the key as in quickstart.mjs.
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { connect, RoomEventKind } from "@quayutec/client";

/** Your work for one event; here, a line of output. @param {import("@quayutec/client").RoomEvent} event */
function handle(event) {
  const body = event.detail.case === "message" ? event.detail.value.body : event.detail.case;
  console.log(`[${event.cursor}] ${RoomEventKind[event.kind].toLowerCase()}: ${body}`);
}

const roomId = process.env.QUAYUTEC_ROOM_ID ?? "";
const cursorFile = process.env.QUAYUTEC_CURSOR_FILE ?? `room-${roomId}.cursor`;
const after = existsSync(cursorFile) ? readFileSync(cursorFile, "utf8") : "0"; // 0: from the oldest event kept
const limit = Number(process.env.QUAYUTEC_MAX_EVENTS ?? 0);

const client = connect({
  address: process.env.QUAYUTEC_GATEWAY_ADDR ?? "localhost:50051",
  apiKey: process.env.QUAYUTEC_API_KEY ?? "",
  plaintext: process.env.QUAYUTEC_PLAINTEXT === "1",
});
const events = client.watch(roomId, { after });
let seen = 0;
try {
  for await (const event of events) {
    handle(event);
    // Stored once the event is handled: a crash between the two handles it again on restart. Keep
    // the cursor in the same transaction as what handling writes to have it exactly once.
    writeFileSync(cursorFile, String(events.cursor));
    if (++seen === limit) break;
  }
} finally {
  events.close();
  client.close();
}
