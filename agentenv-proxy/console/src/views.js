// The list views: nodes, sandboxes, templates and snapshots; the create dialog
// and the sandbox actions shared with the sandbox page.

import { enc, rest } from './api.js';
import {
  ago, bytes, confirmDialog, duration, h, meter, notice, numberDialog, parseTime, table, td, toast, until,
} from './ui.js';

const TROUBLESHOOTING = 'docs/troubleshooting.md';

export function heading(title, ...tools) {
  return h('div', { class: 'view-head' }, h('h1', null, title), h('div', { class: 'tools' }, ...tools));
}

/** Says so when the shown state is the last one a dropped socket sent. */
function staleNote(store) {
  return store.live === 'reconnecting'
    ? notice('info', 'The live connection to the gateway dropped: this is the last state it sent. Reconnecting…')
    : null;
}

/** The error or "waiting" block shared by views that read the events socket. */
function liveGap(store, what) {
  const error = store.errors[what];
  if (error) {
    return notice('error', error,
      h('p', { class: 'small' }, `The view shows ${what} again as soon as the gateway can read them (see ${TROUBLESHOOTING}).`));
  }
  return notice('info', `Waiting for the gateway to send the ${what}…`);
}

// ---- nodes ------------------------------------------------------------------

export function nodesView(root, store) {
  const body = h('div');
  root.append(heading('Nodes'), body);
  document.title = 'Nodes · AgentENV console';

  const render = () => {
    const nodes = store.nodes;
    if (!nodes) {
      body.replaceChildren(liveGap(store, 'nodes'));
      return;
    }
    const parts = [staleNote(store)];
    // With no node at all, the empty state below says what the error would.
    const err = store.errors.nodes;
    if (err && !(nodes.length === 0 && /^no nodes are reporting/i.test(err))) parts.push(notice('error', err));
    if (nodes.length === 0) {
      parts.push(notice('empty', `No nodes are reporting: check the scheduler (see ${TROUBLESHOOTING}).`));
      body.replaceChildren(...parts.filter(Boolean));
      return;
    }
    const sorted = [...nodes].sort((a, b) => String(a.id).localeCompare(String(b.id)));
    const rows = sorted.map((n) => {
      const m = n.metrics || {};
      const paused = n.sandboxPausedCount || 0;
      return h('tr', { dataset: { nodeId: n.id } },
        td('Node', h('span', { class: 'mono' }, n.id)),
        td('Status', h('span', { class: `badge status-${n.status}` }, n.status || 'unknown')),
        td('Sandboxes', `${n.sandboxCount ?? 0}`, paused ? h('span', { class: 'muted' }, ` (+${paused} paused)`) : null),
        td('CPU', meter(m.allocatedCPU || 0, m.cpuCount || 0, `${m.allocatedCPU ?? 0} / ${m.cpuCount ?? '?'} vCPU`)),
        td('Memory', meter(m.allocatedMemoryBytes || 0, m.memoryTotalBytes || 0,
          `${bytes(m.allocatedMemoryBytes || 0)} / ${bytes(m.memoryTotalBytes || 0)}`)),
        td('Heartbeat', h('span', { class: 'rel', dataset: { ms: n.lastHeartbeatUnixMs || 0 }, title: new Date(n.lastHeartbeatUnixMs || 0).toLocaleString() },
          ago(n.lastHeartbeatUnixMs))));
    });
    parts.push(table('nodes-table', ['Node', 'Status', 'Sandboxes', 'CPU allocated', 'Memory allocated', 'Last heartbeat'], rows, 'Nodes of the cluster'));
    body.replaceChildren(...parts.filter(Boolean));
  };
  render();
  return { update: render, tick: () => tickRelative(root) };
}

/** Refreshes every "… ago" text under root from its data-ms. */
function tickRelative(root) {
  const now = Date.now();
  for (const el of root.querySelectorAll('.rel[data-ms]')) el.textContent = ago(Number(el.dataset.ms), now);
  for (const el of root.querySelectorAll('.until[data-ms]')) el.textContent = until(Number(el.dataset.ms), now);
}

// ---- sandboxes --------------------------------------------------------------

/** Where a sandbox runs, when the list says. */
export function nodeOf(s) {
  return s.node || s.nodeID || s.clientID || '';
}

function metaText(meta) {
  return Object.entries(meta || {}).map(([k, v]) => `${k}=${v}`).join(' ');
}

/** The action buttons of one sandbox (list row or sandbox page). */
export function sandboxActions(s, { onDone } = {}) {
  const id = s.sandboxID;
  const btn = (label, testid, fn, cls = 'btn') => h('button', {
    type: 'button', class: cls, 'data-testid': testid, 'aria-label': `${label} ${id}`,
    onclick: async (ev) => {
      const b = ev.currentTarget;
      b.disabled = true;
      try {
        await fn();
        if (onDone) onDone();
      } catch (e) {
        toast(`${label} ${id}: ${e.message}`, 'error');
      } finally {
        b.disabled = false;
      }
    },
  }, label);
  const paused = s.state === 'paused';
  return h('span', { class: 'actions' },
    paused
      ? btn('Resume', 'sandbox-resume', () => resume(id))
      : btn('Pause', 'sandbox-pause', () => pause(id)),
    paused ? null : btn('Extend', 'sandbox-extend', () => extend(id)),
    btn('Kill', 'sandbox-kill', () => kill(id), 'btn btn-danger'));
}

export async function pause(id) {
  await rest.post(`sandboxes/${enc(id)}/pause`);
  toast(`Paused ${id}`);
}

export async function resume(id) {
  await rest.post(`sandboxes/${enc(id)}/resume`, { timeout: 300 });
  toast(`Resumed ${id} for 5 min`);
}

export async function extend(id) {
  const secs = await numberDialog(`Extend ${id}`, 'New timeout from now (seconds)', 600, 1, 86400);
  if (secs === null || !Number.isFinite(secs)) return;
  await rest.post(`sandboxes/${enc(id)}/timeout`, { timeout: Math.round(secs) });
  toast(`${id} now ends in ${duration(Math.round(secs))}`);
}

export async function kill(id) {
  const yes = await confirmDialog('Kill sandbox?', `Kill ${id}? Its processes and files are gone for good.`, 'Kill');
  if (!yes) return;
  await rest.del(`sandboxes/${enc(id)}`);
  toast(`Killed ${id}`);
}

export function sandboxesView(root, store) {
  document.title = 'Sandboxes · AgentENV console';
  const stateSel = h('select', { id: 'filter-state' },
    h('option', { value: '' }, 'All states'),
    h('option', { value: 'running' }, 'Running'),
    h('option', { value: 'paused' }, 'Paused'));
  const search = h('input', { id: 'filter-search', type: 'search', placeholder: 'id, template or key=value', autocomplete: 'off' });
  const createBtn = h('button', { type: 'button', id: 'create-open', 'data-testid': 'create-open', class: 'btn btn-primary', onclick: () => openCreate() }, 'Create sandbox');
  const filters = h('div', { class: 'filters' },
    h('label', { for: 'filter-state' }, 'State'), stateSel,
    h('label', { for: 'filter-search' }, 'Search'), search);
  const body = h('div');
  root.append(heading('Sandboxes', createBtn), filters, body);

  const render = () => {
    const all = store.sandboxes;
    if (!all) {
      body.replaceChildren(liveGap(store, 'sandboxes'));
      return;
    }
    const parts = [staleNote(store)];
    if (store.errors.sandboxes) parts.push(notice('error', `${store.errors.sandboxes} (the list below may be out of date)`));
    if (store.truncated) parts.push(notice('info', `Showing the first ${all.length} sandboxes: filter by state or search to narrow the list.`));
    const q = search.value.trim().toLowerCase();
    const st = stateSel.value;
    const list = all.filter((s) => (!st || s.state === st) && (!q
      || [s.sandboxID, s.templateID, s.alias, metaText(s.metadata)].some((f) => String(f || '').toLowerCase().includes(q))));
    if (all.length === 0) {
      parts.push(notice('empty', 'No sandboxes are running: create one from a template.',
        h('button', { type: 'button', class: 'btn', onclick: () => openCreate() }, 'Create sandbox')));
    } else if (list.length === 0) {
      parts.push(notice('empty', `No sandboxes match the filter (${all.length} in all): clear the search or the state filter.`));
    }
    if (list.length) {
      list.sort((a, b) => parseTime(b.startedAt) - parseTime(a.startedAt) || String(a.sandboxID).localeCompare(String(b.sandboxID)));
      // The nodes' lists do not name the node (clientID is empty): the column shows when one does.
      const withNode = list.some((s) => nodeOf(s));
      const rows = list.map((s) => h('tr', { dataset: { sandboxId: s.sandboxID, state: s.state } },
        td('Sandbox', h('a', { href: `#/sandboxes/${enc(s.sandboxID)}`, class: 'mono' }, s.sandboxID)),
        td('State', h('span', { class: `badge state-${s.state}` }, s.state)),
        td('Template', s.alias || s.templateID || '—'),
        withNode ? td('Node', h('span', { class: 'mono' }, nodeOf(s) || '—')) : null,
        td('Age', h('span', { class: 'rel', dataset: { ms: parseTime(s.startedAt) } }, ago(parseTime(s.startedAt)))),
        td(s.state === 'paused' ? 'Paused' : 'Expires',
          s.state === 'paused'
            ? h('span', { class: 'rel', dataset: { ms: parseTime(s.endAt) } }, ago(parseTime(s.endAt)))
            : h('span', { class: 'until', dataset: { ms: parseTime(s.endAt) } }, until(parseTime(s.endAt)))),
        td('Metadata', h('span', { class: 'meta' }, Object.entries(s.metadata || {}).map(([k, v]) => h('span', { class: 'tag' }, `${k}=${v}`)))),
        td('Actions', sandboxActions(s))));
      const cols = ['Sandbox', 'State', 'Template', withNode ? 'Node' : null, 'Age', 'Expires', 'Metadata', 'Actions'].filter(Boolean);
      parts.push(table('sandboxes-table', cols, rows, 'Sandboxes of the cluster'));
    }
    body.replaceChildren(...parts.filter(Boolean));
  };
  stateSel.addEventListener('change', render);
  search.addEventListener('input', render);
  render();
  return { update: render, tick: () => tickRelative(root) };
}

// ---- create dialog ------------------------------------------------------------

let createPreset = '';

/**
 * `GET /templates` lists the templates built through the API; `base` is built into
 * every node and listed only by `/default-templates`: add it when missing.
 */
export async function listTemplates() {
  const list = (await rest.get('templates')) || [];
  if (!list.some((t) => t.templateID === 'base' || (t.aliases || []).includes('base'))) {
    list.unshift({ templateID: 'base', aliases: ['base'], names: ['base'], buildStatus: 'ready', builtIn: true });
  }
  return list;
}

/** Opens the create dialog, the template list read fresh from the gateway. */
export async function openCreate(templateID = '') {
  createPreset = templateID;
  const dlg = document.getElementById('create-dialog');
  const sel = document.getElementById('create-template');
  document.getElementById('create-error').textContent = '';
  sel.replaceChildren(h('option', { value: '' }, 'Loading templates…'));
  dlg.showModal();
  try {
    const templates = await listTemplates();
    const names = [];
    for (const t of templates) {
      if (t.buildStatus && t.buildStatus !== 'ready') continue;
      const alias = (t.aliases || t.names || [])[0];
      names.push({ value: alias || t.templateID, label: alias && alias !== t.templateID ? `${alias} (${t.templateID})` : t.templateID });
    }
    if (!names.length) {
      sel.replaceChildren(h('option', { value: '' }, 'No ready templates'));
      document.getElementById('create-error').textContent = 'No template is ready: build one with aenv build (docs/templates.md), or check that the nodes are up.';
      return;
    }
    sel.replaceChildren(...names.map((n) => h('option', { value: n.value }, n.label)));
    const want = createPreset || 'base';
    if (names.some((n) => n.value === want)) sel.value = want;
  } catch (e) {
    sel.replaceChildren(h('option', { value: '' }, 'Templates unavailable'));
    document.getElementById('create-error').textContent = `Cannot list templates: ${e.message}`;
  }
}

/** Parses "key=value" lines; throws a message naming the bad line. */
export function parseMetadata(text) {
  const out = {};
  text.split('\n').forEach((line, i) => {
    const l = line.trim();
    if (!l) return;
    const eq = l.indexOf('=');
    if (eq <= 0) throw new Error(`metadata line ${i + 1} is not key=value`);
    out[l.slice(0, eq).trim()] = l.slice(eq + 1).trim();
  });
  return out;
}

export function setupCreateDialog() {
  const form = document.getElementById('create-form');
  const dlg = document.getElementById('create-dialog');
  const err = document.getElementById('create-error');
  form.addEventListener('submit', async (ev) => {
    if (!ev.submitter || ev.submitter.value !== 'create') return; // Cancel closes
    ev.preventDefault();
    err.textContent = '';
    const templateID = form.template.value;
    const timeout = Number(form.timeout.value);
    let metadata;
    try {
      if (!templateID) throw new Error('choose a template');
      if (!Number.isInteger(timeout) || timeout < 1) throw new Error('the timeout is a whole number of seconds, at least 1');
      metadata = parseMetadata(form.metadata.value);
    } catch (e) {
      err.textContent = `Cannot create: ${e.message}.`;
      return;
    }
    const submit = document.getElementById('create-submit');
    submit.disabled = true;
    submit.textContent = 'Creating…';
    try {
      const s = await rest.post('sandboxes', { templateID, timeout, metadata });
      dlg.close('created');
      form.metadata.value = '';
      toast(`Created ${s.sandboxID}`);
      location.hash = `#/sandboxes/${enc(s.sandboxID)}`;
    } catch (e) {
      err.textContent = `The gateway refused: ${e.message}`;
    } finally {
      submit.disabled = false;
      submit.textContent = 'Create';
    }
  });
}
