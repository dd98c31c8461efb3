// The meshd console: polls /console/state once a second and draws it; the chat box streams
// from the OpenAI endpoint. Everything a member names (ids, addresses, model names, reasons)
// is set as text, never as markup: members are strangers.
"use strict";

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const KEY_STORE = "meshd-api-key";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  }
  return node;
}

function short(id) { return id ? id.slice(0, 12) : "–"; }
function mib(bytes) { return bytes ? `${(bytes / 1048576).toFixed(bytes < 1048576 * 10 ? 1 : 0)} MiB` : "–"; }
function num(value, digits) { return value == null ? "–" : Number(value).toFixed(digits); }
function sig(value) { return value == null ? "–" : Number(value).toPrecision(3); }

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}`, "x-api-key": key } : {};
}

// ----- state

let models = [];
let drawn = "";

async function poll() {
  let wait = document.hidden ? HIDDEN_POLL_MS : POLL_MS;
  try {
    const reply = await fetch("/console/state", { headers: authHeaders(), cache: "no-store" });
    if (reply.status === 401 || reply.status === 403) {
      $("key-form").hidden = false;
      setLink("down", "this member wants an API key");
    } else if (!reply.ok) {
      setLink("down", `state unavailable (HTTP ${reply.status})`);
    } else {
      render(await reply.json());
      setLink("live", "live");
    }
  } catch (err) {
    setLink("down", "cannot reach this member");
    wait = POLL_MS * 2;
  }
  setTimeout(poll, wait);
}

function setLink(state, text) {
  const node = $("link-state");
  node.dataset.state = state;
  node.textContent = text;
}

function render(state) {
  $("node-id").textContent = short(state.node_id);
  $("node-id").title = state.node_id;
  $("tracker").textContent = state.tracker ? short(state.tracker) : "none";
  $("tracker").title = state.tracker || "";
  $("term").textContent = String(state.term);
  $("updated").textContent = new Date(state.time * 1000).toLocaleTimeString();
  // redrawn only when something changed: a redraw replaces the nodes a reader may be selecting
  const key = JSON.stringify([state.members, state.models, state.asks]);
  if (key === drawn) return;
  drawn = key;
  models = state.models;
  renderMembers(state.members);
  renderModels(state.models);
  renderAsks(state.asks);
  renderModelChoice();
}

function renderMembers(members) {
  const body = document.querySelector("#members tbody");
  const names = new Map(models.map((m) => [m.digest, m.name]));
  body.replaceChildren(...members.map((m) => {
    const stage = m.stage || {};
    const served = m.served.map((s) => `${names.get(s.model) || short(s.model)} [${s.start}, ${s.end})`).join(", ");
    const roles = m.roles.join(", ");
    const state = m.leaving && m.state === "alive" ? "leaving" : m.state;
    return el("tr", { "data-node": m.node_id, "data-state": m.state },
      el("td", { class: "mono", title: m.node_id }, short(m.node_id)),
      el("td", { class: "mono address" }, m.address || (m.reachability === "nat" ? "behind NAT" : "–")),
      el("td", { class: "state" }, state),
      el("td", {}, roles),
      el("td", { class: "num" }, mib(m.memory_bytes)),
      el("td", { class: "served", title: m.offload ? `GPU: ${m.offload}` : "" },
        served || "–", m.offload ? el("div", { class: "offload" }, `GPU: ${m.offload}`) : ""),
      el("td", { class: "num" }, m.rtt_ms == null ? "–" : `${num(m.rtt_ms, 1)} ms`),
      el("td", { class: "num", title: m.speed_from || "no figure" }, sig(m.ms_per_layer)),
      el("td", { class: "num sessions" }, stage.sessions == null ? "–" : String(stage.sessions)),
      el("td", { class: "num" }, stage.kv_tokens == null ? "–" : String(stage.kv_tokens)),
      el("td", { class: "num" }, stage.step_ms_p50 ? `${num(stage.step_ms_p50, 1)} ms` : "–"),
      el("td", { class: "num cache-hits" }, stage.cache_hit_rate == null ? "–" : `${num(100 * stage.cache_hit_rate, 0)} %`),
      el("td", { class: "num tok-s" }, m.stage ? num(stage.tok_s, 1) : "–"),
      el("td", { class: "num credit" }, m.credit == null ? "–" : num(m.credit, 0)));
  }));
}

function renderAsks(asks) {
  const names = new Map(models.map((m) => [m.digest, m.name]));
  $("no-asks").hidden = asks.length > 0;
  $("asks").hidden = asks.length === 0;
  document.querySelector("#asks tbody").replaceChildren(...asks.map((a) => el("tr", { "data-ask": a.id },
    el("td", { class: "num" }, `#${a.id}`),
    el("td", {}, names.get(a.model) || short(a.model)),
    el("td", {}, `${a.dialect}${a.stream ? ", streamed" : ""}`),
    el("td", { class: "num" }, `${num(a.seconds, 1)} s`),
    el("td", { class: "num" }, String(a.prompt_tokens)),
    el("td", { class: "num" }, String(a.tokens)),
    el("td", { class: "num" }, String(a.epochs)),
    el("td", { class: "mono" }, a.route.map((s) => `${short(s.node_id)} [${s.start}, ${s.end})`).join(" → ") || "–"))));
}

function renderModels(list) {
  $("no-models").hidden = list.length > 0;
  $("model-list").replaceChildren(...list.map((m) => renderModel(m)));
}

function renderModel(m) {
  const head = el("div", { class: "model-head" },
    el("span", { class: "model-name" }, m.name),
    el("span", { class: "mono", title: m.digest }, short(m.digest)),
    el("span", { class: "coverage-status" }, m.covered ? "covered" : "not covered"),
    el("span", { class: "coverage-count" }, `${m.covered_layers} of ${m.n_layers} layers`),
    el("span", {}, `${m.replicas} ${m.replicas === 1 ? "replica" : "replicas"}`));
  const box = el("div", { class: "model", "data-digest": m.digest, "data-covered": m.covered }, head,
    drawLayers(m));
  // what routes count of each stage, and where that came from (the tracker's probe, real asks' traffic, or a default)
  const figured = m.ranges.filter((r) => r.speed).sort((a, b) => a.start - b.start || a.end - b.end);
  if (figured.length) {
    box.append(el("ul", { class: "speeds" }, ...figured.map((r) => el("li", { "data-source": r.speed.source },
      el("span", { class: "mono" }, `${short(r.node_id)} [${r.start}, ${r.end})`),
      `: ${sig(r.speed.ms_per_layer)} ms/layer, ${r.speed.from}`))));
  }
  if (m.why.length) {
    box.append(el("ul", { class: "why" }, ...m.why.map((line) => el("li", { class: "reason" }, line))));
  }
  if (m.route) {
    const hops = m.route.stages.map((s) => `${short(s.node_id)} [${s.start}, ${s.end}) @ ${s.address}`);
    box.append(el("p", { class: "route" }, "route now: ", el("span", { class: "mono" }, hops.join(" → ")),
      ` (${num(m.route.seconds_per_token * 1000, 1)} ms a token, estimated)`));
  } else if (m.route_error) {
    box.append(el("p", { class: "route" }, `no route: ${m.route_error}`));
  }
  return box;
}

// Each lane is a row of ranges that do not overlap: replicas stack as lanes over the layer axis.
function drawLayers(m) {
  const lanes = [];
  const sorted = [...m.ranges].sort((a, b) => a.start - b.start || a.end - b.end);
  for (const r of sorted) {
    let lane = lanes.find((l) => l.end <= r.start);
    if (!lane) { lane = { end: 0, bars: [] }; lanes.push(lane); }
    lane.bars.push(r);
    lane.end = r.end;
  }
  const n = Math.max(1, m.n_layers);
  const box = el("div", { class: "layers" });
  for (const lane of lanes) {
    const row = el("div", { class: "lane" });
    for (const r of lane.bars) {
      const bar = el("div", { class: "bar", "data-node": r.node_id, "data-state": r.state,
        title: `${r.node_id} serves [${r.start}, ${r.end}) (${r.state})` }, `${short(r.node_id)} [${r.start}, ${r.end})`);
      bar.style.left = `${(100 * r.start) / n}%`;
      bar.style.width = `${(100 * (r.end - r.start)) / n}%`;
      row.append(bar);
    }
    box.append(row);
  }
  box.append(el("div", { class: "depth" }, ...m.depth.map((d, i) =>
    el("span", { "data-depth": Math.min(d, 2), title: `layer ${i}: ${d} ${d === 1 ? "copy" : "copies"}` }))));
  box.append(el("div", { class: "axis" }, el("span", {}, "layer 0"), el("span", {}, `${m.n_layers}`)));
  return box;
}

function renderModelChoice() {
  const select = $("chat-model");
  const chosen = select.value;
  const want = models.map((m) => `${m.digest}:${m.covered}`).join(",");
  if (select.dataset.models === want) return;
  select.dataset.models = want;
  select.replaceChildren(...models.map((m) =>
    el("option", { value: m.digest }, `${m.name}${m.covered ? "" : " (not covered)"}`)));
  if (models.some((m) => m.digest === chosen)) select.value = chosen;
}

// ----- chat: one conversation, streamed from /v1/chat/completions

const history = [];
let running = null;

function addMessage(kind, text) {
  const node = el("div", { class: `msg ${kind}` }, text);
  $("chat-log").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

async function send(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || running) return;
  $("chat-input").value = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.done = "false";
  running = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const body = {
    model: $("chat-model").value || undefined,
    messages: history,
    stream: true,
    max_tokens: Number($("chat-max-tokens").value) || 64,
    temperature: Number($("chat-temperature").value) || 0,
  };
  let answer = "";
  let verification = null;
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!reply.ok) throw new Error(await errorText(reply));
    for await (const data of sseData(reply.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      const choice = (chunk.choices || [])[0];
      if (choice && choice.delta && choice.delta.content) {
        answer += choice.delta.content;
        out.textContent = answer;
      }
      if (choice && choice.finish_reason) out.dataset.finish = choice.finish_reason;
      if (chunk.meshd) verification = chunk.meshd;
    }
    if (verification) showVerification(out, verification);
    history.push({ role: "assistant", content: answer });
  } catch (err) {
    if (err.name === "AbortError") {
      history.push({ role: "assistant", content: answer });
      out.dataset.finish = "stopped";
    } else {
      history.pop();
      out.remove();
      addMessage("error", String(err.message || err));
    }
  } finally {
    out.dataset.done = "true";
    running = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

// Under the answer: whether a replica checked every range of it, and if not, which ranges went unchecked and why.
function showVerification(out, v) {
  out.dataset.verified = String(v.verified);
  let text = "verified: every range checked on a replica";
  if (!v.verified) {
    const notes = v.unchecked.map((n) => `layers [${n.layers[0]}, ${n.layers[1]}) of node ${n.node.slice(0, 16)} ` +
      `unchecked from position ${n.since} (${n.why})`);
    text = "unverified: " + (notes.length ? notes.join("; ") : "no spot checks ran");
  }
  if ((v.crossed_numerics_at || []).length) {
    text += `; continued on other numerics after ${v.crossed_numerics_at[0]} tokens (one engine build and ` +
      "backend throughout may answer otherwise)";
  }
  const note = el("div", { class: `verification ${v.verified ? "ok" : "warn"}` }, text);
  out.after(note);
  note.scrollIntoView({ block: "end" });
}

async function errorText(reply) {
  try {
    const body = await reply.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (err) {
    return `HTTP ${reply.status}`;
  }
}

// The data of each server-sent event of a streamed body.
async function* sseData(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    // joined before normalising, so a CRLF split across two reads is still one line end
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("api-key").value);
  $("key-form").hidden = true;
}

document.addEventListener("DOMContentLoaded", () => {
  $("chat-form").addEventListener("submit", send);
  $("chat-stop").addEventListener("click", () => running && running.abort());
  $("chat-clear").addEventListener("click", () => { history.length = 0; $("chat-log").replaceChildren(); });
  $("key-form").addEventListener("submit", useKey);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  poll();
});
