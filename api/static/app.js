// kv-prefix-indexer live page: plain JS, no build step, no dependency.
// Polls GET /ui/state (counters only) and draws tables and canvas charts;
// "Explain" posts one prompt to POST /v1/explain.
"use strict";

(function () {
  const $ = (sel, root) => (root || document).querySelector(sel);
  const TOKEN_KEY = "kvi_token";
  const TIER_COLORS = { GPU: "#2e9d4f", CPU: "#2f6fd6", STORAGE: "#8a3fbf" };
  let pollTimer = null;
  let lastState = null;

  // ------------------------------------------------------------ requests

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const t = sessionStorage.getItem(TOKEN_KEY);
    if (t) h["Authorization"] = "Bearer " + t;
    return h;
  }

  class AuthError extends Error {}

  async function api(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = headers(o.headers);
    const r = await fetch(path, o);
    if (r.status === 401 || r.status === 403) {
      showTokenForm(r.status === 403 ? "The token was refused (403): try again." : null);
      throw new AuthError("the API token is needed");
    }
    const text = await r.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = { detail: text }; }
    if (!r.ok) throw new Error((body && (body.detail || body.error)) || ("HTTP " + r.status));
    return body;
  }

  function showTokenForm(msg) {
    const f = $("#token-form");
    f.hidden = false;
    if (msg) $(".hint", f).textContent = msg;
    setStatus("error", "token needed");
  }

  $("#token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    $("#token-form").hidden = true;
    poll();
  });

  function setStatus(state, text) {
    const s = $("#status");
    s.dataset.state = state;
    s.textContent = text;
  }

  // ------------------------------------------------------------ formatting

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function num(n) {
    if (n === null || n === undefined) return "–";
    if (typeof n !== "number") return esc(n);
    if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return Number.isInteger(n) ? String(n) : n.toFixed(1);
  }
  function age(s) {
    if (s === null || s === undefined) return "never";
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function tiers(obj) {
    const keys = Object.keys(obj || {});
    if (!keys.length) return '<span class="muted">–</span>';
    return keys.map((t) => `<span class="tier" data-tier="${esc(t)}"><i class="${esc(t)}"></i>${esc(t)} <b>${num(obj[t])}</b></span>`).join("");
  }

  // ------------------------------------------------------------ sections

  function renderSummary(st) {
    const ws = st.workers;
    const connected = ws.filter((w) => w.connected).length;
    const last = st.series[st.series.length - 1];
    const items = [
      ["workers", `${connected}/${ws.length} connected`],
      ["stale", st.totals.stale_workers],
      ["nodes", num(st.totals.nodes)],
      ["resident", num(st.totals.resident_entries)],
      ["events/s", last ? num(last.events_s) : "–"],
      ["queries/s", last ? num(last.queries_s) : "–"],
      ["in flight", num(st.in_flight.requests)],
    ];
    const rs = st.route_sync;
    if (rs) {  // several router replicas: whether this one sees the others' decisions
      const peers = Object.keys(rs.peers).length;
      const theirs = Object.entries(rs.held).filter(([o]) => o !== "").reduce((a, [, n]) => a + n, 0);
      items.push(["route sync", rs.connected
        ? `${peers} peer${peers === 1 ? "" : "s"} · ${num(theirs)} of theirs`
        : `<span class="why">NATS down: own view only</span>`]);
    }
    $("#summary").innerHTML = items.map(([k, v]) => `<span class="stat" data-stat="${k}">${k} <b>${v}</b></span>`).join("");
  }

  function renderWorkers(st) {
    const tb = $("#workers tbody");
    const multiGroup = st.workers.some((w) => Object.keys(w.resident_by_group || {}).length > 1);
    const rows = st.workers.map((w) => {
      const name = `${w.engine}/${w.dp_rank}`;
      const health = w.health || (w.stale ? "stale" : "ok");
      const why = w.stale ? `<span class="why" data-field="stale_reason">${esc(w.stale_reason || "stale")}</span>` : "";
      let blocks = tiers(w.resident_blocks);
      if (multiGroup) {
        blocks = Object.entries(w.resident_by_group || {}).map(([g, t]) => `<div>group ${esc(g)}: ${tiers(t)}</div>`).join("");
      }
      const inf = w.in_flight || {};
      const drops = Object.entries(w.dropped || {}).map(([k, v]) => `${esc(k)} ${v}`).join(", ") || "–";
      const repl = w.replaying ? ' <span class="badge replaying">replaying</span>' : "";
      return `<tr data-worker="${esc(name)}" class="${w.stale ? "stale" : ""}">
        <td><b>${esc(name)}</b></td><td>${esc(w.model || "")}</td>
        <td data-field="health" data-health="${esc(health)}"><span class="badge ${esc(health)}">${esc(health)}</span>${repl}${why}</td>
        <td class="num" data-field="last_seq">${w.last_seq === null || w.last_seq === undefined ? "–" : w.last_seq}</td>
        <td class="num" data-field="last_event_age">${age(w.last_event_age_s)}</td>
        <td data-field="blocks">${blocks}</td>
        <td data-field="in_flight">${num(inf.requests || 0)} req · ${num(inf.prefill_tokens || 0)} tok · ${num(inf.decode_blocks || 0)} blk</td>
        <td class="num" data-field="gaps">${num(w.gaps || 0)} · ${num(w.replays_ok || 0)}/<span class="${w.replays_failed ? "why" : ""}">${num(w.replays_failed || 0)}</span> · ${num(w.restarts || 0)}</td>
        <td class="num" data-field="messages">${num(w.messages || 0)}</td>
        <td data-field="dropped">${drops}</td></tr>`;
    });
    tb.innerHTML = rows.join("");
  }

  function renderModels(st) {
    const last = st.series[st.series.length - 1];
    const rows = Object.entries(st.models).map(([name, m]) => {
      const groups = Object.entries(m.groups || {});
      const nodes = groups.map(([g, gd]) => `<div>group ${esc(g)}${gd.kind ? " (" + esc(gd.kind) + ")" : ""}: <b>${num(gd.nodes)}</b></div>`).join("") || "–";
      const res = groups.map(([g, gd]) => `<div>${groups.length > 1 ? "group " + esc(g) + ": " : ""}${tiers(gd.tiers)}</div>`).join("") || "–";
      const rate = last && last.model_batches_s ? last.model_batches_s[name] : null;
      const orph = m.orphans || 0;
      const near = orph >= 0.8 * st.max_orphans;
      return `<tr data-model="${esc(name)}"><td><b>${esc(name)}</b></td><td class="num">${m.live_workers}/${m.workers}</td>
        <td class="num">${m.block_size || "–"}</td><td>${nodes}</td><td>${res}</td>
        <td class="num" data-field="batches_s">${rate === null || rate === undefined ? "–" : num(rate)}</td>
        <td class="num ${near ? "why" : ""}" data-field="orphans">${num(orph)} <span class="muted">/ ${num(st.max_orphans)}</span></td>
        <td class="num">${num(st.in_flight.requests)} req · ${num(st.in_flight.predicted_nodes)} nodes</td></tr>`;
    });
    $("#models tbody").innerHTML = rows.join("");
    $("#model-names").innerHTML = Object.keys(st.models).map((m) => `<option value="${esc(m)}">`).join("");
    const sel = $("#decisions-model");
    const want = ["", ...Object.keys(st.models)];
    if ([...sel.options].map((o) => o.value).join("\n") !== want.join("\n")) {
      const cur = sel.value;
      sel.innerHTML = want.map((m) => `<option value="${esc(m)}">${m ? esc(m) : "all models"}</option>`).join("");
      sel.value = want.includes(cur) ? cur : "";
    }
  }

  function renderGateway(st) {
    const g = st.gateway;
    const ws = g ? Object.entries(g.workers) : [];
    $("#gateway-section").hidden = ws.length === 0;
    if (!ws.length) return;
    const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
    $("#gateway tbody").innerHTML = ws.map(([name, w]) => {
      const gap = w.prompt_tokens ? w.abs_error / w.prompt_tokens : null;
      const o = w.outcomes;
      return `<tr data-worker="${esc(name)}"><td><b>${esc(name)}</b></td>
        <td class="num">${num(w.requests)} / ${num(w.reports)}</td><td class="num">${num(w.active)}</td>
        <td class="num" data-field="predicted">${num(w.predicted)}</td><td class="num" data-field="delivered">${num(w.delivered)}</td>
        <td class="num">${pct(w.delivered_ratio)}</td><td class="num">${w.reports ? pct(w.exact / w.reports) : "–"}</td>
        <td class="num ${gap !== null && gap > 0.05 ? "why" : ""}" data-field="gap">${pct(gap)}</td>
        <td class="num">${num(o.engine_error + o.upstream_failed)} · ${num(o.timeout)} · ${num(o.client_aborted)}</td></tr>`;
    }).join("");
  }

  function renderDecisions(st) {
    const rows = st.decisions.map((d) => {
      const s = d.split;
      const parts = [];
      for (const t of ["GPU", "CPU", "STORAGE"]) if (s.cached[t]) parts.push([t, s.cached[t], `cached on ${t}`]);
      parts.push(["pred", s.predicted, "predicted"], ["unc", s.uncached, "uncached prompt blocks"],
        ["queue", s.queued_prefill, "queued prefill blocks"], ["dec", s.decode, "decode blocks"]);
      const total = parts.reduce((a, p) => a + p[1], 0) || 1;
      const bar = parts.filter((p) => p[1] > 0).map((p) =>
        `<span class="${p[0]}" style="width:${(100 * p[1] / total).toFixed(2)}%" title="${esc(p[2])}: ${p[1]}"></span>`).join("");
      const cachedTxt = Object.entries(s.cached).map(([t, n]) => `${t} ${n}`).join(" + ") || "0";
      const ru = d.runner_up ? `${esc(d.runner_up.worker)} <span class="muted">cost ${num(d.runner_up.cost)}, ${d.runner_up.cached_blocks} cached</span>` : "–";
      const when = new Date(d.t * 1000).toLocaleTimeString();
      return `<tr data-decision="${esc(d.request_id || "")}"><td>${when}</td><td>${esc(d.model)}</td>
        <td class="num">${num(d.prompt_tokens)} tok · ${d.prompt_blocks} blk</td>
        <td><b data-field="chosen">${esc(d.worker)}</b>${d.stale ? ' <span class="badge stale">stale</span>' : ""}</td>
        <td><span class="reason">${esc(d.reason)}</span></td><td class="num">${num(d.score)}</td><td class="num">${num(d.cost)}</td>
        <td><div class="bar">${bar}</div><span class="muted">cached ${cachedTxt} · predicted ${s.predicted} · uncached ${s.uncached} · queued ${s.queued_prefill} · decode ${s.decode} (${esc(s.load_source)} load)</span></td>
        <td>${ru}</td></tr>`;
    });
    $("#decisions tbody").innerHTML = rows.join("");
    $("#decisions-empty").hidden = st.decisions.length > 0;
  }

  // ------------------------------------------------------------ charts

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // lines: [{name, color, pts: [[t, v|null], ...]}]
  function drawChart(canvas, lines, opts) {
    const o = opts || {};
    const dpr = window.devicePixelRatio || 1;
    const W = canvas.clientWidth || canvas.width, H = canvas.clientHeight || canvas.height;
    canvas.width = W * dpr; canvas.height = H * dpr;
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, W, H);
    const L = 52, R = 10, T = 22, B = 20;
    const all = lines.flatMap((l) => l.pts.filter((p) => p[1] !== null && p[1] !== undefined));
    g.font = "11px system-ui, sans-serif";
    if (!all.length) {
      g.fillStyle = "#6b7385";
      g.fillText(o.empty || "no samples yet", L, H / 2);
      return;
    }
    const t1 = Math.max(...all.map((p) => p[0])), t0 = Math.min(...all.map((p) => p[0]), t1 - 60);
    const ymax = o.ymax || niceMax(Math.max(...all.map((p) => p[1])) * 1.05);
    const x = (t) => L + (W - L - R) * (t - t0) / Math.max(t1 - t0, 1);
    const y = (v) => T + (H - T - B) * (1 - Math.min(v, ymax) / ymax);
    g.strokeStyle = "#e2e5ea"; g.fillStyle = "#6b7385"; g.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const v = ymax * i / 4, yy = Math.round(y(v)) + 0.5;
      g.beginPath(); g.moveTo(L, yy); g.lineTo(W - R, yy); g.stroke();
      g.fillText((o.fmt || num)(v), 4, yy + 4);
    }
    const span = t1 - t0;
    g.fillText(`-${age(span)}`, L, H - 5);
    g.fillText("now", W - R - 22, H - 5);
    let lx = L;
    for (const l of lines) {
      g.strokeStyle = l.color; g.lineWidth = 1.8; g.beginPath();
      let pen = false;
      for (const [t, v] of l.pts) {
        if (v === null || v === undefined) { pen = false; continue; }
        if (pen) g.lineTo(x(t), y(v)); else { g.moveTo(x(t), y(v)); pen = true; }
      }
      g.stroke();
      g.fillStyle = l.color; g.fillRect(lx, 7, 10, 3);
      g.fillStyle = "#1d2330";
      const last = [...l.pts].reverse().find((p) => p[1] !== null && p[1] !== undefined);
      const label = `${l.name}${last ? " " + (o.fmt || num)(last[1]) : ""}`;
      g.fillText(label, lx + 13, 12);
      lx += g.measureText(label).width + 28;
    }
  }

  function renderCharts(st) {
    const s = st.series;
    const pts = (f) => s.map((p) => [p.t, f(p)]);
    drawChart($("#chart-ingest"), [
      { name: "events", color: "#2f6fd6", pts: pts((p) => p.events_s) },
      { name: "batches", color: "#2e9d4f", pts: pts((p) => p.batches_s) },
    ]);
    drawChart($("#chart-queries"), [{ name: "queries", color: "#8a3fbf", pts: pts((p) => p.queries_s) }]);
    drawChart($("#chart-latency"), [
      { name: "p50", color: "#2e9d4f", pts: pts((p) => p.latency_us && p.latency_us["50"]) },
      { name: "p90", color: "#e8a400", pts: pts((p) => p.latency_us && p.latency_us["90"]) },
      { name: "p99", color: "#d63a3a", pts: pts((p) => p.latency_us && p.latency_us["99"]) },
    ], { fmt: (v) => v >= 1000 ? (v / 1000).toFixed(1) + "k" : v.toFixed(0), empty: "no queries in this window" });
    const share = (k) => pts((p) => p.cached_share ? 100 * (p.cached_share[k] || 0) : null);
    drawChart($("#chart-cached"), [
      { name: "GPU", color: TIER_COLORS.GPU, pts: share("GPU") },
      { name: "CPU", color: TIER_COLORS.CPU, pts: share("CPU") },
      { name: "storage", color: TIER_COLORS.STORAGE, pts: share("STORAGE") },
      { name: "predicted", color: "#f08c00", pts: share("predicted") },
    ], { ymax: 100, fmt: (v) => v.toFixed(0), empty: "no routed prompts in this window" });
    $("#charts-note").textContent = `${s.length} samples, one a second while a page is open`;
  }

  // ------------------------------------------------------------ polling

  async function poll() {
    clearTimeout(pollTimer);
    const started = performance.now();
    let delay = 1000;
    try {
      const dm = $("#decisions-model").value;
      const st = await api("/ui/state" + (dm ? "?decisions_model=" + encodeURIComponent(dm) : ""));
      lastState = st;
      renderSummary(st);
      renderWorkers(st);
      renderModels(st);
      renderGateway(st);
      renderCharts(st);
      renderDecisions(st);
      setStatus(st.ingest.running ? "live" : "error",
        st.ingest.running ? `live · ${new Date(st.now * 1000).toLocaleTimeString()}` : `ingest stopped: ${st.ingest.error || "?"}`);
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      // A large fleet's answer takes longer to build: never poll more than a third of the time.
      delay = Math.max(1000 * (st.poll_s || 1), 3 * (performance.now() - started));
    } catch (e) {
      if (e instanceof AuthError) return; // waits for the token form
      setStatus("error", "unreachable: " + e.message);
      delay = 3000;
    }
    pollTimer = setTimeout(poll, delay);
  }

  // ------------------------------------------------------------ explain

  function parseTokens(text) {
    const t = text.trim();
    if (!t) throw new Error("paste token ids first");
    if (t[0] === "{" || t[0] === "[") {
      const v = JSON.parse(t);
      const ids = Array.isArray(v) ? v : v.token_ids;
      if (!Array.isArray(ids)) throw new Error('expected a JSON array or {"token_ids": [...]}');
      return { ids, model: Array.isArray(v) ? null : v.model };
    }
    const words = t.split(/[\s,]+/).filter(Boolean);
    if (words.every((x) => /^\d+$/.test(x))) return { ids: words.map(Number), model: null };
    // Anything else is text: the service tokenizes it with the model's tokenizer (when configured).
    return { text: t, model: null };
  }

  function renderExplain(x) {
    const out = $("#explain-out");
    const n = x.shown_blocks;
    const avail = Math.max(300, out.clientWidth - 130 - 330);
    const cw = Math.max(4, Math.min(16, Math.floor(avail / Math.max(n, 1))));
    let html = `<div class="xsum" data-field="summary">model <b>${esc(x.model)}</b>, group ${esc(x.group ?? "–")}, block size ${x.block_size ?? "–"}:
      <b data-field="query_blocks">${x.query_blocks}</b> blocks${n < x.query_blocks ? ` (first ${n} shown)` : ""}, ${x.workers.length} workers</div>`;
    const ticks = [];
    const step = Math.max(1, Math.ceil(40 / cw));
    for (let i = 0; i < n; i += step) ticks.push(`<span style="left:${i * cw}px">${i}</span>`);
    html += `<div class="xaxis">${ticks.join("")}</div>`;
    for (const w of x.workers) {
      const cells = [];
      for (let i = 0; i < n; i++) {
        const ld = w.loaded[i], held = w.held[i] || [];
        let cls = "cell";
        if (ld) cls += " l-" + (TIER_COLORS[ld] ? ld : "other");
        else if (held.length) cls += held.length === 1 && held[0] === "GPU" ? " h-GPU" : " h-any";
        if (!ld && i < w.predicted_blocks) cls += " pred";
        if (i === w.total_blocks - 1) cls += " endmark";
        const tip = `block ${i}: ${held.length ? "held on " + held.join(", ") : "not held"}${ld ? "; loaded from " + ld : ""}`;
        cells.push(`<span class="${cls}" style="width:${cw}px" data-block="${i}" data-loaded="${esc(ld || "")}" data-held="${esc(held.join(","))}" title="${esc(tip)}"></span>`);
      }
      const stale = w.stale ? `<span class="stale-tag" data-field="stale">stale: ${esc(w.stale_reason || "?")}</span>` : "";
      html += `<div class="xrow${w.stale ? " stale" : ""}" data-worker="${esc(w.worker)}" data-total="${w.total_blocks}" data-reason="${esc(w.end_reason)}" data-stale="${w.stale}">
        <span class="who" title="${esc(w.worker)}">${esc(w.worker)}</span><span class="cells">${cells.join("")}</span>
        <span class="info">${w.total_blocks} blocks (GPU ${w.gpu_blocks}) · ends: <span class="reason ${esc(w.end_reason)}">${esc(w.end_reason.replace(/_/g, " "))}</span>${w.predicted_blocks > w.total_blocks ? ` · predicted to ${w.predicted_blocks}` : ""}${stale}</span></div>`;
    }
    out.innerHTML = html;
  }

  $("#explain-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const err = $("#explain-error");
    err.hidden = true;
    try {
      const p = parseTokens($("#explain-tokens").value);
      const body = p.ids ? { token_ids: p.ids } : { prompt: p.text };
      const model = $("#explain-model").value.trim() || p.model;
      if (model) body.model = model;
      if ($("#explain-lora").value.trim()) body.lora_name = $("#explain-lora").value.trim();
      if ($("#explain-salt").value) body.cache_salt = $("#explain-salt").value;
      const x = await api("/v1/explain", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
      renderExplain(x);
    } catch (e) {
      err.textContent = e.message;
      err.hidden = false;
      $("#explain-out").innerHTML = "";
    }
  });

  $("#decisions-model").addEventListener("change", () => poll());
  window.addEventListener("resize", () => { if (lastState) renderCharts(lastState); });
  poll();
})();
