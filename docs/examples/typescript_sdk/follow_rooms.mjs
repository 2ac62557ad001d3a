// @ts-check
// Follow every room of your company in one stream and keep your place: each event is printed once,
// and the cursors (room id -> cursor) are written to a file after each, so a restart of this program
// carries on after them, missing and repeating nothing; a room your company joined meanwhile is
// followed from its joining.
//
// QUAYUTEC_CURSOR_FILE names the file (default rooms.cursors.json), and QUAYUTEC_MAX_EVENTS stops after
// that many events (unset: follow until interrupted). The Gateway and the key as in quickstart.mjs.
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { connect, RoomEventKind } from "@quayutec/client";

/** Your work for one event; here, a line of output. @param {import("@quayutec/client").RoomEvent} event */
function handle(event) {
  const body = event.detail.case === "message" ? event.detail.value.body : event.detail.case;
  console.log(`${event.roomId} [${event.cursor}] ${RoomEventKind[event.kind].toLowerCase()}: ${body}`);
}

const cursorFile = process.env.QUAYUTEC_CURSOR_FILE ?? "rooms.cursors.json";
// No file yet: {} (every room from your company's joining; leaving `after` out would mean from now).
// Cursors are stored as strings (they are 64-bit).
const after = existsSync(cursorFile) ? JSON.parse(readFileSync(cursorFile, "utf8")) : {};
const limit = Number(process.env.QUAYUTEC_MAX_EVENTS ?? 0);

const client = connect({
  address: process.env.QUAYUTEC_GATEWAY_ADDR ?? "localhost:50051",
  apiKey: process.env.QUAYUTEC_API_KEY ?? "",
  plaintext: process.env.QUAYUTEC_PLAINTEXT === "1",
});
const events = client.watchRooms({ after });
let seen = 0;
try {
  for await (const event of events) {
    handle(event);
    // Stored once the event is handled, as in follow.mjs: every room's cursor, so rooms joined since
    // are told apart from rooms already followed.
    const cursors = Object.fromEntries([...events.cursors].map(([room, cursor]) => [room, String(cursor)]));
    writeFileSync(cursorFile, JSON.stringify(cursors));
    if (++seen === limit) break;
  }
} finally {
  events.close();
  client.close();
}
