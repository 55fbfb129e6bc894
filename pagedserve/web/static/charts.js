// Small time-series charts on a canvas: a ring buffer of points, redrawn on demand.
"use strict";
window.PS = window.PS || {};

PS.Chart = class {
  constructor(canvas, series, opts = {}) {
    this.canvas = canvas;
    this.series = series;  // [{label, color}]
    this.max = opts.max;  // fixed top of the y axis, else the data's maximum
    this.format = opts.format || ((v) => PS.fmt(v));
    this.capacity = opts.capacity || 300;
    this.points = [];  // [t, [values]]
  }
  push(t, values) {
    this.points.push([t, values]);
    if (this.points.length > this.capacity) this.points.shift();
  }
  clear() { this.points = []; }
  draw() {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 44, right = 6, top = 16, bottom = 4;
    const pw = w - left - right, ph = h - top - bottom;
    let max = this.max;
    if (max === undefined) {
      max = 0;
      for (const [, vs] of this.points) for (const v of vs) if (v > max) max = v;
      max = max > 0 ? max * 1.1 : 1;
    }
    g.strokeStyle = "#2a313b"; g.fillStyle = "#8a96a3"; g.font = "10px sans-serif"; g.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const y = top + ph - (ph * i) / 2;
      g.beginPath(); g.moveTo(left, y + 0.5); g.lineTo(left + pw, y + 0.5); g.stroke();
      g.fillText(this.format((max * i) / 2), 2, y + 3);
    }
    let x = left;
    this.series.forEach((s, i) => {  // the legend, with each series' latest value
      const last = this.points.length ? this.points[this.points.length - 1][1][i] : undefined;
      const text = s.label + " " + this.format(last);
      g.fillStyle = s.color; g.fillRect(x, 4, 8, 8);
      g.fillStyle = "#d8dee6"; g.fillText(text, x + 11, 12);
      x += g.measureText(text).width + 24;
    });
    const n = this.points.length;
    if (n < 2) return;
    const t0 = this.points[0][0], t1 = this.points[n - 1][0], span = Math.max(t1 - t0, 1e-3);
    this.series.forEach((s, i) => {
      g.strokeStyle = s.color; g.lineWidth = 1.5; g.beginPath();
      this.points.forEach(([t, vs], j) => {
        const px = left + ((t - t0) / span) * pw;
        const py = top + ph - (Math.min(vs[i], max) / max) * ph;
        if (j === 0) g.moveTo(px, py); else g.lineTo(px, py);
      });
      g.stroke();
    });
  }
};
