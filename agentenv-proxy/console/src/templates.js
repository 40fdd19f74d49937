// The templates and snapshots lists (read when the view opens), and a
// template build's log, followed while the build runs.

import { enc, rest } from './api.js';
import { ago, h, notice, parseTime, table, td } from './ui.js';
import { heading, listTemplates, openCreate } from './views.js';

/** How often an open build log asks for new lines while its build runs. */
const FOLLOW_MS = 2000;

export function templatesView(root) {
  document.title = 'Templates · AgentENV console';
  const tBody = h('div', null, notice('info', 'Loading templates…'));
  const sBody = h('div', null, notice('info', 'Loading snapshots…'));
  const refresh = h('button', { type: 'button', class: 'btn', onclick: () => load() }, 'Refresh');
  const logBox = h('div');
  root.append(heading('Templates', refresh), tBody, logBox, h('h2', null, 'Snapshots'), sBody);
  let log = null;
  const showLog = (t) => {
    if (log) log.dispose();
    log = buildLog(logBox, t);
  };

  const load = async () => {
    refresh.disabled = true;
    const [templates, snapshots] = await Promise.allSettled([listTemplates(), rest.get('snapshots')]);
    refresh.disabled = false;
    if (templates.status === 'rejected') {
      tBody.replaceChildren(notice('error', `Cannot list templates: ${templates.reason.message}`));
    } else if (!templates.value || templates.value.length === 0) {
      tBody.replaceChildren(notice('empty', 'No templates: build one with aenv build or Template.build in the SDKs (see docs/templates.md).'));
    } else {
      const rows = templates.value.map((t) => h('tr', { dataset: { templateId: t.templateID } },
        td('Template', h('span', { class: 'mono' }, t.templateID)),
        td('Names', (t.aliases || t.names || []).join(', ') || '—'),
        td('Status', h('span', { class: `badge build-${t.buildStatus}` }, t.buildStatus || '—')),
        td('CPU', t.builtIn ? 'node default' : `${t.cpuCount ?? '?'} vCPU`),
        td('Memory', t.builtIn ? 'node default' : `${t.memoryMB ?? '?'} MiB`),
        td('Updated', t.builtIn ? 'built into every node' : parseTime(t.updatedAt) ? ago(parseTime(t.updatedAt)) : '—'),
        td('', h('span', { class: 'actions' },
          t.builtIn || !t.buildID ? null : h('button', {
            type: 'button', class: 'btn', 'data-testid': 'template-build-log', onclick: () => showLog(t),
          }, 'Build log'),
          h('button', {
            type: 'button', class: 'btn', disabled: t.buildStatus && t.buildStatus !== 'ready',
            onclick: () => openCreate((t.aliases || [])[0] || t.templateID),
          }, 'Create sandbox')))));
      tBody.replaceChildren(table('templates-table', ['Template', 'Names', 'Build', 'CPU', 'Memory', 'Updated', ''], rows, 'Templates'));
    }
    if (snapshots.status === 'rejected') {
      sBody.replaceChildren(notice('error', `Cannot list snapshots: ${snapshots.reason.message}`));
      return;
    }
    const items = Array.isArray(snapshots.value) ? snapshots.value : (snapshots.value && snapshots.value.items) || [];
    if (items.length === 0) {
      sBody.replaceChildren(notice('empty', 'No snapshots: take one from a running sandbox (POST /sandboxes/{id}/snapshots, see docs/sandbox-api.md).'));
      return;
    }
    const rows = items.map((s) => h('tr', { dataset: { snapshotId: s.snapshotID } },
      td('Snapshot', h('span', { class: 'mono' }, s.snapshotID)),
      td('Names', (s.names || []).join(', ') || '—'),
      td('CPU', `${s.cpuCount ?? '?'} vCPU`),
      td('Memory', `${s.memoryMB ?? '?'} MiB`),
      td('Disk', s.diskSizeMB ? `${s.diskSizeMB} MiB` : '—'),
      td('Created', parseTime(s.createdAt) ? ago(parseTime(s.createdAt)) : '—')));
    sBody.replaceChildren(table('snapshots-table', ['Snapshot', 'Names', 'CPU', 'Memory', 'Disk', 'Created'], rows, 'Snapshots'));
  };
  load();
  return {
    cleanup: () => {
      if (log) log.dispose();
    },
  };
}

/**
 * Shows the log of template `t`'s latest build in `box`; while the build runs, asks
 * for the lines after the last one every FOLLOW_MS. Returns { dispose }.
 */
function buildLog(box, t) {
  const name = (t.aliases || [])[0] || t.templateID;
  const status = h('span', { class: 'badge' }, '…');
  const lines = h('ol', { class: 'logs', tabindex: '0', 'aria-label': `Build log of ${name}` });
  const err = h('div');
  const close = h('button', { type: 'button', class: 'btn btn-small', onclick: () => { dispose(); box.replaceChildren(); } }, 'Close');
  box.replaceChildren(h('section', { class: 'card', 'aria-labelledby': 'build-log-h', id: 'build-log' },
    h('div', { class: 'section-head' },
      h('h2', { id: 'build-log-h' }, `Build ${t.buildID} of ${name} `, status), close),
    err, lines));
  let offset = 0;
  let timer = null;
  let done = false;

  const fetchMore = async () => {
    timer = null;
    try {
      const res = await rest.get(`templates/${enc(t.templateID)}/builds/${enc(t.buildID)}/status?logsOffset=${offset}&limit=100`);
      if (done) return;
      err.replaceChildren();
      const entries = res.logEntries || [];
      offset += entries.length;
      const stick = lines.scrollTop + lines.clientHeight >= lines.scrollHeight - 4;
      lines.append(...entries.map((l) => h('li', { class: `log log-${l.level}` },
        h('time', { datetime: l.timestamp }, new Date(parseTime(l.timestamp)).toLocaleTimeString()),
        h('span', { class: 'log-level' }, l.level),
        h('span', { class: 'log-msg' }, l.step ? `[${l.step}] ${l.message}` : l.message))));
      if (stick) lines.scrollTop = lines.scrollHeight;
      status.textContent = res.status;
      status.className = `badge build-${res.status}`;
      if (res.reason && res.reason.message) {
        err.replaceChildren(notice('error', `The build failed${res.reason.step ? ` at ${res.reason.step}` : ''}: ${res.reason.message}`));
      }
      const running = res.status === 'building' || res.status === 'waiting';
      if (entries.length === 100) timer = setTimeout(fetchMore, 0);
      else if (running) timer = setTimeout(fetchMore, FOLLOW_MS);
      else if (offset === 0) lines.replaceWith(notice('empty', 'This build wrote no log lines.'));
    } catch (e) {
      if (done) return;
      err.replaceChildren(notice('error', `Cannot read the build log: ${e.message}`));
    }
  };
  const dispose = () => {
    done = true;
    if (timer) clearTimeout(timer);
  };
  fetchMore();
  close.focus();
  return { dispose };
}
