// The live dashboard: reads /v1/engine/events (server-sent events over fetch), keeps the last five
// minutes in the page, and draws the charts and the KV block map: one panel for a server, one per
// replica behind a front end (whose events carry a "replica" field).
"use strict";

const HISTORY_S = 300;
const $ = (id) => document.getElementById(id);
const panels = {};  // "main" for a single server, else the replica's index

function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
function ms(x) { return x == null ? "–" : (1000 * x).toFixed(0) + " ms"; }

class Panel {
  // The template's data-id elements become ids: unchanged for the server's own panel, "r<i>-" first for a replica.
  constructor(key) {
    const node = $("panel").content.firstElementChild.cloneNode(true);
    this.prefix = key === "main" ? "" : `r${key}-`;
    for (const el of node.querySelectorAll("[data-id]")) el.id = this.prefix + el.dataset.id;
    if (key !== "main") {
      node.querySelector("h2.replica").hidden = false;
      node.querySelector('[data-id="name"]').textContent = `Replica ${key}`;
    }
    const after = Object.keys(panels).map(Number).filter((k) => k > key).sort((a, b) => a - b)[0];
    $("panels").insertBefore(node, after === undefined ? null : panels[after].node);
    this.node = node;
    this.info = {};
    this.series = {t: [], gen: [], prompt: [], prefill: [], decode: [], spec: [], running: [], waiting: [],
                   ttft: [], itl: [], prefix: [], accept: []};
    this.charts = [
      this.chart("c-tps", ["generated", "prompt"], ["gen", "prompt"], ["#2a6fdb", "#e07b00"]),
      this.chart("c-step", ["prefill", "decode", "spec"], ["prefill", "decode", "spec"], ["#e07b00", "#2a6fdb", "#8a3ffc"]),
      this.chart("c-req", ["running", "waiting"], ["running", "waiting"], ["#2a6fdb", "#d0342c"]),
      this.chart("c-lat", ["TTFT", "ITL"], ["ttft", "itl"], ["#d0342c", "#2a6fdb"]),
      this.chart("c-rate", ["prefix hits %", "spec accepted %"], ["prefix", "accept"], ["#198038", "#8a3ffc"]),
    ];
  }

  el(id) { return $(this.prefix + id); }

  chart(id, labels, keys, colors) {
    const el = this.el(id);
    const opts = {width: el.clientWidth || 420, height: 170, legend: {live: false},
                  scales: {x: {time: true}}, axes: [{}, {size: 60}],
                  series: [{}].concat(labels.map((l, i) => ({label: l, stroke: colors[i], width: 1.5,
                                                             fill: colors[i] + "22", spanGaps: false})))};
    return {plot: new uPlot(opts, [[]].concat(keys.map(() => [])), el), keys};
  }

  setState(text) { const s = this.el("state"); if (s) s.textContent = text; }

  onSample(s) {
    const series = this.series;
    const t = s.time;
    const push = (k, v) => series[k].push(v);
    push("t", t);
    push("gen", s.generation_tokens_per_s); push("prompt", s.prompt_tokens_per_s);
    push("prefill", s.step_tokens.prefill); push("decode", s.step_tokens.decode); push("spec", s.step_tokens.spec);
    push("running", s.running); push("waiting", s.waiting);
    push("ttft", s.ttft_s == null ? null : 1000 * s.ttft_s); push("itl", s.itl_s == null ? null : 1000 * s.itl_s);
    push("prefix", s.prefix_hit_rate == null ? null : 100 * s.prefix_hit_rate);
    push("accept", s.spec_acceptance == null ? null : 100 * s.spec_acceptance);
    while (series.t.length && series.t[0] < t - HISTORY_S) for (const k in series) series[k].shift();

    this.setState("live");
    this.el("v-running").textContent = s.running;
    this.el("v-waiting").textContent = s.waiting;
    this.el("v-gen").textContent = s.generation_tokens_per_s.toFixed(1);
    this.el("v-prompt").textContent = s.prompt_tokens_per_s.toFixed(0);
    this.el("v-steps").textContent = s.steps_per_s.toFixed(1);
    this.el("v-kv").textContent = pct(s.kv_usage);
    this.el("v-prefix").textContent = pct(s.prefix_hit_rate_total);
    this.el("v-spec").textContent = pct(s.spec_acceptance_total);
    this.el("v-ttft").textContent = ms(s.ttft_s);
    this.el("v-itl").textContent = ms(s.itl_s);
    this.el("v-preempt").textContent = s.preemptions;
    for (const c of this.charts) c.plot.setData([series.t].concat(c.keys.map((k) => series[k])));
    if (s.block_map) this.drawBlocks(s.block_map);
  }

  drawBlocks(map) {
    const cells = atob(map.cells);
    const n = cells.length;
    const cols = Math.max(16, Math.ceil(Math.sqrt(n * 8)));
    const rows = Math.ceil(n / cols);
    const canvas = this.el("blockmap");
    if (canvas.width !== cols || canvas.height !== rows) { canvas.width = cols; canvas.height = rows; }
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    for (let b = 0; b < n; b++) {
      const code = cells.charCodeAt(b);
      let rgb;
      if (code === 0) rgb = [230, 230, 230];
      else if (code === 1) rgb = [154, 208, 160];
      else if (code === 2) rgb = [68, 68, 68];
      else rgb = hsl(((code - 3) * 47) % 360, 0.7, 0.55);
      img.data.set([rgb[0], rgb[1], rgb[2], 255], 4 * b);
    }
    ctx.putImageData(img, 0, 0);
    this.el("blockinfo").textContent = `${n} blocks × ${this.info.block_size || "?"} tokens: ${map.in_use} in use by ` +
                                       `${map.owners} requests, ${map.cached} cached, ${map.free} free`;
  }
}

function hsl(h, s, l) {
  const a = s * Math.min(l, 1 - l);
  const f = (n) => { const k = (n + h / 30) % 12; return 255 * (l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1))); };
  return [f(0), f(8), f(4)];
}

function panel(key) { return panels[key] || (panels[key] = new Panel(key)); }

function onEvent(name, body) {
  if (name === "replicas") {  // a front end: its replicas' panels, in order, before their first events
    for (let i = 0; i < body.replicas; i++) panel(i).setState("connecting…");
    return;
  }
  const p = panel(body.replica == null ? "main" : body.replica);
  if (name === "info") p.info = body;
  else if (name === "down") p.setState("down; waiting for it…");
  else p.onSample(body);
}

async function connect() {
  for (;;) {
    try {
      const resp = await apiFetch("/v1/engine/events?interval=0.5");
      if (!resp.ok) throw new Error(await apiError(resp));
      $("status").textContent = "live";
      await readSSE(resp, (name, data) => onEvent(name, JSON.parse(data)));
      $("status").textContent = "disconnected; retrying…";
    } catch (e) {
      $("status").textContent = "error: " + (e.message || e) + "; retrying…";
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

connect();
