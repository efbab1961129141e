// sloserve dashboard: one page, no dependencies, no build step.
//
// Routes (hash, so every view is linkable and the server serves one file):
//   #/                           the overview (GET /v2/dashboard, every second)
//   #/models/NAME?version=V&range=15m   one model's history
//                                (GET /v2/dashboard/models/NAME, then ?since= every second)
//
// Elements the end-to-end test reads carry data attributes: each overview
// row data-model/data-key/data-status with cells data-field + data-value
// (the raw API number); each chart <svg data-chart=ID data-points=N
// data-last-t=T> with <path data-series=KEY data-points=N> and reference
// lines <line data-ref=slo data-value=V>; <body data-page, data-time,
// data-renders> say what was rendered from which response.
'use strict';

(function () {
  const POLL_MS = 1000;
  const OVERVIEW_ON_MODEL_PAGE_MS = 5000;
  const FETCH_TIMEOUT_MS = 5000;
  const STALE_AFTER_MS = 3500;
  const RANGES = [['5m', 300], ['15m', 900], ['1h', 3600], ['6h', 21600]];
  const DEFAULT_RANGE = '15m';

  const STATUS = {
    missing: { label: 'missing SLO', icon: '✕', order: 0, text: 'is missing its SLO' },
    unavailable: { label: 'unavailable', icon: '!', order: 1, text: 'is not serving' },
    ok: { label: 'ok', icon: '✓', order: 2, text: 'meets its SLO' },
    idle: { label: 'idle', icon: '○', order: 3, text: 'has no traffic' },
    'no-slo': { label: 'no SLO', icon: '–', order: 4, text: 'has no latency SLO (best effort)' },
  };
  const statusInfo = (s) => STATUS[s] || { label: s || 'unknown', icon: '?', order: 5, text: '' };

  // Distinct colours that stay legible on white (Tableau 10, slightly darkened).
  const PALETTE = ['#2f6db3', '#e0731b', '#3a9a3a', '#c23b3b', '#7d5bb0', '#8c5a4a', '#c957a6', '#6b6b6b', '#a3a322', '#1f9fb0'];
  const C = {
    p50: '#7fa7d9', p90: '#3d77c2', p99: '#173f7a', slo: '#c62828', target: '#c62828',
    attainment: '#2e7d32', goodput: '#2e7d32', throughput: '#8a9aa9', arrival: '#1565c0', forecast: '#ef6c00',
    share: '#5e35b1', targetShare: '#ef6c00', memShare: '#00838f', memUsed: '#26a69a',
    predicted: '#ef6c00', observed: '#1565c0', planned: '#8a9aa9', queue: '#6d4c41',
    deadline: '#e53935', queueFull: '#fb8c00', dropped: '#8e24aa', failed: '#37474f',
  };
  const EVENT_COLOURS = { resize: '#5e35b1', evict: '#8d6e63', pin: '#00838f', unpin: '#00838f', error: '#c62828', place: '#2e7d32', move: '#ef6c00' };

  // ---------------------------------------------------------------- DOM

  const SVGNS = 'http://www.w3.org/2000/svg';

  function append(el, kids) {
    for (const k of kids) {
      if (k === null || k === undefined || k === false) continue;
      if (Array.isArray(k)) append(el, k);
      else el.appendChild(typeof k === 'object' ? k : document.createTextNode(String(k)));
    }
  }

  function setAttrs(el, attrs) {
    if (!attrs) return;
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') el.setAttribute('class', v);
      else if (k === 'style' && typeof v === 'object') {
        for (const [p, pv] of Object.entries(v)) {
          if (p.startsWith('--')) el.style.setProperty(p, pv);
          else el.style[p] = pv;
        }
      }
      else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? '' : String(v));
    }
  }

  // h builds an HTML element: h('td', {class: 'num'}, 'text', child...).
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    append(el, kids);
    return el;
  }

  // s builds an SVG element.
  function s(tag, attrs, ...kids) {
    const el = document.createElementNS(SVGNS, tag);
    setAttrs(el, attrs);
    append(el, kids);
    return el;
  }

  // swap makes old look like fresh and returns the element on the page.
  // It changes only what differs, so a render once a second keeps the
  // nodes (links under the pointer, focus, a text selection) that did not
  // change.
  function swap(old, fresh) {
    if (!old) return fresh;
    return morph(old, fresh);
  }

  function morph(old, fresh) {
    if (old.nodeType !== fresh.nodeType || old.nodeName !== fresh.nodeName) {
      old.replaceWith(fresh);
      return fresh;
    }
    if (old.nodeType !== Node.ELEMENT_NODE) {
      if (old.nodeValue !== fresh.nodeValue) old.nodeValue = fresh.nodeValue;
      return old;
    }
    if (old.isEqualNode(fresh)) return old;
    for (const a of [...old.attributes]) if (!fresh.hasAttribute(a.name)) old.removeAttribute(a.name);
    for (const a of [...fresh.attributes]) if (old.getAttribute(a.name) !== a.value) old.setAttribute(a.name, a.value);
    const oc = [...old.childNodes];
    const fc = [...fresh.childNodes];
    for (let i = 0; i < fc.length; i++) {
      if (i < oc.length) morph(oc[i], fc[i]);
      else old.appendChild(fc[i]);
    }
    for (let i = fc.length; i < oc.length; i++) oc[i].remove();
    return old;
  }

  // ---------------------------------------------------------------- formatting
  // Every formatter shows null (unknown) as an em dash.

  const DASH = '—';
  const isNum = (v) => typeof v === 'number' && isFinite(v);

  function fmtMs(v) {
    if (!isNum(v)) return DASH;
    if (v < 10) return v.toFixed(1) + ' ms';
    return Math.round(v) + ' ms';
  }

  // fmtAttainment rounds as the server's sentences do, except that short
  // of 100% it never shows 100.0%.
  function fmtAttainment(v) {
    if (!isNum(v)) return DASH;
    const text = (v * 100).toFixed(1);
    return (v < 1 && text === '100.0' ? '99.9' : text) + '%';
  }

  function fmtPct(v, digits) {
    if (!isNum(v)) return DASH;
    const p = v * 100;
    const d = digits !== undefined ? digits : (p !== 0 && Math.abs(p) < 10 ? 1 : 0);
    return p.toFixed(d) + '%';
  }

  function fmtRate(v) {
    if (!isNum(v)) return DASH;
    if (v === 0) return '0/s';
    if (v < 1) return v.toFixed(2) + '/s';
    if (v < 100) return v.toFixed(1) + '/s';
    return Math.round(v) + '/s';
  }

  function fmtShare(v) {
    if (!isNum(v)) return DASH;
    if (v === 0) return 'no limit';
    return fmtPct(v);
  }

  function fmtBytes(v) {
    if (!isNum(v)) return DASH;
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    let x = v;
    while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    if (i === 0) return Math.round(x) + ' B';
    return (Math.abs(x) < 10 ? x.toFixed(1) : Math.round(x).toString()) + ' ' + units[i];
  }

  function fmtMemShare(v) {
    if (!isNum(v)) return DASH;
    if (v === 0) return 'no limit';
    return fmtBytes(v);
  }

  function fmtCount(v) {
    if (!isNum(v)) return DASH;
    if (Math.abs(v - Math.round(v)) < 1e-9) return String(Math.round(v));
    return v.toFixed(1);
  }

  function fmtCores(share, cpus) {
    if (!isNum(share) || !isNum(cpus) || share === 0) return '';
    return (share * cpus).toFixed(2) + ' of ' + cpus + ' CPUs';
  }

  const pad2 = (n) => String(n).padStart(2, '0');

  function toDate(t) {
    if (t instanceof Date) return t;
    if (typeof t === 'number') return new Date(t * 1000);
    return new Date(t);
  }

  function fmtClock(t, withSeconds) {
    const d = toDate(t);
    if (isNaN(d)) return DASH;
    const hm = pad2(d.getHours()) + ':' + pad2(d.getMinutes());
    return withSeconds === false ? hm : hm + ':' + pad2(d.getSeconds());
  }

  function fmtAgo(ms) {
    const sec = Math.max(0, Math.round(ms / 1000));
    if (sec < 60) return sec + ' s ago';
    if (sec < 3600) return Math.round(sec / 60) + ' min ago';
    return Math.round(sec / 3600) + ' h ago';
  }

  function fmtDuration(sec) {
    if (sec < 60) return sec + ' s';
    if (sec < 3600) return Math.round(sec / 60) + ' min';
    return Math.round(sec / 3600) + ' h';
  }

  // DEVICE_EVENTS are the kinds of a GPU's fault recovery: no share changes.
  const DEVICE_EVENTS = new Set(['fault', 'recovered', 'hung', 'risky']);

  // fmtChange describes an event's old -> new share.
  function fmtChange(e) {
    // Placement events say where the model went; the reason says why
    // (and, for a move, from where).
    if ((e.kind === 'place' || e.kind === 'move') && e.device) return '→ ' + e.device;
    const o = e.old || {};
    const n = e.new || {};
    const parts = [];
    if (o.compute !== n.compute && (isNum(o.compute) || isNum(n.compute))) {
      parts.push('compute ' + fmtShare(o.compute) + ' → ' + fmtShare(n.compute));
    }
    if (o.memory_bytes !== n.memory_bytes && (isNum(o.memory_bytes) || isNum(n.memory_bytes))) {
      parts.push('memory ' + fmtMemShare(o.memory_bytes) + ' → ' + fmtMemShare(n.memory_bytes));
    }
    if (parts.length === 0 && isNum(n.compute)) parts.push('compute ' + fmtShare(n.compute));
    return parts.join(', ') || DASH;
  }

  // ---------------------------------------------------------------- fetching and liveness

  // A server with an inference token (auth.inference_token_file) answers the
  // page's JSON calls with 401. The page then asks for a token and sends it
  // in the Authorization header, never in a URL (URLs end up in logs and
  // history). It is kept in sessionStorage: this tab only, gone when the tab
  // closes. The static files are served without a token.
  const TOKEN_KEY = 'sloserve-token';

  function storedToken() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (_) { return ''; }
  }

  function storeToken(v) {
    try {
      if (v) sessionStorage.setItem(TOKEN_KEY, v); else sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) { /* storage blocked: the token lasts until the page reloads */ }
    memoryToken = v;
  }
  let memoryToken = storedToken();

  // askToken shows the token form (once) with the server's message.
  function askToken(message) {
    let form = document.getElementById('token-form');
    if (!form) {
      form = document.createElement('form');
      form.id = 'token-form';
      form.className = 'token-form';
      const msg = document.createElement('p');
      msg.className = 'token-message';
      const label = document.createElement('label');
      label.htmlFor = 'token-input';
      label.textContent = 'Access token';
      const input = document.createElement('input');
      input.id = 'token-input';
      input.type = 'password';
      input.autocomplete = 'off';
      input.spellcheck = false;
      const button = document.createElement('button');
      button.type = 'submit';
      button.textContent = 'Use token';
      form.append(msg, label, input, button);
      form.addEventListener('submit', (ev) => {
        ev.preventDefault();
        const v = input.value.trim();
        if (!v) return;
        storeToken(v);
        input.value = '';
        form.remove();
      });
      document.body.insertBefore(form, document.getElementById('app'));
      input.focus();
    }
    form.querySelector('.token-message').textContent =
      'This server needs an access token (the inference or admin token). ' + message;
  }

  async function getJSON(url) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const headers = { Accept: 'application/json' };
      const token = memoryToken;
      if (token) headers.Authorization = 'Bearer ' + token;
      const resp = await fetch(url, { signal: ctl.signal, cache: 'no-store', headers });
      let body = null;
      try { body = await resp.json(); } catch (_) { /* not JSON */ }
      if (resp.status === 401) {
        if (token && token === memoryToken) storeToken('');
        askToken(token ? 'The token was not accepted.' : '');
      }
      if (!resp.ok) {
        const err = new Error((body && body.error) || ('HTTP ' + resp.status));
        err.status = resp.status;
        throw err;
      }
      return body;
    } finally {
      clearTimeout(timer);
    }
  }

  // conn tracks whether polls succeed and drives the live indicator.
  const conn = {
    lastOK: 0,
    lastDataTime: null,
    lastError: null,
    ok(dataTime) {
      this.lastOK = Date.now();
      this.lastDataTime = dataTime;
      this.lastError = null;
      this.paint();
    },
    fail(err) {
      this.lastError = err;
      this.paint();
    },
    paint() {
      const el = document.getElementById('live');
      if (!el) return;
      const text = el.querySelector('.live-text');
      const age = Date.now() - this.lastOK;
      let state;
      let label;
      if (!this.lastOK) {
        state = this.lastError ? 'down' : 'connecting';
        label = this.lastError ? 'cannot reach the server: ' + this.lastError.message : 'connecting…';
      } else if (this.lastError || age > STALE_AFTER_MS) {
        state = this.lastError ? 'down' : 'stale';
        label = (this.lastError ? 'disconnected, retrying' : 'stale') + ' · last update ' + fmtClock(this.lastDataTime) + ' (' + fmtAgo(age) + ')';
      } else {
        state = 'live';
        label = 'live · updated ' + fmtClock(this.lastDataTime);
      }
      el.dataset.live = state;
      el.title = this.lastError ? 'Last error: ' + this.lastError.message : 'The page polls the server every second.';
      if (text.textContent !== label) text.textContent = label;
      document.body.classList.toggle('is-stale', state === 'down' || state === 'stale');
    },
  };
  setInterval(() => conn.paint(), 1000);

  // poll calls fn now and then every interval after it settles, until stopped.
  function poll(fn, interval) {
    let stopped = false;
    let timer = null;
    async function tick() {
      if (stopped) return;
      try {
        await fn();
      } catch (err) {
        if (!stopped) conn.fail(err);
      }
      if (!stopped) timer = setTimeout(tick, interval);
    }
    tick();
    return { stop() { stopped = true; clearTimeout(timer); } };
  }

  function markRendered(page, time) {
    document.body.dataset.page = page;
    if (time !== undefined && time !== null) document.body.dataset.time = String(time);
    document.body.dataset.renders = String((+document.body.dataset.renders || 0) + 1);
  }

  // ---------------------------------------------------------------- header

  let lastOverview = null;

  function paintServer(ov) {
    const box = document.getElementById('server');
    const set = (field, text, cls) => {
      const el = box.querySelector('[data-field="' + field + '"]');
      if (el.textContent !== text) el.textContent = text;
      if (cls !== undefined) el.className = 'meta ' + cls;
    };
    set('version', 'version ' + (ov.version || DASH));
    set('policy', 'policy ' + (ov.policy || DASH));
    set('ready', ov.ready ? 'ready' : 'not ready', ov.ready ? 'ready' : 'not-ready');
  }

  function setCrumbs(...items) {
    const nav = document.getElementById('crumbs');
    nav.replaceChildren(...items.map((it, i) => h('span', { class: 'crumb' },
      i > 0 ? h('span', { class: 'sep', 'aria-hidden': 'true' }, '›') : null,
      it.href ? h('a', { href: it.href }, it.text) : h('span', { 'aria-current': 'page' }, it.text))));
  }

  // ---------------------------------------------------------------- shared pieces

  function badge(status, state) {
    const st = statusInfo(status);
    return h('span', { class: 'badge st-' + (status || 'unknown'), 'data-field': 'status', 'data-value': JSON.stringify(status || '') },
      h('span', { class: 'icon', 'aria-hidden': 'true' }, st.icon), st.label);
  }

  function modelHref(name, version, range) {
    const q = [];
    if (version) q.push('version=' + encodeURIComponent(version));
    if (range && range !== DEFAULT_RANGE) q.push('range=' + encodeURIComponent(range));
    return '#/models/' + encodeURIComponent(name) + (q.length ? '?' + q.join('&') : '');
  }

  function sortModels(models) {
    return models.slice().sort((a, b) =>
      statusInfo(a.status).order - statusInfo(b.status).order ||
      String(a.name).localeCompare(String(b.name)) ||
      String(a.version).localeCompare(String(b.version), undefined, { numeric: true }));
  }

  // colourMap gives every model key a stable colour for the capacity bars.
  function colourMap(ov) {
    const keys = new Set();
    for (const m of ov.models || []) if (m.key) keys.add(m.key);
    for (const d of ov.devices || []) for (const sh of d.shares || []) keys.add(sh.key);
    const map = new Map();
    [...keys].sort().forEach((k, i) => map.set(k, PALETTE[i % PALETTE.length]));
    return map;
  }

  // field wraps a displayed value with the raw API value for the tests.
  function field(name, raw, text, attrs) {
    return h('span', Object.assign({ 'data-field': name, 'data-value': raw === undefined ? 'null' : JSON.stringify(raw) }, attrs || {}), text);
  }

  function tdField(name, raw, text, cls, extra) {
    return h('td', { class: cls || 'num', 'data-field': name, 'data-value': raw === undefined ? 'null' : JSON.stringify(raw) }, text, extra || null);
  }

  // ---------------------------------------------------------------- overview

  const overviewView = {
    els: null,
    poller: null,

    start() {
      setCrumbs({ text: 'All models' });
      const app = document.getElementById('app');
      this.els = {
        headline: h('section', { class: 'headline', id: 'headline', 'aria-live': 'polite' }, h('p', { class: 'muted' }, 'Loading…')),
        table: h('div'),
        devices: h('div'),
        events: h('div'),
      };
      app.replaceChildren(
        this.els.headline,
        h('section', { class: 'card', 'aria-labelledby': 'models-title' },
          h('div', { class: 'card-head' }, h('h2', { id: 'models-title' }, 'Models'),
            h('p', { class: 'hint', id: 'window-hint' }, 'Latency, attainment and rates over the last few seconds. Models missing their SLO come first.')),
          this.els.table),
        h('div', { class: 'two-col' },
          h('section', { class: 'card', 'aria-labelledby': 'devices-title' },
            h('div', { class: 'card-head' }, h('h2', { id: 'devices-title' }, 'Device capacity'),
              h('p', { class: 'hint' }, 'How each device is split between models right now.')),
            this.els.devices),
          h('section', { class: 'card', 'aria-labelledby': 'events-title' },
            h('div', { class: 'card-head' }, h('h2', { id: 'events-title' }, 'Recent adjuster events'),
              h('p', { class: 'hint' }, 'Newest first: what the adjustment loop changed, and why.')),
            this.els.events)));
      this.poller = poll(async () => {
        const ov = await getJSON('/v2/dashboard');
        if (!this.els) return;
        this.render(ov);
        conn.ok(ov.time);
      }, POLL_MS);
    },

    stop() {
      if (this.poller) this.poller.stop();
      this.poller = null;
      this.els = null;
    },

    render(ov) {
      lastOverview = ov;
      paintServer(ov);
      const colours = colourMap(ov);
      const models = sortModels(ov.models || []);
      this.els.headline = swap(this.els.headline, renderHeadline(ov, models));
      const hint = document.getElementById('window-hint');
      if (hint && ov.window_s) {
        hint.textContent = 'p99, attainment and rates over the last ' + ov.window_s + ' s; attainment target ' +
          fmtPct(ov.attainment_target, 1) + '. Models missing their SLO come first.';
      }
      this.els.table = swap(this.els.table, renderModelsTable(ov, models));
      this.els.devices = swap(this.els.devices, renderDevices(ov, colours));
      this.els.events = swap(this.els.events, renderEvents(ov.events || [], { showModel: true, limit: 50 }));
      markRendered('overview', ov.time);
    },
  };

  function renderHeadline(ov, models) {
    const missing = models.filter((m) => m.status === 'missing');
    const unavailable = models.filter((m) => m.status === 'unavailable');
    const withSLO = models.filter((m) => m.status !== 'no-slo');
    const counts = {};
    for (const m of models) counts[m.status] = (counts[m.status] || 0) + 1;
    const summary = h('p', { class: 'counts' },
      Object.keys(STATUS).filter((k) => counts[k]).map((k) =>
        h('span', { class: 'count st-' + k, 'data-count': k }, h('strong', null, String(counts[k])), ' ' + statusInfo(k).label)));

    let tone;
    let title;
    let list = null;
    if (models.length === 0) {
      tone = 'neutral';
      title = 'No models are loaded';
      list = h('p', { class: 'muted' }, 'Put a model folder into a repository, or load one with POST /v2/repository/models/NAME/load.');
    } else if (missing.length > 0) {
      tone = 'bad';
      title = missing.length + ' of ' + withSLO.length + (withSLO.length === 1 ? ' model' : ' models') +
        (missing.length === 1 ? ' is missing its SLO' : ' are missing their SLO');
      list = h('ul', { class: 'why-list' }, missing.map((m) =>
        h('li', { 'data-missing': m.name },
          h('a', { href: modelHref(m.name, m.version) }, m.name), versionTag(m),
          h('span', { class: 'why' }, ' — ' + (m.why || 'p99 ' + fmtMs(m.p99_ms) + ' is over the ' + fmtMs(m.slo_ms) + ' SLO')))));
    } else {
      tone = unavailable.length ? 'warn' : 'good';
      const lc = models.filter((m) => m.class === 'latency-critical' && (m.status === 'ok' || m.status === 'idle'));
      title = lc.length ? 'All latency-critical models meet their SLO' : 'No model is missing its SLO';
      // Say which model is closest to its SLO, the one to watch.
      let closest = null;
      for (const m of models) {
        if (m.status !== 'ok' || !isNum(m.p99_ms) || !isNum(m.slo_ms) || m.slo_ms <= 0) continue;
        if (!closest || m.p99_ms / m.slo_ms > closest.p99_ms / closest.slo_ms) closest = m;
      }
      if (closest) {
        list = h('p', { class: 'closest' }, 'Closest to its SLO: ', h('a', { href: modelHref(closest.name, closest.version) }, closest.name), versionTag(closest),
          ', p99 ' + fmtMs(closest.p99_ms) + ' of ' + fmtMs(closest.slo_ms) + ' (' + fmtPct(closest.p99_ms / closest.slo_ms) + ')' +
          (isNum(closest.attainment) ? ', attainment ' + fmtAttainment(closest.attainment) : '') + '.');
      }
    }
    if (unavailable.length) {
      const ul = h('ul', { class: 'why-list' }, unavailable.map((m) =>
        h('li', { 'data-unavailable': m.name },
          h('strong', null, m.name), versionTag(m),
          h('span', { class: 'why' }, ' is ' + String(m.state || 'unavailable').toLowerCase() + (m.reason ? ': ' + m.reason : (m.why ? ': ' + m.why : ''))))));
      list = list ? [list, ul] : ul;
    }
    return h('section', { class: 'headline tone-' + tone, id: 'headline', 'aria-live': 'polite', 'data-missing-count': String(missing.length) },
      h('div', { class: 'headline-main' },
        h('span', { class: 'headline-icon', 'aria-hidden': 'true' }, tone === 'bad' ? '✕' : tone === 'good' ? '✓' : tone === 'warn' ? '!' : '·'),
        h('div', null, h('h1', null, title), list)),
      summary);
  }

  function versionTag(m) {
    return m.version ? h('span', { class: 'ver' }, ' v' + m.version) : null;
  }

  function p99Cell(m) {
    const td = h('td', { class: 'p99cell', 'data-field': 'p99_ms', 'data-value': JSON.stringify(m.p99_ms === undefined ? null : m.p99_ms) });
    if (!isNum(m.p99_ms)) {
      td.append(h('span', { class: 'muted' }, DASH));
      return td;
    }
    const over = isNum(m.slo_ms) && m.slo_ms > 0 && m.p99_ms > m.slo_ms;
    const text = h('span', { class: 'val' + (over ? ' over' : '') }, fmtMs(m.p99_ms));
    td.append(text);
    if (isNum(m.slo_ms) && m.slo_ms > 0) {
      const ratio = m.p99_ms / m.slo_ms;
      // The track spans 0..1.5x the SLO; the tick marks the SLO.
      const w = Math.min(ratio, 1.5) / 1.5 * 100;
      td.append(h('span', { class: 'ratio' + (over ? ' over' : ''), title: 'p99 is ' + ratio.toFixed(2) + '× the SLO' }, ratio.toFixed(2) + '×'),
        h('span', { class: 'slobar', 'aria-hidden': 'true' },
          h('span', { class: 'fill' + (over ? ' over' : ''), style: { width: w.toFixed(1) + '%' } }),
          h('span', { class: 'tick' })));
    }
    return td;
  }

  function renderModelsTable(ov, models) {
    if (models.length === 0) {
      return h('div', { class: 'empty', 'data-empty': 'models' }, 'No models yet. The table fills in as soon as a model is loaded.');
    }
    const cpus = {};
    for (const d of ov.devices || []) cpus[d.device] = d.cpus;
    const target = ov.attainment_target;
    const head = h('thead', null, h('tr', null,
      h('th', { scope: 'col' }, 'Status'),
      h('th', { scope: 'col' }, 'Model'),
      h('th', { scope: 'col', class: 'num' }, 'SLO'),
      h('th', { scope: 'col', class: 'num' }, 'p99 vs SLO'),
      h('th', { scope: 'col', class: 'num' }, 'Attainment'),
      h('th', { scope: 'col', class: 'num', title: 'Requests completed within their SLO per second' }, 'Goodput'),
      h('th', { scope: 'col', class: 'num', title: 'Arrival rate, and the forecast the adjuster plans for' }, 'Arrivals'),
      h('th', { scope: 'col', class: 'num', title: 'Share of the device\'s compute, and the share the predictor asks for' }, 'Compute'),
      h('th', { scope: 'col', class: 'num', title: 'Memory share and memory in use' }, 'Memory'),
      h('th', { scope: 'col' }, 'Why')));
    const rows = models.map((m) => {
      const attOver = isNum(m.attainment) && isNum(target) && m.attainment < target;
      const tgt = m.target_compute_share;
      const showTarget = isNum(tgt) && isNum(m.compute_share) && Math.abs(tgt - m.compute_share) >= 0.005;
      const why = m.why || (m.status === 'unavailable' && m.reason) || '';
      return h('tr', { 'data-model': m.name, 'data-key': m.key || '', 'data-status': m.status || '', class: 'row st-' + (m.status || '') },
        h('td', { class: 'status' }, badge(m.status),
          h('div', { class: 'sub' }, field('state', m.state, String(m.state || DASH).toLowerCase()))),
        h('td', { class: 'model' },
          h('a', { href: modelHref(m.name, m.version), 'data-field': 'name', 'data-value': JSON.stringify(m.name) }, m.name),
          h('div', { class: 'sub' }, field('version', m.version, 'v' + (m.version || DASH)), ' · ', field('class', m.class, m.class || 'no class'))),
        tdField('slo_ms', m.slo_ms, isNum(m.slo_ms) && m.slo_ms > 0 ? fmtMs(m.slo_ms) : DASH),
        p99Cell(m),
        tdField('attainment', m.attainment, fmtAttainment(m.attainment), 'num' + (attOver ? ' over' : '')),
        tdField('goodput', m.goodput, fmtRate(m.goodput)),
        tdField('arrival_rate', m.arrival_rate, fmtRate(m.arrival_rate), 'num',
          isNum(m.forecast_rate) ? h('div', { class: 'sub' }, 'forecast ', field('forecast_rate', m.forecast_rate, fmtRate(m.forecast_rate))) : null),
        h('td', { class: 'num', 'data-field': 'compute_share', 'data-value': JSON.stringify(m.compute_share === undefined ? null : m.compute_share), title: fmtCores(m.compute_share, cpus[m.device]) || null },
          fmtShare(m.compute_share),
          m.pinned ? h('div', { class: 'sub' }, 'pinned') : null,
          showTarget ? h('div', { class: 'sub' + (tgt > m.compute_share ? ' over' : '') }, 'wants ', field('target_compute_share', tgt, fmtShare(tgt))) : null),
        h('td', { class: 'num', 'data-field': 'memory_share_bytes', 'data-value': JSON.stringify(m.memory_share_bytes === undefined ? null : m.memory_share_bytes) },
          fmtMemShare(m.memory_share_bytes),
          isNum(m.memory_used_bytes) ? h('div', { class: 'sub' }, 'used ', field('memory_used_bytes', m.memory_used_bytes, fmtBytes(m.memory_used_bytes))) : null),
        h('td', { class: 'why', 'data-field': 'why', 'data-value': JSON.stringify(m.why || '') },
          why ? why : h('span', { class: 'muted' }, statusInfo(m.status).text)));
    });
    return h('div', { class: 'table-wrap' }, h('table', { class: 'models', 'data-table': 'models' }, head, h('tbody', null, rows)));
  }

  // renderDevices draws, per device, the compute capacity and the memory
  // shares as stacked bars.
  function renderDevices(ov, colours) {
    const devices = ov.devices || [];
    if (devices.length === 0) return h('div', { class: 'empty' }, 'No device reported yet.');
    const names = new Map();
    for (const m of ov.models || []) if (m.key) names.set(m.key, m);
    return h('div', { class: 'devices' }, devices.map((d) => renderDevice(d, colours, names)));
  }

  function shareLabel(key, names) {
    const m = names.get(key);
    return m ? m.name + (m.version ? ' v' + m.version : '') : key;
  }

  function renderDevice(d, colours, names) {
    const shares = (d.shares || []).slice().sort((a, b) => (b.compute || 0) - (a.compute || 0) || a.key.localeCompare(b.key));
    const limited = shares.filter((x) => isNum(x.compute) && x.compute > 0);
    const unlimited = shares.filter((x) => !(isNum(x.compute) && x.compute > 0));
    const allocated = limited.reduce((a, x) => a + x.compute, 0);
    const scale = Math.max(1, allocated);
    const title = d.device + (d.limiter ? ' · ' + d.limiter : '') + (d.cpus ? ' · ' + d.cpus + ' CPUs' : '');

    const segs = limited.map((x) => {
      const pct = x.compute / scale * 100;
      const label = shareLabel(x.key, names) + ' ' + fmtPct(x.compute);
      return h('div', {
        class: 'seg', 'data-segment': x.key, 'data-share': String(x.compute),
        style: { width: pct + '%', background: colours.get(x.key) || '#888' },
        title: label + (d.cpus ? ' (' + fmtCores(x.compute, d.cpus) + ')' : ''),
      }, pct > 9 ? h('span', null, label) : null);
    });
    const rest = Math.max(0, 1 - allocated);
    if (unlimited.length) {
      const who = unlimited.map((x) => shareLabel(x.key, names)).join(', ');
      segs.push(h('div', {
        class: 'seg shared', 'data-segment': 'shared', 'data-models': unlimited.map((x) => x.key).join(' '),
        style: { width: Math.max(rest * 100, 6) + '%' },
        title: 'No limit: ' + who + ' contend for the capacity the limited models do not use',
      }, h('span', null, 'no limit: ' + who)));
    } else if (rest > 0.0005) {
      segs.push(h('div', { class: 'seg free', 'data-segment': 'unallocated', 'data-share': String(rest), style: { width: rest * 100 + '%' }, title: 'Unallocated ' + fmtPct(rest) },
        rest > 0.09 ? h('span', null, 'unallocated ' + fmtPct(rest)) : null));
    }
    const computeLegend = h('ul', { class: 'legend' },
      limited.map((x) => h('li', null, h('span', { class: 'sw', style: { background: colours.get(x.key) || '#888' } }),
        h('a', { href: modelHref(names.get(x.key) ? names.get(x.key).name : x.key.split('/')[0]) }, shareLabel(x.key, names)),
        ' ', h('span', { class: 'muted' }, fmtPct(x.compute) + (d.cpus ? ' · ' + (x.compute * d.cpus).toFixed(2) + ' CPU' : '')))),
      unlimited.map((x) => h('li', null, h('span', { class: 'sw shared' }), shareLabel(x.key, names), ' ', h('span', { class: 'muted' }, 'no limit'))),
      !unlimited.length && rest > 0.0005 ? h('li', null, h('span', { class: 'sw free' }), 'unallocated ', h('span', { class: 'muted' }, fmtPct(rest))) : null);
    const notes = [];
    if (allocated > 1.0005) notes.push('Oversubscribed: the limits add up to ' + fmtPct(allocated) + ' of the device.');
    if (unlimited.length) notes.push('Models without a compute limit (hatched) share whatever the limited models leave.');

    // Memory: the API reports each model's limit and use, not the device's
    // total, so the bar is the sum of the limits (or of the use, for models
    // without a limit).
    const mem = shares.map((x) => ({ key: x.key, limit: isNum(x.memory_bytes) ? x.memory_bytes : 0, used: isNum(x.memory_used_bytes) ? x.memory_used_bytes : 0 }));
    const memTotal = mem.reduce((a, x) => a + Math.max(x.limit, x.used), 0);
    let memBar;
    if (memTotal <= 0) {
      memBar = h('p', { class: 'muted small' }, 'No memory limits or use reported.');
    } else {
      memBar = h('div', { class: 'bar mem', role: 'img', 'aria-label': 'Memory shares: ' + mem.map((x) => shareLabel(x.key, names) + ' ' + fmtMemShare(x.limit) + ', ' + fmtBytes(x.used) + ' used').join('; ') },
        mem.map((x) => {
          const size = Math.max(x.limit, x.used);
          const pct = size / memTotal * 100;
          const usedPct = size > 0 ? Math.min(1, x.used / size) * 100 : 0;
          const label = shareLabel(x.key, names) + ' ' + (x.limit ? fmtBytes(x.used) + ' of ' + fmtBytes(x.limit) : fmtBytes(x.used) + ' (no limit)');
          return h('div', {
            class: 'seg' + (x.limit ? '' : ' nolimit'), 'data-segment': x.key, 'data-bytes': String(x.limit), 'data-used': String(x.used),
            style: { width: pct + '%', '--c': colours.get(x.key) || '#888' }, title: label,
          }, h('span', { class: 'used', style: { width: usedPct + '%' } }), pct > 12 ? h('span', { class: 'lbl' }, label) : null);
        }));
    }
    return h('div', { class: 'device', 'data-device': d.device },
      h('h3', null, title),
      h('div', { class: 'bar-label' }, 'Compute'),
      h('div', { class: 'bar compute', role: 'img', 'data-bar': 'compute', 'aria-label': 'Compute shares: ' + shares.map((x) => shareLabel(x.key, names) + ' ' + fmtShare(x.compute)).join(', ') }, segs),
      computeLegend,
      notes.length ? h('p', { class: 'note' }, notes.join(' ')) : null,
      h('div', { class: 'bar-label' }, 'Memory ', h('span', { class: 'muted small' }, '(limit per model; the darker part is in use)')),
      memBar);
  }

  // keyLabel turns an instance key "name/version" into "name v1".
  function keyLabel(key) {
    const i = key.lastIndexOf('/');
    return i > 0 ? key.slice(0, i) + ' v' + key.slice(i + 1) : key;
  }

  function renderEvents(events, opts) {
    const list = events.slice().reverse().slice(0, opts.limit || 50);
    if (list.length === 0) {
      return h('div', { class: 'empty', 'data-empty': 'events' }, opts.emptyText || 'No adjuster events yet.');
    }
    const names = new Map();
    for (const m of (lastOverview && lastOverview.models) || []) if (m.key) names.set(m.key, m.name);
    return h('div', { class: 'events-wrap' }, h('table', { class: 'events', 'data-table': 'events' },
      h('thead', null, h('tr', null, h('th', { scope: 'col' }, 'Time'), opts.showModel ? h('th', { scope: 'col' }, 'Model') : null,
        h('th', { scope: 'col' }, 'Change and reason'))),
      h('tbody', null, list.map((e) => {
        const extra = [isNum(e.forecast_rate) && e.forecast_rate > 0 ? 'forecast ' + fmtRate(e.forecast_rate) : null,
          isNum(e.predicted_latency_ms) && e.predicted_latency_ms > 0 ? 'predicted ' + fmtMs(e.predicted_latency_ms) : null].filter(Boolean);
        return h('tr', { 'data-event': e.kind, 'data-model': e.model || '' },
          h('td', { class: 'time', title: e.time }, fmtClock(e.time)),
          opts.showModel ? h('td', { class: 'model' }, e.model ? h('a', { href: modelHref(names.get(e.model) || e.model.split('/')[0]) }, keyLabel(e.model)) : DASH) : null,
          h('td', { class: 'what' },
            h('div', { class: 'change' }, h('span', { class: 'kind k-' + e.kind }, e.kind), ' ', DEVICE_EVENTS.has(e.kind) ? e.device : fmtChange(e)),
            e.reason ? h('div', { class: 'reason' }, e.reason) : null,
            extra.length ? h('div', { class: 'sub' }, extra.join(' · ')) : null));
      }))));
  }

  // ---------------------------------------------------------------- model page

  const SERIES_KEYS = ['p50_ms', 'p90_ms', 'p99_ms', 'attainment', 'goodput', 'throughput', 'arrival_rate', 'forecast_rate',
    'compute_share', 'target_compute_share', 'memory_share_bytes', 'memory_used_bytes', 'predicted_ms', 'observed_ms', 'planned_ms',
    'queue_depth', 'rejected_deadline', 'rejected_queue_full', 'dropped', 'failed'];

  const modelView = {
    name: null,
    version: null,
    range: DEFAULT_RANGE,
    data: null, // {t: [], series..., events: [], model, resolution_s, window_s}
    poller: null,
    ovPoller: null,
    els: null,
    hover: {},
    gen: 0,

    start(name, params) {
      this.name = name;
      this.version = params.get('version') || '';
      this.range = RANGES.some((r) => r[0] === params.get('range')) ? params.get('range') : DEFAULT_RANGE;
      this.data = null;
      this.hover = {};
      const gen = ++this.gen;
      setCrumbs({ text: 'All models', href: '#/' }, { text: name + (this.version ? ' v' + this.version : '') });
      const app = document.getElementById('app');
      this.els = {
        head: h('section', { class: 'model-head' }, h('h1', null, name), h('p', { class: 'muted' }, 'Loading…')),
        switcher: h('nav', { class: 'switcher', 'aria-label': 'Other models' }),
        kpis: h('div'),
        toolbar: h('div'),
        charts: h('div', { class: 'charts' }),
        events: h('div'),
      };
      app.replaceChildren(this.els.switcher, this.els.head, this.els.kpis, this.els.toolbar, this.els.charts);
      this.chartEls = {};
      this.buildCharts();
      this.els.charts.append(h('section', { class: 'card events-card', 'aria-labelledby': 'mev-title' },
        h('div', { class: 'card-head' }, h('h2', { id: 'mev-title' }, 'Adjuster events for this model'),
          h('p', { class: 'hint' }, 'Also marked on the latency chart\'s time axis.')),
        this.els.events));
      this.ovPoller = poll(async () => {
        const ov = await getJSON('/v2/dashboard');
        if (gen !== this.gen) return;
        lastOverview = ov;
        paintServer(ov);
        this.renderSwitcher(ov);
        if (this.data) this.render();
      }, OVERVIEW_ON_MODEL_PAGE_MS);
      this.poller = poll(() => this.fetch(gen), POLL_MS);
    },

    stop() {
      this.gen++;
      if (this.poller) this.poller.stop();
      if (this.ovPoller) this.ovPoller.stop();
      this.poller = this.ovPoller = null;
      this.els = null;
    },

    rangeSeconds() {
      return (RANGES.find((r) => r[0] === this.range) || RANGES[1])[1];
    },

    async fetch(gen) {
      const base = '/v2/dashboard/models/' + encodeURIComponent(this.name);
      const q = new URLSearchParams();
      const retention = lastOverview && lastOverview.retention_s;
      let last = this.rangeSeconds();
      if (isNum(retention) && retention > 0) last = Math.min(last, retention);
      q.set('last', String(last));
      if (this.version) q.set('version', this.version);
      const have = this.data && this.data.t.length > 0;
      if (have) {
        // Ask again for the last couple of points too, in case the newest
        // was still filling when it was fetched; merge replaces them.
        const res = this.data.resolution_s || 1;
        q.set('since', String(this.data.t[this.data.t.length - 1] - 2 * res));
      }
      let resp;
      try {
        resp = await getJSON(base + '?' + q.toString());
      } catch (err) {
        if (gen !== this.gen) return;
        if (err.status === 404) {
          this.renderMissing(err.message);
          conn.ok(new Date().toISOString());
          return;
        }
        throw err;
      }
      if (gen !== this.gen) return;
      this.merge(resp);
      this.render();
      conn.ok(this.data.t.length ? this.data.t[this.data.t.length - 1] : new Date().toISOString());
    },

    merge(resp) {
      const ser = resp.series || {};
      const t = ser.t || [];
      if (!this.data) {
        this.data = { t: [], series: {}, events: [] };
        for (const k of SERIES_KEYS) this.data.series[k] = [];
      }
      const d = this.data;
      d.model = resp.model;
      d.key = resp.key;
      d.resolution_s = resp.resolution_s || d.resolution_s || 1;
      d.window_s = resp.window_s || d.window_s;
      for (let i = 0; i < t.length; i++) {
        // Replace a point we already have (the overlap), else append in order.
        let j = d.t.length - 1;
        while (j >= 0 && d.t[j] > t[i]) j--;
        const same = j >= 0 && d.t[j] === t[i];
        if (!same) {
          d.t.splice(j + 1, 0, t[i]);
          for (const k of SERIES_KEYS) d.series[k].splice(j + 1, 0, null);
          j = j + 1;
        }
        for (const k of SERIES_KEYS) {
          const arr = ser[k];
          d.series[k][j] = arr && arr[i] !== undefined ? arr[i] : null;
        }
      }
      // Keep the sliding window.
      if (d.t.length) {
        const from = d.t[d.t.length - 1] - this.rangeSeconds();
        let cut = 0;
        while (cut < d.t.length && d.t[cut] <= from) cut++;
        if (cut > 0) {
          d.t.splice(0, cut);
          for (const k of SERIES_KEYS) d.series[k].splice(0, cut);
        }
      }
      const seen = new Set(d.events.map(eventKey));
      for (const e of resp.events || []) {
        const k = eventKey(e);
        if (!seen.has(k)) { seen.add(k); d.events.push(e); }
      }
      d.events.sort((a, b) => toDate(a.time) - toDate(b.time));
      if (d.t.length) {
        const from = d.t[0];
        d.events = d.events.filter((e) => toDate(e.time) / 1000 >= from - 1);
      }
    },

    setRange(r) {
      if (r === this.range) return;
      const params = new URLSearchParams();
      if (this.version) params.set('version', this.version);
      if (r !== DEFAULT_RANGE) params.set('range', r);
      // A new range refetches the whole span.
      location.hash = '#/models/' + encodeURIComponent(this.name) + (params.toString() ? '?' + params.toString() : '');
    },

    renderSwitcher(ov) {
      const models = sortModels(ov.models || []);
      this.els.switcher = swap(this.els.switcher, h('nav', { class: 'switcher', 'aria-label': 'Other models' },
        models.map((m) => h('a', {
          href: modelHref(m.name, m.version, this.range),
          class: 'chip st-' + m.status + (m.name === this.name && (!this.version || this.version === m.version) ? ' current' : ''),
          'aria-current': m.name === this.name ? 'page' : null,
          title: m.name + ' ' + statusInfo(m.status).text,
        }, h('span', { class: 'icon', 'aria-hidden': 'true' }, statusInfo(m.status).icon), m.name, versionTag(m)))));
    },

    renderMissing(msg) {
      for (const el of [this.els.kpis, this.els.toolbar, this.els.charts]) el.hidden = true;
      // A model the server knows but that never served (it failed to
      // load, say) has no history; the overview still says why.
      const known = ((lastOverview && lastOverview.models) || []).find((m) => m.name === this.name);
      this.els.head = swap(this.els.head, h('section', { class: 'model-head', 'data-not-found': this.name },
        h('div', { class: 'title-row' }, h('h1', null, this.name, known ? versionTag(known) : null), known ? badge(known.status) : null),
        known ? h('p', { class: 'why-box tone-warn' }, h('strong', null, this.name + ' is ' + String(known.state || 'unavailable').toLowerCase() + ': '),
          known.reason || known.why || 'no reason given', '. It has no history yet.')
          : h('p', { class: 'why-box tone-warn' }, msg || 'No such model.'),
        h('p', null, h('a', { href: '#/' }, '← back to all models'))));
      markRendered('model-missing', null);
    },

    render() {
      const d = this.data;
      const m = d.model || {};
      for (const el of [this.els.kpis, this.els.toolbar, this.els.charts]) el.hidden = false;
      this.els.head = swap(this.els.head, renderModelHead(m, this.name));
      this.els.kpis = swap(this.els.kpis, renderKPIs(m, d, lastOverview));
      this.els.toolbar = swap(this.els.toolbar, this.renderToolbar());
      this.els.events = swap(this.els.events, renderEvents(d.events, { showModel: false, limit: 200, emptyText: 'No adjuster events for this model in the shown time range.' }));
      this.drawCharts();
      markRendered('model', d.t.length ? d.t[d.t.length - 1] : null);
    },

    renderToolbar() {
      const d = this.data;
      const span = d.t.length ? fmtClock(d.t[0]) + ' – ' + fmtClock(d.t[d.t.length - 1]) : 'no data yet';
      return h('div', { class: 'toolbar' },
        h('div', { class: 'range', role: 'group', 'aria-label': 'Time range' },
          RANGES.map(([label]) => h('button', {
            type: 'button', class: label === this.range ? 'on' : '', 'aria-pressed': label === this.range ? 'true' : 'false', 'data-range': label,
            onclick: () => this.setRange(label),
          }, label))),
        h('p', { class: 'hint' }, 'Showing ' + span + ' · one point per ' + (d.resolution_s || 1) + ' s · quantiles and rates over trailing ' + (d.window_s || DASH) + ' s windows · hover a chart for values'));
    },

    buildCharts() {
      const defs = [
        ['latency', 'Latency vs SLO', 'p50, p90 and p99 end-to-end latency at the server; dashed: the SLO; marks on the axis: adjuster events'],
        ['attainment', 'SLO attainment', 'Share of arrived requests answered within the SLO; dashed: the target'],
        ['goodput', 'Goodput and throughput', 'Requests per second answered within the SLO, and all answered'],
        ['arrivals', 'Arrival rate and forecast', 'What came in, and what the adjuster planned for'],
        ['compute', 'Compute share', 'Share of the device given to the model, and what the predictor asks for'],
        ['memory', 'Memory', 'Memory limit of the model and memory in use'],
        ['prediction', 'Predicted vs observed latency', 'The predictor\'s latency at the current share, what was measured, and what the adjuster planned'],
        ['queue', 'Queue depth', 'Requests waiting for the model'],
        ['rejections', 'Rejections by reason', 'Requests per interval not served: refused (deadline, queue full), dropped while queued, failed'],
      ];
      for (const [id, title, sub] of defs) {
        const body = h('div', { class: 'chart-body' });
        const legend = h('div', { class: 'legend-row' });
        const card = h('section', { class: 'card chart-card', 'data-card': id, 'aria-label': title },
          h('div', { class: 'card-head' }, h('h2', null, title), h('p', { class: 'hint' }, sub)), legend, body);
        this.chartEls[id] = { card, body, legend, svg: null, tip: null };
        this.els.charts.append(card);
      }
    },

    drawCharts() {
      const d = this.data;
      const m = d.model || {};
      const se = d.series;
      const t1 = d.t.length ? d.t[d.t.length - 1] : Date.now() / 1000;
      // A history shorter than the range (a model loaded a minute ago)
      // fills the width instead of sitting in a corner.
      const first = d.t.length ? d.t[0] : t1;
      const t0 = Math.max(t1 - this.rangeSeconds(), Math.min(first, t1 - 30));
      const slo = isNum(m.slo_ms) && m.slo_ms > 0 ? m.slo_ms : null;
      const target = lastOverview && isNum(lastOverview.attainment_target) ? lastOverview.attainment_target : null;
      const events = d.events.map((e) => ({ t: toDate(e.time) / 1000, kind: e.kind, text: fmtClock(e.time) + ' ' + e.kind + ': ' + fmtChange(e) + (e.reason ? ' — ' + e.reason : '') }));
      const common = { t: d.t, t0, t1, res: d.resolution_s || 1 };
      const draw = (id, spec) => drawChart(this.chartEls[id], Object.assign({ id }, common, spec), this.hover);
      draw('latency', {
        unit: 'ms', fmt: fmtMs, agg: 'max',
        series: [
          { key: 'p99_ms', label: 'p99', color: C.p99, values: se.p99_ms, width: 2.2 },
          { key: 'p90_ms', label: 'p90', color: C.p90, values: se.p90_ms },
          { key: 'p50_ms', label: 'p50', color: C.p50, values: se.p50_ms },
        ],
        refs: slo ? [{ key: 'slo', label: 'SLO ' + fmtMs(slo), value: slo, color: C.slo }] : [],
        events,
        empty: m.status === 'idle' ? 'No requests in this range' : 'No latency data yet',
      });
      draw('attainment', {
        unit: '%', fmt: (v) => fmtAttainment(v), tick: (v) => fmtPct(v, v > 0.9 && v < 1 ? 1 : 0), agg: 'min', yMax: 1, fixedY: true, yMinAuto: true,
        series: [{ key: 'attainment', label: 'attainment', color: C.attainment, values: se.attainment, width: 2, area: true }],
        refs: target !== null ? [{ key: 'target', label: 'target ' + fmtPct(target, 1), value: target, color: C.target }] : [],
        empty: 'No attainment data: no requests with an SLO in this range',
      });
      draw('goodput', {
        unit: 'req/s', fmt: fmtRate, agg: 'mean',
        series: [
          { key: 'goodput', label: 'goodput', color: C.goodput, values: se.goodput, width: 2.2, area: true },
          { key: 'throughput', label: 'throughput', color: C.throughput, values: se.throughput, dash: '5 3' },
        ],
      });
      draw('arrivals', {
        unit: 'req/s', fmt: fmtRate, agg: 'mean',
        series: [
          { key: 'arrival_rate', label: 'arrivals', color: C.arrival, values: se.arrival_rate, width: 2 },
          { key: 'forecast_rate', label: 'forecast', color: C.forecast, values: se.forecast_rate, dash: '6 3' },
        ],
      });
      draw('compute', {
        unit: '% of device', fmt: fmtShare, tick: (v) => fmtPct(v, 0), agg: 'mean', yMax: 1, minYMax: 0.1,
        series: [
          { key: 'compute_share', label: 'share', color: C.share, values: se.compute_share, width: 2.2, step: true },
          { key: 'target_compute_share', label: 'predictor asks for', color: C.targetShare, values: se.target_compute_share, dash: '6 3', step: true },
        ],
        note: seriesAllZero(se.compute_share) ? 'A share of 0 means no limit: the model contends for the whole device.' : null,
      });
      draw('memory', {
        unit: 'bytes', fmt: fmtBytes, tick: fmtBytes, agg: 'max',
        series: [
          { key: 'memory_share_bytes', label: 'limit', color: C.memShare, values: se.memory_share_bytes, dash: '6 3', step: true, skipZero: true },
          { key: 'memory_used_bytes', label: 'in use', color: C.memUsed, values: se.memory_used_bytes, width: 2, area: true },
        ],
      });
      draw('prediction', {
        unit: 'ms', fmt: fmtMs, agg: 'mean',
        series: [
          { key: 'observed_ms', label: 'observed', color: C.observed, values: se.observed_ms, width: 2 },
          { key: 'predicted_ms', label: 'predicted', color: C.predicted, values: se.predicted_ms, dash: '6 3' },
          { key: 'planned_ms', label: 'planned', color: C.planned, values: se.planned_ms, dash: '2 3' },
        ],
        refs: slo ? [{ key: 'slo', label: 'SLO ' + fmtMs(slo), value: slo, color: C.slo }] : [],
      });
      draw('queue', {
        unit: 'requests', fmt: fmtCount, agg: 'max', minYMax: 4,
        series: [{ key: 'queue_depth', label: 'queue depth', color: C.queue, values: se.queue_depth, width: 2, area: true, step: true }],
      });
      draw('rejections', {
        unit: 'requests', fmt: fmtCount, agg: 'sum', bars: true, minYMax: 4,
        series: [
          { key: 'rejected_deadline', label: 'deadline', color: C.deadline, values: se.rejected_deadline },
          { key: 'rejected_queue_full', label: 'queue full', color: C.queueFull, values: se.rejected_queue_full },
          { key: 'dropped', label: 'dropped', color: C.dropped, values: se.dropped },
          { key: 'failed', label: 'failed', color: C.failed, values: se.failed },
        ],
      });
    },
  };

  function seriesAllZero(arr) {
    let any = false;
    for (const v of arr) { if (isNum(v)) { if (v !== 0) return false; any = true; } }
    return any;
  }

  function eventKey(e) {
    return [e.time, e.model, e.kind, e.reason].join('|');
  }

  function renderModelHead(m, name) {
    const missing = m.status === 'missing';
    const why = m.why || (m.status === 'unavailable' ? m.reason : '') || '';
    return h('section', { class: 'model-head', 'data-model': name, 'data-status': m.status || '' },
      h('div', { class: 'title-row' },
        h('h1', null, name, versionTag(m)), badge(m.status)),
      h('p', { class: 'meta-row' },
        metaItem('state', 'State', m.state ? String(m.state).toLowerCase() : DASH, m.state),
        metaItem('class', 'Class', m.class || DASH, m.class),
        metaItem('slo_ms', 'SLO', isNum(m.slo_ms) && m.slo_ms > 0 ? fmtMs(m.slo_ms) : 'none', m.slo_ms),
        metaItem('device', 'Device', m.device || DASH, m.device),
        metaItem('share_source', 'Share set by', (m.share_source || DASH) + (m.pinned ? ' (pinned)' : ''), m.share_source),
        m.key ? metaItem('key', 'Instance', m.key, m.key) : null),
      h('div', { class: 'why-box tone-' + (missing ? 'bad' : m.status === 'ok' ? 'good' : m.status === 'unavailable' ? 'warn' : 'neutral') },
        h('span', { class: 'headline-icon', 'aria-hidden': 'true' }, statusInfo(m.status).icon),
        h('p', { 'data-field': 'why', 'data-value': JSON.stringify(m.why || '') },
          h('strong', null, name + ' ' + statusInfo(m.status).text + (why ? ': ' : '.')), why)));
  }

  function metaItem(fieldName, label, text, raw) {
    return h('span', { class: 'meta-item' }, h('span', { class: 'k' }, label), ' ', field(fieldName, raw === undefined ? null : raw, text));
  }

  function kpi(fieldName, label, raw, text, opts) {
    opts = opts || {};
    return h('div', { class: 'kpi' + (opts.bad ? ' bad' : '') + (opts.good ? ' good' : ''), 'data-kpi': fieldName },
      h('div', { class: 'k' }, label),
      h('div', { class: 'v', 'data-field': fieldName, 'data-value': JSON.stringify(raw === undefined ? null : raw) }, text),
      opts.sub ? h('div', { class: 'sub' }, opts.sub) : null);
  }

  function renderKPIs(m, d, ov) {
    const slo = isNum(m.slo_ms) && m.slo_ms > 0 ? m.slo_ms : null;
    const target = ov && isNum(ov.attainment_target) ? ov.attainment_target : null;
    const win = d.window_s ? 'last ' + d.window_s + ' s' : '';
    const cpus = ov && (ov.devices || []).find((x) => x.device === m.device);
    const over = isNum(m.p99_ms) && slo !== null && m.p99_ms > slo;
    const rej = ['rejected_deadline', 'rejected_queue_full', 'dropped', 'failed'];
    const rejTotal = rej.reduce((a, k) => a + (isNum(m[k]) ? m[k] : 0), 0);
    const tot = m.totals || null;
    return h('div', { class: 'kpis' },
      kpi('p99_ms', 'p99 latency', m.p99_ms, fmtMs(m.p99_ms), {
        bad: over, good: isNum(m.p99_ms) && slo !== null && !over,
        sub: [slo !== null ? 'SLO ' + fmtMs(slo) + (isNum(m.p99_ms) ? ' · ' + (m.p99_ms / slo).toFixed(2) + '×' : '') : 'no SLO', h('br'),
          'p50 ', field('p50_ms', m.p50_ms, fmtMs(m.p50_ms)), ' · p90 ', field('p90_ms', m.p90_ms, fmtMs(m.p90_ms))],
      }),
      kpi('attainment', 'SLO attainment', m.attainment, fmtAttainment(m.attainment), {
        bad: isNum(m.attainment) && target !== null && m.attainment < target,
        good: isNum(m.attainment) && target !== null && m.attainment >= target,
        sub: (target !== null ? 'target ' + fmtPct(target, 1) : '') + (win ? ' · ' + win : ''),
      }),
      kpi('goodput', 'Goodput', m.goodput, fmtRate(m.goodput), { sub: ['throughput ', field('throughput', m.throughput, fmtRate(m.throughput))] }),
      kpi('arrival_rate', 'Arrival rate', m.arrival_rate, fmtRate(m.arrival_rate), { sub: ['forecast ', field('forecast_rate', m.forecast_rate, fmtRate(m.forecast_rate))] }),
      kpi('compute_share', 'Compute share', m.compute_share, fmtShare(m.compute_share), {
        bad: isNum(m.target_compute_share) && isNum(m.compute_share) && m.compute_share > 0 && m.target_compute_share > m.compute_share + 0.005,
        sub: ['predictor asks for ', field('target_compute_share', m.target_compute_share, fmtShare(m.target_compute_share)),
          cpus && fmtCores(m.compute_share, cpus.cpus) ? [h('br'), fmtCores(m.compute_share, cpus.cpus)] : null],
      }),
      kpi('memory_share_bytes', 'Memory limit', m.memory_share_bytes, fmtMemShare(m.memory_share_bytes), { sub: ['in use ', field('memory_used_bytes', m.memory_used_bytes, fmtBytes(m.memory_used_bytes))] }),
      kpi('observed_ms', 'Observed vs predicted', m.observed_ms, fmtMs(m.observed_ms), {
        sub: ['predicted ', field('predicted_ms', m.predicted_ms, fmtMs(m.predicted_ms)), h('br'), 'planned ', field('planned_ms', m.planned_ms, fmtMs(m.planned_ms))],
      }),
      kpi('queue_depth', 'Queue depth', m.queue_depth, fmtCount(m.queue_depth), { sub: 'requests waiting now' }),
      kpi('rejections', 'Not served', rejTotal, m.status === 'unavailable' ? DASH : fmtCount(rejTotal), {
        bad: rejTotal > 0,
        sub: [win ? win + ': ' : '', 'deadline ', field('rejected_deadline', m.rejected_deadline, fmtCount(m.rejected_deadline)),
          ' · queue full ', field('rejected_queue_full', m.rejected_queue_full, fmtCount(m.rejected_queue_full)), h('br'),
          'dropped ', field('dropped', m.dropped, fmtCount(m.dropped)), ' · failed ', field('failed', m.failed, fmtCount(m.failed))],
      }),
      tot ? kpi('totals', 'Arrived since load', tot.arrived, fmtCount(tot.arrived), {
        sub: [tot.good + ' good · ' + tot.late + ' late', h('br'), tot.rejected + ' rejected · ' + tot.dropped + ' dropped', h('br'), tot.failed + ' failed'],
      }) : null);
  }

  // ---------------------------------------------------------------- charts

  const M = { top: 12, right: 14, bottom: 24, left: 58 };

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const n = raw / mag;
    return (n <= 1 ? 1 : n <= 2 ? 2 : n <= 2.5 ? 2.5 : n <= 5 ? 5 : 10) * mag;
  }

  function niceBytesStep(span, count) {
    const raw = span / Math.max(1, count);
    const steps = [];
    for (let p = 1; p <= Math.pow(1024, 4); p *= 1024) for (const f of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]) steps.push(f * p);
    return steps.find((x) => x >= raw) || raw;
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200];

  // bucketize shrinks the points in [t0, t1] to at most maxPoints by
  // aggregating whole buckets (max for latency, sum for counts, ...).
  function bucketize(t, series, t0, t1, res, maxPoints, agg) {
    let first = 0;
    while (first < t.length && t[first] < t0) first++;
    const n = t.length - first;
    if (n <= maxPoints) {
      return { t: t.slice(first), values: series.map((v) => v.slice(first)), bucket: res };
    }
    const span = t1 - t0;
    const bucket = Math.max(res, Math.ceil(span / maxPoints / res) * res);
    const outT = [];
    const outV = series.map(() => []);
    let i = first;
    while (i < t.length) {
      const b = Math.floor(t[i] / bucket) * bucket;
      const acc = series.map(() => ({ n: 0, v: null }));
      let j = i;
      for (; j < t.length && Math.floor(t[j] / bucket) * bucket === b; j++) {
        series.forEach((vals, si) => {
          const x = vals[j];
          if (!isNum(x)) return;
          const a = acc[si];
          if (a.v === null) a.v = x;
          else if (agg === 'max') a.v = Math.max(a.v, x);
          else if (agg === 'min') a.v = Math.min(a.v, x);
          else a.v += x;
          a.n++;
        });
      }
      outT.push(b + bucket - res);
      acc.forEach((a, si) => outV[si].push(a.v === null ? null : agg === 'mean' ? a.v / a.n : a.v));
      i = j;
    }
    return { t: outT, values: outV, bucket };
  }

  function countPoints(t, vals, t0) {
    let n = 0;
    for (let i = 0; i < t.length; i++) if (t[i] >= t0 && isNum(vals[i])) n++;
    return n;
  }

  function lowerBound(arr, x) {
    let lo = 0;
    let hi = arr.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (arr[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // drawChart renders one time-series chart into its card; spec:
  //   t, t0, t1, res       the time axis (unix seconds) and its domain
  //   series [{key, label, color, values, dash, width, area, step, skipZero}]
  //   refs [{key, label, value, color}]   horizontal dashed lines
  //   events [{t, kind, text}]            marks on the time axis
  //   unit, fmt, tick, agg, yMax, fixedY, minYMax, bars, empty, note
  function drawChart(ce, spec, hoverState) {
    const width = Math.max(280, Math.round(ce.body.clientWidth || 560));
    const height = spec.height || 210;
    const pw = width - M.left - M.right;
    const ph = height - M.top - M.bottom;
    const fmt = spec.fmt || String;
    const tick = spec.tick || fmt;

    // Downsample so there is at most one point per pixel (two for bars' room).
    const maxPoints = spec.bars ? Math.max(10, Math.floor(pw / 4)) : Math.max(10, pw);
    const vals = spec.series.map((x) => (x.skipZero ? x.values.map((v) => (v === 0 ? null : v)) : x.values));
    const b = bucketize(spec.t, vals, spec.t0, spec.t1, spec.res, maxPoints, spec.bars ? 'sum' : spec.agg || 'mean');

    // y domain: from 0 (or, with yMinAuto, from just below the lowest
    // value, as attainment near 100% needs) to a round number above the
    // highest value and reference line.
    let ymax = 0;
    let dmin = Infinity;
    let any = false;
    if (spec.bars) {
      for (let i = 0; i < b.t.length; i++) {
        let sum = 0;
        for (const v of b.values) if (isNum(v[i])) { sum += v[i]; any = true; }
        ymax = Math.max(ymax, sum);
      }
    } else {
      for (const v of b.values) for (const x of v) if (isNum(x)) { ymax = Math.max(ymax, x); dmin = Math.min(dmin, x); any = true; }
    }
    for (const r of spec.refs || []) if (isNum(r.value)) { ymax = Math.max(ymax, r.value); dmin = Math.min(dmin, r.value); }
    if (spec.fixedY && isNum(spec.yMax)) ymax = spec.yMax;
    else {
      if (isNum(spec.minYMax)) ymax = Math.max(ymax, spec.minYMax);
      if (isNum(spec.yMax)) ymax = Math.min(Math.max(ymax * 1.1, 1e-9), spec.yMax);
      else ymax = ymax * 1.1;
    }
    if (!(ymax > 0)) ymax = 1;
    let ymin = 0;
    if (spec.yMinAuto && isFinite(dmin) && dmin > 0) {
      ymin = Math.max(0, dmin - Math.max((ymax - dmin) * 0.15, ymax * 0.01));
    }
    const step = spec.unit === 'bytes' ? niceBytesStep(ymax - ymin, 4) : niceStep(ymax - ymin, 4);
    ymin = Math.floor(ymin / step + 1e-9) * step;
    if (!spec.fixedY) ymax = Math.ceil(ymax / step - 1e-9) * step;

    const span = Math.max(1, spec.t1 - spec.t0);
    const X = (t) => M.left + (t - spec.t0) / span * pw;
    const Y = (v) => M.top + ph - (v - ymin) / (ymax - ymin) * ph;

    const svg = s('svg', {
      width, height, viewBox: '0 0 ' + width + ' ' + height, class: 'chart', role: 'img',
      'data-chart': spec.id,
      'data-points': String(countPoints(spec.t, spec.series[0].values, spec.t0)),
      'data-last-t': spec.t.length ? String(spec.t[spec.t.length - 1]) : '',
      'aria-label': (ce.card.getAttribute('aria-label') || spec.id) + ': ' + spec.series.map((x) => x.label + ' ' + fmt(lastValue(x.values))).join(', '),
    });
    const defs = s('defs', null, s('clipPath', { id: 'clip-' + spec.id }, s('rect', { x: M.left, y: M.top - 2, width: pw, height: ph + 4 })));
    svg.append(defs);

    // grid and y axis
    const gy = s('g', { class: 'axis y' });
    for (let k = 0, v = ymin; v <= ymax + step * 1e-6; k++, v = ymin + k * step) {
      const y = Y(v);
      gy.append(s('line', { x1: M.left, x2: M.left + pw, y1: y, y2: y, class: k === 0 ? 'base' : 'grid' }),
        s('text', { x: M.left - 6, y: y + 4, 'text-anchor': 'end' }, v === 0 ? '0' : tick(v)));
    }
    svg.append(gy);

    // x axis
    const gx = s('g', { class: 'axis x' });
    const tstep = TIME_STEPS.find((x) => pw / (span / x) >= 70) || 7200;
    for (let t = Math.ceil(spec.t0 / tstep) * tstep; t <= spec.t1; t += tstep) {
      const x = X(t);
      gx.append(s('line', { x1: x, x2: x, y1: M.top + ph, y2: M.top + ph + 4, class: 'tick' }),
        s('text', { x, y: height - 6, 'text-anchor': 'middle' }, fmtClock(t, tstep < 60)));
    }
    svg.append(gx);

    const plot = s('g', { 'clip-path': 'url(#clip-' + spec.id + ')' });
    svg.append(plot);

    if (spec.bars) {
      const bw = Math.max(1, pw * b.bucket / span - 1);
      spec.series.forEach((x, si) => {
        plot.append(s('g', { 'data-series': x.key, 'data-points': String(countPoints(spec.t, x.values, spec.t0)), fill: x.color }));
      });
      const groups = plot.querySelectorAll('g[data-series]');
      for (let i = 0; i < b.t.length; i++) {
        let base = 0;
        b.values.forEach((v, si) => {
          if (!isNum(v[i]) || v[i] <= 0) return;
          const y0 = Y(base);
          const y1 = Y(base + v[i]);
          groups[si].append(s('rect', { x: X(b.t[i]) - bw, y: y1, width: bw, height: Math.max(0.5, y0 - y1) }));
          base += v[i];
        });
      }
    } else {
      spec.series.forEach((x, si) => {
        const v = b.values[si];
        const segs = [];
        let cur = [];
        for (let i = 0; i < b.t.length; i++) {
          if (isNum(v[i])) cur.push([X(b.t[i]), Y(v[i])]);
          else if (cur.length) { segs.push(cur); cur = []; }
        }
        if (cur.length) segs.push(cur);
        let d = '';
        let area = '';
        const singles = [];
        for (const seg of segs) {
          if (seg.length === 1) { singles.push(seg[0]); continue; }
          let p = 'M' + seg[0][0].toFixed(1) + ',' + seg[0][1].toFixed(1);
          for (let k = 1; k < seg.length; k++) {
            if (x.step) p += 'H' + seg[k][0].toFixed(1) + 'V' + seg[k][1].toFixed(1);
            else p += 'L' + seg[k][0].toFixed(1) + ',' + seg[k][1].toFixed(1);
          }
          d += p;
          if (x.area) area += p + 'V' + Y(ymin).toFixed(1) + 'H' + seg[0][0].toFixed(1) + 'Z';
        }
        const g = s('g', { 'data-series': x.key, 'data-points': String(countPoints(spec.t, x.values, spec.t0)) });
        if (area) g.append(s('path', { d: area, fill: x.color, 'fill-opacity': 0.1, stroke: 'none', class: 'area' }));
        if (d) g.append(s('path', { d, fill: 'none', stroke: x.color, 'stroke-width': x.width || 1.5, 'stroke-dasharray': x.dash || null, 'stroke-linejoin': 'round', class: 'line', 'data-series': x.key, 'data-vertices': String(segs.reduce((a, sg) => a + sg.length, 0)) }));
        for (const [px, py] of singles) g.append(s('circle', { cx: px, cy: py, r: 2.2, fill: x.color }));
        plot.append(g);
      });
    }

    // reference lines (SLO, target)
    for (const r of spec.refs || []) {
      if (!isNum(r.value)) continue;
      const y = Y(r.value);
      svg.append(s('g', { class: 'ref' },
        s('line', { x1: M.left, x2: M.left + pw, y1: y, y2: y, stroke: r.color, 'stroke-width': 1.5, 'stroke-dasharray': '7 4', 'data-ref': r.key, 'data-value': String(r.value) }),
        s('text', { x: M.left + 6, y: y - 5, 'text-anchor': 'start', fill: r.color, class: 'ref-label' }, r.label)));
    }

    // adjuster events on the time axis
    const evs = (spec.events || []).filter((e) => e.t >= spec.t0 && e.t <= spec.t1 + 1);
    if (spec.events) {
      const ge = s('g', { class: 'events', 'data-events': String(evs.length) });
      for (const e of evs) {
        const x = X(e.t);
        const col = EVENT_COLOURS[e.kind] || '#555';
        ge.append(s('g', { class: 'ev', 'data-kind': e.kind },
          s('title', null, e.text),
          s('line', { x1: x, x2: x, y1: M.top, y2: M.top + ph, stroke: col, 'stroke-opacity': 0.35, 'stroke-dasharray': '2 3' }),
          s('path', { d: 'M' + (x - 5) + ',' + (M.top + ph + 9) + 'L' + (x + 5) + ',' + (M.top + ph + 9) + 'L' + x + ',' + (M.top + ph + 1) + 'Z', fill: col })));
      }
      svg.append(ge);
    }

    if (!any) {
      svg.append(s('text', { x: M.left + pw / 2, y: M.top + ph / 2, 'text-anchor': 'middle', class: 'nodata' }, spec.empty || 'No data in this range'));
    }

    // hover readout
    const cursor = s('line', { class: 'cursor', x1: 0, x2: 0, y1: M.top, y2: M.top + ph, visibility: 'hidden' });
    svg.append(cursor);
    const overlay = s('rect', { x: M.left, y: M.top, width: pw, height: ph, fill: 'transparent', class: 'overlay' });
    svg.append(overlay);

    const tip = ce.tip || h('div', { class: 'tip', role: 'status', hidden: true });
    const show = (tx) => {
      if (!spec.t.length) return;
      let i = lowerBound(spec.t, tx);
      if (i >= spec.t.length) i = spec.t.length - 1;
      if (i > 0 && Math.abs(spec.t[i - 1] - tx) < Math.abs(spec.t[i] - tx)) i--;
      const t = spec.t[i];
      if (t < spec.t0) return;
      const x = X(t);
      cursor.setAttribute('x1', x);
      cursor.setAttribute('x2', x);
      cursor.setAttribute('visibility', 'visible');
      const rows = spec.series.map((sr) => h('div', { class: 'tip-row' },
        h('span', { class: 'sw', style: { background: sr.color } }), sr.label + ' ', h('strong', null, fmt(sr.values[i]))));
      for (const r of spec.refs || []) rows.push(h('div', { class: 'tip-row muted' }, r.label));
      const near = evs.filter((e) => Math.abs(e.t - t) <= Math.max(spec.res, span / pw * 4));
      for (const e of near) rows.push(h('div', { class: 'tip-row ev' }, e.text));
      tip.replaceChildren(h('div', { class: 'tip-time' }, fmtClock(t)), ...rows);
      tip.hidden = false;
      const left = x + 12 + 220 > width ? x - 12 - 220 : x + 12;
      tip.style.left = Math.max(0, left) + 'px';
      tip.style.top = M.top + 'px';
    };
    const hide = () => {
      cursor.setAttribute('visibility', 'hidden');
      tip.hidden = true;
    };
    overlay.addEventListener('mousemove', (ev) => {
      const rect = svg.getBoundingClientRect();
      const px = (ev.clientX - rect.left) * (width / rect.width);
      const tx = spec.t0 + (px - M.left) / pw * span;
      hoverState[spec.id] = tx;
      show(tx);
    });
    overlay.addEventListener('mouseleave', () => { delete hoverState[spec.id]; hide(); });

    // legend with the latest values
    const legend = h('div', { class: 'legend-row' }, spec.series.map((x) => h('span', { class: 'lg', 'data-legend': x.key },
      spec.bars ? h('span', { class: 'sw box', style: { background: x.color } })
        : h('span', { class: 'sw line' + (x.dash ? ' dashed' : ''), style: { 'border-color': x.color } }),
      x.label, ' ', h('strong', null, spec.bars ? fmt(sumInRange(spec.t, x.values, spec.t0)) + ' total' : fmt(lastValue(x.values))))),
    (spec.refs || []).map((r) => h('span', { class: 'lg' }, h('span', { class: 'sw line dashed', style: { 'border-color': r.color } }), r.label)),
    spec.events && evs.length ? h('span', { class: 'lg' }, h('span', { class: 'sw tri', 'aria-hidden': 'true' }, '▲'), evs.length + (evs.length === 1 ? ' event' : ' events')) : null,
    spec.note ? h('span', { class: 'lg note' }, spec.note) : null);
    ce.legend = swap(ce.legend, legend);

    if (ce.svg) ce.svg.replaceWith(svg); else ce.body.append(svg);
    ce.svg = svg;
    if (!ce.tip) { ce.tip = tip; ce.body.append(tip); }
    if (hoverState[spec.id] !== undefined) show(hoverState[spec.id]); else hide();
  }

  function lastValue(arr) {
    for (let i = arr.length - 1; i >= 0; i--) if (isNum(arr[i])) return arr[i];
    return null;
  }

  function sumInRange(t, arr, t0) {
    let sum = 0;
    for (let i = 0; i < t.length; i++) if (t[i] >= t0 && isNum(arr[i])) sum += arr[i];
    return sum;
  }

  // ---------------------------------------------------------------- router

  let current = null;

  function route() {
    if (current) current.stop();
    const hash = location.hash.replace(/^#/, '') || '/';
    const [path, query] = hash.split('?');
    const params = new URLSearchParams(query || '');
    const m = path.match(/^\/models\/([^/]+)\/?$/);
    document.body.dataset.renders = '0';
    delete document.body.dataset.time;
    if (m) {
      current = modelView;
      modelView.start(decodeURIComponent(m[1]), params);
      document.title = decodeURIComponent(m[1]) + ' · sloserve dashboard';
    } else {
      current = overviewView;
      overviewView.start();
      document.title = 'sloserve dashboard';
    }
    window.scrollTo(0, 0);
  }

  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (current === modelView && modelView.data) modelView.drawCharts(); }, 150);
  });
  window.addEventListener('hashchange', route);

  // For tests and the curious: what the page shows, from which response.
  window.sloserveDashboard = {
    get page() { return document.body.dataset.page || ''; },
    get overview() { return lastOverview; },
    get history() { return modelView.data; },
  };

  route();
})();
