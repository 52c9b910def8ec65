// Coxswain dashboard: polls the gateway's /v1/dashboard/state about once a second and
// draws it. No dependencies (the cluster may have no internet): the plots are drawn on
// <canvas> by the small functions below, and every value from the server is inserted as
// text, never as HTML (run ids, sources and error messages come from users).
"use strict";

const STATE_URL = "v1/dashboard/state"; // relative: works behind a route prefix
const KEY_STORE = "coxswain.apiKey";
const POLL_MS = 1000;
const HISTORY = 120; // polls kept for the time series: two minutes at one a second

const SITES = ["pre_attn", "post_attn", "post_block"];
const COLORS = {
  generated: "#2563eb",
  prompt: "#f59e0b",
  hit: "#10b981",
  sites: { pre_attn: "#8b5cf6", post_attn: "#ec4899", post_block: "#0891b2" },
  recent: "#111827",
  monitor: "#dc2626",
  store: "#0f766e",
  storeOver: "#ef4444",
  budget: "#111827",
  grid: "#e5e7eb",
  axis: "#6b7280",
  track: "#eef0f3",
};
const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif';

const samples = []; // one per poll: {t, gen, prompt, hit, gates: {"L.site": {tokens, fired}}}
let pollTimer = null;

const $ = (id) => document.getElementById(id);

// -- the API key ------------------------------------------------------------------------------

function takeKeyFromUrl() {
  const url = new URL(window.location.href);
  const key = url.searchParams.get("key");
  if (key === null) return;
  if (key) sessionStorage.setItem(KEY_STORE, key);
  url.searchParams.delete("key");
  // Keep the key out of the address bar, the browser history and bookmarks.
  window.history.replaceState(null, "", url.pathname + url.search + url.hash);
}

function askForKey(message) {
  clearTimeout(pollTimer);
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  setStatus("wait", "API key needed");
  if (!samples.length) $("model").textContent = "";
  $("key-input").focus();
}

function submitKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  $("key-form").hidden = true;
  $("main").hidden = false;
  poll();
}

// -- polling ----------------------------------------------------------------------------------

function errorMessage(body, status) {
  const err = body && body.error;
  return err && err.message ? err.message : `HTTP ${status}`;
}

async function poll() {
  clearTimeout(pollTimer);
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const resp = await fetch(STATE_URL, { headers, cache: "no-store" });
    const body = await resp.json().catch(() => null);
    if (resp.status === 401 || resp.status === 403) {
      if (key && resp.status === 401) sessionStorage.removeItem(KEY_STORE);
      askForKey(key ? errorMessage(body, resp.status) : "");
      return; // no more polls until a key is given
    }
    if (!resp.ok) throw new Error(errorMessage(body, resp.status));
    render(body);
    setStatus("live", "live");
  } catch (err) {
    setStatus("down", `no data: ${err.message}`);
  }
  // The next poll starts a second after this one ended, so polls never pile up.
  pollTimer = setTimeout(poll, POLL_MS);
}

function setStatus(kind, text) {
  const pill = $("status");
  pill.className = `pill pill-${kind}`;
  pill.textContent = text;
}

// -- formatting -------------------------------------------------------------------------------

function fmtRate(x) {
  if (x >= 1000) return `${(x / 1000).toFixed(1)}k`;
  return x >= 100 ? x.toFixed(0) : x.toFixed(1);
}
const fmtPct = (x) => `${(100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0)}%`;
const fmtInt = (n) => n.toLocaleString("en-US");
const plural = (n, word) => `${fmtInt(n)} ${word}${n === 1 ? "" : "s"}`;

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

// The smallest 1, 2 or 5 × 10^k at or above x: round axis maxima.
function niceMax(x) {
  if (!(x > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

// -- canvas helpers ---------------------------------------------------------------------------

// A canvas sized to its CSS box at the device's pixel ratio; drawing is in CSS pixels.
function setupCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  // Where the plot lies on the page, in CSS pixels: lets a screenshot be checked per plot.
  const box = canvas.getBoundingClientRect();
  canvas.dataset.box = [box.left + window.scrollX, box.top + window.scrollY, w, h]
    .map(Math.round)
    .join(",");
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = FONT;
  return { ctx, w, h };
}

// Horizontal grid lines with labels on the left; returns the plot area.
function drawYAxis(ctx, w, h, max, fmt) {
  const area = { l: 52, r: 12, t: 12, b: 22 };
  area.w = w - area.l - area.r;
  area.h = h - area.t - area.b;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = Math.round(area.t + area.h - (area.h * i) / 4) + 0.5;
    ctx.strokeStyle = COLORS.grid;
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(area.l, y);
    ctx.lineTo(area.l + area.w, y);
    ctx.stroke();
    ctx.fillStyle = COLORS.axis;
    ctx.fillText(fmt((max * i) / 4), area.l - 8, y);
  }
  return area;
}

function drawEmpty(ctx, w, h, text) {
  ctx.fillStyle = COLORS.axis;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  ctx.fillText(text, w / 2, h / 2);
}

// -- plots ------------------------------------------------------------------------------------

// Lines over the kept polls, x by server time; `series` is [{color, values, fill}].
function drawTimeSeries(canvas, series, { max, fmt }) {
  const { ctx, w, h } = setupCanvas(canvas);
  const n = samples.length;
  const top = max || niceMax(Math.max(0, ...series.flatMap((s) => s.values)) * 1.1);
  const area = drawYAxis(ctx, w, h, top, fmt);
  const t0 = samples[0].t;
  const span = samples[n - 1].t - t0;
  const x = (i) => (span > 0 ? area.l + ((samples[i].t - t0) / span) * area.w : area.l + area.w);
  const y = (v) => area.t + area.h - (Math.min(v, top) / top) * area.h;

  ctx.fillStyle = COLORS.axis;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(span > 0 ? `−${fmtSeconds(span)}` : "", area.l, area.t + area.h + 6);
  ctx.textAlign = "right";
  ctx.fillText("now", area.l + area.w, area.t + area.h + 6);

  // Fills first, so no tint lies over another series' line.
  for (const s of series.filter((s) => s.fill && n > 1)) {
    ctx.beginPath();
    ctx.moveTo(x(0), y(0));
    s.values.forEach((v, i) => ctx.lineTo(x(i), y(v)));
    ctx.lineTo(x(n - 1), y(0));
    ctx.closePath();
    ctx.globalAlpha = 0.12;
    ctx.fillStyle = s.color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.beginPath();
    s.values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke();
    ctx.fillStyle = s.color; // the latest value
    ctx.beginPath();
    ctx.arc(x(n - 1), y(s.values[n - 1]), 3.5, 0, 2 * Math.PI);
    ctx.fill();
  }
  canvas.dataset.points = String(n);
}

// The firing rate over the kept polls, for the dark tick: null when no gated tokens ran.
function recentRate(key) {
  const first = samples.find((s) => s.gates[key]);
  const last = samples[samples.length - 1].gates[key];
  if (!first || !last) return null;
  const tokens = last.tokens - first.gates[key].tokens;
  return tokens > 0 ? (last.fired - first.gates[key].fired) / tokens : null;
}

// Grouped bars: one group per layer, one bar per site that has gates; monitors marked "M".
function drawGates(canvas, state) {
  const { ctx, w, h } = setupCanvas(canvas);
  const layers = state.model.num_layers;
  const sites = SITES.filter((s) => state.gates.some((g) => g.site === s));
  const area = drawYAxis(ctx, w, h, 1, (v) => `${Math.round(v * 100)}%`);
  const gw = area.w / layers;
  const bw = sites.length ? Math.min(28, (gw * 0.8) / sites.length) : 0;
  const every = Math.max(1, Math.ceil(layers / (area.w / 26))); // label spacing

  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  ctx.fillStyle = COLORS.axis;
  for (let l = 0; l < layers; l += every) {
    ctx.fillText(String(l), area.l + gw * (l + 0.5), area.t + area.h + 6);
  }
  for (const g of state.gates) {
    const left = area.l + gw * g.layer + (gw - bw * sites.length) / 2 + bw * sites.indexOf(g.site);
    const barH = g.rate * area.h;
    ctx.fillStyle = COLORS.sites[g.site];
    ctx.fillRect(left + 1, area.t + area.h - barH, bw - 2, barH);
    const recent = recentRate(`${g.layer}.${g.site}`);
    if (recent !== null) {
      ctx.fillStyle = COLORS.recent;
      ctx.fillRect(left - 1, Math.round(area.t + area.h - recent * area.h) - 1, bw + 2, 2);
    }
    if (bw >= 18) { // the rate as text: inside a tall bar, above a short one
      const inside = barH > 18;
      ctx.fillStyle = inside ? "#ffffff" : COLORS.axis;
      ctx.textBaseline = inside ? "top" : "bottom";
      const y = area.t + area.h - barH + (inside ? 4 : -3);
      ctx.fillText(fmtPct(g.rate), left + bw / 2, y);
      ctx.textBaseline = "top";
    }
  }
  ctx.font = `bold ${FONT}`;
  ctx.fillStyle = COLORS.monitor;
  for (const m of state.steering.monitors) {
    ctx.fillText("M", area.l + gw * (m.layer + 0.5), area.t);
  }
  if (!state.gates.length) {
    ctx.font = FONT;
    drawEmpty(ctx, w, h, "no gated decode tokens yet");
  }
  canvas.dataset.bars = String(state.gates.length);

  const legend = $("gate-legend");
  legend.replaceChildren(
    ...sites.map((s) => legendItem(COLORS.sites[s], s)),
    legendItem(COLORS.recent, "recent", 2),
  );
}

function legendItem(color, text, height = 8) {
  const span = document.createElement("span");
  const sw = document.createElement("i");
  sw.className = "sw";
  sw.style.background = color;
  sw.style.height = `${height}px`;
  span.append(sw, text);
  return span;
}

// Bytes held against the budget: a bar, the budget marked, red past it.
function drawStore(canvas, ps) {
  const { ctx, w, h } = setupCanvas(canvas);
  const scale = Math.max(ps.budget_bytes, ps.bytes);
  const bar = { l: 0, t: 26, w: w - 2, h: 18 };
  const px = (bytes) => (bytes / scale) * bar.w;
  ctx.fillStyle = COLORS.track;
  ctx.fillRect(bar.l, bar.t, bar.w, bar.h);
  const within = Math.min(ps.bytes, ps.budget_bytes);
  ctx.fillStyle = COLORS.store;
  ctx.fillRect(bar.l, bar.t, ps.bytes > 0 ? Math.max(3, px(within)) : 0, bar.h);
  if (ps.bytes > ps.budget_bytes) {
    ctx.fillStyle = COLORS.storeOver;
    ctx.fillRect(bar.l + px(ps.budget_bytes), bar.t, px(ps.bytes - ps.budget_bytes), bar.h);
  }
  ctx.fillStyle = COLORS.budget; // the budget line
  ctx.fillRect(bar.l + px(ps.budget_bytes) - 1, bar.t - 4, 2, bar.h + 8);

  ctx.textBaseline = "bottom";
  ctx.textAlign = "left";
  ctx.fillStyle = "#1c2330";
  ctx.font = `600 13px system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif`;
  ctx.fillText(
    `${fmtBytes(ps.bytes)} of ${fmtBytes(ps.budget_bytes)} · ${fmtPct(ps.occupancy)}`,
    bar.l,
    bar.t - 8,
  );
  ctx.font = FONT;
  ctx.textAlign = "right";
  ctx.fillStyle = ps.bytes_over_budget > 0 ? COLORS.storeOver : COLORS.axis;
  ctx.fillText(
    ps.bytes_over_budget > 0
      ? `over budget by ${fmtBytes(ps.bytes_over_budget)} (leased runs kept)`
      : `${plural(ps.runs, "run")} · ${fmtInt(ps.leased_runs)} leased`,
    bar.l + bar.w,
    bar.t - 8,
  );
  canvas.dataset.occupancy = String(ps.occupancy);
}

// -- tables -----------------------------------------------------------------------------------

// Rows of cells; a cell is a string/number, or {text, cls, chips: [strings]}.
function fillTable(tbody, rows, emptyText) {
  const columns = tbody.closest("table").querySelectorAll("thead th");
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = columns.length;
    td.className = "none";
    td.textContent = emptyText;
    tr.append(td);
    tbody.replaceChildren(tr);
    return;
  }
  tbody.replaceChildren(
    ...rows.map((cells) => {
      const tr = document.createElement("tr");
      cells.forEach((cell, i) => {
        const td = document.createElement("td");
        if (columns[i] && columns[i].classList.contains("num")) td.classList.add("num");
        if (cell !== null && typeof cell === "object") {
          if (cell.cls) td.classList.add(cell.cls);
          if (cell.chips) td.append(...chips(cell.chips));
          if (cell.text !== undefined) td.append(String(cell.text));
          if (cell.title) td.title = cell.title;
        } else {
          td.textContent = cell === undefined || cell === null ? "" : String(cell);
        }
        tr.append(td);
      });
      return tr;
    }),
  );
}

function chips(items) {
  if (!items.length) return [document.createTextNode("—")];
  return items.map((text) => {
    const c = document.createElement("span");
    c.className = "chip";
    c.textContent = text;
    return c;
  });
}

// -- one poll's state -------------------------------------------------------------------------

function render(state) {
  const e = state.engine;
  samples.push({
    t: state.time,
    gen: e.generation_tokens_per_s,
    prompt: e.prompt_tokens_per_s,
    hit: e.prefix_cache_hit_rate,
    gates: Object.fromEntries(state.gates.map((g) => [`${g.layer}.${g.site}`, g])),
  });
  if (samples.length > HISTORY) samples.splice(0, samples.length - HISTORY);

  const m = state.model;
  $("model").textContent =
    `${m.id} · ${m.num_layers} layers · hidden ${m.hidden_size} · ${m.device} · ${m.dtype}`;
  $("updated").textContent = `updated ${new Date(state.time * 1000).toLocaleTimeString()}`;
  $("t-gen").textContent = fmtRate(e.generation_tokens_per_s);
  $("t-prompt").textContent = fmtRate(e.prompt_tokens_per_s);
  $("t-hit").textContent = fmtPct(e.prefix_cache_hit_rate);
  $("t-req").textContent = `${e.requests_running} / ${e.requests_waiting}`;
  $("t-kv").textContent = `${fmtInt(e.kv_blocks_free)} / ${fmtInt(e.kv_blocks)}`;
  $("t-steps").textContent = fmtInt(e.steps);
  $("rate-window").textContent = `tokens/s over ${e.rate_window_s.toFixed(0)} s`;
  $("hit-detail").textContent =
    `${fmtInt(e.prefix_cache_hits)} of ${fmtInt(e.prefix_cache_queries)} block lookups`;

  drawTimeSeries(
    $("plot-throughput"),
    [
      { color: COLORS.prompt, values: samples.map((s) => s.prompt) },
      { color: COLORS.generated, values: samples.map((s) => s.gen), fill: true },
    ],
    { fmt: fmtRate },
  );
  drawTimeSeries(
    $("plot-cache"),
    [{ color: COLORS.hit, values: samples.map((s) => s.hit), fill: true }],
    { max: 1, fmt: (v) => `${Math.round(v * 100)}%` },
  );
  drawGates($("plot-gates"), state);
  renderStore(state);
  renderQueue(state.queue);
  renderSteering(state.steering);
}

function renderStore(state) {
  const ps = state.patch_store;
  const missing = $("store-missing");
  $("store-body").hidden = !ps;
  missing.hidden = Boolean(ps);
  if (!ps) {
    missing.textContent = state.patch_store_error
      ? `The patch store could not be read: ${state.patch_store_error}`
      : "No patch store is attached to this gateway.";
    $("store-detail").textContent = "";
    fillTable($("runs"), [], "no patch store");
    return;
  }
  const c = ps.counters;
  $("store-detail").textContent =
    `${fmtInt(c.hits || 0)} hits · ${fmtInt(c.misses || 0)} misses · ` +
    `${fmtInt(c.evictions || 0)} evictions`;
  drawStore($("plot-store"), ps);
  fillTable(
    $("leases"),
    ps.leases.map((l) => [
      { text: l.run, cls: "mono" },
      { chips: l.holders },
      fmtSeconds(l.expires_in_s),
      fmtBytes(l.bytes),
    ]),
    "no leases held",
  );
  fillTable(
    $("runs"),
    ps.recent_runs.map((r) => [
      r.run,
      fmtBytes(r.bytes),
      r.layers.join(", "),
      { chips: r.sites },
      fmtInt(r.positions),
      fmtSeconds(r.age_s),
      r.leased ? "yes" : "",
    ]),
    "no runs stored",
  );
}

function renderQueue(q) {
  $("queue-detail").textContent = `${fmtInt(q.depth)} waiting of ${fmtInt(q.capacity)}`;
  $("queue-meter").style.width = `${Math.min(100, (100 * q.depth) / q.capacity)}%`;
  fillTable(
    $("queue"),
    q.sources.map((s) => [
      s.source,
      fmtInt(s.enqueued),
      fmtInt(s.applied),
      s.rejected ? { text: fmtInt(s.rejected), cls: "bad" } : "0",
      s.dropped ? { text: fmtInt(s.dropped), cls: "bad" } : "0",
      { text: s.last_rejection || "", title: s.last_rejection || "" },
    ]),
    "no actions yet",
  );
}

function renderSteering(st) {
  const pool = (p) => `${fmtInt(p.used)} / ${fmtInt(p.size)} rows`;
  fillTable(
    $("tiers"),
    [
      ["global · prefill", { chips: st.global_prefill }, st.global_scale.prefill],
      ["global · decode", { chips: st.global_decode }, st.global_scale.decode],
      ["dynamic", { chips: st.dynamic_sites }, st.dynamic_gain],
      ["per-request rows", { text: pool(st.per_request_pool) }, ""],
      ["dynamic override rows", { text: pool(st.dynamic_pool) }, ""],
      ["active sites", { chips: st.active_sites }, ""],
    ],
    "",
  );
  $("loop-detail").textContent =
    `${fmtInt(st.probe_aborts)} probe aborts · ${fmtInt(st.latched_sequences)} latched · ` +
    `${fmtInt(st.admissions_waiting_for_rows)} waits for rows`;
  fillTable(
    $("monitors"),
    st.monitors.map((m) => [m.layer, m.site, m.threshold, m.sharpness, m.gate_rows ? "yes" : "no"]),
    "no monitors installed",
  );
  fillTable(
    $("consumers"),
    st.consumers.map((c) => [
      c.name,
      fmtInt(c.calls),
      c.mean_ms.toFixed(2),
      c.max_ms.toFixed(2),
      c.errors ? { text: fmtInt(c.errors), cls: "bad" } : "0",
      c.last_error || "",
    ]),
    "no sync consumers registered",
  );
}

// -- start ------------------------------------------------------------------------------------

$("key-form").addEventListener("submit", submitKey);
$("change-key").addEventListener("click", () => askForKey(""));
takeKeyFromUrl();
poll();
