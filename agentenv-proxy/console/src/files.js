// The file browser of a running sandbox: list a directory, open folders,
// download files, upload with a file input.

import { call, enc } from './api.js';
import { bytes, h, localTime, notice, table, td, toast } from './ui.js';

/** Where the browser opens: the first of these that lists. */
const STARTS = ['/home/user', '/root', '/'];

function parentOf(path) {
  if (path === '/') return null;
  const p = path.replace(/\/+$/, '');
  const i = p.lastIndexOf('/');
  return i <= 0 ? '/' : p.slice(0, i);
}

function join(dir, name) {
  return dir.endsWith('/') ? `${dir}${name}` : `${dir}/${name}`;
}

/** Mounts the browser into `box` for sandbox `id`. Returns { dispose }. */
export function mountFiles(box, id) {
  let path = STARTS[0];
  let firstLoad = true;
  let gen = 0;

  const pathInput = h('input', { id: 'files-path', type: 'text', value: path, spellcheck: 'false', autocomplete: 'off' });
  const goForm = h('form', { class: 'files-go', onsubmit: (ev) => { ev.preventDefault(); load(pathInput.value.trim() || '/'); } },
    h('label', { for: 'files-path' }, 'Folder'), pathInput,
    h('button', { type: 'submit', class: 'btn' }, 'Open'));
  const upBtn = h('button', { type: 'button', class: 'btn', onclick: () => { const p = parentOf(path); if (p) load(p); } }, 'Up');
  const upload = h('input', { id: 'files-upload', 'data-testid': 'files-upload', type: 'file', multiple: true, class: 'file-input' });
  const uploadLabel = h('label', { for: 'files-upload', class: 'btn' }, 'Upload files…');
  const status = h('p', { class: 'small muted', role: 'status', 'aria-live': 'polite' });
  const list = h('div');
  box.append(h('div', { class: 'files-bar' }, goForm, upBtn, upload, uploadLabel), status, list);

  async function load(dir) {
    const mine = ++gen;
    status.textContent = `Listing ${dir}…`;
    try {
      const res = await call('GET', `sandboxes/${enc(id)}/dir?path=${enc(dir)}`);
      if (mine !== gen) return;
      path = res.path || dir;
      pathInput.value = path;
      status.textContent = '';
      render(res.entries || []);
    } catch (e) {
      if (mine !== gen) return;
      const next = STARTS[STARTS.indexOf(dir) + 1];
      if (firstLoad && e.status === 404 && STARTS.includes(dir) && next) {
        load(next);
        return;
      }
      status.textContent = '';
      const fix = {
        400: 'Type an absolute path, starting with /.',
        404: 'No such folder: go up or open another one.',
        409: 'The sandbox is paused: resume it to browse its files.',
      }[e.status] || '';
      list.replaceChildren(notice('error', `Cannot list ${dir}: ${e.message}`, fix ? h('p', null, fix) : null));
    }
    firstLoad = false;
  }

  function render(entries) {
    const rows = entries.map((e) => {
      const isDir = e.type === 'dir';
      // A symlink may lead to a folder: opening it lists the target (or says it is not one).
      const name = isDir || e.type === 'symlink'
        ? h('button', { type: 'button', class: 'link', onclick: () => load(e.path), title: isDir ? null : 'symbolic link: open it as a folder' },
          isDir ? `${e.name}/` : `${e.name} →`)
        : h('span', { class: 'mono' }, e.name);
      const dl = e.type !== 'dir'
        ? h('a', { class: 'btn btn-small', href: `/console/api/sandboxes/${enc(id)}/file?path=${enc(e.path)}`, download: e.name, 'aria-label': `Download ${e.name}` }, 'Download')
        : null;
      return h('tr', { dataset: { path: e.path, type: e.type } },
        td('Name', name),
        td('Size', isDir ? '—' : bytes(e.size)),
        td('Modified', localTime(e.modifiedUnixMs)),
        td('', dl));
    });
    if (!rows.length) {
      list.replaceChildren(notice('empty', `${path} is empty: upload files into it with "Upload files…".`),
        table('files-list', ['Name', 'Size', 'Modified', ''], [], `Files in ${path}`));
      return;
    }
    list.replaceChildren(h('div', { class: 'files-scroll' }, table('files-list', ['Name', 'Size', 'Modified', ''], rows, `Files in ${path}`)));
  }

  upload.addEventListener('change', async () => {
    const files = [...upload.files];
    upload.value = '';
    const dir = path;
    for (const f of files) {
      status.textContent = `Uploading ${f.name} (${bytes(f.size)})…`;
      try {
        await call('POST', `sandboxes/${enc(id)}/file?path=${enc(join(dir, f.name))}`, f);
        toast(`Uploaded ${f.name} to ${dir}`);
      } catch (e) {
        const fix = e.status === 413 ? ' (files over 100 MiB are refused)' : '';
        toast(`Upload of ${f.name} failed: ${e.message}${fix}`, 'error');
      }
    }
    status.textContent = '';
    load(dir);
  });

  load(path);
  return {
    dispose() {
      gen += 1;
    },
  };
}
