// leasehold console: renders the frames the server sends (server-sent events, ten a second)
// and sends the actions. No framework, no build step. The token lives in the input field
// only: never a cookie, never storage.
"use strict";

const $ = (sel) => document.querySelector(sel);
let actionsOn = false;
// A cancel the console asked for, until the job's end shows in the outcomes: a cancel is a
// request, and the page says so until the job has really ended.
let pendingCancel = null;
let lastNow = 0;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function secs(ms) {
  if (ms === null || ms === undefined) return "–";
  const s = ms / 1000;
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  return m + " min " + Math.floor(s - m * 60) + " s";
}

// ---- stats -------------------------------------------------------------------------------

const STATS = [
  ["capacity", "capacity"], ["held_slots", "slots held"], ["active", "active"],
  ["draining", "draining"], ["waiting", "waiting"], ["quarantined", "quarantined"],
  ["acquired_total", "acquired"], ["released_total", "released"],
  ["release_failed_total", "release failed"], ["orphan_expired_total", "orphans expired"],
];

function renderStats(stats) {
  const dl = $("#stats");
  if (!dl.childElementCount) {
    for (const [key, label] of STATS) {
      const d = el("div");
      d.dataset.stat = key;
      d.append(el("dt", null, label), el("dd"));
      dl.append(d);
    }
  }
  for (const [key] of STATS) {
    const v = stats[key];
    dl.querySelector(`[data-stat="${key}"] dd`).textContent = v === null ? "?" : String(v);
  }
}

// ---- lanes -------------------------------------------------------------------------------

function laneFor(slot) {
  const lanes = $("#lanes");
  let lane = lanes.querySelector(`.lane[data-slot="${slot}"]`);
  if (lane) return lane;
  lane = el("div", "lane");
  lane.dataset.slot = String(slot);
  lane.append(el("span", "slot", "slot " + slot), el("span", "holder"), el("span", "phase"),
    el("span", "held"), el("span", "waits"), el("span", "lane-actions"));
  const cancel = el("button", "lane-cancel", "cancel");
  cancel.type = "button";
  cancel.hidden = true;
  cancel.addEventListener("click", () => {
    if (lane.dataset.job) act("cancel", { job_id: lane.dataset.job });
  });
  lane.querySelector(".lane-actions").append(cancel);
  lanes.append(lane);
  return lane;
}

function renderLanes(lanes) {
  const keep = new Set();
  for (const { slot, lease } of lanes) {
    keep.add(String(slot));
    const lane = laneFor(slot);
    const cancel = lane.querySelector(".lane-cancel");
    if (!lease) {
      lane.dataset.phase = "idle";
      lane.dataset.color = "idle";
      delete lane.dataset.job;
      delete lane.dataset.lease;
      lane.querySelector(".holder").textContent = "";
      lane.querySelector(".phase").textContent = "free";
      lane.querySelector(".held").textContent = "";
      lane.querySelector(".waits").textContent = "";
      cancel.hidden = true;
      continue;
    }
    lane.dataset.phase = lease.phase;
    lane.dataset.color = lease.color;
    lane.dataset.lease = String(lease.lease_id);
    if (lease.job_id) lane.dataset.job = lease.job_id; else delete lane.dataset.job;
    const holder = lease.job_id ? lease.job_id : "explicit lease";
    lane.querySelector(".holder").textContent = holder;
    lane.querySelector(".holder").title = `lease ${lease.lease_id}, ${lease.kind}, priority ${lease.priority}` +
      (lease.slots.length > 1 ? `, slots ${lease.slots.join(", ")}` : "") +
      (lease.gpu_device !== null ? `, GPU device ${lease.gpu_device}` : "");
    lane.querySelector(".phase").textContent = lease.phase;
    lane.querySelector(".held").textContent = secs(lease.held_ms);
    let waits;
    if (lease.phase === "quarantined") {
      waits = "reason: " + (lease.reason || "(asking the supervisor…)");
    } else if (lease.waiting_for.length && lease.phase === "running") {
      waits = "its release will wait for " + lease.waiting_for.join(", then ");
    } else if (lease.waiting_for.length) {
      waits = "release waits for " + lease.waiting_for.join(", then ");
    } else {
      waits = lease.kind === "explicit" ? "held by its owner" : "body running";
    }
    if (lease.priority !== "normal") waits += ` · ${lease.priority} priority`;
    if (lease.child_pids.length) waits += ` · pids ${lease.child_pids.join(", ")}`;
    lane.querySelector(".waits").textContent = waits;
    cancel.hidden = !(actionsOn && lease.job_id && (lease.phase === "running" || lease.phase === "draining"));
  }
  for (const lane of [...$("#lanes").children]) {
    if (!keep.has(lane.dataset.slot)) lane.remove();
  }
}

// ---- timeline ----------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function renderTimeline(tl, lanes, now) {
  const box = $("#timeline");
  box.replaceChildren();
  // The last minute once the console has been up that long; until then, its whole life (at
  // least 5 s), so that a young console's bars are not squeezed against "now".
  const span = Math.min(tl.window_ms, Math.max(now, 5000));
  const from = now - span;
  const bySlot = new Map(tl.lanes.map((l) => [l.slot, l.segments]));
  const slots = [...new Set([...lanes.map((l) => l.slot), ...tl.lanes.map((l) => l.slot)])].sort((a, b) => a - b);
  for (const slot of slots) {
    const row = el("div", "tl-row");
    row.dataset.slot = String(slot);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${span} 10`);
    svg.setAttribute("preserveAspectRatio", "none");
    for (const seg of bySlot.get(slot) || []) {
      const x = Math.max(seg.from_ms, from) - from;
      const w = Math.max(seg.to_ms - Math.max(seg.from_ms, from), span / 500);
      const r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", String(x));
      r.setAttribute("y", "0");
      r.setAttribute("width", String(w));
      r.setAttribute("height", "10");
      r.setAttribute("class", seg.color);
      const t = document.createElementNS(SVG, "title");
      t.textContent = `${seg.holder}: ${seg.color}, ${secs(seg.to_ms - seg.from_ms)}`;
      r.append(t);
      svg.append(r);
    }
    row.append(el("span", "slot", "slot " + slot), svg);
    box.append(row);
  }
  const scale = el("div", "tl-scale");
  const ticks = el("span");
  ticks.append(el("span", null, "−" + Math.round(span / 1000) + " s"), el("span", null, "now"));
  scale.append(el("span"), ticks);
  box.append(scale);
}

// ---- queue, quarantine, outcomes ---------------------------------------------------------

function renderQueue(queue) {
  $("#queue").textContent = queue.waiting === 0 ? "No caller waits for a slot."
    : queue.waiting === 1 ? "1 caller waits for a slot." : `${queue.waiting} callers wait for a slot.`;
  $("#queue").dataset.waiting = String(queue.waiting);
  // In the order they are served; heard from the supervisor about once a second.
  const body = $("#waiters tbody");
  body.replaceChildren();
  queue.waiters.forEach((w, i) => {
    const tr = el("tr");
    tr.dataset.job = w.job_id || "";
    tr.dataset.priority = w.priority;
    const slots = w.gathered > 0 ? `${w.gathered} of ${w.slots}` : String(w.slots);
    tr.append(el("td", "num", String(i + 1)), el("td", "job", w.job_id || "explicit lease"),
      el("td", "priority", w.priority), el("td", "num", slots), el("td", "num", secs(w.waited_ms)));
    body.append(tr);
  });
  $("#waiters").hidden = queue.waiters.length === 0;
}

function renderQuarantine(rows) {
  const body = $("#quarantine tbody");
  body.replaceChildren();
  for (const q of rows) {
    const tr = el("tr");
    tr.dataset.lease = String(q.lease_id);
    tr.dataset.slot = String(q.slot);
    tr.append(el("td", null, String(q.slot)), el("td", "job", q.job_id || "explicit lease"),
      el("td", null, String(q.lease_id)), el("td", "reason", q.reason || "(asking the supervisor…)"));
    body.append(tr);
  }
  $("#quarantine-empty").hidden = rows.length > 0;
}

function renderOutcomes(rows, now) {
  const body = $("#outcomes tbody");
  body.replaceChildren();
  for (const o of rows) {
    const tr = el("tr");
    tr.dataset.job = o.job_id;
    const code = el("td", "code", o.code || "ended");
    code.dataset.ok = o.code === null ? "unknown" : String(o.code === "OK");
    if (o.code === null) code.title = "code not reported: the embedder did not record this job's result";
    let detail = o.detail || "";
    if (o.last_phase) detail = (detail ? detail + " · " : "") + "last seen " + o.last_phase;
    if (o.code === null) detail = (detail ? detail + " · " : "") + "code not reported";
    tr.append(el("td", "num", secs(now - o.at_ms) + " ago"), el("td", "job", o.job_id), code,
      el("td", "num", o.slot === null ? "–" : String(o.slot)), el("td", "num", secs(o.held_ms)),
      el("td", "detail", detail));
    body.append(tr);
  }
  $("#outcomes-empty").hidden = rows.length > 0;
}

// ---- actions -----------------------------------------------------------------------------

async function act(action, body) {
  const out = $("#action-result");
  const token = $("#token").value;
  const headers = { "Content-Type": "application/json" };
  if (token) headers["Authorization"] = "Bearer " + token;
  out.textContent = `${action}…`;
  out.dataset.status = "";
  out.dataset.code = "";
  let status = 0;
  let answer = null;
  try {
    const res = await fetch("api/actions/" + action, {
      method: "POST", headers, body: JSON.stringify(body), credentials: "omit", cache: "no-store",
    });
    status = res.status;
    answer = await res.json();
  } catch (e) {
    out.textContent = `${action}: ${e}`;
    out.dataset.status = "0";
    out.dataset.ok = "false";
    return;
  }
  const code = answer.error ? answer.error.code : "OK";
  out.dataset.status = String(status);
  out.dataset.code = code;
  out.dataset.ok = String(!answer.error);
  let text = `${action}: ${status} ${code}`;
  if (answer.error) text += ` — ${answer.error.message}` + (answer.error.cause ? ` (${answer.error.cause})` : "");
  else if (action === "resize") text += ` — capacity ${answer.capacity}`;
  else if (action === "reclaim") text += ` — ${answer.reclaimed.length} reclaimed, ${answer.still_quarantined.length} still quarantined`;
  else if (action === "cancel") {
    text += ` — cancel requested for ${answer.job_id}; waiting for it to end`;
    pendingCancel = { job: answer.job_id, since: lastNow, text };
    out.dataset.requested = answer.job_id;
    out.dataset.ended = "";
  }
  out.textContent = text;
}

// The outcome of a cancel asked for: once the job's end is in the outcomes.
function settleCancel(rows) {
  if (!pendingCancel) return;
  const row = rows.find((o) => o.job_id === pendingCancel.job && o.at_ms >= pendingCancel.since);
  if (!row) return;
  const out = $("#action-result");
  const ended = row.code || "code not reported";
  out.textContent = pendingCancel.text.replace("; waiting for it to end", `; it ended: ${ended}`);
  out.dataset.ended = row.code || "unknown";
  // An end observed before the embedder recorded its result: its code may follow.
  if (row.code) pendingCancel = null;
}

function wireActions() {
  $("#cancel-btn").addEventListener("click", () => act("cancel", { job_id: $("#cancel-job").value.trim() }));
  $("#reclaim-btn").addEventListener("click", () => act("reclaim", {}));
  $("#resize-btn").addEventListener("click", () => {
    const typed = $("#resize-slots").value.trim();
    if (typed === "") {
      // Never a value the user did not type (an empty field is not 0).
      const out = $("#action-result");
      out.textContent = "resize: type the number of slots first";
      out.dataset.status = "";
      out.dataset.code = "";
      return;
    }
    const n = Number(typed);
    act("resize", { slots: Number.isInteger(n) ? n : -1 });
  });
}

// ---- the stream --------------------------------------------------------------------------

function render(frame) {
  actionsOn = frame.actions;
  $("#exposed").hidden = !frame.exposed;
  $("#actions").hidden = !frame.actions;
  $("#clock").textContent = "console up " + secs(frame.now_ms);
  renderStats(frame.stats);
  renderLanes(frame.lanes);
  renderTimeline(frame.timeline, frame.lanes, frame.now_ms);
  renderQueue(frame.queue);
  renderQuarantine(frame.quarantined);
  renderOutcomes(frame.outcomes, frame.now_ms);
  settleCancel(frame.outcomes);
  lastNow = frame.now_ms;
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

// ---- the connection: the event stream, or polling the snapshot when the stream is refused ---

const POLL_MS = 1000;
const STREAM_RETRY_MS = 5000;
let source = null;
let pollTimer = null;
let retryTimer = null;

function setConn(state, text) {
  const conn = $("#conn");
  conn.dataset.state = state;
  conn.textContent = text;
}

// Disconnected: what the page shows is the last thing it heard, not a fact. The "nothing
// here" notes would claim an empty quarantine or no outcome; they go, and the page says why.
function markStale() {
  document.body.dataset.stale = "true";
  for (const id of ["#quarantine-empty", "#outcomes-empty"]) $(id).hidden = true;
  $("#queue").textContent = "Unknown while disconnected.";
  $("#stale").hidden = false;
}

function fresh() {
  document.body.dataset.stale = "false";
  $("#stale").hidden = true;
}

// The stream was refused for good (the browser does not retry a 429, the stream cap): the
// page polls the snapshot instead, and tries the stream again now and then.
function startPolling() {
  if (pollTimer) return;
  setConn("polling", "polling (live stream unavailable)");
  const poll = async () => {
    try {
      const res = await fetch("api/snapshot", { cache: "no-store", credentials: "omit" });
      if (!res.ok) throw new Error(String(res.status));
      const frame = await res.json();
      if (pollTimer) setConn("polling", "polling (live stream unavailable)");
      fresh();
      render(frame);
    } catch (e) {
      setConn("lost", "connection lost, retrying…");
      markStale();
    }
  };
  poll();
  pollTimer = setInterval(poll, POLL_MS);
}

function stopPolling() {
  if (pollTimer) clearInterval(pollTimer);
  pollTimer = null;
}

function connect() {
  retryTimer = null;
  source = new EventSource("api/events");
  source.onopen = () => {
    stopPolling();
    setConn("live", "live");
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      source.close();
      startPolling();
      if (!retryTimer) retryTimer = setTimeout(connect, STREAM_RETRY_MS);
    } else if (!pollTimer) {
      // The browser reconnects by itself.
      setConn("lost", "connection lost, retrying…");
      markStale();
    }
  };
  source.onmessage = (msg) => {
    fresh();
    render(JSON.parse(msg.data));
  };
}

wireActions();
connect();
