// The console's entry point: sign-in, the hash router, and the live state fed
// by the events WebSocket (the only source of live updates).

import { onSignedOut, resumeSession, signIn, signOut, wsUrl } from './api.js';
import { nodesView, sandboxesView, setupCreateDialog } from './views.js';
import { templatesView } from './templates.js';
import { sandboxView } from './sandbox.js';

/** What the events socket last said; views read it and re-render on change. */
export const store = {
  nodes: null,
  sandboxes: null,
  truncated: false,
  /** What the gateway said it cannot read, per list (null: nothing wrong). */
  errors: { nodes: null, sandboxes: null },
  live: 'connecting',
  listeners: new Set(),
  emit() {
    for (const fn of this.listeners) fn();
  },
};

const $ = (id) => document.getElementById(id);

let current = null; // { cleanup, update, tick }
let events = null;

// ---- sign-in ----------------------------------------------------------------

function showSignIn(message) {
  stopEvents();
  unmount();
  $('top').hidden = true;
  $('view').hidden = true;
  $('signin-view').hidden = false;
  $('signin-error').textContent = message || '';
  $('signin-key').value = '';
  $('signin-key').focus();
  document.title = 'Sign in · AgentENV console';
}

function showApp() {
  $('signin-view').hidden = true;
  $('top').hidden = false;
  $('view').hidden = false;
  startEvents();
  route();
}

$('signin-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const input = $('signin-key');
  const key = input.value;
  input.value = ''; // the key stays in no field and no storage
  const btn = $('signin-submit');
  btn.disabled = true;
  $('signin-error').textContent = '';
  try {
    await signIn(key);
    showApp();
  } catch (e) {
    $('signin-error').textContent = e.status === 401
      ? "That key was refused: use the cluster's API key (AENV_API_KEY on the gateway)."
      : `Sign-in failed: ${e.message}`;
    input.focus();
  } finally {
    btn.disabled = false;
  }
});

$('signout').addEventListener('click', async () => {
  try {
    await signOut();
  } catch (e) {
    showSignIn(`Signed out here; the gateway said: ${e.message}`);
  }
});

onSignedOut((reason) => showSignIn(reason));

// ---- live events ------------------------------------------------------------

function setLive(state, text) {
  store.live = state;
  const el = $('live-status');
  el.dataset.state = state;
  el.textContent = text;
  store.emit();
}

function startEvents() {
  if (events) return;
  let backoff = 1000;
  let timer = null;
  let ws = null;
  let stopped = false;

  const connect = () => {
    timer = null;
    ws = new WebSocket(wsUrl('events'));
    ws.onopen = () => {
      backoff = 1000;
      setLive('live', 'live');
    };
    ws.onmessage = (ev) => {
      if (typeof ev.data !== 'string') return;
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      // An error names its list ("list": nodes or sandboxes) and is not repeated;
      // the list is sent again when it can be read, which ends its error.
      if (msg.type === 'nodes') {
        store.nodes = Array.isArray(msg.items) ? msg.items : [];
        if (store.nodes.length) store.errors.nodes = null;
      } else if (msg.type === 'sandboxes') {
        store.sandboxes = Array.isArray(msg.items) ? msg.items : [];
        store.truncated = !!msg.truncated;
        store.errors.sandboxes = null;
      } else if (msg.type === 'error') {
        const text = String(msg.message || 'the gateway cannot read the cluster state');
        const sandboxes = msg.list === 'sandboxes';
        const nodes = msg.list === 'nodes';
        if (nodes || !sandboxes) store.errors.nodes = text;
        if (sandboxes || !nodes) store.errors.sandboxes = text;
      } else {
        return;
      }
      store.emit();
    };
    ws.onclose = async (ev) => {
      ws = null;
      if (stopped) return;
      if (ev.code === 4001) {
        showSignIn('Your session ended: sign in again.');
        return;
      }
      setLive('reconnecting', `reconnecting in ${Math.round(backoff / 1000)} s…`);
      // A refused upgrade looks like any drop: ask whether the session still exists.
      try {
        if (!(await resumeSession())) {
          showSignIn('Your session ended: sign in again.');
          return;
        }
      } catch {
        // the gateway is down: keep trying
      }
      if (stopped) return;
      timer = setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 30000);
    };
  };

  setLive('connecting', 'connecting…');
  connect();
  events = {
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
      if (ws) ws.close(1000);
    },
  };
}

function stopEvents() {
  if (events) events.stop();
  events = null;
  store.nodes = null;
  store.sandboxes = null;
  store.errors = { nodes: null, sandboxes: null };
  setLive('offline', 'offline');
}

// ---- router -----------------------------------------------------------------

function unmount() {
  if (current && current.cleanup) current.cleanup();
  current = null;
  $('view').replaceChildren();
}

function parseRoute() {
  const hash = location.hash.replace(/^#\/?/, '');
  let parts;
  try {
    parts = hash.split('/').filter(Boolean).map(decodeURIComponent);
  } catch {
    return null; // malformed percent-encoding: back to the default view
  }
  if (parts[0] === 'sandboxes' && parts[1]) return { name: 'sandbox', id: parts[1] };
  if (['nodes', 'sandboxes', 'templates'].includes(parts[0])) return { name: parts[0] };
  return null;
}

function route() {
  if ($('signin-view').hidden === false) return;
  const r = parseRoute();
  if (!r) {
    location.replace('#/nodes');
    return;
  }
  unmount();
  const view = $('view');
  const mount = {
    nodes: () => nodesView(view, store),
    sandboxes: () => sandboxesView(view, store),
    templates: () => templatesView(view, store),
    sandbox: () => sandboxView(view, store, r.id),
  }[r.name];
  current = mount();
  for (const a of document.querySelectorAll('nav a')) {
    const on = a.getAttribute('href') === `#/${r.name === 'sandbox' ? 'sandboxes' : r.name}`;
    if (on) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
}

window.addEventListener('hashchange', () => {
  route();
  // A new view: start reading at its top (a terminal that opens takes the focus itself).
  window.scrollTo(0, 0);
  if (!document.activeElement || document.activeElement === document.body) $('main').focus({ preventScroll: true });
});
store.listeners.add(() => current && current.update && current.update());
// Relative times ("3 s ago") move on without asking the gateway anything.
setInterval(() => current && current.tick && current.tick(), 1000);

// ---- start ------------------------------------------------------------------

setupCreateDialog(store);

(async () => {
  try {
    if (await resumeSession()) showApp();
    else showSignIn('');
  } catch (e) {
    showSignIn(`Cannot check the session: ${e.message}`);
  }
})();
