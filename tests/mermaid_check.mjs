// Parses Mermaid diagrams with the real mermaid package (the one the site serves), in node.
// Usage: node mermaid_check.mjs NODE_MODULES < blocks.json, where blocks.json is a list of
// {"name": ..., "text": ...}; prints one JSON object per block: {name, ok, type | error}.
// jsdom stands in for the browser's DOM, which mermaid's sanitizer needs even to parse.
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { readFileSync } from "node:fs";

const modules = process.argv[2];
const require = createRequire(join(modules, "noop.js"));
const { JSDOM } = require("jsdom");
const dom = new JSDOM("<!doctype html><html><body></body></html>");
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const { default: mermaid } = await import(pathToFileURL(join(modules, "mermaid", "dist", "mermaid.core.mjs")).href);
mermaid.initialize({ startOnLoad: false });

const blocks = JSON.parse(readFileSync(0, "utf8"));
for (const block of blocks) {
  try {
    const parsed = await mermaid.parse(block.text);
    console.log(JSON.stringify({ name: block.name, ok: true, type: parsed.diagramType }));
  } catch (error) {
    console.log(JSON.stringify({ name: block.name, ok: false, error: String(error.message ?? error) }));
  }
}
