// The real stack the tests run against: the control API of tests/harness/sdk_stack.py (a Gateway
// process that can be killed, Room, Claims, Runtime and model stand-in on loopback). With
// QUAYUTEC_SDK_STACK set (the pytest that runs `npm test` sets it) that stack is used; otherwise this
// process starts one with the repository's Python (QUAYUTEC_PYTHON, or .venv/bin/python) and stops it
// when the tests end.
import { spawn, type ChildProcess } from "node:child_process";
import { once } from "node:events";
import * as path from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");

export interface Extra {
  gateway: string;
  other_gateway: string;
  limited_gateway: string;
  strict_gateway: string;
  tls_gateway: string;
  tls_ca_pem: string;
}

export interface Company {
  company_id: string;
  name: string;
  api_key: string;
}

export class Stack {
  constructor(readonly control: string, readonly extra: Extra, private readonly child?: ChildProcess) {}

  async post<T = Record<string, unknown>>(route: string, body: object = {}): Promise<T> {
    const response = await fetch(`${this.control}${route}`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
    });
    const answer = (await response.json()) as T & { error?: string };
    if (!response.ok) {
      throw new Error(`${route}: ${answer.error}`);
    }
    return answer;
  }

  company(name?: string): Promise<Company> {
    return this.post<Company>("/company", name ? { name } : {});
  }

  async close(): Promise<void> {
    if (this.child && this.child.exitCode === null) {
      this.child.stdin?.end();
      await once(this.child, "exit");
    }
  }
}

export async function startStack(): Promise<Stack> {
  let control = process.env.QUAYUTEC_SDK_STACK;
  let child: ChildProcess | undefined;
  if (!control) {
    const python = process.env.QUAYUTEC_PYTHON ?? path.join(REPO, ".venv", "bin", "python");
    child = spawn(python, ["-m", "tests.harness.sdk_stack"], { cwd: REPO, stdio: ["pipe", "pipe", "inherit"] });
    const lines = createInterface({ input: child.stdout! });
    const [first] = (await Promise.race([once(lines, "line"), once(child, "exit").then(() => [undefined])])) as [string | undefined];
    if (!first) {
      throw new Error(`${python} -m tests.harness.sdk_stack exited before serving (run \`make test\` once to make .venv)`);
    }
    control = (JSON.parse(first) as { control: string }).control;
  }
  const response = await fetch(`${control}/extra`, { method: "POST" });
  return new Stack(control, (await response.json()) as Extra, child);
}
