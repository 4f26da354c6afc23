// The live dashboard: reads /v1/engine/events (server-sent events over fetch), keeps the last five
// minutes in the page, and draws the charts and the KV block map.
"use strict";

const HISTORY_S = 300;
const $ = (id) => document.getElementById(id);
const series = {t: [], gen: [], prompt: [], prefill: [], decode: [], spec: [], running: [], waiting: [],
                ttft: [], itl: [], prefix: [], accept: []};
let info = {};
const charts = {};

function chart(id, labels, keys, colors) {
  const el = $(id);
  const opts = {width: el.clientWidth || 420, height: 170, legend: {live: false},
                scales: {x: {time: true}}, axes: [{}, {size: 60}],
                series: [{}].concat(labels.map((l, i) => ({label: l, stroke: colors[i], width: 1.5,
                                                           fill: colors[i] + "22", spanGaps: false})))};
  charts[id] = {plot: new uPlot(opts, [[]].concat(keys.map(() => [])), el), keys};
}

function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
function ms(x) { return x == null ? "–" : (1000 * x).toFixed(0) + " ms"; }

function onSample(s) {
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

  $("v-running").textContent = s.running;
  $("v-waiting").textContent = s.waiting;
  $("v-gen").textContent = s.generation_tokens_per_s.toFixed(1);
  $("v-prompt").textContent = s.prompt_tokens_per_s.toFixed(0);
  $("v-steps").textContent = s.steps_per_s.toFixed(1);
  $("v-kv").textContent = pct(s.kv_usage);
  $("v-prefix").textContent = pct(s.prefix_hit_rate_total);
  $("v-spec").textContent = pct(s.spec_acceptance_total);
  $("v-ttft").textContent = ms(s.ttft_s);
  $("v-itl").textContent = ms(s.itl_s);
  $("v-preempt").textContent = s.preemptions;
  for (const c of Object.values(charts)) c.plot.setData([series.t].concat(c.keys.map((k) => series[k])));
  if (s.block_map) drawBlocks(s.block_map);
}

function drawBlocks(map) {
  const cells = atob(map.cells);
  const n = cells.length;
  const cols = Math.max(16, Math.ceil(Math.sqrt(n * 8)));
  const rows = Math.ceil(n / cols);
  const canvas = $("blockmap");
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
  $("blockinfo").textContent = `${n} blocks × ${info.block_size || "?"} tokens: ${map.in_use} in use by ` +
                               `${map.owners} requests, ${map.cached} cached, ${map.free} free`;
}

function hsl(h, s, l) {
  const a = s * Math.min(l, 1 - l);
  const f = (n) => { const k = (n + h / 30) % 12; return 255 * (l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1))); };
  return [f(0), f(8), f(4)];
}

async function connect() {
  for (;;) {
    try {
      const resp = await apiFetch("/v1/engine/events?interval=0.5");
      if (!resp.ok) throw new Error(await apiError(resp));
      $("status").textContent = "live";
      await readSSE(resp, (name, data) => {
        const body = JSON.parse(data);
        if (name === "info") info = body;
        else onSample(body);
      });
      $("status").textContent = "disconnected; retrying…";
    } catch (e) {
      $("status").textContent = "error: " + (e.message || e) + "; retrying…";
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

chart("c-tps", ["generated", "prompt"], ["gen", "prompt"], ["#2a6fdb", "#e07b00"]);
chart("c-step", ["prefill", "decode", "spec"], ["prefill", "decode", "spec"], ["#e07b00", "#2a6fdb", "#8a3ffc"]);
chart("c-req", ["running", "waiting"], ["running", "waiting"], ["#2a6fdb", "#d0342c"]);
chart("c-lat", ["TTFT", "ITL"], ["ttft", "itl"], ["#d0342c", "#2a6fdb"]);
chart("c-rate", ["prefix hits %", "spec accepted %"], ["prefix", "accept"], ["#198038", "#8a3ffc"]);
connect();
