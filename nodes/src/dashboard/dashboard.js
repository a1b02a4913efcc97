// troupe dashboard: renders each snapshot pushed on /events (server-sent events).
"use strict";

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function mib(bytes) {
  return (bytes / 1048576).toFixed(1) + " MiB";
}

function list(items) {
  const ul = el("ul");
  for (const i of items) ul.appendChild(el("li", i));
  return ul;
}

function spark(samples) {
  const ns = "http://www.w3.org/2000/svg";
  const w = 240, h = 40;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  if (samples.length > 0) {
    const t0 = samples[0][0], t1 = samples[samples.length - 1][0];
    const max = Math.max(1, ...samples.map(s => s[1]));
    const pts = samples.map(([t, u]) => {
      const x = t1 > t0 ? ((t - t0) / (t1 - t0)) * (w - 2) + 1 : w - 1;
      const y = h - 1 - (u / max) * (h - 2);
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#2a6ebb");
    svg.appendChild(line);
  }
  return svg;
}

// One cell of items, each an element with `attr` = "node/key" so a test can find it.
function cell(node, items, attr, text) {
  const td = el("td");
  if (items.length === 0) { td.textContent = "-"; td.classList.add("muted"); return td; }
  const ul = el("ul");
  for (const i of items) {
    const [key, line] = text(i);
    ul.appendChild(el("li", line, { [attr]: node + "/" + key }));
  }
  td.appendChild(ul);
  return td;
}

// The workloads' live figures of every node that answered and has some.
function renderLive(nodes) {
  const body = document.getElementById("live");
  const rows = [];
  for (const n of nodes) {
    const l = n.live;
    if (!l || (l.residency.length + l.queues.length + l.mailboxes.length + l.stages.length + l.pools.length) === 0) continue;
    const tr = el("tr", null, { "class": "live", "data-node": n.name });
    tr.appendChild(el("td", n.name));
    tr.appendChild(cell(n.name, l.residency, "data-residency", r => [r.executor,
      `${r.executor}: device ${r.device_experts} experts (${mib(r.device_bytes)}), host ${r.host_experts} experts (${mib(r.host_bytes)})`]));
    tr.appendChild(cell(n.name, l.queues, "data-queue", q => [q.workload + "/" + q.queue,
      `${q.workload} ${q.queue}: ${q.depth}`]));
    tr.appendChild(cell(n.name, l.mailboxes, "data-mailbox", m => [m.actor,
      `${m.actor}: ${m.depth} queued, at most ${m.max_depth}`]));
    tr.appendChild(cell(n.name, l.stages, "data-stage", w => [w.worker,
      `${w.worker}: ${w.stage === null ? "no stage live" : "stage " + w.stage}`]));
    const pools = el("td");
    for (const p of l.pools) {
      const row = el("div", null, { "data-pool": n.name + "/" + p.pool });
      row.appendChild(spark(p.history));
      row.appendChild(el("span", ` ${p.pool}: ${mib(p.used_bytes)} / ${mib(p.budget_bytes)}, fragmentation ${p.fragmentation.toFixed(3)}, ${p.history.length} samples`));
      pools.appendChild(row);
    }
    if (l.pools.length === 0) { pools.textContent = "-"; pools.classList.add("muted"); }
    tr.appendChild(pools);
    rows.push(tr);
  }
  if (rows.length === 0) {
    const tr = el("tr");
    tr.appendChild(el("td", "no node reports a workload yet", { "colspan": "6", "class": "muted" }));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function render(s) {
  document.getElementById("seq").textContent = s.seq;
  document.getElementById("at").textContent = s.at_ms ? new Date(s.at_ms).toISOString() : "";
  document.body.dataset.seq = s.seq;

  const body = document.getElementById("nodes");
  body.replaceChildren();
  for (const n of s.nodes) {
    const tr = el("tr", null, { "class": "node", "data-node": n.name, "data-state": n.state });
    tr.appendChild(el("td", n.name));
    tr.appendChild(el("td", n.state, { "class": "state" }));
    tr.appendChild(el("td", n.last_heard_ms_ago === null ? "-" : n.last_heard_ms_ago + " ms ago"));
    tr.appendChild(el("td", n.addr || "-"));
    const actors = el("td");
    if (n.actors) actors.appendChild(list(n.actors)); else actors.textContent = "not asked";
    tr.appendChild(actors);
    const devices = el("td");
    if (n.devices) {
      devices.appendChild(list(n.devices.map(d =>
        `${d.name} (${d.kind}): ${mib(d.used_bytes)} / ${mib(d.budget_bytes)}, fragmentation ${d.fragmentation.toFixed(3)}`)));
    } else devices.textContent = "not asked";
    tr.appendChild(devices);
    const seen = el("td");
    seen.appendChild(list(n.reported_by));
    tr.appendChild(seen);
    body.appendChild(tr);
  }

  renderLive(s.nodes);

  const mem = document.getElementById("memory");
  const keys = Object.keys(s.memory_history);
  if (keys.length > 0) {
    mem.replaceChildren();
    mem.classList.remove("muted");
    for (const k of keys) {
      const h = s.memory_history[k];
      const row = el("div", null, { "data-device": k });
      row.appendChild(spark(h));
      row.appendChild(el("span", ` ${k}: ${mib(h[h.length - 1][1])} now, ${h.length} samples`));
      mem.appendChild(row);
    }
  }

  const sources = document.getElementById("sources");
  sources.replaceChildren();
  for (const src of s.sources) {
    sources.appendChild(el("li", src.ok ? `${src.addr}: ${src.node} answered`
      : `${src.addr}${src.node ? " (" + src.node + ")" : ""}: ${src.error}`));
  }
  document.getElementById("missing").replaceChildren(...s.missing.map(m => el("li", m)));
}

// For snapshot tools (a headless browser that dumps the page once the network is idle):
// `?once` closes the event stream after the first snapshot; `?until=NODE:STATE` closes it once
// that node shows that state. Without either, the stream stays open and every update applies.
const params = new URLSearchParams(location.search);
const until = (params.get("until") || "").split(":");
let received = 0;
// Every state change seen, in order (`b:up b:down`), so a test can tell a pushed change from a
// page loaded after it.
const last = {};
const changes = [];

function done(s) {
  if (params.has("once")) return s.seq > 0;
  return until.length === 2 && s.nodes.some(n => n.name === until[0] && n.state === until[1]);
}

const conn = document.getElementById("conn");
const events = new EventSource("/events");
events.onopen = () => { conn.textContent = "open"; conn.dataset.conn = "open"; };
events.onerror = () => { conn.textContent = "reconnecting"; conn.dataset.conn = "error"; };
events.addEventListener("status", e => {
  let s;
  try { s = JSON.parse(e.data); render(s); } catch (err) { conn.textContent = "bad snapshot: " + err; return; }
  received += 1;
  for (const n of s.nodes) {
    if (last[n.name] !== n.state) { changes.push(n.name + ":" + n.state); last[n.name] = n.state; }
  }
  document.body.dataset.changes = changes.join(" ");
  document.body.dataset.events = received;
  if (done(s)) { events.close(); conn.textContent = "closed (snapshot)"; conn.dataset.conn = "closed"; }
});
