// A certified OpenID provider (panva's oidc-provider) on loopback, for the console's sign-in tests.
//
// node provider.mjs '<json>' listens on 127.0.0.1 (a port the system picks), then prints one line,
// {"issuer": ..., "port": ...}, and serves until killed. The JSON names the client and how to misbehave:
//   {"client_id", "client_secret", "redirect_uris": [...], "names": {"<login>": "<display name>"},
//    "mode": "" | "wrong_issuer" | "bad_signature" | "expired_id_token",
//    "unverified": ["<login>", ...]}  (their ID tokens say email_verified: false)
// Any login with any password signs in (the library's development login pages); the login is the
// person's email and subject. The modes are real faults a provider can have: tokens naming another
// issuer than its discovery document, published keys that do not sign its tokens, ID tokens expired
// when issued.
import { generateKeyPairSync } from 'node:crypto';
import http from 'node:http';
import Provider from 'oidc-provider';

const options = JSON.parse(process.argv[2] || '{}');
const mode = options.mode || '';
const names = options.names || {};
const unverified = options.unverified || [];

function signingKey(kid) {
  const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
  return { ...privateKey.export({ format: 'jwk' }), kid, alg: 'RS256', use: 'sig' };
}

function publicPart(jwk) {
  const { kty, n, e, kid, alg, use } = jwk;
  return { kty, n, e, kid, alg, use };
}

const server = http.createServer();
server.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;
  const key = signingKey('signing-1');
  // bad_signature: another key published under the same key id.
  const published = { keys: [publicPart(mode === 'bad_signature' ? signingKey('signing-1') : key)] };
  const provider = new Provider(mode === 'wrong_issuer' ? `${issuer}/elsewhere` : issuer, {
    clients: [{
      client_id: options.client_id,
      client_secret: options.client_secret,
      redirect_uris: options.redirect_uris,
      grant_types: ['authorization_code'],
      response_types: ['code'],
    }],
    jwks: { keys: [key] },
    claims: { openid: ['sub'], email: ['email', 'email_verified'], profile: ['name'] },
    conformIdTokenClaims: false,
    cookies: {
      keys: ['quayutec-test-cookie-key'],
      long: { httpOnly: true, sameSite: 'lax' },
      short: { httpOnly: true, sameSite: 'lax' },
    },
    // A function, as the library checks only a number's sign: issued ten minutes past its expiry.
    ttl: { IdToken: function idTokenTtl() { return mode === 'expired_id_token' ? -600 : 600; } },
    async findAccount(ctx, id) {
      return {
        accountId: id,
        async claims() {
          return { sub: id, email: id, email_verified: !unverified.includes(id), name: names[id] || id };
        },
      };
    },
  });
  provider.use(async (ctx, next) => {
    await next();
    if (ctx.path === '/.well-known/openid-configuration' && mode === 'wrong_issuer') {
      ctx.body = { ...ctx.body, issuer };
    }
    if (ctx.path === '/jwks') {
      ctx.body = published;
    }
  });
  server.on('request', provider.callback());
  process.stdout.write(`${JSON.stringify({ issuer, port })}\n`);
});
