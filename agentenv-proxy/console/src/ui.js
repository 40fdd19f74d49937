// DOM helpers, formatting and dialogs shared by the views.

/**
 * Builds an element: h('button', {class: 'x', onclick: fn}, 'text', child...).
 * Attributes starting with "on" become listeners; null/false values are skipped;
 * strings are always inserted as text (never parsed as HTML).
 */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2), v);
    } else if (k === 'dataset') {
      Object.assign(el.dataset, v);
    } else if (v === true) {
      el.setAttribute(k, '');
    } else {
      el.setAttribute(k, String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** An SVG element (the charts). */
export function svg(tag, attrs, ...children) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  append(el, children);
  return el;
}

/** "3 s ago", "5 min ago", "2 h ago", "4 d ago". */
export function ago(ms, now = Date.now()) {
  if (!ms) return '—';
  const s = Math.max(0, Math.round((now - ms) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

/** A duration in seconds as "45 s", "12 min", "3 h 5 min", "2 d 4 h". */
export function duration(secs) {
  const s = Math.max(0, Math.round(secs));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) {
    const m = Math.floor((s % 3600) / 60);
    return `${Math.floor(s / 3600)} h${m ? ` ${m} min` : ''}`;
  }
  const hr = Math.floor((s % 86400) / 3600);
  return `${Math.floor(s / 86400)} d${hr ? ` ${hr} h` : ''}`;
}

/** "in 4 min" / "4 min ago" relative to now. */
export function until(ms, now = Date.now()) {
  if (!ms) return '—';
  const d = (ms - now) / 1000;
  return d >= 0 ? `in ${duration(d)}` : `${duration(-d)} ago`;
}

export function parseTime(s) {
  const t = Date.parse(s || '');
  return Number.isFinite(t) && t > 0 ? t : 0;
}

export function bytes(n) {
  if (!Number.isFinite(n) || n < 0) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n >= 10 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

export function localTime(ms) {
  return ms ? new Date(ms).toLocaleString() : '—';
}

/** A horizontal bar with a label: used/total. */
export function meter(used, total, label) {
  const pct = total > 0 ? Math.min(100, Math.round((used / total) * 100)) : 0;
  const bar = h('span', { class: 'meter-fill' });
  bar.style.width = `${pct}%`;
  if (pct >= 90) bar.classList.add('hot');
  return h('span', { class: 'meter', title: `${pct}%` },
    h('span', { class: 'meter-track', 'aria-hidden': 'true' }, bar),
    h('span', { class: 'meter-text' }, label));
}

/** A message block: kind is "empty", "error" or "info". */
export function notice(kind, text, ...extra) {
  return h('div', { class: `notice notice-${kind}`, role: kind === 'error' ? 'alert' : null },
    h('p', null, text), ...extra);
}

/** Announces a status line to screen readers and shows it briefly. */
export function toast(text, kind = 'info') {
  const box = document.getElementById('toasts');
  if (!box) return;
  const el = h('div', { class: `toast toast-${kind}` }, text);
  box.append(el);
  setTimeout(() => el.remove(), kind === 'error' ? 9000 : 4000);
}

/** Opens the confirmation dialog; resolves true on "yes". */
export function confirmDialog(title, text, yesLabel = 'Yes') {
  const dlg = document.getElementById('confirm-dialog');
  dlg.querySelector('#confirm-title').textContent = title;
  dlg.querySelector('#confirm-text').textContent = text;
  const yes = dlg.querySelector('#confirm-yes');
  yes.textContent = yesLabel;
  return new Promise((resolve) => {
    const done = () => {
      dlg.removeEventListener('close', done);
      resolve(dlg.returnValue === 'yes');
    };
    dlg.returnValue = '';
    dlg.addEventListener('close', done);
    dlg.showModal();
    dlg.querySelector('#confirm-no').focus();
  });
}

/** Opens the one-field prompt dialog (a number); resolves the value or null. */
export function numberDialog(title, label, value, min, max) {
  const dlg = document.getElementById('prompt-dialog');
  dlg.querySelector('#prompt-title').textContent = title;
  dlg.querySelector('#prompt-label').textContent = label;
  const input = dlg.querySelector('#prompt-input');
  input.min = String(min);
  input.max = String(max);
  input.value = String(value);
  return new Promise((resolve) => {
    const done = () => {
      dlg.removeEventListener('close', done);
      resolve(dlg.returnValue === 'ok' ? Number(input.value) : null);
    };
    dlg.returnValue = '';
    dlg.addEventListener('close', done);
    dlg.showModal();
    input.select();
  });
}

/** A table whose rows become cards on narrow screens (cells carry data-label). */
export function table(testid, columns, rows, caption) {
  return h('div', { class: 'table-wrap' },
    h('table', { class: 'list', id: testid, 'data-testid': testid },
      caption ? h('caption', { class: 'sr-only' }, caption) : null,
      h('thead', null, h('tr', null, columns.map((c) => h('th', { scope: 'col' }, c)))),
      h('tbody', null, rows)));
}

/** A cell labelled for the card layout. */
export function td(label, ...content) {
  return h('td', { 'data-label': label }, ...content);
}
