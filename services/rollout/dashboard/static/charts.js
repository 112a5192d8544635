// Small SVG charts for the dashboard: lines, bars and a Gantt of phases. No dependencies.
"use strict";
const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                   "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const PHASE_COLORS = {"trainer.wait_data": "#e9c46a", "trainer.step": "#2a9d8f",
                        "trainer.checkpoint": "#8d99ae", "trainer.weight_sync": "#e76f51",
                        "rollout.engine_pause": "#e76f51"};
  const M = {left: 46, right: 10, top: 20, bottom: 30};

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function frame(container) {
    container.textContent = "";
    const w = container.clientWidth || 400, h = container.clientHeight || 180;
    const svg = el("svg", {viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none"}, container);
    return {svg, w, h, iw: w - M.left - M.right, ih: h - M.top - M.bottom};
  }

  function empty(container, text) {
    container.textContent = "";
    const p = document.createElement("p");
    p.className = "empty";
    p.textContent = text || "no data yet";
    container.appendChild(p);
    return 0;
  }

  // Engine URLs make long labels; the scheme adds nothing.
  const short = name => String(name).replace(/^https?:\/\//, "");

  function fmt(v) {
    if (!isFinite(v)) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10 || v === Math.round(v)) return String(Math.round(v));
    return v.toFixed(2);
  }

  function axes(f, x0, x1, y0, y1, opts) {
    const sx = v => M.left + (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5) * f.iw;
    const sy = v => M.top + f.ih - (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5) * f.ih;
    el("line", {x1: M.left, y1: M.top + f.ih, x2: M.left + f.iw, y2: M.top + f.ih,
                stroke: "#aab"}, f.svg);
    el("line", {x1: M.left, y1: M.top, x2: M.left, y2: M.top + f.ih, stroke: "#aab"}, f.svg);
    for (let i = 0; i <= 4; i++) {
      const yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
      el("text", {x: M.left - 4, y: sy(yv) + 3, "text-anchor": "end"}, f.svg).textContent = fmt(yv);
      const label = opts.xTime ? `${fmt(xv - (opts.tOrigin ?? x0))}s` : fmt(xv);
      el("text", {x: sx(xv), y: M.top + f.ih + 12, "text-anchor": "middle"}, f.svg)
        .textContent = label;
    }
    if (opts.xLabel) {
      el("text", {x: M.left + f.iw / 2, y: f.h - 4, "text-anchor": "middle"}, f.svg)
        .textContent = opts.xLabel;
    }
    return {sx, sy};
  }

  function legend(f, names) {
    let x = M.left + 4;
    names.forEach((name, i) => {
      el("rect", {x, y: 2, width: 8, height: 8, fill: PALETTE[i % PALETTE.length]}, f.svg);
      const t = el("text", {x: x + 11, y: 10}, f.svg);
      t.textContent = name;
      x += 16 + 6 * name.length;
    });
  }

  // series: [{name, points: [[x, y]], dash, color}]; returns the number of points drawn.
  function line(container, series, opts = {}) {
    const pts = series.flatMap(s => s.points);
    if (!pts.length) return empty(container);
    const f = frame(container);
    const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
    const y0 = opts.yMin ?? Math.min(0, ...ys), y1 = opts.yMax ?? Math.max(...ys, y0 + 1e-9);
    const {sx, sy} = axes(f, Math.min(...xs), Math.max(...xs), y0, y1, opts);
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`)
        .join("");
      el("path", {d, fill: "none", stroke: color, "stroke-width": 1.5,
                  "stroke-dasharray": s.dash ? "4 3" : "none"}, f.svg);
      if (s.points.length === 1) {
        el("circle", {cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 3, fill: color}, f.svg);
      }
    });
    legend(f, series.filter(s => !s.hideLegend).map(s => short(s.name)));
    return pts.length;
  }

  // counts: {label: value}
  function bars(container, counts, opts = {}) {
    const entries = Object.entries(counts);
    if (!entries.length) return empty(container, opts.emptyText);
    const f = frame(container);
    const max = Math.max(...entries.map(e => e[1]), 1);
    const {sy} = axes(f, 0, 1, 0, max, {});
    f.svg.querySelectorAll("text[text-anchor=middle]").forEach(t => t.remove());
    const bw = f.iw / entries.length;
    entries.forEach(([label, value], i) => {
      const x = M.left + i * bw + bw * 0.1;
      el("rect", {x, y: sy(value), width: bw * 0.8, height: M.top + f.ih - sy(value),
                  fill: PALETTE[i % PALETTE.length]}, f.svg);
      el("text", {x: x + bw * 0.4, y: M.top + f.ih + 12, "text-anchor": "middle"}, f.svg)
        .textContent = label;
      el("text", {x: x + bw * 0.4, y: sy(value) - 2, "text-anchor": "middle"}, f.svg)
        .textContent = fmt(value);
    });
    if (opts.xLabel) {
      el("text", {x: M.left + f.iw / 2, y: f.h - 4, "text-anchor": "middle"}, f.svg)
        .textContent = opts.xLabel;
    }
    return entries.length;
  }

  // timeline: {t0, t1, lanes: [{lane, spans: [{kind, start, end, open, label}]}], in_flight}
  function gantt(container, timeline) {
    const spans = timeline.lanes.flatMap(l => l.spans);
    if (!spans.length && !timeline.in_flight.length) return empty(container);
    const f = frame(container);
    const t0 = timeline.t0, t1 = Math.max(timeline.t1, t0 + 1e-9);
    const sx = v => M.left + 70 + (v - t0) / (t1 - t0) * (f.iw - 70);
    const lanes = timeline.lanes.length + 1, laneH = f.ih / lanes;
    timeline.lanes.forEach((lane, i) => {
      const y = M.top + i * laneH;
      el("text", {x: M.left + 66, y: y + laneH / 2 + 3, "text-anchor": "end"}, f.svg)
        .textContent = short(lane.lane.replace(/^engine /, ""));
      for (const s of lane.spans) {
        const r = el("rect", {x: sx(s.start), y: y + 2, width: Math.max(1, sx(s.end) - sx(s.start)),
                              height: laneH - 4, fill: PHASE_COLORS[s.kind] || "#999",
                              "data-kind": s.kind, opacity: s.open ? 0.55 : 1}, f.svg);
        el("title", {}, r).textContent =
          `${s.kind} ${s.label ?? ""} ${(s.end - s.start).toFixed(1)} s${s.open ? " (open)" : ""}`;
      }
    });
    const y = M.top + (lanes - 1) * laneH, pts = timeline.in_flight;
    el("text", {x: M.left + 66, y: y + laneH / 2 + 3, "text-anchor": "end"}, f.svg)
      .textContent = "in flight";
    if (pts.length) {
      const max = Math.max(...pts.map(p => p[1]), 1);
      const d = pts.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},` +
                        `${(y + laneH - 2 - p[1] / max * (laneH - 4)).toFixed(1)}`).join("");
      el("path", {d, fill: "none", stroke: "#264653", "stroke-width": 1.2}, f.svg);
    }
    for (let i = 0; i <= 4; i++) {
      const tv = t0 + (t1 - t0) * i / 4;
      el("text", {x: sx(tv), y: M.top + f.ih + 12, "text-anchor": "middle"}, f.svg)
        .textContent = `${fmt(tv - t0)}s`;
    }
    let x = M.left + 70;
    for (const [kind, color] of Object.entries(PHASE_COLORS)) {
      if (kind === "rollout.engine_pause") continue;
      el("rect", {x, y: f.h - 10, width: 8, height: 8, fill: color}, f.svg);
      el("text", {x: x + 11, y: f.h - 2}, f.svg).textContent = kind.replace("trainer.", "");
      x += 20 + 6 * kind.length;
    }
    return spans.length + pts.length;
  }

  return {line, bars, gantt, fmt, short, PALETTE};
})();
