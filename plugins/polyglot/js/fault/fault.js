// fault (test plugin, JavaScript): what `process` does depends on the
// message value:
//
//   `loop`  - spins forever (the host's deadline must stop it);
//   `alloc` - allocates 1 MiB arrays without bound (the memory cap must stop it);
//   `throw` - throws an Error (`fault-js: deliberate exception`);
//   anything else passes the message on unchanged.

export function process(msg) {
  const what = msg.value === undefined ? '' : new TextDecoder().decode(msg.value);
  if (what === 'loop') {
    let spins = 0;
    for (;;) {
      spins = (spins + 1) | 0;
    }
  }
  if (what === 'alloc') {
    const hoard = [];
    for (;;) {
      hoard.push(new Uint8Array(1 << 20).fill(0xa5));
    }
  }
  if (what === 'throw') {
    throw new Error('fault-js: deliberate exception');
  }
  return { tag: 'emit', val: [{ key: msg.key, value: msg.value, headers: msg.headers }] };
}

export function processBatch(batch) {
  return batch.map((msg) => ({ tag: 'ok', val: process(msg) }));
}
