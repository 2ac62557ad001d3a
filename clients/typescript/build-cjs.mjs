// The CommonJS build: the sources copied under a package.json of "type": "commonjs" (so NodeNext
// compiles them as CommonJS), compiled into dist/cjs, which gets the same marker.
import { cpSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { execFileSync } from "node:child_process";

rmSync("build/cjs", { recursive: true, force: true });
rmSync("dist/cjs", { recursive: true, force: true });
mkdirSync("build/cjs", { recursive: true });
cpSync("src", "build/cjs/src", { recursive: true });
const commonjs = JSON.stringify({ type: "commonjs" }) + "\n";
writeFileSync("build/cjs/package.json", commonjs);
execFileSync(process.execPath, ["node_modules/typescript/bin/tsc", "-p", "tsconfig.cjs.json"], { stdio: "inherit" });
writeFileSync("dist/cjs/package.json", commonjs);
rmSync("build", { recursive: true, force: true });
