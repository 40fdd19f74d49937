// Talking to the gateway: the session (cookie + CSRF token kept in memory only)
// and JSON calls under /console/api.

export const BASE = '/console/api';

const session = { csrf: null, expiresAt: 0 };
const signedOutHandlers = [];

/** An error with the gateway's message and HTTP status. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function csrfToken() {
  return session.csrf;
}

export function onSignedOut(fn) {
  signedOutHandlers.push(fn);
}

function signedOut(reason) {
  session.csrf = null;
  for (const fn of signedOutHandlers) fn(reason);
}

async function errorOf(res) {
  let message = `${res.status} ${res.statusText}`.trim();
  const type = res.headers.get('content-type') || '';
  try {
    const text = await res.text();
    if (text && type.includes('json')) {
      const j = JSON.parse(text);
      message = j.message || j.error || message;
    } else if (text && type.startsWith('text/plain')) {
      message = text.slice(0, 500);
    }
  } catch {
    // keep the status line
  }
  return new ApiError(res.status, message);
}

/**
 * Calls /console/api/<path>. `body` is sent as JSON unless it is a Blob/File
 * (sent as raw bytes). Every method other than GET/HEAD carries the CSRF token.
 * A 401 on anything but the session call means the session ended.
 */
export async function call(method, path, body, { raw = false } = {}) {
  const headers = {};
  const init = { method, headers, credentials: 'same-origin', cache: 'no-store' };
  if (method !== 'GET' && method !== 'HEAD' && session.csrf) {
    headers['X-CSRF-Token'] = session.csrf;
  }
  if (body instanceof Blob) {
    headers['Content-Type'] = 'application/octet-stream';
    init.body = body;
  } else if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(`${BASE}/${path}`, init);
  } catch (e) {
    throw new ApiError(0, `the gateway did not answer (${e.message}): check that it is running and reachable`);
  }
  if (res.status === 401 && path !== 'session') {
    const err = await errorOf(res);
    signedOut('Your session ended: sign in again.');
    throw err;
  }
  if (!res.ok) throw await errorOf(res);
  if (raw) return res;
  if (res.status === 204) return null;
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

/** GET /console/api/rest/<path>: the control-plane API through the session. */
export const rest = {
  get: (path) => call('GET', `rest/${path}`),
  post: (path, body) => call('POST', `rest/${path}`, body === undefined ? {} : body),
  del: (path) => call('DELETE', `rest/${path}`),
};

/** Asks whether a session exists (cookie); true when signed in. */
export async function resumeSession() {
  try {
    const s = await call('GET', 'session');
    session.csrf = s.csrfToken;
    session.expiresAt = s.expiresAtUnixMs;
    return true;
  } catch (e) {
    if (e.status === 401) return false;
    throw e;
  }
}

export async function signIn(apiKey) {
  const s = await call('POST', 'session', { apiKey });
  session.csrf = s.csrfToken;
  session.expiresAt = s.expiresAtUnixMs;
}

export async function signOut() {
  try {
    await call('DELETE', 'session');
  } finally {
    signedOut('Signed out.');
  }
}

/** ws(s)://host/console/api/<path> */
export function wsUrl(path) {
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${proto}//${location.host}${BASE}/${path}`;
}

export function enc(s) {
  return encodeURIComponent(s);
}
