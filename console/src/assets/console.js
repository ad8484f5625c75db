// leasehold console: renders the frames the server sends (server-sent events, ten a second)
// and sends the actions. No framework, no build step. The token lives in the input field
// only: never a cookie, never storage.
//
// Every action names what it acts on: the first click arms its button with a question that
// says exactly what (a job and its lease, the quarantined slots, the capacity from and to),
// a second, separate click (not the rest of a double-click or of a held key, and half a second
// or more later) sends that, and nothing else; an armed button whose target changes (its lane
// passed to another job, another slot quarantined) disarms. The server refuses an action whose target
// has changed since (CONSOLE_TARGET_CHANGED). Each answer shows next to the button that asked.
"use strict";

const $ = (sel) => document.querySelector(sel);
let actionsOn = false;
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

// A stable code with a break opportunity after each underscore, so that a narrow column
// breaks it between its words ("LEASE_BODY_" / "FAILED"), never inside one.
function setCode(node, code) {
  if (node.dataset.text === code) return;
  node.dataset.text = code;
  const parts = code.split(/(?<=_)/);
  node.replaceChildren(...parts.flatMap((p, i) => (i < parts.length - 1 ? [p, el("wbr")] : [p])));
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

// ---- confirming, and the answers next to their buttons ------------------------------------

// Long enough to read the question; the target is checked at every frame meanwhile.
const ARM_MS = 10000;
// How long after arming a click starts to confirm: the second click of a double-click, or a
// click this soon, cannot have read the question. Then `data-ready` is set.
const SETTLE_MS = 500;

// Whether the key down now is held (auto-repeating): each repeat of Enter on a button clicks
// it again, and one held press must not arm and then, once ready, confirm.
let keyHeld = false;
window.addEventListener("keydown", (event) => { keyHeld = event.repeat; }, true);
window.addEventListener("keyup", () => { keyHeld = false; }, true);
window.addEventListener("blur", () => { keyHeld = false; });

// A first click arms the button for ARM_MS with a question that names `target` (a string that
// identifies exactly what the action acts on); a later, separate click on the same target acts.
// `event` is the click: the rest of a multi-click (`detail` > 1; a key gives 0) or of a held key
// (a click of `detail` 0 from an auto-repeated key press) neither arms nor acts, and a click
// before the button is ready leaves it armed, asking.
function confirmThen(button, target, question, action, event) {
  if (event.detail > 1 || (event.detail === 0 && keyHeld)) return;
  if (button.dataset.armed === "true" && button.dataset.target === target) {
    if (button.dataset.ready !== "true") return;
    disarm(button);
    action();
    return;
  }
  disarm(button);
  button.dataset.armed = "true";
  button.dataset.target = target;
  button.dataset.label = button.textContent;
  button.textContent = question;
  button.armTimer = setTimeout(() => disarm(button), ARM_MS);
  button.readyTimer = setTimeout(() => { button.dataset.ready = "true"; }, SETTLE_MS);
}

function disarm(button) {
  clearTimeout(button.armTimer);
  clearTimeout(button.readyTimer);
  if (button.dataset.armed === "true" && button.dataset.label) button.textContent = button.dataset.label;
  button.dataset.armed = "false";
  delete button.dataset.target;
  delete button.dataset.ready;
}

// Disarms a button armed for another target than `target` (what it would act on now).
function disarmUnless(button, target) {
  if (button.dataset.armed === "true" && button.dataset.target !== target) disarm(button);
}

// Shows an answer in `out`, the output element next to the button that asked.
function answer(out, text, { status = "", code = "", ok } = {}) {
  out.textContent = text;
  out.dataset.status = String(status);
  out.dataset.code = code;
  if (ok === undefined) delete out.dataset.ok; else out.dataset.ok = String(ok);
  delete out.dataset.requested;
  delete out.dataset.ended;
  clearTimeout(out.clearTimer);
}

// Sends an action; its answer (or refusal) goes to `out`. `done(reply)` words a success.
// Resolves to the reply of a success, else null.
async function act(action, body, out, done) {
  const token = $("#token").value;
  const headers = { "Content-Type": "application/json" };
  if (token) headers["Authorization"] = "Bearer " + token;
  answer(out, `${action}…`);
  let status = 0;
  let reply = null;
  try {
    const res = await fetch("api/actions/" + action, {
      method: "POST", headers, body: JSON.stringify(body), credentials: "omit", cache: "no-store",
    });
    status = res.status;
    reply = await res.json();
  } catch (e) {
    answer(out, `${action}: ${e}`, { status: 0, ok: false });
    return null;
  }
  if (reply.error) {
    const e = reply.error;
    answer(out, `${action}: ${status} ${e.code} — ${e.message}` + (e.cause ? ` (${e.cause})` : ""),
      { status, code: e.code, ok: false });
    return null;
  }
  answer(out, `${action}: ${status} OK — ${done(reply)}`, { status, code: "OK", ok: true });
  return reply;
}

// ---- cancel ------------------------------------------------------------------------------

// The cancels asked for, until the job's end shows in the outcomes: a cancel is a request,
// and its answer says so until the job has really ended. Keyed by the answer's element.
const pendingCancels = new Map();

async function cancel(target, out) {
  const body = { job_id: target.job };
  if (target.lease !== undefined) body.lease_id = target.lease;
  const since = lastNow;
  const what = target.lease !== undefined ? `${target.job} (lease ${target.lease})` : target.job;
  const reply = await act("cancel", body, out, () => `cancel requested for ${what}; waiting for it to end`);
  if (!reply) return;
  pendingCancels.set(out, { job: reply.job_id, lease: target.lease, since });
  out.dataset.requested = reply.job_id;
  out.dataset.ended = "";
}

// The outcome of each cancel asked for, once the job's end is in the outcomes.
function settleCancels(rows) {
  for (const [out, p] of pendingCancels) {
    const row = rows.find((o) => o.job_id === p.job && o.at_ms >= p.since &&
      (p.lease === undefined || o.lease_id === null || o.lease_id === p.lease));
    if (!row) continue;
    const ended = row.label || row.code || "code not reported";
    out.textContent = out.textContent.replace(/; waiting for it to end$|; it ended: .*$/, `; it ended: ${ended}`);
    out.dataset.ended = row.code || "unknown";
    // An end observed before the embedder recorded its result: its code may follow.
    if (row.code) {
      pendingCancels.delete(out);
      // A lane's answer goes after a while: the lane shows another job by then.
      if (out.classList.contains("lane-result")) out.clearTimer = setTimeout(() => answer(out, ""), 20000);
    }
  }
}

// What a typed job id names now, from the lanes of the latest frame: its lease when it holds
// exactly one, else every job of that id (waiting, or several leases).
function typedTarget(job) {
  const leases = lastFrame ? lastFrame.lanes.map((l) => l.lease).filter((l) => l && l.job_id === job) : [];
  const unique = [...new Map(leases.map((l) => [l.lease_id, l])).values()];
  if (unique.length === 1) {
    const l = unique[0];
    return { job, lease: l.lease_id, key: `${job}#${l.lease_id}`,
      question: `Confirm: cancel ${job} (lease ${l.lease_id} on slot ${l.slots.join(", ")})?` };
  }
  const where = unique.length > 1 ? `all ${unique.length} leases of it` : "it holds no slot now";
  return { job, key: `${job}#${unique.map((l) => l.lease_id).join(",")}`,
    question: `Confirm: cancel every job named ${job} (${where})?` };
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
  const button = el("button", "lane-cancel", "cancel");
  button.type = "button";
  button.hidden = true;
  const out = el("output", "action-result lane-result");
  out.setAttribute("aria-live", "polite");
  button.addEventListener("click", (event) => {
    // The job and lease the lane shows at this click: the confirmation names them, and the
    // second click sends them, whatever the lane shows by then (a lane that changes hands
    // disarms its button first: see renderLanes).
    const job = lane.dataset.job;
    const lease = Number(lane.dataset.lease);
    if (!job || !Number.isFinite(lease)) return;
    confirmThen(button, `${job}#${lease}`, `Confirm: cancel ${job} (lease ${lease})?`,
      () => cancel({ job, lease }, out), event);
  });
  lane.querySelector(".lane-actions").append(button);
  lane.append(out);
  lanes.append(lane);
  return lane;
}

function renderLanes(lanes) {
  const keep = new Set();
  for (const { slot, lease } of lanes) {
    keep.add(String(slot));
    const lane = laneFor(slot);
    const button = lane.querySelector(".lane-cancel");
    if (!lease) {
      setData(lane, "phase", "idle");
      setData(lane, "color", "idle");
      setData(lane, "job", undefined);
      setData(lane, "lease", undefined);
      setText(lane.querySelector(".holder"), "");
      setText(lane.querySelector(".phase"), "free");
      setText(lane.querySelector(".held"), "");
      setText(lane.querySelector(".waits"), "");
      disarmUnless(button, "");
      setHidden(button, true);
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
    // Armed for the lane's previous holder (or its cancel no longer offered): disarmed.
    disarmUnless(button, offer ? `${lease.job_id}#${lease.lease_id}` : "");
    setHidden(button, !offer);
  }
  for (const lane of [...$("#lanes").children]) {
    if (!keep.has(lane.dataset.slot)) lane.remove();
  }
}

// ---- timeline ----------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

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
    const svg = svgEl("svg", { viewBox: `0 0 ${span} 10`, preserveAspectRatio: "none" });
    for (const seg of bySlot.get(slot) || []) {
      const x = Math.max(seg.from_ms, from) - from;
      const w = Math.max(seg.to_ms - Math.max(seg.from_ms, from), span / 500);
      const r = svgEl("rect", { x, y: 0, width: w, height: 10, class: seg.color });
      r.append(svgEl("title", {}, `${seg.holder}: ${seg.color}, ${secs(seg.to_ms - seg.from_ms)}`));
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

// ---- queue, quarantine -------------------------------------------------------------------

// Keeps a table's rows in step with `items` without rebuilding them: a row per key, reused
// from frame to frame, and a cell's text set only when it changed, so that a selection or a
// tooltip in the table survives the updates. A cell whose class is "code" is set as a code.
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
    cells.forEach(([cls, text, title], i) => {
      const td = tr.children[i];
      if (cls === "code") setCode(td, text);
      else if (td.textContent !== text) td.textContent = text;
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
  setHidden($("#waiters"), waiters.length === 0);
}

function queueSearch() {
  return $("#queue-search").value.trim();
}

const SEARCH_ROWS = 25;

async function searchQueue() {
  const q = queueSearch();
  if (!q) return;
  try {
    const res = await fetch(`api/queue?limit=${SEARCH_ROWS}&q=` + encodeURIComponent(q), { cache: "no-store", credentials: "omit" });
    const reply = await res.json();
    fillWaiters(reply.rows);
    $("#queue-found").textContent = `${reply.rows.length} of the ${reply.listed} listed match “${q}”` +
      (reply.rows.length === SEARCH_ROWS ? " (the first shown)" : "");
  } catch (e) { /* the connection state says why */ }
}

function renderQuarantine(rows) {
  syncRows($("#quarantine tbody"), rows, (q) => q.lease_id,
    (q) => [[null, String(q.slot)], ["job", q.job_id || "explicit lease"], [null, String(q.lease_id)],
      ["reason", q.reason || "(asking the supervisor…)"]],
    (tr, q) => { tr.dataset.lease = String(q.lease_id); tr.dataset.slot = String(q.slot); });
  setHidden($("#quarantine-empty"), rows.length > 0);
  // Reclaim: offered while a slot is quarantined; armed for the slots it named.
  const offer = actionsOn && rows.length > 0;
  setHidden($("#reclaim-row"), !offer && !$("#reclaim-result").textContent);
  setHidden($("#reclaim-btn"), !offer);
  disarmUnless($("#reclaim-btn"), offer ? reclaimTarget(rows).key : "");
}

function reclaimTarget(rows) {
  const ids = [...new Set(rows.map((q) => q.lease_id))].sort((a, b) => a - b);
  const slots = [...new Set(rows.map((q) => q.slot))].sort((a, b) => a - b);
  const what = slots.length === 1 ? `slot ${slots[0]}` : `slots ${slots.join(", ")}`;
  return { ids, key: ids.join(","), question: `Confirm: reclaim ${what} (lease ${ids.join(", ")})?` };
}

function renderGpu(devices) {
  setHidden($("#gpu-section"), devices.length === 0);
  syncRows($("#gpu tbody"), devices, (d) => d.index,
    (d) => [["num", String(d.index) + (d.adopted ? " (the engine's)" : "")], [null, `${d.adapter} · ${d.backend}`],
      ["num", `${d.in_use} of ${d.sub_slots}`], ["num", String(d.fence_waits)],
      ["detail", (d.given_up ? "given up" : d.lost ? "lost: " + d.lost : "ok") + (d.recreated ? ` · re-created ${d.recreated}×` : "")]],
    (tr, d) => { tr.dataset.device = String(d.index); tr.dataset.lost = String(!!d.lost); });
}

// ---- history, in pages, and a job's detail -----------------------------------------------

const PAGE_ROWS = 25;
let historyRows = [];
let historyVersion = -1;
let historyAsked = false;
let historyAgain = false;
// The page shown: the rows older than `cursor` (null: the newest rows, live); the cursors of
// the newer pages, to go back.
let cursor = null;
const newerCursors = [];

function ended(o) {
  // The phase its lease was last sampled in before it left the table.
  return o.last_phase ? `ended while ${o.last_phase}` : "";
}

function outcomeCells(o, now) {
  const detail = [o.note, o.detail, ended(o), o.code === null ? "code not reported" : ""].filter(Boolean).join(" · ");
  const codeTitle = o.code === null ? "code not reported: the embedder did not record this job's result"
    : o.label ? `the embedder's label; code ${o.code}` : "";
  return [["num", secs(now - o.at_ms) + " ago"], ["job", o.job_id],
    ["code", o.label || o.code || "ended", codeTitle],
    ["num", o.slot === null ? "–" : String(o.slot)], ["num", secs(o.held_ms)], ["detail", detail]];
}

function renderHistory(now) {
  syncRows($("#outcomes tbody"), historyRows, (o) => o.seq, (o) => outcomeCells(o, now),
    (tr, o) => {
      tr.dataset.job = o.job_id;
      tr.tabIndex = 0;
      setData(tr.querySelector(".code"), "ok", o.code === null ? "unknown" : String(o.code === "OK"));
      setData(tr.querySelector(".code"), "label", o.label || undefined);
    });
  setHidden($("#outcomes-empty"), historyRows.length > 0);
}

async function fetchHistory() {
  if (historyAsked) { historyAgain = true; return; }
  historyAsked = true;
  const code = $("#history-code").value.trim();
  const q = $("#history-search").value.trim();
  try {
    let url = `api/history?limit=${PAGE_ROWS}&code=${encodeURIComponent(code)}&q=${encodeURIComponent(q)}`;
    if (cursor !== null) url += `&before=${cursor}`;
    const res = await fetch(url, { cache: "no-store", credentials: "omit" });
    const page = await res.json();
    historyRows = page.rows;
    const first = page.newer + 1;
    const last = page.newer + page.rows.length;
    const range = page.rows.length ? `rows ${first}–${last} of ${page.matched}` : `none of ${page.matched}`;
    $("#history-range").textContent = !page.total ? ""
      : (code || q) ? `${range} matching (${page.total} job ends kept)` : `${range} job ends`;
    $("#history-older").disabled = last >= page.matched;
    $("#history-newer").disabled = cursor === null;
    $("#history-newest").disabled = cursor === null;
    renderHistory(lastNow);
    const open = $("#detail");
    if (open.open && open.dataset.seq) {
      const row = historyRows.find((o) => String(o.seq) === open.dataset.seq);
      if (row) fillDetail(row);
    }
  } catch (e) { /* the connection state says why */ }
  historyAsked = false;
  if (historyAgain) { historyAgain = false; fetchHistory(); }
}

function toPage(next) {
  if (next === "older" && historyRows.length) {
    newerCursors.push(cursor);
    cursor = historyRows[historyRows.length - 1].seq;
  } else if (next === "newer") {
    cursor = newerCursors.length ? newerCursors.pop() : null;
  } else {
    cursor = null;
    newerCursors.length = 0;
  }
  fetchHistory();
}

function fillDetail(o) {
  const box = $("#detail");
  box.dataset.seq = String(o.seq);
  box.dataset.job = o.job_id;
  const t = o.timings;
  const rows = [["job", o.job_id], ["code", o.code || "not reported"]];
  if (o.label) rows.push(["label", o.label]);
  if (o.note) rows.push(["note", o.note]);
  rows.push(["slot", o.slot === null ? "–" : String(o.slot)]);
  if (t) {
    rows.push(["lease", `${t.lease_id} (${t.kind}${t.gpu_device !== null ? `, GPU device ${t.gpu_device}` : ""})`]);
    rows.push(["waited", t.waited_ms === null ? "not seen waiting" : "at least " + secs(t.waited_ms)]);
    const drain = t.draining_ms ?? t.releasing_ms ?? t.ended_ms;
    rows.push(["ran", secs(drain - t.started_ms)]);
    if (t.draining_ms !== null) rows.push(["drained", secs((t.releasing_ms ?? t.ended_ms) - t.draining_ms)]);
    for (const [proof, at] of t.proofs) rows.push(["· " + proof, "done " + secs(at - drain) + " into the drain"]);
    if (t.releasing_ms !== null) rows.push(["released", secs(t.ended_ms - t.releasing_ms)]);
    if (o.last_phase) rows.push(["ended", `while ${o.last_phase} (the phase its lease was last sampled in)`]);
  } else {
    rows.push(["lease", o.lease_id !== null ? `${o.lease_id} (as the embedder said; too short for the console to sample)`
      : "not seen by the console (too short, or it never got a slot)"]);
  }
  const e = o.errors || {};
  if (e.acquire) rows.push(["acquire error", e.acquire]);
  if (e.prepare) rows.push(["prepare error", e.prepare]);
  if (e.body) rows.push(["body error", e.body]);
  if (e.cleanup) rows.push(["cleanup error", e.cleanup]);
  $("#detail dl").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", null, k), el("dd", null, v)]));
}

// The detail opens as a dialog over the page, where the user is looking, not below the list.
function showDetail(o) {
  const box = $("#detail");
  if (!o) { if (box.open) box.close(); return; }
  fillDetail(o);
  if (!box.open) box.showModal();
}

// ---- actions -----------------------------------------------------------------------------

const MAX_RESIZE = 4096;

// The resize the field asks for, from the capacity shown: a whole number of slots in
// 1..=MAX_RESIZE, or why not (nothing is sent then).
function resizeTarget() {
  const typed = $("#resize-slots").value.trim();
  if (typed === "") return { why: "type the number of slots first" };
  if (!/^[0-9]+$/.test(typed) || Number(typed) < 1 || Number(typed) > MAX_RESIZE) {
    return { why: `“${typed}” is not a whole number of slots from 1 to ${MAX_RESIZE}` };
  }
  const n = Number(typed);
  const from = lastFrame ? lastFrame.stats.capacity : null;
  if (from === n) return { why: `the capacity is ${n} already` };
  const was = from === null ? "" : `from ${from} `;
  return { n, from, key: `${from}->${n}`, question: `Confirm: resize ${was}to ${n} slots?` };
}

function wireActions() {
  const cancelBtn = $("#cancel-btn");
  const cancelOut = $("#cancel-result");
  cancelBtn.addEventListener("click", (event) => {
    const job = $("#cancel-job").value.trim();
    if (!job) { disarm(cancelBtn); answer(cancelOut, "cancel: type a job id first", { ok: false }); return; }
    const target = typedTarget(job);
    confirmThen(cancelBtn, target.key, target.question, () => cancel(target, cancelOut), event);
  });
  $("#cancel-job").addEventListener("input", () => disarm(cancelBtn));

  const reclaimBtn = $("#reclaim-btn");
  reclaimBtn.addEventListener("click", (event) => {
    const rows = lastFrame ? lastFrame.quarantined : [];
    if (!rows.length) return;
    const target = reclaimTarget(rows);
    confirmThen(reclaimBtn, target.key, target.question, () =>
      act("reclaim", { lease_ids: target.ids }, $("#reclaim-result"),
        (r) => `${r.reclaimed.length} reclaimed, ${r.still_quarantined.length} still quarantined` +
          r.still_quarantined.map((q) => ` · slot ${q.slot}: ${q.reason}`).join("")), event);
  });

  const resizeBtn = $("#resize-btn");
  const resizeOut = $("#resize-result");
  resizeBtn.addEventListener("click", (event) => {
    const target = resizeTarget();
    if (target.why) { disarm(resizeBtn); answer(resizeOut, "resize: " + target.why, { ok: false }); return; }
    const body = { slots: target.n };
    if (target.from !== null) body.from = target.from;
    confirmThen(resizeBtn, target.key, target.question, () =>
      act("resize", body, resizeOut, (r) => `capacity ${r.capacity}`), event);
  });
  $("#resize-slots").addEventListener("input", () => disarm(resizeBtn));
}

// Disarms the typed cancel and the resize when what they would act on changed.
function renderActions(frame) {
  setHidden($("#actions"), !frame.actions);
  // Offered only where it can work: the supervisor's in-process pool.
  setHidden($("#resize-row"), !(frame.actions && frame.resizable));
  const cancelBtn = $("#cancel-btn");
  if (cancelBtn.dataset.armed === "true") {
    const job = $("#cancel-job").value.trim();
    disarmUnless(cancelBtn, job ? typedTarget(job).key : "");
  }
  const resizeBtn = $("#resize-btn");
  if (resizeBtn.dataset.armed === "true") disarmUnless(resizeBtn, resizeTarget().key || "");
}

// ---- the stream --------------------------------------------------------------------------

let paused = false;
// The frame the page shows (what an action's confirmation names), and the latest heard.
let lastFrame = null;
let latestFrame = null;

function render(frame) {
  latestFrame = frame;
  if (!paused) lastFrame = frame;
  settleCancels(frame.outcomes);
  // Counted in a variable, not an attribute: an attribute on <body> would make the browser
  // recheck the style of the whole page every frame.
  window.consoleFrames = (window.consoleFrames || 0) + 1;
  if (paused) return;
  lastNow = frame.now_ms;
  actionsOn = frame.actions;
  setHidden($("#exposed"), !frame.exposed);
  setText($("#clock"), "console up " + secs(frame.now_ms));
  renderStats(frame.stats);
  renderActions(frame);
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

// Each chart: its key, title, note, the series (a key of the data, and its legend), and how a
// value is written.
const count = (v) => String(v);
const CHARTS = [
  ["throughput", "throughput", "jobs ended per second", [["throughput", "ends / s"]], count],
  ["queue", "queue depth", "the deepest the queue was in the second", [["queue", "callers waiting"]], count],
  ["wait", "wait", "of the jobs granted in the second, as the queue listing showed it",
    [["wait_p50_ms", "p50"], ["wait_p99_ms", "p99"]], secs],
  ["drain", "drain", "from the body's end to the release, of the jobs that ended in the second",
    [["drain_p99_ms", "p99"]], secs],
];

// The chart's drawing area, in the SVG's own units (it scales with the page's width).
const CW = 320, CH = 128, CL = 44, CR = 10, CT = 18, CB = 18, MAX_SPAN_S = 300;

// How far back a chart goes: five minutes, or less while the console is younger (a minute at
// least, whole minutes beyond), so that a young console's values are not squeezed against
// "now"; and its time ticks.
function timeAxis(c) {
  const span = Math.min(MAX_SPAN_S, Math.max(60, Math.ceil(c.now_s / 60) * 60));
  const ticks = span === 60 ? [60, 45, 30, 15, 0].map((s) => [s, s === 0 ? "now" : `−${s} s`])
    : [...Array(span / 60 + 1).keys()].reverse().map((m) => [m * 60, m === 0 ? "now" : `−${m} min`]);
  return { span, ticks };
}

function chartFor(key, title, note) {
  let box = document.querySelector(`.chart[data-chart="${key}"]`);
  if (box) return box;
  box = el("figure", "chart");
  box.dataset.chart = key;
  const svg = svgEl("svg", { viewBox: `0 0 ${CW} ${CH}`, role: "img",
    "aria-label": `${title}, per second, the last five minutes` });
  const caption = el("figcaption");
  caption.append(el("span", "chart-title", title), el("span", "chart-now"), el("span", "note", " · " + note));
  box.append(caption, svg);
  $("#charts").append(box);
  return box;
}

// 1, 2 or 5 times a power of ten, at least `v` (at least 1).
function niceMax(v) {
  if (!(v > 1)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// Draws one chart: a time axis (the last five minutes, "now" at the right: the last second
// that has ended), a y scale from 0 to a round maximum, a legend, each series as lines, and a
// value with no neighbour as a dot, so that a lone value is seen.
function drawChart(svg, c, series, fmt) {
  svg.replaceChildren();
  const lastS = c.now_s - 1;
  const { span, ticks: timeTicks } = timeAxis(c);
  const x = (s) => CL + ((s - (lastS - span)) / span) * (CW - CL - CR);
  const all = series.flatMap(([values]) => values.filter((v) => v !== null));
  // At least 1 of a count, 1 s of a time: an empty chart still has a readable scale.
  const max = niceMax(Math.max(fmt === count ? 1 : 1000, ...all));
  const y = (v) => CT + (1 - v / max) * (CH - CT - CB);
  svg.dataset.nowS = String(lastS);
  svg.dataset.max = String(max);
  // The y scale: 0, the middle (when a count can be that) and the maximum.
  const ticks = Number.isInteger(max / 2) ? [0, max / 2, max] : [0, max];
  for (const t of ticks) {
    svg.append(svgEl("line", { class: t === 0 ? "axis" : "grid", x1: CL, x2: CW - CR, y1: y(t), y2: y(t) }));
    svg.append(svgEl("text", { class: "y-tick", x: CL - 4, y: y(t) + 3, "text-anchor": "end" }, fmt(t)));
  }
  // The time axis, "now" at the right.
  svg.append(svgEl("line", { class: "axis", x1: CL, x2: CL, y1: CT, y2: CH - CB }));
  timeTicks.forEach(([ago, label], i) => {
    const at = x(lastS - ago);
    const anchor = i === 0 ? "start" : i === timeTicks.length - 1 ? "end" : "middle";
    svg.append(svgEl("line", { class: "grid", x1: at, x2: at, y1: CH - CB, y2: CH - CB + 3 }));
    svg.append(svgEl("text", { class: "x-tick", x: at, y: CH - 4, "text-anchor": anchor }, label));
  });
  // The legend, top right: a line in the series' colour, then its name.
  const widths = series.map(([, label]) => label.length * 5 + 22);
  let lx = CW - CR - widths.reduce((a, b) => a + b, 0);
  series.forEach(([, label], i) => {
    svg.append(svgEl("line", { class: `key series-${i}`, x1: lx + 6, x2: lx + 18, y1: 8, y2: 8 }));
    svg.append(svgEl("text", { class: "key", x: lx + 21, y: 11 }, label));
    lx += widths[i];
  });
  // The series: runs of values as lines, a lone value as a dot.
  series.forEach(([values], i) => {
    let run = [];
    const flush = () => {
      if (run.length === 1) {
        svg.append(svgEl("circle", { class: `series-${i} lone`, cx: run[0][0], cy: run[0][1], r: 2.5 }));
      } else if (run.length > 1) {
        svg.append(svgEl("polyline", { class: `series-${i}`, points: run.map((p) => p.join(",")).join(" ") }));
      }
      run = [];
    };
    values.forEach((v, k) => {
      // Older than the axis (a console younger than five minutes shows less): left out.
      if (v === null || c.from_s + k < lastS - span) { flush(); return; }
      run.push([x(c.from_s + k).toFixed(1), y(v).toFixed(1)]);
    });
    flush();
  });
  return all.length;
}

function renderCharts(c) {
  for (const [key, title, note, defs, fmt] of CHARTS) {
    const box = chartFor(key, title, note);
    const series = defs.map(([k, label]) => [c[k], label]);
    const points = drawChart(box.querySelector("svg"), c, series, fmt);
    // "now": the last second that has ended (the second in progress has not counted all of
    // its ends yet).
    const now = series.map(([values, label]) => {
      const v = values.length ? values[values.length - 1] : null;
      return (series.length > 1 ? label + " " : "") + (v === null ? "–" : fmt(v));
    });
    setText(box.querySelector(".chart-now"), " · now " + now.join(", "));
    box.dataset.points = String(points);
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
    if (!paused && latestFrame) render(latestFrame);
  });
  let typing = null;
  const later = (f) => () => { clearTimeout(typing); typing = setTimeout(f, 250); };
  const refilter = () => { cursor = null; newerCursors.length = 0; fetchHistory(); };
  $("#history-code").addEventListener("input", later(refilter));
  $("#history-search").addEventListener("input", later(refilter));
  $("#history-older").addEventListener("click", () => toPage("older"));
  $("#history-newer").addEventListener("click", () => toPage("newer"));
  $("#history-newest").addEventListener("click", () => toPage("newest"));
  $("#queue-search").addEventListener("input", later(() => {
    $("#queue-found").textContent = "";
    if (queueSearch()) searchQueue(); else if (lastFrame) fillWaiters(lastFrame.queue.waiters);
  }));
  const rowOf = (ev) => {
    const tr = ev.target.closest("tr");
    return tr && historyRows.find((o) => String(o.seq) === tr.dataset.key);
  };
  $("#outcomes tbody").addEventListener("click", (ev) => { const o = rowOf(ev); if (o) showDetail(o); });
  $("#outcomes tbody").addEventListener("keydown", (ev) => {
    const o = rowOf(ev);
    if (o && ev.key === "Enter") showDetail(o);
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
