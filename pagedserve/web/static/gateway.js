// The gateway dashboard: per tier admitted / queued / shed by reason, bucket levels and latency
// distributions; per pool and replica health, seats and estimated wait. One `gateway` event every
// half second carries cumulative counters; rates are differences between events.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const COLOURS = ["#5eb1ff", "#5fd08a", "#f2c14e", "#ff6b6b", "#c18cff", "#4fd1c5", "#ff9f5a"];
  const esc = (s) => String(s).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]));
  let prev = null, charts = null, tierNames = [];

  function quantile(h, q) {  // from cumulative bucket counts: the upper bound of the bucket holding q
    if (!h.count) return null;
    const want = q * h.count;
    for (let i = 0; i < h.le.length; i++) if (h.cumulative[i] >= want) return h.le[i];
    return null;
  }
  const secs = (v) => v === null || v === undefined ? "–" : v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";

  function makeCharts(tiers) {
    tierNames = tiers.map((t) => t.name);
    const series = tierNames.map((n, i) => ({ label: n, color: COLOURS[i % COLOURS.length] }));
    charts = {
      admitted: new PS.Chart($("c-admitted"), series.map((s) => ({ ...s, label: s.label + " admitted" }))),
      shed: new PS.Chart($("c-shed"), series.map((s) => ({ ...s, label: s.label + " shed" }))),
    };
    $("hist-tier").innerHTML = tierNames.map((n) => `<option>${esc(n)}</option>`).join("");
  }

  function drawHistogram(canvas, h) {
    const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, ht = canvas.clientHeight;
    canvas.width = w * dpr; canvas.height = ht * dpr;
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, ht);
    if (!h || !h.le.length) return;
    const counts = h.cumulative.map((c, i) => c - (i ? h.cumulative[i - 1] : 0));
    const max = Math.max(1, ...counts), n = counts.length, bw = (w - 8) / n;
    g.font = "10px sans-serif";
    counts.forEach((c, i) => {
      const bh = (c / max) * (ht - 30);
      g.fillStyle = "#5eb1ff"; g.fillRect(4 + i * bw + 1, ht - 16 - bh, bw - 2, bh);
      g.fillStyle = "#8a96a3";
      const label = h.le[i] === null ? "+∞" : h.le[i] < 1 ? (h.le[i] * 1000) + "ms" : h.le[i] + "s";
      g.fillText(label, 4 + i * bw + 1, ht - 4);
      if (c) { g.fillStyle = "#d8dee6"; g.fillText(String(c), 4 + i * bw + 2, ht - 19 - bh); }
    });
  }

  function render(s) {
    if (!charts || s.tiers.length !== tierNames.length) makeCharts(s.tiers);
    const dt = prev ? Math.max(s.wall_time - prev.wall_time, 1e-3) : null;
    const before = new Map((prev ? prev.tiers : []).map((t) => [t.name, t]));
    const admittedRates = [], shedRates = [];
    $("limiter").textContent = `limiter ${s.limiter.kind}: ${s.limiter.up ? "up" : "DOWN"}`;
    document.querySelector("#tiers tbody").innerHTML = s.tiers.map((t) => {
      const b = before.get(t.name);
      const aRate = dt && b ? (t.admitted - b.admitted) / dt : 0, sRate = dt && b ? (t.shed_total - b.shed_total) / dt : 0;
      admittedRates.push(aRate); shedRates.push(sRate);
      const reasons = Object.entries(t.shed).filter(([, v]) => v > 0)
        .map(([r, v]) => `<span data-reason="${esc(r)}">${esc(r)} ${v}</span>`).join(", ") || "–";
      const buckets = t.buckets.map((k) => {
        const frac = k.level === null ? 0 : Math.max(0, Math.min(1, k.level / k.burst));
        return `<div class="row" title="${esc(k.key)} ${k.kind}: ${k.level === null ? "unknown" : k.level.toFixed(0)} of ${k.burst}, refills ${k.rate}/s">` +
          `<span class="muted" style="width:110px;overflow:hidden">${esc(k.key)} ${k.kind}</span>` +
          `<div class="bar" style="width:90px"><div style="width:${(frac * 100).toFixed(1)}%"></div></div>` +
          `<span>${k.level === null ? "?" : PS.fmt(k.level)} / ${PS.fmt(k.burst)}</span></div>`;
      }).join("");
      return `<tr data-tier="${esc(t.name)}" data-admitted="${t.admitted}" data-queued="${t.queued}" data-shed="${t.shed_total}">` +
        `<td>${esc(t.name)}</td><td class="num">${t.priority}</td><td>${t.pools.map(esc).join(", ")}</td>` +
        `<td class="num">${t.admitted}</td><td class="num">${aRate.toFixed(1)}</td><td class="num">${t.queued}</td>` +
        `<td class="num">${t.shed_total}</td><td>${reasons}</td><td>${buckets}</td>` +
        `<td class="num">${secs(quantile(t.queue_wait, 0.5))} / ${secs(quantile(t.queue_wait, 0.99))}</td>` +
        `<td class="num">${secs(quantile(t.ttft, 0.5))} / ${secs(quantile(t.ttft, 0.99))}</td></tr>`;
    }).join("");
    document.querySelector("#pools tbody").innerHTML = s.pools.map((p) => p.replicas.map((r, i) =>
      `<tr data-pool="${esc(p.name)}" data-replica="${esc(r.url)}" data-healthy="${r.healthy ? 1 : 0}">` +
      `<td>${i ? "" : esc(p.name) + (p.provisioned ? " <span class='muted'>(provisioned)</span>" : "")}</td>` +
      `<td>${esc(r.url)}</td><td class="${r.healthy ? "up" : "down"}">${r.healthy ? "up" : "down"}${r.source ? " · " + esc(r.source) : ""}</td>` +
      `<td class="num">${r.seats ?? "?"}</td><td class="num">${r.inflight}</td><td class="num">${r.running ?? "–"}</td>` +
      `<td class="num">${r.waiting ?? "–"}</td><td class="num">${secs(r.est_wait_s)}</td>` +
      `<td class="num">${r.kv_utilization === null ? "–" : (r.kv_utilization * 100).toFixed(0) + "%"}</td>` +
      `<td class="num">${r.tokens_per_s === null ? "–" : r.tokens_per_s.toFixed(1)}</td>` +
      `<td class="num">${i ? "" : p.queued}</td><td class="muted">${esc(r.last_error || "")}</td></tr>`).join("")).join("");
    if (dt) {
      charts.admitted.push(s.wall_time, admittedRates); charts.shed.push(s.wall_time, shedRates);
      charts.admitted.draw(); charts.shed.draw();
    }
    const shown = s.tiers.find((t) => t.name === $("hist-tier").value) || s.tiers[0];
    if (shown) { drawHistogram($("h-wait"), shown.queue_wait); drawHistogram($("h-ttft"), shown.ttft); }
    prev = s;
  }

  PS.connectFeed("/dashboard/events", {
    onState(state) { const el = $("conn"); el.dataset.state = state; el.textContent = state; },
    onOpen() { prev = null; },
    askKey: PS.keyPrompt,
    onEvent(name, msg) { if (name === "gateway") render(msg); },
  });
})();
