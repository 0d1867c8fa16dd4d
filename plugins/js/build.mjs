// Build a JavaScript plugin into a component with componentize-js's API:
//   node plugins/js/build.mjs plugins/js/<name>/aggregate.js wit out.wasm
// The plugin's import of ../km0_sdk.js is inlined first (one self-contained module).
import { componentize } from '@bytecodealliance/componentize-js';
import { readFile, writeFile, mkdtemp } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { tmpdir } from 'node:os';

const [sourcePath, witPath, out] = process.argv.slice(2);
const sdk = (await readFile(join(dirname(sourcePath), '..', 'km0_sdk.js'), 'utf8')).replace(/^export /gm, '');
const plugin = (await readFile(sourcePath, 'utf8')).replace(/^import .* from '\.\.\/km0_sdk\.js';$/m, '');
const bundled = join(await mkdtemp(join(tmpdir(), 'km0-js-')), 'aggregate.js');
await writeFile(bundled, `${sdk}\n${plugin}`);
const { component } = await componentize({
  sourcePath: bundled,
  witPath,
  worldName: 'aggregate-plugin',
  disableFeatures: ['http', 'fetch-event', 'random', 'stdio', 'clocks'],
});
await writeFile(out, component);
