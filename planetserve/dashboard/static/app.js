// The planetserve dashboard: polls /api/state every 2 s and draws it; the chat box posts to /api/chat.
// Everything from the network is inserted as text (textContent), never as markup.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2f5fd0", "#d0452f", "#1f8a4c", "#9b4dca", "#d08a2f", "#2fa7b8", "#b8336a", "#5c6b1f",
                 "#6d4c41", "#455a64"];
const colours = new Map();  // node key -> colour, stable across polls
let latest = null;

function $(id) { return document.getElementById(id); }

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === null || value === undefined) continue;
    if (name === "className") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function short(hex, n = 12) {
  if (!hex) return "-";
  return hex.length > n ? hex.slice(0, n) + "…" : hex;
}

function rep(ppm) { return ppm === null || ppm === undefined ? "-" : (ppm / 1e6).toFixed(3); }

function showError(id, message) {
  const node = $(id);
  node.hidden = !message;
  node.textContent = message || "";
}

function colourOf(key) {
  if (!colours.has(key)) colours.set(key, PALETTE[colours.size % PALETTE.length]);
  return colours.get(key);
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function facts(dl, pairs) {
  const items = [];
  for (const [name, value] of pairs) {
    const dd = value instanceof Node ? el("dd", {}, value) : el("dd", { text: value === null ? "-" : value });
    items.push(el("dt", { text: name }), dd);
  }
  dl.replaceChildren(...items);
}

// -- sections ----------------------------------------------------------------------------------------

function drawValidators(state) {
  const rows = (state.validators || []).map((v) => {
    if (v.error) {
      return el("tr", { className: "down" },
        el("td", { text: v.moniker || "?" }), el("td", { className: "height num", text: "-" }),
        el("td", { colspan: "3", text: v.error }), el("td", { className: "mono", text: v.rpc }));
    }
    const time = v.block_time ? new Date(v.block_time) : null;
    return el("tr", { "data-moniker": v.moniker },
      el("td", { text: v.moniker }),
      el("td", { className: "height num", text: String(v.height) }),
      el("td", { className: "mono", title: v.app_hash, text: short(v.app_hash, 16) }),
      el("td", { text: time && !isNaN(time) ? time.toLocaleTimeString() : "-" }),
      el("td", { className: "num", text: String(v.voting_power) }),
      el("td", { className: "mono", text: v.rpc }));
  });
  fill($("validators").tBodies[0], rows);
  const agree = state.validators_agree;
  const p = $("agreement");
  p.className = agree === false ? "bad" : "muted";
  p.textContent = agree === null || agree === undefined ? "" :
    agree ? "validators at the same height agree on the app hash" :
      "validators at the same height report different app hashes!";
}

function drawEpoch(state) {
  const e = state.epoch || {};
  showError("epoch-error", e.error);
  if (e.error) { $("epoch").replaceChildren(); return; }
  const leader = e.leader ? (e.leader_name ? `${e.leader_name} (${short(e.leader, 10)})` : short(e.leader, 16)) : "-";
  const next = e.next_leader ?
    (e.next_leader_name ? `${e.next_leader_name} (${short(e.next_leader, 10)})` : short(e.next_leader, 16)) +
      (e.next_election ? `, ${e.next_election}` : "") : "not elected yet";
  facts($("epoch"), [
    ["epoch", el("strong", { id: "epoch-number", text: String(e.number) })],
    ["phase", el("span", { id: "epoch-phase-name", text: e.phase })],
    ["blocks", `${e.start}–${e.end} (height ${e.height}, ${e.blocks_left} to go)`],
    ["leader", `${leader}${e.election ? ", " + e.election : ""}`],
    ["plan", e.plan_status === undefined ? "-" : `${e.plan_status}, ${e.plan_nodes} node(s) to challenge`],
    ["next leader", next],
    ["finalized", e.finalized ? `yes: ${e.scored} scored, ${e.faults} fault(s)` : "at its last block"],
  ]);
  $("epoch-progress").style.width = `${Math.min(100, Math.max(0, 100 * (e.offset + 1) / e.blocks))}%`;
  $("epoch-phase").textContent = e.phase_detail + (e.windows && e.windows.length ?
    ` (open windows: ${e.windows.join(", ")})` : "");
}

function drawNodes(state) {
  const section = state.nodes || { items: [], history: [] };
  showError("nodes-error", section.error || section.history_error);
  const rows = (section.items || []).map((n) => {
    const standing = el("span", {
      className: n.trusted && n.listed ? "ok" : n.trusted ? "warn" : "bad",
      text: (n.trusted ? "trusted" : "untrusted") + (n.listed ? ", listed" : ", not listed") +
        (n.status !== "active" ? `, ${n.status}` : ""),
    });
    const swatch = el("span", { className: "swatch" });
    swatch.style.background = colourOf(n.key);
    return el("tr", { "data-node": n.key },
      el("td", {}, swatch),
      el("td", { className: "name", title: n.key, text: n.name || short(n.key, 16) }),
      el("td", { text: n.org_id }),
      el("td", { text: n.model_id }),
      el("td", {}, standing),
      el("td", { className: "num reputation", text: rep(n.reputation) }),
      el("td", { className: "num", text: String(n.scored_epochs) }),
      el("td", { className: "mono", text: n.address }));
  });
  fill($("nodes").tBodies[0], rows);
  drawPlot(section);
}

function drawPlot(section) {
  const plot = $("reputation-plot");
  const W = 720, H = 260, left = 44, right = 20, top = 12, bottom = 34;
  const pw = W - left - right, ph = H - top - bottom;
  const history = section.history || [];
  const items = section.items || [];
  const epochs = history.map((p) => p.epoch);
  const lo = Math.min(...epochs), hi = Math.max(...epochs);
  const x = (epoch) => hi === lo ? left + pw / 2 : left + (pw * (epoch - lo)) / (hi - lo);
  const y = (ppm) => top + ph * (1 - ppm / 1e6);
  const parts = [];
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    parts.push(svg("line", { class: "grid", x1: left, x2: W - right, y1: y(v * 1e6), y2: y(v * 1e6) }));
    parts.push(svg("text", { class: "axis", x: left - 6, y: y(v * 1e6) + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  if (section.threshold !== null && section.threshold !== undefined) {
    parts.push(svg("line", { class: "threshold", x1: left, x2: W - right, y1: y(section.threshold),
                             y2: y(section.threshold) }));
  }
  const every = Math.max(1, Math.ceil(history.length / 12));
  history.forEach((p, i) => {
    if (i % every && i !== history.length - 1) return;
    const label = p.source === "current" ? `now (${p.epoch})` : String(p.epoch);
    parts.push(svg("text", { class: "axis", x: x(p.epoch), y: H - bottom + 16, "text-anchor": "middle" }, label));
  });
  parts.push(svg("text", { class: "axis", x: left + pw / 2, y: H - 4, "text-anchor": "middle" },
    "epoch (reputation after it was finalized)"));
  for (const node of items) {
    const colour = colourOf(node.key);
    const name = node.name || short(node.key, 10);
    const series = svg("g", { class: "series", "data-node": node.key, "data-name": name });
    const points = history.filter((p) => p.values && p.values[node.key] !== undefined);
    if (points.length > 1) {
      series.append(svg("polyline", {
        stroke: colour, points: points.map((p) => `${x(p.epoch)},${y(p.values[node.key])}`).join(" "),
      }));
    }
    for (const p of points) {
      const dot = svg("circle", { class: "point", cx: x(p.epoch), cy: y(p.values[node.key]), r: 4, fill: colour,
                                  "data-epoch": p.epoch, "data-source": p.source });
      dot.append(svg("title", {}, `${name}: ${rep(p.values[node.key])} ` +
        (p.source === "current" ? "now" : `after epoch ${p.epoch}`) + (p.source === "sampled" ? " (sampled)" : "")));
      series.append(dot);
    }
    parts.push(series);
  }
  plot.replaceChildren(...parts);
  const finalized = history.filter((p) => p.source !== "current").length;
  $("plot-caption").textContent = items.length === 0 ? "no model node is registered" :
    `${finalized} finalized epoch(s) shown` + (section.threshold ? `; dashed: untrusted below ${rep(section.threshold)}` : "");
}

function drawOrganisations(state) {
  const section = state.organisations || { items: [] };
  showError("orgs-error", section.error);
  const rows = (section.items || []).map((o) => el("tr", { "data-org": o.org_id },
    el("td", { title: o.name, text: o.org_id }),
    el("td", { className: "num", text: String(o.nodes) }),
    el("td", { className: "num " + (o.trusted === false ? "bad" : ""), text: rep(o.reputation) }),
    el("td", { className: "num credits", text: o.balance }),
    el("td", { className: "num", text: o.earned }),
    el("td", { className: "num", text: o.spent })));
  fill($("organisations").tBodies[0], rows);
}

function drawOverlay(state) {
  const o = state.overlay || {};
  showError("overlay-error", o.error);
  const rate = o.delivery_rate === null || o.delivery_rate === undefined ? "no requests yet" :
    `${(100 * o.delivery_rate).toFixed(1)} %`;
  const chat = state.chat || {};
  facts($("overlay"), [
    ["relay", o.relay || "none"],
    ["live proxies", el("strong", { id: "live-proxies", text: o.live_paths === null ? "-" : String(o.live_paths) })],
    ["requests", o.requests === null ? "-" : `${o.requests} sent, ${o.answered} answered, ${o.failed} failed`],
    ["delivery rate", el("span", { id: "delivery-rate", text: rate })],
    ["known", o.model_nodes === null ? "-" :
      `${o.model_nodes} trusted model node(s), ${o.registered_nodes} registered, ${o.users} user relay(s)`],
    ["relaying", o.relayed_paths === null ? "-" : `${o.relayed_paths} path(s) of other users`],
    ["this page's chats", `${chat.chats || 0} sent, ${chat.answered || 0} answered, ${chat.failed || 0} failed`],
  ]);
  const chips = (o.paths || []).map((p) => el("li", { title: `proxy ${p.proxy}; ${p.misses} missed ping(s)`,
                                                      text: `proxy ${short(p.proxy, 8)} · ${Math.round(p.age)} s` }));
  $("proxies").replaceChildren(...chips);
}

function draw(state) {
  latest = state;
  $("chain").textContent = state.chain_id || "chain unknown";
  const ledger = state.ledger || {};
  $("ledger").textContent = ledger.height ? `ledger height ${ledger.height}, verified` +
    (ledger.rpc ? ` via ${ledger.rpc}` : "") : "";
  $("updated").textContent = `updated ${new Date(state.time * 1000).toLocaleTimeString()}` +
    (state.took_ms !== undefined ? ` (${state.took_ms} ms)` : "");
  showError("global-error", state.error || (ledger.error && !ledger.height ? ledger.error : ""));
  for (const part of [drawValidators, drawEpoch, drawNodes, drawOrganisations, drawOverlay]) {
    try { part(state); } catch (err) { console.error(err); }
  }
  document.body.dataset.ready = "true";
}

async function poll() {
  try {
    const reply = await fetch("/api/state", { cache: "no-store" });
    if (!reply.ok) throw new Error(`the dashboard answered ${reply.status}`);
    draw(await reply.json());
  } catch (err) {
    showError("global-error", `cannot reach the dashboard server: ${err.message}`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// -- chat ----------------------------------------------------------------------------------------------

function nodeName(key) {
  const nodes = latest && latest.nodes && latest.nodes.items || [];
  const found = nodes.find((n) => n.key === key);
  return found && found.name;
}

async function send(event) {
  event.preventDefault();
  const box = $("chat-prompt");
  const prompt = box.value.trim();
  if (!prompt) { box.focus(); return; }
  const button = $("chat-send");
  button.disabled = true;
  const entry = el("li", { className: "pending" }, el("div", { className: "question", text: prompt }),
    el("div", { className: "signer", text: "on its way through the overlay…" }));
  $("chat-log").append(entry);
  try {
    const reply = await fetch("/api/chat", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ prompt }),
    });
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error ? body.error.message : `HTTP ${reply.status}`);
    const name = body.node_name || nodeName(body.node) || short(body.node, 16);
    const served = body.served_by && body.served_by !== body.node ?
      `, computed by ${body.served_by_name || nodeName(body.served_by) || short(body.served_by, 16)}` : "";
    entry.className = "answer";
    entry.replaceChildren(
      el("div", { className: "question", text: prompt }),
      body.answer ? el("div", { className: "answer-text", text: body.answer }) :
        el("div", { className: "answer-text muted", text: "(an empty answer: the model ended it at once)" }),
      el("div", { className: "signer", "data-node": body.node || "" },
        "signed by ", el("strong", { className: "signer-name", text: name }),
        ` (${short(body.node, 16)})${served}; signature ${body.signature_valid ? "verified" : "NOT valid"}; ` +
        `${body.model}, ${body.seconds} s`));
    box.value = "";
  } catch (err) {
    entry.className = "failed";
    entry.replaceChildren(el("div", { className: "question", text: prompt }),
      el("div", { className: "error", text: err.message }));
  } finally {
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("chat-form").addEventListener("submit", send);
  $("chat-prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  poll();
});
