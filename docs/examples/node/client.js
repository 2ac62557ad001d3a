// Call the Gateway from Node: who am I, a room, a message posted twice with one idempotency key
// (posted once), every message page by page, and an error read as a gRPC status.
// `npm ci` in this folder installs @grpc/grpc-js and @grpc/proto-loader; the .proto files are the
// repository's protos/ folder (QUAYUTEC_PROTOS points elsewhere).
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const protos = process.env.QUAYUTEC_PROTOS || path.join(__dirname, "..", "..", "..", "protos");
const definition = protoLoader.loadSync("quayutec/v1/gateway.proto", {
  includeDirs: [protos],
  keepCase: true, // field names as in the .proto: room_id, next_page_token
  longs: String,
  enums: String,
  defaults: true,
});
const { GatewayService } = grpc.loadPackageDefinition(definition).quayutec.v1;

const addr = process.env.QUAYUTEC_GATEWAY_ADDR || "localhost:50051";
const gw = new GatewayService(addr, grpc.credentials.createInsecure()); // createSsl() for a TLS Gateway
const metadata = new grpc.Metadata();
metadata.set("authorization", `Bearer ${process.env.QUAYUTEC_API_KEY}`);

const call = (method, request) =>
  new Promise((resolve, reject) =>
    gw[method](request, metadata, (err, response) => (err ? reject(err) : resolve(response))),
  );

async function main() {
  const me = await call("WhoAmI", {});
  console.log(`company ${me.company.company_id} ${me.company.name}`);

  const { room } = await call("CreateRoom", { name: "from-node" });
  console.log(`room ${room.room_id}`);

  // A retry with the same idempotency key returns the first message; nothing is posted twice.
  const post = { room_id: room.room_id, person: "ana", body: "hello", idempotency_key: "k1" };
  const first = (await call("PostMessage", post)).message;
  const again = (await call("PostMessage", post)).message;
  console.log(`posted ${first.message_id}; the retry returned the same message: ${again.message_id === first.message_id}`);
  await call("PostMessage", { room_id: room.room_id, person: "ana", body: "second" });

  // Pages: pass next_page_token back until it comes back empty.
  const bodies = [];
  let token = "";
  do {
    const page = await call("ListMessages", { room_id: room.room_id, page_size: 1, page_token: token });
    bodies.push(...page.messages.map((m) => m.body));
    token = page.next_page_token;
  } while (token);
  console.log(`messages, one page each: ${JSON.stringify(bodies)}`);

  // Errors are gRPC status codes with a message saying what to fix.
  try {
    await call("ListMessages", { room_id: "00000000-0000-0000-0000-000000000000" });
  } catch (err) {
    console.log(`unknown room: ${grpc.status[err.code]}`);
  }
  gw.close();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
