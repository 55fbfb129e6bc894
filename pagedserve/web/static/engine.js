// The engine dashboard: the KV block pool as a grid (from `full` and `delta` events), the request
// list, an event log (preemptions, evictions) and time series (from `stats` events). A pool shared by
// KV groups (Gemma 3's full-attention and sliding-window layers) also shows each block's group.
"use strict";
(function () {
  const FREE = 0, OWNED = 1, CACHED = 2, SHARED = 3;
  // A grouped pool marks each held or cached block's KV group in its state byte (pagedserve/engine/
  // block_map_feed.py): bits 0-1 the state, above them the group's tag, (group + 1) << 1 | window.
  const STATE_MASK = 3, TAG_SHIFT = 2;
  const FULL_HUE = 28;  // full-attention groups: orange; sliding-window groups: blues to violets
  const FLASH_MS = 700;  // a block that just changed is outlined this long
  const $ = (id) => document.getElementById(id);
  const grid = $("grid"), wrap = $("grid-wrap");
  const pool = { n: 0, state: new Uint8Array(0), group: new Uint8Array(0), owner: new Int32Array(0),
                 refs: new Uint8Array(0), changed: new Float64Array(0), meta: null };
  const groupsSeen = new Set();  // the tags of every group this connection's pool has shown
  let layout = { cell: 8, k: 1, cols: 1 };
  let dirty = false;
  const seqRequest = new Map();  // seq id -> "request#index", for tooltips

  const charts = {
    util: new PS.Chart($("c-util"), [{ label: "paged", color: "#5fd08a" }, { label: "worst case", color: "#ff6b6b" },
                                     { label: "prefix hits", color: "#5eb1ff" }],
                       { max: 1, format: (v) => v === undefined ? "–" : (v * 100).toFixed(0) + "%" }),
    reqs: new PS.Chart($("c-reqs"), [{ label: "running", color: "#5fd08a" }, { label: "waiting", color: "#f2c14e" }]),
    tps: new PS.Chart($("c-tps"), [{ label: "tokens/s", color: "#5eb1ff" }]),
    pre: new PS.Chart($("c-pre"), [{ label: "preemptions", color: "#ff6b6b" }, { label: "evictions", color: "#f2c14e" }]),
  };
  let lastStats = null;

  // ---- colours ------------------------------------------------------------------------------
  const colourCache = new Map();
  function colour(state, owner) {
    const key = state * 4294967296 + owner;
    let c = colourCache.get(key);
    if (c === undefined) {
      const h = PS.hue(owner).toFixed(0);
      c = state === OWNED ? `hsl(${h},65%,55%)` : state === SHARED ? `hsl(${h},80%,32%)`
        : state === CACHED ? `hsl(${h},35%,30%)` : "#222831";
      if (colourCache.size > 50000) colourCache.clear();
      colourCache.set(key, c);
    }
    return c;
  }

  const groupIndex = (tag) => (tag >> 1) - 1, isWindow = (tag) => (tag & 1) === 1;
  const groupName = (tag) => `${isWindow(tag) ? "window" : "full"} group ${groupIndex(tag)}`;
  function groupColour(state, tag) {
    const key = -(state * 64 + tag) - 1;  // negative: apart from the per-owner keys
    let c = colourCache.get(key);
    if (c === undefined) {
      const h = isWindow(tag) ? 190 + (groupIndex(tag) * 47) % 110 : FULL_HUE;
      c = state === OWNED ? `hsl(${h},65%,55%)` : state === SHARED ? `hsl(${h},80%,32%)`
        : state === CACHED ? `hsl(${h},35%,30%)` : "#222831";
      colourCache.set(key, c);
    }
    return c;
  }
  const byGroup = () => groupsSeen.size > 0 && $("colour-by").value === "group";
  // A block's colour: its group's in "colour by KV group", else its owner's (request or prefix).
  const blockColour = (state, owner, tag, grouped) => grouped && tag ? groupColour(state, tag) : colour(state, owner);

  // ---- layout and drawing ---------------------------------------------------------------------
  function computeLayout() {
    const width = Math.max(wrap.clientWidth - 2, 100);
    const choice = $("zoom").value;
    if (choice !== "auto") {
      const [cell, k] = choice.split(",").map(Number);
      return { cell, k, cols: Math.max(1, Math.floor(width / cell)) };
    }
    const maxHeight = 400;
    for (const cell of [28, 20, 16, 12, 10, 8, 6, 5, 4, 3]) {
      const cols = Math.floor(width / cell);
      if (Math.ceil(pool.n / cols) * cell <= maxHeight) return { cell, k: 1, cols };
    }
    const cell = 3, cols = Math.floor(width / cell), rows = Math.floor(maxHeight / cell);
    return { cell, k: Math.ceil(pool.n / (cols * rows)), cols };
  }

  function draw() {
    dirty = false;
    layout = computeLayout();
    const { cell, k, cols } = layout;
    const cells = Math.ceil(pool.n / k), rows = Math.max(1, Math.ceil(cells / cols));
    const dpr = window.devicePixelRatio || 1, w = cols * cell, h = rows * cell;
    if (grid.width !== w * dpr || grid.height !== h * dpr) {
      grid.width = w * dpr; grid.height = h * dpr; grid.style.width = w + "px"; grid.style.height = h + "px";
    }
    const g = grid.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.fillStyle = "#111418"; g.fillRect(0, 0, w, h);
    const gap = cell >= 5 ? 1 : 0, now = performance.now();
    const { state, owner, group, changed } = pool, grouped = byGroup();
    $("legend-owned").textContent = grouped ? "in use (colour per KV group, table below)" : "owned by a request (colour per request)";
    $("legend-cached").textContent = grouped ? "cached, free (its group's colour, muted)" : "cached prefix, free (colour per prefix)";
    for (let c = 0; c < cells; c++) {
      const x = (c % cols) * cell, y = Math.floor(c / cols) * cell, s = cell - gap;
      if (k === 1) {
        g.fillStyle = blockColour(state[c], owner[c], group[c], grouped);
        g.fillRect(x, y, s, s);
        if (state[c] === SHARED && cell >= 6) {  // a white corner: more than one table holds it
          g.fillStyle = "#ffffff"; g.fillRect(x + s - 3, y, 3, 3);
        }
        if (cell >= 4 && now - changed[c] < FLASH_MS) {
          g.strokeStyle = "#ffffff"; g.lineWidth = 1; g.strokeRect(x + 0.5, y + 0.5, s - 1, s - 1);
        }
        continue;
      }
      // k blocks per cell: a stacked bar of the states' fractions, bottom up.
      const lo = c * k, hi = Math.min(lo + k, pool.n);
      let used = 0, shared = 0, cached = 0, firstOwner = -1, firstCached = -1, ownerTag = 0, cachedTag = 0;
      for (let i = lo; i < hi; i++) {
        const st = state[i];
        if (st === OWNED || st === SHARED) {
          if (st === OWNED) used++; else shared++;
          if (firstOwner < 0) { firstOwner = owner[i]; ownerTag = group[i]; }
        } else if (st === CACHED) { cached++; if (firstCached < 0) { firstCached = owner[i]; cachedTag = group[i]; } }
      }
      g.fillStyle = "#222831"; g.fillRect(x, y, s, s);
      const span = hi - lo;
      let top = y + s;
      for (const [count, st, own, tag] of [[used, OWNED, firstOwner, ownerTag], [shared, SHARED, firstOwner, ownerTag],
                                           [cached, CACHED, firstCached, cachedTag]]) {
        if (!count) continue;
        const hgt = (count / span) * s;
        g.fillStyle = blockColour(st, own, tag, grouped); g.fillRect(x, top - hgt, s, hgt); top -= hgt;
      }
    }
    grid.dataset.blocksPerCell = String(k);
    $("grid-note").textContent = `${pool.n} blocks of ${pool.meta ? pool.meta.block_size : "?"} tokens` +
      (k > 1 ? `, ${k} blocks per cell (stacked: in use, shared, cached, free)` : ", one block per cell") +
      (pool.meta ? ` · snapshot v${pool.meta.version}, built in ${pool.meta.build_ms} ms` : "");
  }

  function schedule() {
    if (!dirty) { dirty = true; requestAnimationFrame(draw); }
  }
  setInterval(() => { if (performance.now() - lastChange < FLASH_MS + 100) schedule(); }, 150);
  let lastChange = 0;

  // ---- the block map -----------------------------------------------------------------------
  function counts() {
    let used = 0, cached = 0, free = 0;
    const st = pool.state, tags = pool.group;
    const perGroup = new Map([...groupsSeen].map((tag) => [tag, { used: 0, cached: 0 }]));
    for (let i = 0; i < pool.n; i++) {
      const s = st[i];
      if (s === OWNED || s === SHARED) used++; else if (s === CACHED) cached++; else { free++; continue; }
      if (tags[i]) perGroup.get(tags[i])[s === CACHED ? "cached" : "used"]++;
    }
    groupTable(perGroup);
    grid.dataset.used = used; grid.dataset.cached = cached; grid.dataset.free = free;
    grid.dataset.total = pool.n; grid.dataset.version = pool.meta.version;
    $("f-used").textContent = PS.fmt(used); $("f-cached").textContent = PS.fmt(cached);
    $("f-free").textContent = PS.fmt(free);
  }

  // The KV groups' table (shown once the pool has shown a group): blocks in use and cached per group.
  function groupTable(perGroup) {
    const panel = $("kv-groups");
    panel.hidden = $("colour-by-label").hidden = perGroup.size === 0;
    if (!perGroup.size) return;
    const tags = [...perGroup.keys()].sort((a, b) => groupIndex(a) - groupIndex(b));
    const sums = { full: { used: 0, cached: 0 }, window: { used: 0, cached: 0 } };
    $("kv-groups").querySelector("tbody").innerHTML = tags.map((tag) => {
      const c = perGroup.get(tag), kind = isWindow(tag) ? "window" : "full";
      sums[kind].used += c.used; sums[kind].cached += c.cached;
      return `<tr data-group="${groupIndex(tag)}" data-kind="${kind}" data-used="${c.used}" data-cached="${c.cached}">` +
        `<td><i style="display:inline-block;width:10px;height:10px;border-radius:2px;background:${groupColour(OWNED, tag)}"></i></td>` +
        `<td>${groupIndex(tag)}</td><td>${isWindow(tag) ? "sliding window" : "full"}</td>` +
        `<td class="num">${c.used}</td><td class="num">${c.cached}</td></tr>`;
    }).join("");
    const kinds = $("kv-kinds");
    for (const kind of ["full", "window"]) {
      kinds.dataset[kind + "Used"] = sums[kind].used; kinds.dataset[kind + "Cached"] = sums[kind].cached;
    }
    kinds.textContent = `in use: ${sums.full.used} by full-attention layers, ${sums.window.used} by sliding-window layers`;
  }

  function logEvent(kind, html) {
    const li = document.createElement("li");
    li.dataset.kind = kind;
    li.innerHTML = `<time>${new Date().toLocaleTimeString()}</time>` + html;
    const list = $("events");
    list.prepend(li);
    while (list.children.length > 200) list.lastChild.remove();
  }

  const esc = (s) => String(s).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]));

  function noteEvents(prev, meta) {
    const counters = $("counters");
    if (prev && meta.num_preemptions > prev.num_preemptions) {
      const before = new Map(prev.requests.map((r) => [r.seq_id, r.num_preemptions]));
      const who = meta.requests.filter((r) => r.num_preemptions > (before.get(r.seq_id) || 0))
        .map((r) => esc(r.request_id) + (r.index ? "#" + r.index : ""));
      logEvent("preemption", `<b>preempted</b> ${meta.num_preemptions - prev.num_preemptions} ` +
        `sequence(s)${who.length ? ": " + who.join(", ") : ""} — blocks freed, to be recomputed`);
    }
    if (prev && meta.num_evictions > prev.num_evictions) {
      logEvent("eviction", `<b>evicted</b> ${meta.num_evictions - prev.num_evictions} cached block(s) to make room`);
    }
    counters.dataset.preemptions = meta.num_preemptions;
    counters.dataset.evictions = meta.num_evictions;
    counters.textContent = `${meta.num_preemptions} preemptions · ${meta.num_evictions} evictions`;
  }

  function requests(meta) {
    seqRequest.clear();
    const rows = meta.requests.map((r) => {
      seqRequest.set(r.seq_id, r.request_id + (r.index ? "#" + r.index : ""));
      return `<tr data-request="${esc(r.request_id)}" data-state="${r.state}"><td><i style="display:inline-block;width:10px;height:10px;border-radius:2px;background:${colour(OWNED, r.seq_id)}"></i></td>` +
        `<td>${esc(r.request_id)}</td><td>${r.index}</td><td>${r.state}</td><td class="num">${r.priority}</td>` +
        `<td class="num">${r.num_tokens}</td><td class="num">${r.num_computed_tokens}</td><td class="num">${r.num_blocks}</td>` +
        `<td class="num">${r.num_preemptions}</td></tr>`;
    });
    document.querySelector("#requests tbody").innerHTML = rows.join("");
    $("req-summary").textContent = `${meta.num_running} running, ${meta.num_waiting} waiting` +
      (meta.requests.length < meta.num_running + meta.num_waiting ? ` (first ${meta.requests.length} listed)` : "");
  }

  // A block's state byte → its plain state and group tag (0: none).
  function setState(i, byte) {
    pool.state[i] = byte & STATE_MASK;
    const tag = byte >> TAG_SHIFT;
    pool.group[i] = tag;
    if (tag) groupsSeen.add(tag);
  }

  function applyFull(msg) {
    const prev = pool.meta && pool.n === msg.num_blocks ? pool.meta : null;
    pool.n = msg.num_blocks;
    const bytes = PS.base64Bytes(msg.state);
    pool.state = new Uint8Array(pool.n); pool.group = new Uint8Array(pool.n);
    for (let i = 0; i < pool.n; i++) setState(i, bytes[i]);
    pool.owner = new Int32Array(PS.base64Bytes(msg.owner).buffer);
    pool.refs = PS.base64Bytes(msg.refs);
    pool.changed = new Float64Array(pool.n);
    finish(prev, msg);
  }

  function applyDelta(msg) {
    if (!pool.meta || pool.meta.version !== msg.from_version) return;  // out of step: the next full fixes it
    const idx = new Int32Array(PS.base64Bytes(msg.index).buffer), st = PS.base64Bytes(msg.state);
    const own = new Int32Array(PS.base64Bytes(msg.owner).buffer), refs = PS.base64Bytes(msg.refs);
    const now = performance.now();
    for (let j = 0; j < idx.length; j++) {
      const i = idx[j];
      setState(i, st[j]); pool.owner[i] = own[j]; pool.refs[i] = refs[j]; pool.changed[i] = now;
    }
    if (idx.length) lastChange = now;
    finish(pool.meta, msg);
  }

  function finish(prev, msg) {
    const meta = { ...msg };
    delete meta.state; delete meta.owner; delete meta.refs; delete meta.index;
    noteEvents(prev, meta);
    pool.meta = meta;
    counts();
    requests(meta);
    schedule();
  }

  // ---- stats ---------------------------------------------------------------------------------
  function onStats(s) {
    const t = s.wall_time;
    let hit = 0;
    if (lastStats) {  // prefix hit rate over the last interval, not since start
      const q = s.prefix_queried_tokens - lastStats.prefix_queried_tokens;
      hit = q > 0 ? (s.prefix_hit_tokens - lastStats.prefix_hit_tokens) / q : (charts.util.points.length ? charts.util.points[charts.util.points.length - 1][1][2] : 0);
    }
    lastStats = s;
    charts.util.push(t, [s.kv_utilization, s.naive_utilization, hit]);
    charts.reqs.push(t, [s.running, s.waiting]);
    charts.tps.push(t, [s.tokens_per_s]);
    charts.pre.push(t, [s.preemptions, pool.meta ? pool.meta.num_evictions : 0]);
    for (const c of Object.values(charts)) c.draw();
    $("model").textContent = `${s.model} · ${s.kv_blocks_total} blocks × ${s.block_size} tokens · max_model_len ${s.max_model_len}`;
    $("f-util").textContent = s.kv_slots_allocated ? (s.kv_utilization * 100).toFixed(1) + "%" : "–";
    $("f-naive").textContent = s.naive_reserved_tokens ? (s.naive_utilization * 100).toFixed(1) + "%" : "–";
    document.body.dataset.loadUsed = s.kv_blocks_used;
  }

  // ---- tooltip and controls --------------------------------------------------------------------
  grid.addEventListener("mousemove", (ev) => {
    const r = grid.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / layout.cell), row = Math.floor((ev.clientY - r.top) / layout.cell);
    const c = row * layout.cols + col, i = c * layout.k;
    if (col >= layout.cols || i >= pool.n || i < 0) { grid.title = ""; return; }
    if (layout.k > 1) { grid.title = `blocks ${i}–${Math.min(i + layout.k, pool.n) - 1}`; return; }
    const s = pool.state[i], o = pool.owner[i], tag = pool.group[i];
    grid.title = `block ${i}: ` + (s === FREE ? "free" : s === CACHED ? `cached prefix ${o} (free, reusable)`
      : `${s === SHARED ? "shared, refcount " + pool.refs[i] + ", first holder " : "owned by "}${seqRequest.get(o) || "sequence " + o}`) +
      (tag && s !== FREE ? ` · ${groupName(tag)}` : "");
  });
  $("zoom").addEventListener("change", schedule);
  $("colour-by").addEventListener("change", schedule);
  window.addEventListener("resize", () => { schedule(); for (const c of Object.values(charts)) c.draw(); });

  PS.connectFeed("/dashboard/events", {
    onState(state) { const el = $("conn"); el.dataset.state = state; el.textContent = state; },
    onOpen() { lastStats = null; groupsSeen.clear(); logEvent("connected", "feed connected"); },
    askKey: PS.keyPrompt,
    onEvent(name, msg) {
      if (name === "full") applyFull(msg);
      else if (name === "delta") applyDelta(msg);
      else if (name === "stats") onStats(msg);
    },
  });
})();
