// The live terminal: xterm.js bridged over the terminal WebSocket to a PTY
// shell in the sandbox. A dropped socket reconnects with the shell's pid, so the
// shell survives a network blip.

import { enc, wsUrl } from './api.js';
import { h } from './ui.js';

const encoder = new TextEncoder();

/**
 * Mounts a terminal into `box` for sandbox `id`; `status` is an element that
 * shows the connection state. Returns { dispose }.
 */
export function mountTerminal(box, status, id) {
  if (typeof window.Terminal !== 'function' || !window.FitAddon) {
    box.append(h('p', { class: 'form-error' }, 'The terminal emulator did not load: reload the page.'));
    return { dispose() {} };
  }
  const term = new window.Terminal({
    cursorBlink: true,
    fontFamily: 'ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace',
    fontSize: 14,
    scrollback: 5000,
    theme: { background: '#0f1720', foreground: '#e6edf3' },
  });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  const holder = h('div', { id: 'terminal', 'data-testid': 'terminal', class: 'term' });
  box.append(holder);
  term.open(holder);
  safeFit(fit);

  let ws = null;
  let pid = null;
  let disposed = false;
  let ended = false;
  let backoff = 500;
  let timer = null;
  let failures = 0;

  const setStatus = (state, text, ...extra) => {
    status.dataset.state = state;
    status.replaceChildren(text, ...extra);
  };

  const newShellButton = () => h('button', {
    type: 'button', class: 'btn btn-small', onclick: () => {
      pid = null;
      ended = false;
      failures = 0;
      term.reset();
      connect();
    },
  }, 'Start a new shell');

  const send = (obj) => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(obj);
  };

  const connect = () => {
    timer = null;
    if (disposed) return;
    const q = `cols=${term.cols}&rows=${term.rows}${pid !== null ? `&pid=${pid}` : ''}`;
    setStatus('connecting', pid !== null ? 'reconnecting…' : 'connecting…');
    const sock = new WebSocket(wsUrl(`sandboxes/${enc(id)}/terminal?${q}`));
    sock.binaryType = 'arraybuffer';
    ws = sock;
    sock.onmessage = (ev) => {
      if (typeof ev.data !== 'string') {
        term.write(new Uint8Array(ev.data));
        return;
      }
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      if (msg.type === 'started') {
        const again = pid !== null && pid === msg.pid;
        pid = msg.pid;
        failures = 0;
        backoff = 500;
        setStatus('live', again ? `connected again (shell pid ${pid})` : `connected (shell pid ${pid})`);
        // The size may have changed while the socket was away.
        send(JSON.stringify({ type: 'resize', cols: term.cols, rows: term.rows }));
      } else if (msg.type === 'exit') {
        ended = true;
        term.write(`\r\n\x1b[2m[the shell exited with code ${msg.code}]\x1b[0m\r\n`);
        setStatus('ended', `The shell exited (code ${msg.code}). `, newShellButton());
      } else if (msg.type === 'error') {
        ended = true;
        setStatus('error', `Terminal error: ${msg.message} `, newShellButton());
      }
    };
    sock.onclose = (ev) => {
      if (ws === sock) ws = null;
      if (disposed || ended) return;
      failures += 1;
      if (failures > 8) {
        setStatus('error', 'The terminal cannot reconnect: check that the sandbox is running and the gateway reachable. ', newShellButton());
        return;
      }
      const why = ev.code === 1006 ? 'connection lost' : `closed (${ev.code}${ev.reason ? `: ${ev.reason}` : ''})`;
      setStatus('reconnecting', `reconnecting… (${why})`);
      timer = setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 10000);
    };
  };

  term.onData((data) => send(encoder.encode(data)));
  term.onBinary((data) => {
    const buf = new Uint8Array(data.length);
    for (let i = 0; i < data.length; i += 1) buf[i] = data.charCodeAt(i) & 0xff;
    send(buf);
  });
  term.onResize(({ cols, rows }) => send(JSON.stringify({ type: 'resize', cols, rows })));

  const ro = new ResizeObserver(() => safeFit(fit));
  ro.observe(holder);
  connect();
  term.focus();

  return {
    dispose() {
      disposed = true;
      if (timer) clearTimeout(timer);
      ro.disconnect();
      if (ws) ws.close(1000);
      term.dispose();
    },
  };
}

function safeFit(fit) {
  try {
    fit.fit();
  } catch {
    // not laid out yet
  }
}
