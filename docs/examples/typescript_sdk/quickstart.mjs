// @ts-check
// Quayutec rooms from Node with @quayutec/client: connect, post a message that wakes an agent,
// follow the room until the agent's run ends (two minutes at most), and read an error.
//
// Needs `npm install <the packed @quayutec/client>` (it brings @bufbuild/protobuf and Connect). The
// Gateway's address comes from QUAYUTEC_GATEWAY_ADDR, your API key from QUAYUTEC_API_KEY and the
// agent's model provider key from QUAYUTEC_PROVIDER_KEY; QUAYUTEC_PLAINTEXT=1 for a Gateway on your
// machine without TLS.
import { connect, InvalidArgument, RoomEventKind, RunStatus } from "@quayutec/client";

const client = connect({
  address: process.env.QUAYUTEC_GATEWAY_ADDR ?? "localhost:50051",
  apiKey: process.env.QUAYUTEC_API_KEY ?? "",
  plaintext: process.env.QUAYUTEC_PLAINTEXT === "1",
});
try {
  const me = await client.whoAmI();
  console.log(`company ${me.name}`);
  const room = await client.createRoom("launch");
  const writer = await client.registerAgent({
    name: "writer",
    provider: "anthropic",
    model: "claude-sonnet-4-5",
    providerKey: process.env.QUAYUTEC_PROVIDER_KEY,
  });

  const events = await client.watch(room.roomId).ready(); // the room's events from now on
  // The mention wakes the writer once. If the call is retried (the client does so by itself after
  // UNAVAILABLE), every attempt carries the same idempotency key.
  const posted = await client.postMessage(room.roomId, "@writer draft the launch note", {
    person: "ana",
    mentions: [writer.agentId],
  });
  console.log(`posted #${posted.message?.seq}, waking ${posted.wakeIds.length} agent`);
  // Follow the room until the run of that wake ends (its RUN_ENDED event), whatever the outcome: a
  // run that fails ends too, and so does this program, within two minutes.
  const giveUp = setTimeout(() => events.close(), 120_000);
  let run;
  for await (const event of events) {
    if (event.kind === RoomEventKind.RUN_ENDED && event.detail.case === "run" && posted.wakeIds.includes(event.detail.value.wakeId)) {
      run = event.detail.value;
      break;
    }
  }
  clearTimeout(giveUp);
  events.close();
  if (run === undefined) {
    throw new Error("the writer's run did not end within two minutes");
  }
  if (run.status !== RunStatus.SUCCEEDED) {
    throw new Error(`the writer's run ended ${RunStatus[run.status]}: ${run.error}`);
  }
  console.log(`the writer answered (run ${run.runId})`);

  try {
    await client.postMessage(room.roomId, "", { person: "ana" });
  } catch (err) {
    if (!(err instanceof InvalidArgument)) throw err;
    console.log(`refused: ${err.codeName}: ${err.rawMessage}`);
  }
} finally {
  client.close();
}
