// potluck status page: plain JavaScript, no libraries, no build step.
//
// Data comes from the coordinator's snapshot (GET api/v1/state, schema in state.schema.json):
// live over Server-Sent Events (api/v1/events) with polling as the fallback. Peer names are
// volunteers' text: everything is written with textContent, never parsed as HTML.
// Past 200 peers the snapshot holds only the most telling ones (peers_summary.truncated): the table
// then asks the server for the page it shows (GET api/v1/peers, sorted and filtered there), one
// request at a time, again whenever a new snapshot arrives.
// Times in the snapshot are on the coordinator's clock; ages shown here are computed from the
// snapshot plus the local time elapsed since it arrived, so a skewed browser clock does not matter.
"use strict";

(function () {
  const POLL_MS = 2000;          // polling period when the live stream is unavailable
  const FETCH_TIMEOUT_MS = 5000;
  const STREAM_SILENCE_MS = 15000; // the server pings every 5 s; longer silence means a broken stream
  const STALE_S = 15;            // the coordinator rebuilds its snapshot every tick; this long unchanged is suspicious
  const STATES = ["training", "syncing", "recovering", "joining", "waiting", "finished", "left", "failed", "refused", "lost"];
  const GONE = new Set(["lost", "left", "finished", "failed", "refused"]);

  const $ = (id) => document.getElementById(id);
  const page = {
    // performance.now() (ms since navigation started) when the first state arrived, its peers table was
    // filled in, and everything was drawn; renderMs: how long drawing the latest state took
    state: null, lastGenerated: null, changedAt: 0, renders: 0, renderMs: null,
    firstMessageMs: null, firstTableMs: null, firstRenderMs: null,
    mode: "connecting", lostSince: null, lastError: "", stream: null, streamFailures: 0, lastMessageAt: 0,
    pollTimer: null, sortKey: null, sortDir: 1, pageNo: 0, pageSize: 50, filter: "", eventsKey: "",
    lastSeenCells: [], sizes: {},
    // server-side paging (a truncated snapshot): the rows of the last answer, the query it answered, one in flight
    remote: false, remoteRows: [], remoteTotal: 0, remoteQuery: null, remoteBusy: false, remoteAgain: false,
    prefetched: null, // {query, answer}: the first page, fetched while the first state loads
  };
  window.potluck = page; // for tests and the curious

  // ------------------------------------------------------------------ formatting

  function si(n, digits) {
    if (n === null || n === undefined || !isFinite(n)) return "–";
    const a = Math.abs(n);
    const units = [[1e12, " T"], [1e9, " G"], [1e6, " M"], [1e3, " k"]];
    for (const [v, u] of units) if (a >= v) return (n / v).toFixed(digits === undefined ? 2 : digits) + u;
    return a >= 100 || Number.isInteger(n) ? String(Math.round(n)) : n.toFixed(digits === undefined ? 1 : digits);
  }
  function bytes(n) {
    if (n === null || n === undefined || !isFinite(n)) return "–";
    const units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i === 0 ? String(Math.round(n)) : n.toFixed(n >= 100 ? 0 : 1)) + " " + units[i];
  }
  function num(x, d) { return x === null || x === undefined || !isFinite(x) ? "–" : Number(x).toFixed(d); }
  function ago(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    s = Math.max(0, s);
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    if (s < 172800) return (s / 3600).toFixed(1) + " h ago";
    return Math.round(s / 86400) + " d ago";
  }
  function within(s) {  // a wait, as a person reads it (the coordinator's horizons.clock)
    if (s < 90) return Math.round(s) + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " days";
  }
  function horizonText(h) {
    if (!h || h.next_step_in_s === null || h.next_step_in_s === undefined) return "";
    const next = h.overdue_s > 0 ? "next step " + within(h.overdue_s) + " late" : "next step in ~" + within(h.next_step_in_s);
    return next + " · run ends in ~" + within(h.end_in_s) + " (a step takes ~" + within(h.outer_step_s) + ")";
  }
  function duration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
    return (s / 60).toFixed(1) + " min";
  }
  function clock(t) {
    const d = new Date(t * 1000), two = (n) => String(n).padStart(2, "0");
    return two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds());
  }
  function sumValues(obj) { let s = 0; for (const k in obj || {}) s += Number(obj[k]) || 0; return s; }
  function byKind(obj) { return Object.keys(obj || {}).sort().map((k) => k + " " + bytes(obj[k])).join(", ") || "none"; }
  function stateClass(s) { return "s-" + (STATES.includes(s) || s === "empty" ? s : "other"); }
  let palette = null; // read once: style recalculation right after DOM writes is expensive
  function cssVar(name) {
    if (!palette) palette = getComputedStyle(document.documentElement);
    return palette.getPropertyValue(name).trim() || "#888";
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function setText(id, text) { const e = $(id); if (e.textContent !== text) e.textContent = text; }

  // Seconds elapsed on the coordinator's clock since the snapshot was built.
  function sinceSnapshot() { return page.changedAt ? (Date.now() - page.changedAt) / 1000 : 0; }
  function nowOnCoordinator() { return page.state ? page.state.generated_at + sinceSnapshot() : Date.now() / 1000; }

  // ------------------------------------------------------------------ charts

  function niceTicks(lo, hi, count) {
    const span = hi - lo || Math.abs(hi) || 1;
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return ticks;
  }

  // Ticks for unix-time axes: whole seconds, minutes or hours, about `count` of them.
  function timeTicks(lo, hi, count) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    const step = steps.find((s) => (hi - lo) / s <= count) || 86400 * Math.ceil((hi - lo) / count / 86400);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) ticks.push(v);
    return ticks;
  }

  // Draws line series on a canvas and returns the number of data points drawn.
  // opts: {series: [{label, color, points: [[x, y]], dash}], hlines: [{y, label, color}],
  //        xfmt(v, span), yfmt, time (x is unix time), zero (y axis starts at 0), empty (text when nothing to draw),
  //        xtitle (what the x axis counts, under its ticks)}
  function drawChart(canvas, opts) {
    const dpr = window.devicePixelRatio || 1;
    const size = page.sizes[canvas.id] || [canvas.clientWidth, canvas.clientHeight];
    const w = size[0] || 400, h = size[1] || 200;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    const fg = cssVar("--fg"), muted = cssVar("--muted"), line = cssVar("--line");

    const series = opts.series.map((s) => ({
      ...s, points: s.points.filter((p) => p[1] !== null && p[1] !== undefined && isFinite(p[0]) && isFinite(p[1])),
    }));
    const hlines = (opts.hlines || []).filter((l) => l.y !== null && l.y !== undefined && isFinite(l.y));
    let n = 0, x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const s of series) for (const [x, y] of s.points) {
      n++; x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
    }
    canvas.dataset.points = String(n);
    if (!n) {
      ctx.fillStyle = muted;
      ctx.textAlign = "center";
      ctx.fillText(opts.empty || "no data yet", w / 2, h / 2);
      return 0;
    }
    for (const l of hlines) { y0 = Math.min(y0, l.y); y1 = Math.max(y1, l.y); }
    if (opts.zero) y0 = Math.min(0, y0);
    if (y1 === y0) { y1 += Math.abs(y1) * 0.1 || 1; if (!opts.zero) y0 -= Math.abs(y0) * 0.1 || 1; }
    const pad = (y1 - y0) * 0.06;
    y1 += pad; if (!(opts.zero && y0 === 0)) y0 -= pad;
    if (x1 === x0) { x0 -= 1; x1 += 1; }

    const yfmt = opts.yfmt || ((v) => si(v)), xfmt = opts.xfmt || ((v) => String(v));
    const xn = Math.max(2, Math.floor(w / 90));
    const yt = niceTicks(y0, y1, 4), xt = opts.time ? timeTicks(x0, x1, xn) : niceTicks(x0, x1, xn);
    const left = 8 + Math.max(...yt.map((v) => ctx.measureText(yfmt(v)).width));
    const top = 20, right = 10, bottom = opts.xtitle ? 30 : 18;
    const X = (x) => left + (x - x0) / (x1 - x0) * (w - left - right);
    const Y = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);

    ctx.strokeStyle = line; ctx.fillStyle = muted; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (const v of yt) {
      if (v < y0 || v > y1) continue;
      ctx.beginPath(); ctx.moveTo(left, Y(v) + 0.5); ctx.lineTo(w - right, Y(v) + 0.5); ctx.stroke();
      ctx.fillText(yfmt(v), left - 4, Y(v));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const v of xt) if (v >= x0 && v <= x1) ctx.fillText(xfmt(v, x1 - x0), X(v), h - bottom + 4);
    if (opts.xtitle) { ctx.fillText(opts.xtitle, (left + w - right) / 2, h - 13); }

    for (const l of hlines) {
      ctx.save(); ctx.setLineDash([4, 4]); ctx.strokeStyle = l.color || muted;
      ctx.beginPath(); ctx.moveTo(left, Y(l.y)); ctx.lineTo(w - right, Y(l.y)); ctx.stroke(); ctx.restore();
      ctx.fillStyle = l.color || muted; ctx.textAlign = "right"; ctx.textBaseline = "bottom";
      ctx.fillText(l.label, w - right, Y(l.y) - 2);
    }
    for (const s of series) {
      if (!s.points.length) continue;
      const pts = s.points.slice().sort((a, b) => a[0] - b[0]);
      ctx.save();
      ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 1.8;
      if (s.dash) ctx.setLineDash([5, 3]);
      ctx.beginPath();
      pts.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
      ctx.stroke();
      if (pts.length < 2 || pts.length <= 40) {
        for (const [x, y] of pts) { ctx.beginPath(); ctx.arc(X(x), Y(y), 2.2, 0, 2 * Math.PI); ctx.fill(); }
      }
      ctx.restore();
    }
    // legend
    let lx = left;
    ctx.textAlign = "left"; ctx.textBaseline = "middle";
    for (const s of series.concat(hlines.map((l) => ({ label: l.label, color: l.color || muted, dash: true })))) {
      if (!s.label || (s.points && !s.points.length)) continue;
      ctx.save(); ctx.strokeStyle = s.color; ctx.lineWidth = 2; if (s.dash) ctx.setLineDash([4, 2]);
      ctx.beginPath(); ctx.moveTo(lx, 8); ctx.lineTo(lx + 14, 8); ctx.stroke(); ctx.restore();
      ctx.fillStyle = fg; ctx.fillText(s.label, lx + 18, 8);
      lx += 28 + ctx.measureText(s.label).width;
    }
    return n;
  }

  // ------------------------------------------------------------------ header

  function renderHeader(s) {
    const r = s.run, m = r.model || {};
    setText("run-id", r.run_id);
    $("run-id").title = "coordinator " + r.coordinator + (r.join_address ? "\njoin: " + r.join_address : "");
    $("finished").hidden = !r.finished;
    $("insecure").hidden = r.security !== "insecure";
    setText("st-outer", r.outer_step + " / " + r.outer_steps_total);
    $("st-progress").style.width = (r.outer_steps_total ? Math.min(100, 100 * r.outer_step / r.outer_steps_total) : 0) + "%";
    setText("st-inner", r.finished ? "all outer steps committed" : "inner step " + r.inner_step + " / " + r.inner_steps_per_outer
      + (r.window_s ? " · window " + num(r.window_s, 1) + " s" : ""));
    setText("st-horizon", r.finished ? "" : horizonText(r.horizon));
    $("st-inner").title = "each member trains as many inner steps as fit the round's window (the fastest member's " +
      r.inner_steps_per_outer + "), its update weighed by the samples it trained on";
    setText("st-params", si(m.parameters));
    setText("st-model", ["parameters", m.family && m.family !== "tiny" && m.family, m.n_layers && m.n_layers + " layers", m.d_model && "d " + m.d_model,
      m.seq_len && "seq " + m.seq_len].filter(Boolean).join(" · "));
    setText("st-grid", r.stages + " × " + r.replicas);
    const sum = s.peers_summary;
    const counts = sum ? sum.by_state : {};
    if (!sum) for (const p of s.peers) counts[p.state] = (counts[p.state] || 0) + 1;
    const live = sum ? sum.live : s.peers.filter((p) => !GONE.has(p.state)).length;
    const known = sum ? sum.total : s.peers.length;
    setText("st-peers", live + " live");
    setText("st-peers-sub", (counts.lost ? counts.lost + " lost · " : "") + known + " known");
    setText("st-tokens", si(r.tokens_trained));
    const d = r.data || {};
    setText("st-tps", si(r.tokens_per_s) + " tokens/s" + (d.epoch !== null && d.epoch !== undefined
      ? " · data epoch " + num(d.epoch, 2) : "") + (d.pool ? " · " + si(d.pool) + " samples to re-issue" : ""));
    setText("st-loss", num(r.loss, 3));
    let ev = "eval " + num(r.eval_loss, 3);
    if (r.loss_floor !== null && r.loss_floor !== undefined) {
      ev += " · floor " + num(r.loss_floor, 2);
      if (r.eval_loss !== null && r.eval_loss !== undefined) ev += " (+" + num(r.eval_loss - r.loss_floor, 2) + ")";
    }
    if (r.eval_perplexity !== null && r.eval_perplexity !== undefined) ev += " · ppl " + num(r.eval_perplexity, r.eval_perplexity < 100 ? 2 : 0);
    setText("st-eval", ev);
    setText("st-util", r.compute_utilization === null || r.compute_utilization === undefined
      ? "–" : (100 * r.compute_utilization).toFixed(1) + " %");
    const join = !r.finished && r.join_address;
    $("join").hidden = !join;
    setText("join-cmd", join ? "potluck peer --join " + r.join_address : "");
    setText("join-notes", !join ? "" : [r.admission === "private" && "a private run: potluck peer also needs --token, with the token its operator hands out",
      r.data && r.data.source === "bytes" && "a run on a text file: potluck peer also needs --data-path, with your copy of it"].filter(Boolean).join("; "));
    const ex = r.model_export || {};
    $("model-howto").hidden = !r.finished;
    setText("model-howto-text", !r.finished ? "" : ex.version
      ? "The run is finished. Get its model (v" + ex.version + ", the newest checkpoint) on the coordinator's machine:"
      : "The run is finished, but it kept no checkpoint to export (coordinator.checkpoint_every = 0): its peers held the model.");
    setText("model-cmd", r.finished && ex.version ? ex.command : "");
    const waiting = $("waiting");
    waiting.hidden = !r.waiting_reason;
    setText("waiting", r.waiting_reason ? "Waiting: " + r.waiting_reason : "");
  }

  // Texts that age between snapshots: refreshed every second.
  function renderAges() {
    const s = page.state;
    if (!s) return;
    const r = s.run;
    setText("st-last-outer", r.last_outer_at ? ago(nowOnCoordinator() - r.last_outer_at) : "none yet");
    setText("st-allreduce", r.last_allreduce_s !== null && r.last_allreduce_s !== undefined
      ? "all-reduce " + duration(r.last_allreduce_s) : "no all-reduce yet");
    const timeout = (s.config || {}).heartbeat_timeout_s || Infinity;
    for (const [td, p] of page.lastSeenCells) {
      const seen = p.last_seen_s + sinceSnapshot();
      const stale = seen > timeout && !(p.state === "finished" || p.state === "left"); // gone by saying so: not overdue
      td.textContent = ago(seen);
      td.classList.toggle("stale", stale);
      td.parentElement.dataset.stale = String(stale);
    }
  }

  // ------------------------------------------------------------------ charts from the snapshot

  function renderCharts(s) {
    const hist = s.history || [], series = s.series || [];
    const lossPts = hist.map((h) => [h.step, h.loss]), evalPts = hist.map((h) => [h.step, h.eval_loss]);
    const c = $("loss-chart");
    drawChart(c, {
      series: [{ label: "loss", color: cssVar("--c1"), points: lossPts },
               { label: "eval loss", color: cssVar("--c2"), points: evalPts }],
      hlines: [{ y: s.run.loss_floor, label: "floor", color: cssVar("--floor") }],
      xfmt: (v) => String(v), xtitle: "outer step (the model version it made)", yfmt: (v) => v.toFixed(2),
      empty: "no outer step finished yet",
    });
    c.dataset.lossPoints = String(lossPts.filter((p) => p[1] !== null).length);
    c.dataset.evalPoints = String(evalPts.filter((p) => p[1] !== null).length);
    setText("loss-hint", hist.length ? hist.length + " outer steps" : "");

    const tfmt = (t, span) => (span < 600 ? clock(t) : clock(t).slice(0, 5));
    drawChart($("tokens-chart"), {
      series: [{ label: "tokens/s", color: cssVar("--c3"), points: hist.map((h) => [h.step, h.tokens_per_s]) }],
      xfmt: (v) => String(v), xtitle: "outer step", zero: true, empty: "no two outer steps yet",
    });
    drawChart($("peers-chart"), {
      series: [{ label: "live peers", color: cssVar("--c4"), points: series.map((p) => [p.t, p.live_peers]) }],
      xfmt: tfmt, time: true, xtitle: "clock time (the coordinator's)", yfmt: (v) => (Number.isInteger(v) ? String(v) : ""),
      zero: true, empty: "no samples yet",
    });

    const colours = { activations: cssVar("--c1"), gradients: cssVar("--c2"), outer: cssVar("--c3") };
    const kinds = [];
    for (const h of hist) for (const k in h.bytes || {}) if (h.bytes[k] > 0 && !kinds.includes(k)) kinds.push(k);
    const bs = [], hints = [];
    for (const k of kinds) {
      const colour = colours[k] || cssVar("--c4");
      bs.push({ label: k, color: colour, points: hist.map((h) => [h.step, (h.bytes || {})[k] || null]) });
      bs.push({ label: "", color: colour, dash: true, points: hist.map((h) => [h.step, (h.bytes_fp32 || {})[k] || null]) });
      const last = hist.filter((h) => (h.bytes || {})[k] > 0).pop();
      if (last && (last.bytes_fp32 || {})[k]) hints.push(k + " " + (last.bytes_fp32[k] / last.bytes[k]).toFixed(1) + "×");
    }
    drawChart($("bytes-chart"), { series: bs, xfmt: (v) => String(v), xtitle: "outer step", yfmt: bytes, zero: true,
      empty: "nothing sent yet" });
    setText("bytes-hint", "dashed: fp32" + (hints.length ? " · saved " + hints.join(", ") : ""));
  }

  // ------------------------------------------------------------------ tasklet grid

  function renderLegend() {
    const legend = $("legend");
    for (const st of STATES.concat(["empty"])) {
      const item = el("span");
      item.appendChild(el("span", "swatch " + stateClass(st)));
      item.appendChild(document.createTextNode(st === "empty" ? "hole (no peer)" : st));
      legend.appendChild(item);
    }
  }

  function renderGrid(s) {
    const g = s.grid, grid = $("grid");
    const S = g.stages, R = g.replicas;
    const shape = S + "x" + R;
    const byPlace = new Map();
    for (const c of g.cells) byPlace.set(c.stage + ":" + c.replica, c);
    const holes = S * R - g.cells.filter((c) => c.peer && c.stage < S && c.replica < R).length;
    setText("grid-hint", S + " stage" + (S === 1 ? "" : "s") + " × " + R + " replica" + (R === 1 ? "" : "s") +
      (holes > 0 ? " · " + holes + " hole" + (holes === 1 ? "" : "s") : ""));
    const roomy = R <= 16;
    if (grid.dataset.shape !== shape) {
      grid.textContent = "";
      grid.dataset.shape = shape;
      grid.dataset.stages = String(S);
      grid.dataset.replicas = String(R);
      grid.classList.toggle("roomy", roomy);
      grid.style.gridTemplateColumns = "auto repeat(" + R + ", minmax(" + (roomy ? 56 : 10) + "px, 1fr))";
      if (!S || !R) { grid.appendChild(el("p", "empty", "no round decided yet")); return; }
      if (roomy) {
        grid.appendChild(el("span"));
        for (let r = 0; r < R; r++) grid.appendChild(el("span", "col-label", "r" + r));
      }
      for (let st = 0; st < S; st++) {
        grid.appendChild(el("span", "row-label", "stage " + st));
        for (let r = 0; r < R; r++) {
          const cell = el("div", "cell");
          cell.setAttribute("data-testid", "grid-cell");
          cell.dataset.stage = String(st);
          cell.dataset.replica = String(r);
          cell.addEventListener("click", () => {
            if (cell.dataset.peerId) { $("peer-filter").value = cell.dataset.peerId; page.filter = cell.dataset.peerId; page.pageNo = 0; renderPeers(); }
          });
          grid.appendChild(cell);
        }
      }
    }
    for (const cell of grid.querySelectorAll(".cell")) {
      const c = byPlace.get(cell.dataset.stage + ":" + cell.dataset.replica);
      const state = c && c.peer ? c.state : "empty";
      const cls = "cell " + stateClass(state);
      if (cell.className !== cls) cell.className = cls;
      cell.dataset.state = state;
      cell.dataset.peerId = c && c.peer ? c.peer : "";
      const label = c && c.peer ? c.peer.slice(-6) : "";
      cell.textContent = roomy ? (label || "hole") : "";
      cell.title = "stage " + cell.dataset.stage + ", replica " + cell.dataset.replica + ": " +
        (c && c.peer ? c.peer + " (" + state + ")" : "hole: no peer holds this tasklet");
    }
  }

  // ------------------------------------------------------------------ peers table

  const COLUMNS = [
    { key: "short_id", label: "peer", cls: "id", value: (p) => p.short_id, text: (p) => p.short_id, title: (p) => p.id + "\n" + p.address },
    { key: "name", label: "name", value: (p) => p.name, text: (p) => p.name || "–" },
    { key: "device", label: "device", value: (p) => p.memory_gb,
      text: (p) => (p.device_name || p.device) + (p.memory_gb ? " · " + p.memory_gb.toFixed(0) + " GiB" : "") },
    { key: "tasklet", label: "tasklet", value: (p) => (p.tasklet ? p.tasklet.stage * 1e6 + p.tasklet.replica : Infinity),
      text: (p) => (p.tasklet ? p.tasklet.stage + "/" + p.tasklet.replica : "–"), title: () => "stage/replica" },
    { key: "state", label: "state", value: (p) => p.state },
    { key: "last_seen_s", label: "last seen", cls: "num", value: (p) => p.last_seen_s },
    { key: "version", label: "version · inner step", cls: "num", value: (p) => p.version * 1e6 + p.inner_step,
      text: (p) => "v" + p.version + (p.state === "training" ? " · " + p.inner_step + "/" + innerTotal() : ""),
      title: (p) => "holds version " + p.version + " (the model after " + p.version + " outer steps)" +
        (p.state === "training" ? "; inner step " + p.inner_step + " of " + innerTotal() + " of outer step " + (p.version + 1) : "") },
    { key: "tokens_per_s", label: "tokens/s", cls: "num", value: (p) => p.tokens_per_s, text: (p) => (p.tokens_per_s ? si(p.tokens_per_s) : "–") },
    { key: "work_share", label: "share of the round", cls: "num", value: (p) => (p.work_share === null ? -1 : p.work_share),
      text: (p) => (p.too_slow ? "too slow" : (p.work_share === null ? "–" : Math.round(100 * p.work_share) + "% · " +
        p.round_steps + " steps")),
      title: (p) => (p.too_slow || ("its share of the newest committed step's work, and the inner steps its last phase " +
        "trained (at most " + innerTotal() + ": as many as fit the round's window)" +
        (p.step_s ? "; one inner step takes " + num(p.step_s, 2) + " s" : "") +
        (p.window_s ? "; its window ended " + num(p.window_s, 1) + " s into the phase" : ""))) },
    { key: "loss", label: "loss", cls: "num", value: (p) => (p.loss === null ? Infinity : p.loss), text: (p) => num(p.loss, 3) },
    { key: "bytes", label: "sent / received", cls: "num", value: (p) => sumValues(p.bytes_sent),
      text: (p) => bytes(sumValues(p.bytes_sent)) + " / " + bytes(sumValues(p.bytes_received)),
      title: (p) => "sent: " + byKind(p.bytes_sent) + "\nreceived: " + byKind(p.bytes_received) +
        "\nsending " + bytes(p.send_bps || 0) + "/s over the last 10 s; peak " + bytes(p.peak_send_bps || 0) + "/s" },
    { key: "peak_send", label: "peak uplink", cls: "num", value: (p) => p.peak_send_bps || 0,
      text: (p) => bytes(p.peak_send_bps || 0) + "/s",
      title: (p) => "the most it sent in one second since it started (now " + bytes(p.send_bps || 0) + "/s over 10 s)" +
        (p.peak_send_kinds && sumValues(p.peak_send_kinds) ? "\nthat second: " + byKind(p.peak_send_kinds) : "") },
    { key: "relayed", label: "reached", value: (p) => (p.relayed ? relayBytes(p) : -1),
      text: (p) => (p.relayed ? "relayed · " + bytes(relayBytes(p)) : "direct"),
      title: (p) => (p.relayed ? "accepts no connections (behind a NAT): its traffic crosses the coordinator's relay, " +
        bytes(relayBytes(p)) + " so far" : "other peers connect to it directly") },
    { key: "software", label: "version", value: (p) => p.software, text: (p) => p.software || "–" },
  ];

  function innerTotal() { return page.state ? page.state.run.inner_steps_per_outer : "?"; }

  function relayBytes(p) {
    return (p.bytes_sent.relay || 0) + (p.bytes_received.relay || 0);
  }

  function renderPeerHead() {
    const head = $("peers-head");
    for (const col of COLUMNS) {
      const th = el("th", "", col.label);
      th.dataset.sort = col.key;
      th.setAttribute("data-testid", "sort-" + col.key);
      th.addEventListener("click", () => {
        if (page.sortKey === col.key) page.sortDir = -page.sortDir;
        else { page.sortKey = col.key; page.sortDir = 1; }
        page.pageNo = 0;
        renderPeers();
      });
      head.appendChild(th);
    }
  }

  function visiblePeers() {
    const s = page.state;
    let peers = s ? s.peers.map((p, i) => ({ p, i })) : [];
    const f = page.filter.trim().toLowerCase();
    if (f) {
      peers = peers.filter(({ p }) => [p.id, p.name, p.state, p.device, p.device_name, p.address, p.software]
        .some((v) => String(v || "").toLowerCase().includes(f)));
    }
    const col = COLUMNS.find((c) => c.key === page.sortKey);
    if (col) {
      const d = page.sortDir;
      peers.sort((a, b) => {
        const x = col.value(a.p), y = col.value(b.p);
        return (x < y ? -d : x > y ? d : 0) || a.i - b.i;
      });
    }
    return peers.map(({ p }) => p);
  }

  // The query for the page the table shows, as api/v1/peers takes it.
  function remoteQuery() {
    const sort = page.sortKey ? (page.sortDir < 0 ? "-" : "") + page.sortKey : "first_seen";
    return "offset=" + page.pageNo * page.pageSize + "&limit=" + page.pageSize + "&sort=" + encodeURIComponent(sort) +
      (page.filter.trim() ? "&q=" + encodeURIComponent(page.filter.trim().slice(0, 128)) : "");
  }

  // Ask the server for the shown page (one request at a time; a newer need is served right after it).
  async function fetchPeers() {
    if (page.remoteBusy) { page.remoteAgain = true; return; }
    page.remoteBusy = true;
    const query = remoteQuery();
    const pre = page.prefetched;
    page.prefetched = null;
    let ok = false;
    try {
      const r = await (pre && pre.query === query ? pre.answer : fetch("api/v1/peers?" + query, { cache: "no-store" }));
      if (r.ok) {
        const answer = await r.json();
        page.remoteRows = answer.peers || [];
        page.remoteTotal = answer.total || 0;
        page.remoteQuery = query;
        const pages = Math.max(1, Math.ceil(page.remoteTotal / page.pageSize));
        if (page.pageNo > pages - 1) { page.pageNo = pages - 1; page.remoteAgain = true; }
        drawPeers();
        if (page.firstTableMs === null) page.firstTableMs = performance.now();
        ok = true;
      } else {
        page.lastError = "HTTP " + r.status + " from api/v1/peers";
      }
    } catch (err) {
      page.lastError = "api/v1/peers: " + err;
    } finally {
      page.remoteBusy = false;
    }
    // again at once if the table changed meanwhile (a click, a new snapshot); after an error, at the next snapshot
    const again = page.remoteAgain || (page.remote && remoteQuery() !== page.remoteQuery);
    page.remoteAgain = false;
    if (ok && again) fetchPeers();
  }

  function renderPeers() {
    if (!page.state) return;
    if (page.remote) fetchPeers(); // the rows come from the server: drawn when they arrive
    drawPeers();
  }

  function drawPeers() {
    const s = page.state;
    if (!s) return;
    for (const th of $("peers-head").children) {
      th.setAttribute("aria-sort", th.dataset.sort === page.sortKey ? (page.sortDir > 0 ? "ascending" : "descending") : "none");
    }
    const all = page.remote ? null : visiblePeers();
    const total = page.remote ? page.remoteTotal : all.length;
    const pages = Math.max(1, Math.ceil(total / page.pageSize));
    page.pageNo = Math.min(page.pageNo, pages - 1);
    const rows = page.remote ? page.remoteRows : all.slice(page.pageNo * page.pageSize, (page.pageNo + 1) * page.pageSize);
    const body = $("peers-body");
    const frag = document.createDocumentFragment();
    page.lastSeenCells = [];
    for (const p of rows) {
      const tr = el("tr", GONE.has(p.state) ? "gone" : "");
      tr.setAttribute("data-testid", "peer-row");
      tr.dataset.peerId = p.id;
      tr.dataset.state = p.state;
      for (const col of COLUMNS) {
        const td = el("td", col.cls || "");
        td.dataset.col = col.key;
        if (col.key === "state") {
          td.appendChild(el("span", "state " + stateClass(p.state), p.state));
          const beat = s.config && s.config.heartbeat_s;  // silent for two heartbeats or more: not lost yet, but quiet
          if (beat && !GONE.has(p.state) && p.last_seen_s > 2 * beat) {
            td.appendChild(el("span", "silent", " · silent " + Math.round(p.last_seen_s) + " s"));
          }
          if (p.place_in_s !== null && p.place_in_s !== undefined) {  // waiting for a place: the next step boundary
            td.appendChild(el("span", "why", " · place in ~" + within(p.place_in_s)));
          }
          if (p.error && (p.state === "failed" || p.state === "refused")) {  // why it stopped, or cannot take part
            td.appendChild(el("span", "why", " · " + p.error));
          }
        } else if (col.key === "last_seen_s") {
          page.lastSeenCells.push([td, p]);
        } else {
          td.textContent = col.text(p);
        }
        if (col.title) td.title = col.title(p);
        tr.appendChild(td);
      }
      frag.appendChild(tr);
    }
    body.replaceChildren(frag);
    if (!rows.length) {
      const empty = page.remote && page.remoteQuery === null ? "loading peers…"
        : s.peers.length ? "no peer matches the filter" : "no peers yet";
      const tr = el("tr"), td = el("td", "empty", empty);
      td.colSpan = COLUMNS.length; tr.appendChild(td); body.appendChild(tr);
    }
    renderAges();
    const from = total ? page.pageNo * page.pageSize + 1 : 0;
    setText("page-info", "page " + (page.pageNo + 1) + " of " + pages + " · " + from + "–" +
      (page.pageNo * page.pageSize + rows.length) + " of " + total + " peers");
    $("page-info").dataset.page = String(page.pageNo + 1);
    $("page-info").dataset.pages = String(pages);
    $("page-prev").disabled = page.pageNo === 0;
    $("page-next").disabled = page.pageNo >= pages - 1;
    setText("peers-hint", (s.peers_summary ? s.peers_summary.total : s.peers.length) + " known");
  }

  // ------------------------------------------------------------------ links heatmap

  function colourScale(t) {
    // 0 (good) -> green, 0.5 -> amber, 1 (bad) -> red
    t = Math.max(0, Math.min(1, t));
    const hue = 130 * (1 - t);
    return "hsl(" + hue.toFixed(0) + ", 65%, 45%)";
  }

  function renderLinks(s) {
    const links = s.links || { peers: [], rtt_ms: [], bandwidth_mbps: [] };
    const metric = $("links-metric").value;
    const matrix = links[metric] || [];
    const ids = links.peers || [];
    let measured = 0;
    for (const row of matrix) for (const v of row || []) if (v !== null && v !== undefined) measured++;
    const canvas = $("links-canvas");
    $("links-empty").hidden = measured > 0;
    canvas.hidden = measured === 0;
    $("links-controls").hidden = measured === 0;
    setText("links-hint", measured ? ids.length + " peers · " + measured + " measured · green fast, red slow, grey not measured" : "");
    canvas.dataset.peers = String(ids.length);
    canvas.dataset.measured = String(measured);
    if (!measured) return;
    const n = ids.length;
    const labels = n <= 40;
    const width = (page.sizes.links || [canvas.parentElement.clientWidth])[0] || 600;
    const cellPx = Math.max(2, Math.min(22, Math.floor(Math.min(900, width - 60) / n)));
    const off = labels ? 52 : 4;
    const size = off + n * cellPx + 4;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = size * dpr; canvas.height = size * dpr;
    canvas.style.width = size + "px"; canvas.style.height = size + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, size, size);
    // rtt: log scale 1 ms (good) .. 500 ms (bad); bandwidth: log scale 10 Gbit/s (good) .. 1 Mbit/s (bad)
    const badness = metric === "rtt_ms"
      ? (v) => Math.log10(Math.max(1, v)) / Math.log10(500)
      : (v) => 1 - Math.log10(Math.max(1, v)) / 4;
    const line = cssVar("--line");
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        const v = (matrix[i] || [])[j];
        ctx.fillStyle = i === j ? "transparent" : v === null || v === undefined ? line : colourScale(badness(v));
        ctx.fillRect(off + j * cellPx, off + i * cellPx, cellPx - (cellPx > 4 ? 1 : 0), cellPx - (cellPx > 4 ? 1 : 0));
      }
    }
    if (labels) {
      ctx.fillStyle = cssVar("--muted"); ctx.font = "10px ui-monospace, monospace";
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ids.forEach((id, i) => ctx.fillText(id.slice(-6), off - 4, off + i * cellPx + cellPx / 2));
      ctx.save(); ctx.textAlign = "left";
      ids.forEach((id, j) => {
        ctx.save(); ctx.translate(off + j * cellPx + cellPx / 2, off - 4); ctx.rotate(-Math.PI / 2);
        ctx.fillText(id.slice(-6), 0, 0); ctx.restore();
      });
      ctx.restore();
    }
    canvas.onmousemove = (e) => {
      const rect = canvas.getBoundingClientRect();
      const j = Math.floor((e.clientX - rect.left - off) / cellPx), i = Math.floor((e.clientY - rect.top - off) / cellPx);
      if (i < 0 || j < 0 || i >= n || j >= n || i === j) { setText("links-readout", ""); return; }
      const v = (matrix[i] || [])[j];
      const unit = metric === "rtt_ms" ? " ms" : " Mbit/s";
      setText("links-readout", ids[i].slice(-6) + " → " + ids[j].slice(-6) + ": " +
        (v === null || v === undefined ? "not measured" : num(v, 1) + unit));
    };
  }

  // ------------------------------------------------------------------ events

  function renderEvents(s) {
    const evs = s.events || [];
    const key = evs.length + ":" + (evs.length ? evs[evs.length - 1].t : 0);
    if (key === page.eventsKey) return;
    page.eventsKey = key;
    const frag = document.createDocumentFragment();
    for (let k = evs.length - 1; k >= 0; k--) {
      const e = evs[k];
      const li = el("li");
      li.setAttribute("data-testid", "event-row");
      li.dataset.kind = e.kind;
      const t = el("time", "", clock(e.t));
      t.dateTime = new Date(e.t * 1000).toISOString();
      li.appendChild(t);
      li.appendChild(el("span", "kind k-" + e.kind.replace(/[^a-z0-9_-]/gi, ""), e.kind));
      if (e.peer) { const p = el("span", "peer", e.peer.slice(-6)); p.title = e.peer; li.appendChild(p); }
      li.appendChild(el("span", "msg", e.message));
      frag.appendChild(li);
    }
    if (!evs.length) frag.appendChild(el("li", "empty", "no events yet"));
    $("events").replaceChildren(frag);
  }

  // ------------------------------------------------------------------ freshness and the banner

  function setBanner(kind, text) {
    const b = $("banner");
    b.hidden = !kind;
    b.dataset.kind = kind || "";
    setText("banner", text || "");
  }

  function renderFreshness() {
    const f = $("freshness");
    let stale = false;
    if (page.lostSince) {
      const since = (Date.now() - page.lostSince) / 1000;
      setBanner("lost", "Lost contact with the coordinator since " + clock(page.lostSince / 1000) + " (" + ago(since) +
        ")" + (page.lastError ? ": " + page.lastError : "") + ". Retrying every " + POLL_MS / 1000 + " s; what you see is from before.");
    } else if (page.state && sinceSnapshot() > STALE_S) {
      stale = true;
      setBanner("stale", "The coordinator answers but its state has not changed for " + ago(sinceSnapshot()).replace(" ago", "") +
        ": its loop may be stuck.");
    } else if (page.mode === "starting") {
      setBanner("starting", "The coordinator is up but has not built its first snapshot yet.");
    } else {
      setBanner(null, "");
    }
    const age = page.state ? sinceSnapshot() : null;
    f.dataset.age = age === null ? "" : age.toFixed(1);
    f.classList.toggle("stale", stale || !!page.lostSince);
    const how = { stream: " (live)", polling: " (polling)", offline: " (offline)" }[page.mode] || "";
    setText("freshness", age === null ? (page.lostSince ? "cannot reach the coordinator" : "connecting to the coordinator…")
      : "updated " + ago(age) + how);
    setText("mode", { stream: "live stream", polling: "polling every " + POLL_MS / 1000 + " s" }[page.mode] || page.mode);
  }

  function tick() {
    renderAges();
    renderFreshness();
    if (page.stream && Date.now() - page.lastMessageAt > STREAM_SILENCE_MS) {
      // open but silent (a buffering proxy, a half-dead connection): fall back to polling
      closeStream();
      page.streamFailures++;
      schedulePoll(0);
    }
  }

  // ------------------------------------------------------------------ data flow

  function measure() {
    for (const id of ["loss-chart", "tokens-chart", "peers-chart", "bytes-chart"]) {
      const c = $(id);
      page.sizes[id] = [c.clientWidth, c.clientHeight];
    }
    page.sizes.links = [$("links").clientWidth];
  }

  function onState(s) {
    if (!s || s.api !== "potluck.status/v1") {
      page.lastError = "unexpected API " + (s && s.api);
      return;
    }
    if (s.generated_at !== page.lastGenerated) { page.lastGenerated = s.generated_at; page.changedAt = Date.now(); }
    page.state = s;
    const t0 = performance.now();
    measure(); // every size read happens before the first DOM write: one layout, not one per chart
    renderHeader(s);
    page.remote = !!(s.peers_summary && s.peers_summary.truncated);
    renderPeers();
    if (page.firstTableMs === null && !page.remote) page.firstTableMs = performance.now();
    renderGrid(s);
    renderCharts(s);
    renderLinks(s);
    renderEvents(s);
    page.renders++;
    page.renderMs = performance.now() - t0;
    if (page.firstRenderMs === null) page.firstRenderMs = performance.now();
    document.body.dataset.renders = String(page.renders);
    renderFreshness();
  }

  function onContact() {
    page.lostSince = null;
    page.lastError = "";
  }

  function onLost(err) {
    if (!page.lostSince) page.lostSince = Date.now();
    page.mode = "offline";
    page.lastError = err && err.name === "AbortError" ? "no answer within " + FETCH_TIMEOUT_MS / 1000 + " s"
      : err instanceof TypeError ? "no connection" // what fetch reports for refused, reset or unreachable
        : String((err && err.message) || err);
    renderFreshness();
  }

  function openStream() {
    if (!window.EventSource) { schedulePoll(0); return; }
    const es = new EventSource("api/v1/events");
    page.stream = es;
    page.lastMessageAt = Date.now();
    es.addEventListener("state", (e) => {
      if (page.firstMessageMs === null) page.firstMessageMs = performance.now();
      page.lastMessageAt = Date.now();
      page.streamFailures = 0;
      page.mode = "stream";
      onContact();
      try {
        const s = JSON.parse(e.data);
        if (s.generated_at !== page.lastGenerated || !page.state) onState(s); // the stream opens with what the poll just drew
      } catch (err) { page.lastError = "bad state: " + err; }
    });
    es.addEventListener("ping", () => { page.lastMessageAt = Date.now(); onContact(); });
    es.onerror = () => {
      // The server went away, refused the stream (too many viewers) or a proxy cut it: poll instead.
      closeStream();
      page.streamFailures++;
      schedulePoll(0);
    };
  }

  function closeStream() {
    if (page.stream) { page.stream.close(); page.stream = null; }
  }

  function schedulePoll(ms) {
    if (page.pollTimer) clearTimeout(page.pollTimer);
    page.pollTimer = setTimeout(poll, ms);
  }

  async function poll() {
    page.pollTimer = null;
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch("api/v1/state", { cache: "no-store", signal: ctl.signal });
      if (r.status === 503) {
        onContact();
        page.mode = "starting";
        renderFreshness();
      } else if (!r.ok) {
        throw new Error("HTTP " + r.status + " from api/v1/state");
      } else {
        const s = await r.json();
        if (page.firstMessageMs === null) page.firstMessageMs = performance.now();
        onContact();
        page.mode = "polling";
        onState(s);
      }
      if (page.streamFailures < 5) { openStream(); return; } // contact is back: try the live stream again
    } catch (err) {
      onLost(err);
    } finally {
      clearTimeout(timer);
    }
    schedulePoll(POLL_MS);
  }

  // ------------------------------------------------------------------ start

  function start() {
    renderLegend();
    renderPeerHead();
    $("peer-filter").addEventListener("input", (e) => { page.filter = e.target.value; page.pageNo = 0; renderPeers(); });
    $("page-size").addEventListener("change", (e) => { page.pageSize = Number(e.target.value) || 50; page.pageNo = 0; renderPeers(); });
    $("page-prev").addEventListener("click", () => { page.pageNo = Math.max(0, page.pageNo - 1); renderPeers(); });
    $("page-next").addEventListener("click", () => { page.pageNo++; renderPeers(); });
    $("links-metric").addEventListener("change", () => page.state && renderLinks(page.state));
    window.addEventListener("resize", () => { if (page.state) { measure(); renderCharts(page.state); renderLinks(page.state); } });
    window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => { palette = null; });
    setInterval(tick, 1000);
    // the table's first page, asked for beside the first state: past 200 peers (a truncated snapshot) the table
    // fills from it, and asking only once the state had arrived cost a second round trip on every load
    const first = remoteQuery();
    page.prefetched = { query: first, answer: fetch("api/v1/peers?" + first, { cache: "no-store" }) };
    page.prefetched.answer.catch(() => {}); // (unused on a small run; a failure is seen where it is used)
    poll(); // the first state comes from the <link rel=preload> fetch started with the HTML; then the live stream
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
