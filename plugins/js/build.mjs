// Build a JavaScript plugin into a component with componentize-js's API:
//   node build.mjs path/to/aggregate.js path/to/wit out.wasm
// The plugin's import of km0_sdk.js (a path relative to the plugin) is inlined first, so
// componentize-js sees one self-contained module.
import { componentize } from '@bytecodealliance/componentize-js';
import { readFile, writeFile, mkdtemp, rm } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { tmpdir } from 'node:os';

const [sourcePath, witPath, out] = process.argv.slice(2);
const sdkImport = /^import .* from '([^']*km0_sdk\.js)';$/m;
let plugin = await readFile(sourcePath, 'utf8');
const found = plugin.match(sdkImport);
if (found) {
  const sdk = await readFile(resolve(dirname(sourcePath), found[1]), 'utf8');
  plugin = `${sdk.replace(/^export /gm, '')}\n${plugin.replace(sdkImport, '')}`;
}
// The bundled module goes in a folder of its own, removed once the component is built.
const dir = await mkdtemp(join(tmpdir(), 'km0-js-'));
try {
  const bundled = join(dir, 'aggregate.js');
  await writeFile(bundled, plugin);
  const { component } = await componentize({
    sourcePath: bundled,
    witPath,
    worldName: 'aggregate-plugin',
    disableFeatures: ['http', 'fetch-event', 'random', 'stdio', 'clocks'],
  });
  await writeFile(out, component);
} finally {
  await rm(dir, { recursive: true, force: true });
}
