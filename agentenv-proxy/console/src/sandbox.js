// One sandbox: its details and actions, a live terminal, the file browser,
// its logs and a metrics chart.

import { enc, rest } from './api.js';
import { mountFiles } from './files.js';
import { mountTerminal } from './terminal.js';
import { ago, bytes, h, localTime, notice, parseTime, svg, until } from './ui.js';
import { nodeOf, sandboxActions } from './views.js';

export function sandboxView(root, store, id) {
  document.title = `${id} · AgentENV console`;
  let detail = null; // GET rest/sandboxes/{id}
  let detailError = null;
  let shownState = null;
  let term = null;
  let files = null;

  const head = h('div', { class: 'view-head' },
    h('h1', null, h('a', { href: '#/sandboxes', class: 'crumb' }, 'Sandboxes'), ' / ', h('span', { class: 'mono' }, id)),
    h('div', { class: 'tools', id: 'sandbox-actions' }));
  const info = h('div', { class: 'card' });
  const termStatus = h('span', { id: 'terminal-status', class: 'term-status', role: 'status', 'aria-live': 'polite' });
  const termBox = h('div', { class: 'term-box' });
  const filesBox = h('div');
  const logsBox = h('div');
  const metricsBox = h('div');
  root.append(head, info,
    h('section', { class: 'card', 'aria-labelledby': 'term-h' }, h('div', { class: 'section-head' }, h('h2', { id: 'term-h' }, 'Terminal'), termStatus), termBox),
    h('section', { class: 'card', 'aria-labelledby': 'files-h' }, h('h2', { id: 'files-h' }, 'Files'), filesBox),
    h('div', { class: 'two-col' },
      h('section', { class: 'card', 'aria-labelledby': 'metrics-h' }, h('div', { class: 'section-head' }, h('h2', { id: 'metrics-h' }, 'Metrics'),
        h('button', { type: 'button', class: 'btn btn-small', onclick: () => loadMetrics() }, 'Refresh')), metricsBox),
      h('section', { class: 'card', 'aria-labelledby': 'logs-h' }, h('div', { class: 'section-head' }, h('h2', { id: 'logs-h' }, 'Logs'),
        h('button', { type: 'button', class: 'btn btn-small', onclick: () => loadLogs() }, 'Refresh')), logsBox)));

  /** The live list's item when there is one, else what GET /sandboxes/{id} said. */
  let seenLive = false;
  const current = () => {
    // A 404 from the gateway is fresher than the live list (which lags by up to a second).
    if (detailError && detailError.status === 404) return null;
    const live = (store.sandboxes || []).find((s) => s.sandboxID === id);
    if (live) {
      seenLive = true;
      return { ...(detail || {}), ...live };
    }
    return detail;
  };
  // Gone: the live list had it and no longer has it (a fresh sandbox may not be listed yet).
  const gone = () => store.sandboxes && seenLive && !store.sandboxes.some((s) => s.sandboxID === id);

  const renderInfo = () => {
    const s = current();
    if (!s) {
      info.replaceChildren(detailError
        ? notice('error', detailError.status === 404
          ? `There is no sandbox ${id}: it was killed or timed out. Go back to the sandbox list.`
          : `Cannot read ${id}: ${detailError.message}`)
        : notice('info', `Loading ${id}…`));
      head.querySelector('#sandbox-actions').replaceChildren();
      if (detailError) syncPanels(null);
      return;
    }
    if (gone()) {
      info.replaceChildren(notice('empty', `${id} is gone (killed or timed out). Go back to the sandbox list.`));
      head.querySelector('#sandbox-actions').replaceChildren();
      syncPanels(null);
      return;
    }
    const started = parseTime(s.startedAt);
    const end = parseTime(s.endAt);
    const dl = (k, v) => [h('dt', null, k), h('dd', null, v)];
    info.replaceChildren(h('dl', { class: 'details' },
      dl('State', h('span', { class: `badge state-${s.state}` }, s.state)),
      dl('Template', s.alias && s.alias !== s.templateID ? `${s.alias} (${s.templateID})` : s.templateID || s.alias || '—'),
      nodeOf(s) ? dl('Node', h('span', { class: 'mono' }, nodeOf(s))) : null,
      dl('Started', [localTime(started), ' ', h('span', { class: 'muted rel', dataset: { ms: started } }, `(${ago(started)})`)]),
      dl(s.state === 'paused' ? 'Paused' : 'Expires', [localTime(end), ' ',
        h('span', { class: 'muted' }, `(${s.state === 'paused' ? ago(end) : until(end)})`)]),
      dl('Resources', `${s.cpuCount ?? '?'} vCPU, ${s.memoryMB ?? '?'} MiB memory${s.diskSizeMB ? `, ${s.diskSizeMB} MiB disk` : ''}`),
      s.lifecycle ? dl('On timeout', `${s.lifecycle.onTimeout || 'kill'}${s.lifecycle.autoResume ? ', resumes on request' : ''}`) : null,
      s.pauseMode ? dl('Pause keeps', s.pauseMode) : null,
      dl('Metadata', Object.keys(s.metadata || {}).length
        ? h('span', { class: 'meta' }, Object.entries(s.metadata).map(([k, v]) => h('span', { class: 'tag' }, `${k}=${v}`)))
        : '—')));
    head.querySelector('#sandbox-actions').replaceChildren(sandboxActions(s, { onDone: () => loadDetail() }));
    syncPanels(s.state);
  };

  /** Opens or closes the terminal and file browser as the state changes. */
  const syncPanels = (state) => {
    if (state === shownState) return;
    shownState = state;
    if (term) term.dispose();
    if (files) files.dispose();
    term = null;
    files = null;
    termBox.replaceChildren();
    filesBox.replaceChildren();
    termStatus.replaceChildren();
    delete termStatus.dataset.state;
    if (state === 'running') {
      term = mountTerminal(termBox, termStatus, id);
      files = mountFiles(filesBox, id);
    } else if (state === 'paused') {
      termBox.append(notice('empty', 'Sandbox is paused: resume it to open a terminal.'));
      filesBox.append(notice('empty', 'Sandbox is paused: resume it to browse its files.'));
    } else if (state) {
      termBox.append(notice('empty', `The sandbox is ${state}: a terminal opens once it runs.`));
    }
  };

  async function loadDetail() {
    try {
      detail = await rest.get(`sandboxes/${enc(id)}`);
      detailError = null;
    } catch (e) {
      detailError = e;
    }
    renderInfo();
  }

  async function loadLogs() {
    logsBox.replaceChildren(notice('info', 'Loading logs…'));
    try {
      const res = await rest.get(`v2/sandboxes/${enc(id)}/logs?limit=200&direction=backward`);
      const logs = (res && res.logs) || [];
      if (!logs.length) {
        logsBox.replaceChildren(notice('empty', 'No log entries yet: the sandbox\'s agent writes them as processes start and end.'));
        return;
      }
      logs.reverse();
      logsBox.replaceChildren(h('ol', { class: 'logs', tabindex: '0', 'aria-label': 'Log entries, oldest first' },
        logs.map((l) => h('li', { class: `log log-${l.level}` },
          h('time', { datetime: l.timestamp }, new Date(parseTime(l.timestamp)).toLocaleTimeString()),
          h('span', { class: 'log-level' }, l.level), h('span', { class: 'log-msg' }, l.message)))));
    } catch (e) {
      logsBox.replaceChildren(notice('error', `Cannot read the logs: ${e.message}`));
    }
  }

  async function loadMetrics() {
    metricsBox.replaceChildren(notice('info', 'Loading metrics…'));
    try {
      const samples = (await rest.get(`sandboxes/${enc(id)}/metrics`)) || [];
      if (!samples.length) {
        metricsBox.replaceChildren(notice('empty', 'No metrics yet: the node samples a running sandbox every few seconds; refresh in a moment.'));
        return;
      }
      const last = samples[samples.length - 1];
      metricsBox.replaceChildren(
        chart('CPU used (%)', samples, (m) => m.cpuUsedPct, 100, (v) => `${v.toFixed(1)} %`),
        chart('Memory used', samples, (m) => m.memUsed, Math.max(...samples.map((m) => m.memTotal || 0), 1), bytes),
        h('p', { class: 'small muted' },
          `Latest: CPU ${last.cpuUsedPct} % of ${last.cpuCount} vCPU, memory ${bytes(last.memUsed)} of ${bytes(last.memTotal)}, disk ${bytes(last.diskUsed)} of ${bytes(last.diskTotal)}.`));
    } catch (e) {
      metricsBox.replaceChildren(notice('error', `Cannot read the metrics: ${e.message}`));
    }
  }

  renderInfo();
  loadDetail();
  loadLogs();
  loadMetrics();

  return {
    update: renderInfo,
    tick: () => {
      for (const el of info.querySelectorAll('.rel[data-ms]')) el.textContent = `(${ago(Number(el.dataset.ms))})`;
    },
    cleanup: () => {
      if (term) term.dispose();
      if (files) files.dispose();
    },
  };
}

/** A small line chart of one series as inline SVG (no library). */
function chart(title, samples, pick, max, fmt) {
  const W = 320;
  const H = 90;
  const pad = 4;
  const t0 = samples[0].timestampUnix;
  const t1 = samples[samples.length - 1].timestampUnix;
  const span = Math.max(1, t1 - t0);
  const pts = samples.map((m) => {
    const x = samples.length === 1 ? W / 2 : pad + ((m.timestampUnix - t0) / span) * (W - 2 * pad);
    const y = H - pad - (Math.min(max, Math.max(0, pick(m) || 0)) / max) * (H - 2 * pad);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  const last = pick(samples[samples.length - 1]) || 0;
  const label = `${title}: latest ${fmt(last)}, ${samples.length} samples over ${Math.round(span / 60)} min`;
  return h('figure', { class: 'chart' },
    h('figcaption', null, title, h('span', { class: 'muted' }, ` ${fmt(last)}`)),
    svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': label, preserveAspectRatio: 'none' },
      svg('rect', { x: 0, y: 0, width: W, height: H, class: 'chart-bg' }),
      svg('polyline', { points: `${pad},${H - pad} ${pts.join(' ')} ${W - pad},${H - pad}`, class: 'chart-area' }),
      svg('polyline', { points: pts.join(' '), class: 'chart-line' })),
    h('div', { class: 'chart-axis', 'aria-hidden': 'true' },
      h('span', null, new Date(t0 * 1000).toLocaleTimeString()),
      h('span', null, `scale 0 – ${fmt(max)}`),
      h('span', null, new Date(t1 * 1000).toLocaleTimeString())));
}
