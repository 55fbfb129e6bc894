// The live feed both dashboards read: server-sent events over fetch(), so the API key travels in
// an Authorization header (EventSource cannot set one, and a key in the URL would land in logs).
// Reconnects for ever with the server's `retry:` delay; each connection starts with a full state.
"use strict";
window.PS = window.PS || {};

PS.KEY_STORAGE = "pagedserve-api-key";

PS.connectFeed = function (url, handlers) {
  let retryMs = 1000;
  let stopped = false;
  let controller = null;
  const setState = (s) => handlers.onState && handlers.onState(s);

  function dispatch(block) {
    let name = "message", data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;  // a comment: the server's keep-alive ping
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
      else if (field === "retry" && /^\d+$/.test(value)) retryMs = parseInt(value, 10);
    }
    if (data.length) handlers.onEvent(name, JSON.parse(data.join("\n")));
  }

  async function run() {
    while (!stopped) {
      setState("connecting");
      const key = sessionStorage.getItem(PS.KEY_STORAGE);
      controller = new AbortController();
      try {
        const resp = await fetch(url, {
          headers: key ? { Authorization: "Bearer " + key } : {},
          cache: "no-store", signal: controller.signal,
        });
        if (resp.status === 401) {
          setState("unauthorized");
          await handlers.askKey();  // resolves once the user entered a key
          continue;
        }
        if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
        setState("live");
        handlers.onOpen && handlers.onOpen();
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n?/g, "\n");
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            dispatch(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
          }
        }
      } catch (err) {
        if (stopped) return;
      }
      setState("reconnecting");
      await new Promise((r) => setTimeout(r, retryMs));
    }
  }
  run();
  return { stop() { stopped = true; if (controller) controller.abort(); } };
};

// The key form in the header: shown on a 401, the key kept in sessionStorage (this tab only).
PS.keyPrompt = function () {
  const form = document.getElementById("auth");
  return new Promise((resolve) => {
    form.dataset.open = "1";
    const input = form.querySelector("input");
    input.focus();
    form.onsubmit = (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(PS.KEY_STORAGE, input.value.trim());
      input.value = "";
      form.dataset.open = "0";
      resolve();
    };
  });
};

PS.fmt = function (v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof digits === "number") return v.toFixed(digits);
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
};

PS.base64Bytes = function (text) {
  const bin = atob(text);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
};

// A stable colour per id: the golden angle spreads consecutive ids around the hue circle.
PS.hue = function (id) { return ((id * 137.508) % 360 + 360) % 360; };
