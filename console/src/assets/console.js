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

// Sets a node's text (or a data attribute) only when it changed: an unchanged page costs the
// browser no style or layout work.
function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function setHidden(node, hidden) {
  if (node.hidden !== hidden) node.hidden = hidden;
}

function setData(node, key, value) {
  if (value === undefined) {
    if (key in node.dataset) delete node.dataset[key];
  } else if (node.dataset[key] !== value) {
    node.dataset[key] = value;
  }
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
    setText(dl.querySelector(`[data-stat="${key}"] dd`), v === null ? "?" : String(v));
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
    const job = lane.dataset.job;
    if (job) confirmThen(cancel, `confirm cancel of ${job}?`, () => act("cancel", { job_id: job }));
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
      setData(lane, "phase", "idle");
      setData(lane, "color", "idle");
      setData(lane, "job", undefined);
      setData(lane, "lease", undefined);
      setText(lane.querySelector(".holder"), "");
      setText(lane.querySelector(".phase"), "free");
      setText(lane.querySelector(".held"), "");
      setText(lane.querySelector(".waits"), "");
      if (!cancel.hidden) cancel.hidden = true;
      continue;
    }
    setData(lane, "phase", lease.phase);
    setData(lane, "color", lease.color);
    setData(lane, "lease", String(lease.lease_id));
    setData(lane, "job", lease.job_id || undefined);
    const holder = lease.job_id ? lease.job_id : "explicit lease";
    setText(lane.querySelector(".holder"), holder);
    const title = `lease ${lease.lease_id}, ${lease.kind}, priority ${lease.priority}` +
      (lease.slots.length > 1 ? `, slots ${lease.slots.join(", ")}` : "") +
      (lease.gpu_device !== null ? `, GPU device ${lease.gpu_device}` : "");
    if (lane.querySelector(".holder").title !== title) lane.querySelector(".holder").title = title;
    setText(lane.querySelector(".phase"), lease.phase);
    setText(lane.querySelector(".held"), secs(lease.held_ms));
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
    setText(lane.querySelector(".waits"), waits);
    const offer = !!(actionsOn && lease.job_id && (lease.phase === "running" || lease.phase === "draining"));
    if (cancel.hidden === offer) cancel.hidden = !offer;
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

// Keeps a table's rows in step with `items` without rebuilding them: a row per key, reused
// from frame to frame, and a cell's text set only when it changed, so that a selection or a
// tooltip in the table survives the updates.
function syncRows(tbody, items, keyOf, cellsOf, decorate) {
  const old = new Map([...tbody.children].map((tr) => [tr.dataset.key, tr]));
  let at = 0;
  for (const item of items) {
    const key = String(keyOf(item));
    let tr = old.get(key);
    const cells = cellsOf(item);
    if (!tr) {
      tr = el("tr");
      tr.dataset.key = key;
      for (const [cls] of cells) tr.append(el("td", cls));
    }
    old.delete(key);
    cells.forEach(([, text, title], i) => {
      const td = tr.children[i];
      if (td.textContent !== text) td.textContent = text;
      if (title !== undefined && td.title !== title) td.title = title;
    });
    if (decorate) decorate(tr, item);
    if (tbody.children[at] !== tr) tbody.insertBefore(tr, tbody.children[at] || null);
    at += 1;
  }
  for (const tr of old.values()) tr.remove();
}

function renderQueue(queue) {
  const q = $("#queue");
  let text = queue.waiting === 0 ? "No caller waits for a slot."
    : queue.waiting === 1 ? "1 caller waits for a slot." : `${queue.waiting} callers wait for a slot.`;
  if (queue.listed_count > queue.waiters.length) text += ` The first ${queue.waiters.length} are listed; search for the others.`;
  setText(q, text);
  setData(q, "waiting", String(queue.waiting));
  if (queueSearch()) return; // the search's answer is what the table shows
  fillWaiters(queue.waiters);
}

function fillWaiters(waiters) {
  // In the order they are served; heard from the supervisor about once a second.
  syncRows($("#waiters tbody"), waiters.map((w, i) => ({ ...w, place: i + 1 })),
    (w) => `${w.place}:${w.job_id}`,
    (w) => [["num", String(w.place)], ["job", w.job_id || "explicit lease"], ["priority", w.priority],
      ["num", w.gathered > 0 ? `${w.gathered} of ${w.slots}` : String(w.slots)], ["num", secs(w.waited_ms)]],
    (tr, w) => { tr.dataset.job = w.job_id || ""; tr.dataset.priority = w.priority; });
  $("#waiters").hidden = waiters.length === 0;
}

function queueSearch() {
  return $("#queue-search").value.trim();
}

async function searchQueue() {
  const q = queueSearch();
  if (!q) return;
  try {
    const res = await fetch("api/queue?limit=50&q=" + encodeURIComponent(q), { cache: "no-store", credentials: "omit" });
    const answer = await res.json();
    fillWaiters(answer.rows);
    $("#queue-found").textContent = `${answer.rows.length} of the ${answer.listed} listed match “${q}”`;
  } catch (e) { /* the connection state says why */ }
}

function renderQuarantine(rows) {
  syncRows($("#quarantine tbody"), rows, (q) => q.lease_id,
    (q) => [[null, String(q.slot)], ["job", q.job_id || "explicit lease"], [null, String(q.lease_id)],
      ["reason", q.reason || "(asking the supervisor…)"]],
    (tr, q) => { tr.dataset.lease = String(q.lease_id); tr.dataset.slot = String(q.slot); });
  $("#quarantine-empty").hidden = rows.length > 0;
}

function renderGpu(devices) {
  $("#gpu-section").hidden = devices.length === 0;
  syncRows($("#gpu tbody"), devices, (d) => d.index,
    (d) => [["num", String(d.index) + (d.adopted ? " (the engine's)" : "")], [null, `${d.adapter} · ${d.backend}`],
      ["num", `${d.in_use} of ${d.sub_slots}`], ["num", String(d.fence_waits)],
      ["detail", (d.given_up ? "given up" : d.lost ? "lost: " + d.lost : "ok") + (d.recreated ? ` · re-created ${d.recreated}×` : "")]],
    (tr, d) => { tr.dataset.device = String(d.index); tr.dataset.lost = String(!!d.lost); });
}

// ---- history and a job's detail ----------------------------------------------------------

let historyRows = [];
let historyVersion = -1;
let historyAsked = false;

function outcomeCells(o, now) {
  let detail = o.detail || "";
  if (o.last_phase) detail = (detail ? detail + " · " : "") + "last seen " + o.last_phase;
  if (o.code === null) detail = (detail ? detail + " · " : "") + "code not reported";
  return [["num", secs(now - o.at_ms) + " ago"], ["job", o.job_id],
    ["code", o.code || "ended", o.code === null ? "code not reported: the embedder did not record this job's result" : ""],
    ["num", o.slot === null ? "–" : String(o.slot)], ["num", secs(o.held_ms)], ["detail", detail]];
}

function renderHistory(now) {
  syncRows($("#outcomes tbody"), historyRows, (o) => `${o.at_ms}:${o.job_id}`, (o) => outcomeCells(o, now),
    (tr, o) => {
      tr.dataset.job = o.job_id;
      tr.tabIndex = 0;
      tr.querySelector(".code").dataset.ok = o.code === null ? "unknown" : String(o.code === "OK");
    });
  $("#outcomes-empty").hidden = historyRows.length > 0;
}

async function fetchHistory() {
  if (historyAsked) return;
  historyAsked = true;
  const code = $("#history-code").value.trim();
  const q = $("#history-search").value.trim();
  try {
    const res = await fetch(`api/history?limit=200&code=${encodeURIComponent(code)}&q=${encodeURIComponent(q)}`,
      { cache: "no-store", credentials: "omit" });
    const answer = await res.json();
    historyRows = answer.rows;
    $("#history-count").textContent = (code || q)
      ? `${answer.rows.length} of ${answer.total} job ends match`
      : `the newest ${answer.rows.length} of ${answer.total} job ends`;
    renderHistory(lastNow);
    const open = $("#detail").dataset.key;
    if (open) showDetail(historyRows.find((o) => `${o.at_ms}:${o.job_id}` === open));
  } catch (e) { /* the connection state says why */ }
  historyAsked = false;
}

function showDetail(o) {
  const box = $("#detail");
  if (!o) { box.hidden = true; delete box.dataset.key; return; }
  box.dataset.key = `${o.at_ms}:${o.job_id}`;
  box.dataset.job = o.job_id;
  const t = o.timings;
  const rows = [["job", o.job_id], ["code", o.code || "not reported"], ["slot", o.slot === null ? "–" : String(o.slot)]];
  if (t) {
    rows.push(["lease", `${t.lease_id} (${t.kind}${t.gpu_device !== null ? `, GPU device ${t.gpu_device}` : ""})`]);
    rows.push(["waited", t.waited_ms === null ? "not seen waiting" : "at least " + secs(t.waited_ms)]);
    const drain = t.draining_ms ?? t.releasing_ms ?? t.ended_ms;
    rows.push(["ran", secs(drain - t.started_ms)]);
    if (t.draining_ms !== null) rows.push(["drained", secs((t.releasing_ms ?? t.ended_ms) - t.draining_ms)]);
    for (const [proof, at] of t.proofs) rows.push(["· " + proof, "done " + secs(at - drain) + " into the drain"]);
    if (t.releasing_ms !== null) rows.push(["released", secs(t.ended_ms - t.releasing_ms)]);
  } else {
    rows.push(["lease", "not seen by the console (too short, or it never got a slot)"]);
  }
  const e = o.errors || {};
  if (e.acquire) rows.push(["acquire error", e.acquire]);
  if (e.body) rows.push(["body error", e.body]);
  if (e.cleanup) rows.push(["cleanup error", e.cleanup]);
  const dl = $("#detail dl");
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", null, k), el("dd", null, v)]));
  box.hidden = false;
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

// A first click arms the button for 4 s and asks to confirm; the second click acts.
function confirmThen(button, question, action) {
  if (button.dataset.armed === "true") {
    disarm(button);
    action();
    return;
  }
  button.dataset.armed = "true";
  button.dataset.label = button.textContent;
  button.textContent = question;
  button.armTimer = setTimeout(() => disarm(button), 4000);
}

function disarm(button) {
  clearTimeout(button.armTimer);
  button.dataset.armed = "false";
  if (button.dataset.label) button.textContent = button.dataset.label;
}

function wireActions() {
  const cancelBtn = $("#cancel-btn");
  cancelBtn.addEventListener("click", () => {
    const job = $("#cancel-job").value.trim();
    confirmThen(cancelBtn, `Confirm: cancel ${job}?`, () => act("cancel", { job_id: job }));
  });
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

let paused = false;
let lastFrame = null;

function render(frame) {
  lastFrame = frame;
  settleCancel(frame.outcomes);
  lastNow = frame.now_ms;
  // Counted in a variable, not an attribute: an attribute on <body> would make the browser
  // recheck the style of the whole page every frame.
  window.consoleFrames = (window.consoleFrames || 0) + 1;
  if (paused) return;
  actionsOn = frame.actions;
  setHidden($("#exposed"), !frame.exposed);
  setHidden($("#actions"), !frame.actions);
  setHidden($("#reclaim-btn"), !frame.actions);
  // Offered only where it can work: the supervisor's in-process pool.
  setHidden($("#resize-row"), !frame.resizable);
  setText($("#clock"), "console up " + secs(frame.now_ms));
  renderStats(frame.stats);
  renderLanes(frame.lanes);
  renderQueue(frame.queue);
  renderQuarantine(frame.quarantined);
  renderGpu(frame.gpu);
  if (frame.history !== historyVersion) {
    historyVersion = frame.history;
    fetchHistory();
  } else {
    renderHistory(frame.now_ms);
  }
}

// ---- charts: per second, the last five minutes --------------------------------------------

const CHARTS = [
  ["throughput", "throughput", "jobs ended / s", (v) => String(v)],
  ["queue", "queue depth", "callers waiting", (v) => String(v)],
  ["wait", "wait p50 / p99", "as the queue listing showed it", (v) => secs(v)],
  ["drain_p99_ms", "drain p99", "from the body's end to the release", (v) => secs(v)],
];

function chartFor(key, title, note) {
  let box = document.querySelector(`.chart[data-chart="${key}"]`);
  if (box) return box;
  box = el("figure", "chart");
  box.dataset.chart = key;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 300 40");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `${title}, per second, the last five minutes`);
  const caption = el("figcaption");
  caption.append(el("span", "chart-title", title), el("span", "chart-now"), el("span", "note", " " + note));
  box.append(caption, svg);
  $("#charts").append(box);
  return box;
}

// A line per series over 300 seconds, scaled to the highest value; a second without a value
// breaks the line.
function drawLines(svg, series, max) {
  svg.replaceChildren();
  series.forEach((values, i) => {
    const offset = 300 - values.length;
    let points = [];
    const flush = () => {
      if (points.length) {
        const line = document.createElementNS(SVG, "polyline");
        line.setAttribute("points", points.join(" "));
        line.setAttribute("class", "series-" + i);
        svg.append(line);
      }
      points = [];
    };
    values.forEach((v, x) => {
      if (v === null) { flush(); return; }
      points.push(`${offset + x},${(40 - (v / max) * 38).toFixed(1)}`);
    });
    flush();
  });
}

function renderCharts(c) {
  for (const [key, title, note, fmt] of CHARTS) {
    const box = chartFor(key, title, note);
    const series = key === "wait" ? [c.wait_p50_ms, c.wait_p99_ms] : [c[key]];
    const all = series.flat().filter((v) => v !== null);
    const max = Math.max(1, ...all);
    drawLines(box.querySelector("svg"), series, max);
    const last = series.map((s) => s.filter((v) => v !== null).at(-1));
    box.querySelector(".chart-now").textContent =
      " now " + last.map((v) => (v === undefined ? "–" : fmt(v))).join(" / ") + ", max " + fmt(max);
    box.dataset.points = String(all.length);
  }
}

async function fetchTimeline() {
  if (paused || document.body.dataset.stale === "true" || !lastFrame) return;
  try {
    const res = await fetch("api/timeline", { cache: "no-store", credentials: "omit" });
    if (!res.ok) return;
    const tl = await res.json();
    renderTimeline(tl, lastFrame.lanes, tl.now_ms);
    renderCharts(tl.charts);
  } catch (e) { /* the connection state says why */ }
}

function wireView() {
  const pause = $("#pause");
  pause.addEventListener("click", () => {
    paused = !paused;
    pause.textContent = paused ? "Resume" : "Pause";
    pause.setAttribute("aria-pressed", String(paused));
    document.body.dataset.paused = String(paused);
    if (!paused && lastFrame) render(lastFrame);
  });
  let typing = null;
  const later = (f) => () => { clearTimeout(typing); typing = setTimeout(f, 250); };
  $("#history-code").addEventListener("input", later(fetchHistory));
  $("#history-search").addEventListener("input", later(fetchHistory));
  $("#queue-search").addEventListener("input", later(() => {
    $("#queue-found").textContent = "";
    if (queueSearch()) searchQueue(); else if (lastFrame) fillWaiters(lastFrame.queue.waiters);
  }));
  $("#outcomes tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr");
    if (tr) showDetail(historyRows.find((o) => `${o.at_ms}:${o.job_id}` === tr.dataset.key));
  });
  $("#outcomes tbody").addEventListener("keydown", (ev) => {
    const tr = ev.target.closest("tr");
    if (tr && ev.key === "Enter") showDetail(historyRows.find((o) => `${o.at_ms}:${o.job_id}` === tr.dataset.key));
  });
  $("#detail-close").addEventListener("click", () => showDetail(null));
  setInterval(fetchTimeline, 1000);
  setInterval(() => { if (queueSearch() && !paused) searchQueue(); }, 1000);
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
  setData(document.body, "stale", "false");
  setHidden($("#stale"), true);
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
wireView();
connect();
